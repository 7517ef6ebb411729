// fwctl health [--service NAME]
#include <cstdio>
#include <memory>
#include <string>

#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/io.h"

namespace fwctl {

void AddHealthCommand(CLI::App& program, const GlobalOptions& global) {
  Command& command =
      AddCommand(program, "health", "check the server's health (exit 0 SERVING, 3 NOT_SERVING)", "",
                 "Runs the standard gRPC health check and prints SERVING or NOT_SERVING.");
  auto service = std::make_shared<std::string>();
  AddText(command, "service", "NAME",
          "service to check, e.g. fwserve.v1.Fwserve (default: the server)", service.get());
  command.run = [service, &global] {
    auto serving = GetClient(global).Health(*service);
    if (!serving.ok()) return RpcError(serving.status());
    std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
    return *serving ? kExitOk : kExitNotServing;
  };
}

}  // namespace fwctl
