// fwctl's global options (docs/client.md "Global options"): where the server is, how to
// authenticate and secure the connection, deadlines and retries, --verbose and --help.
// They may come before or after the command.
#ifndef FWSERVE_CLIENT_FWCTL_OPTIONS_H_
#define FWSERVE_CLIENT_FWCTL_OPTIONS_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace fwctl {

struct GlobalOptions {
  std::string target;                       // default $FWSERVE_TARGET, else 127.0.0.1:50051
  std::string lb_policy;                    // empty: the library's (pick_first)
  std::optional<std::string> api_key_file;  // when given, wins over --token
  std::string token;                        // default $FWSERVE_API_KEY
  bool insecure = false;
  absl::Duration timeout = absl::Seconds(60);
  absl::Duration stream_timeout = absl::InfiniteDuration();
  int64_t retries = fwserve::ClientOptions().max_retries;
  bool tls = false;
  std::optional<std::string> tls_ca;
  std::optional<std::string> tls_cert;
  std::optional<std::string> tls_key;
  bool verbose = false;
  bool help = false;

  // What the client connects with; set by ResolveClientOptions.
  fwserve::ClientOptions client;
};

// Adds the global options to the program, bound to `options` (which must outlive it).
// The defaults from the environment are read here.
void AddGlobalOptions(CLI::App& program, GlobalOptions* options);

// Sets options->client from the parsed options, reading the --api-key-file. An error
// (the file cannot be read or its first line is empty; --tls-cert without --tls-key) is
// a usage error, and its message names the option.
absl::Status ResolveClientOptions(GlobalOptions* options);

// The client, connected on first use (lazily: connection errors appear at the first
// call). Exits 1 when a TLS file cannot be read or the client cannot be made.
fwserve::Client& GetClient(const GlobalOptions& options);

// Closes the client, if GetClient made one.
void CloseClient();

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_OPTIONS_H_
