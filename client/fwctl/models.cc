// fwctl models [--json] [NAME]
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/io.h"

namespace fwctl {
namespace {

namespace v1 = fwserve::v1;

struct ModelsOptions {
  bool json = false;
  std::optional<std::string> name;
};

int DescribeModel(fwserve::Client& client, const std::string& name, bool json) {
  auto model = client.DescribeModel(name);
  if (!model.ok()) return RpcError(model.status());
  if (json) {
    WriteOut(ToJson(*model) + "\n");
    return kExitOk;
  }
  std::printf(
      "name: %s\ndefault: %s\narchitecture: %s\nparameters: %lld\nstate_bytes_per_session: "
      "%lld\nvocab_size: %lld\nfingerprint: %s\nconfig: %s\n",
      model->name().c_str(), model->is_default() ? "true" : "false", model->architecture().c_str(),
      static_cast<long long>(model->parameters()),
      static_cast<long long>(model->state_bytes_per_session()),
      static_cast<long long>(model->vocab_size()), model->fingerprint().c_str(),
      model->config_json().c_str());
  return kExitOk;
}

int ListModels(fwserve::Client& client, bool json) {
  auto models = client.ListModels();
  if (!models.ok()) return RpcError(models.status());
  if (json) {
    v1::ListModelsResponse response;
    for (const v1::ModelInfo& info : *models) *response.add_models() = info;
    WriteOut(ToJson(response) + "\n");
    return kExitOk;
  }
  std::printf("%-28s %-8s %-18s %12s %12s %6s\n", "MODEL", "DEFAULT", "ARCHITECTURE", "PARAMETERS",
              "STATE_BYTES", "VOCAB");
  for (const v1::ModelInfo& info : *models) {
    std::printf("%-28s %-8s %-18s %12lld %12lld %6lld\n", info.name().c_str(),
                info.is_default() ? "yes" : "", info.architecture().c_str(),
                static_cast<long long>(info.parameters()),
                static_cast<long long>(info.state_bytes_per_session()),
                static_cast<long long>(info.vocab_size()));
  }
  return kExitOk;
}

}  // namespace

void AddModelsCommand(CLI::App& program, const GlobalOptions& global) {
  Command& command = AddCommand(program, "models", "list models, or describe one", "[NAME]",
                                "Without NAME, lists the served models; with NAME, prints its "
                                "description (architecture, sizes, fingerprint and config).");
  auto options = std::make_shared<ModelsOptions>();
  AddSwitch(command, "json", kJsonHelp, &options->json);
  AddWord(command, "NAME", &options->name);
  command.run = [options, &global] {
    fwserve::Client& client = GetClient(global);
    return options->name.has_value() ? DescribeModel(client, *options->name, options->json)
                                     : ListModels(client, options->json);
  };
}

}  // namespace fwctl
