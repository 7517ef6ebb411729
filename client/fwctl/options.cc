#include "client/fwctl/options.h"

#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "client/fwctl/cli.h"
#include "client/fwctl/io.h"

namespace fwctl {

void AddGlobalOptions(CLI::App& program, GlobalOptions* options) {
  const char* env_target = std::getenv("FWSERVE_TARGET");
  const char* env_key = std::getenv("FWSERVE_API_KEY");
  options->target = env_target != nullptr && *env_target != '\0' ? env_target : "127.0.0.1:50051";
  options->token = env_key != nullptr ? env_key : "";

  AddText(program, "target", "HOST:PORT",
          "server address: HOST:PORT or a gRPC target such as dns:///HOST:PORT (every address "
          "the name resolves to) or ipv4:ADDR:PORT,ADDR:PORT (default $FWSERVE_TARGET, else "
          "127.0.0.1:50051)",
          &options->target);
  AddChoice(program, "lb-policy", "POLICY",
            "how calls spread over the target's addresses: pick_first (one connection, the "
            "default) or round_robin (every address in turn; replicas must share a session "
            "store)",
            {"pick_first", "round_robin"}, &options->lb_policy);
  AddText(program, "api-key-file", "FILE",
          "file whose first line is the API key, sent as 'authorization: Bearer KEY' (default "
          "$FWSERVE_API_KEY). A key is never sent in plaintext to a non-loopback server "
          "without --insecure",
          &options->api_key_file);
  AddText(program, "token", "KEY",
          "the API key itself (prefer --api-key-file: a command line is visible to other "
          "users of the machine)",
          &options->token);
  AddSwitch(program, "insecure", "allow sending the API key without TLS to a non-loopback server",
            &options->insecure);
  AddDuration(program, "timeout", "DURATION",
              "deadline of each unary call, e.g. 500ms, 60s, 2m (default 60s)", &options->timeout);
  AddDuration(program, "stream-timeout", "DURATION",
              "deadline of each generate/chat stream (default none: 0 or 'inf')",
              &options->stream_timeout);
  AddInteger(program, "retries", "N",
             "retries of idempotent calls (get, list, score, export, models, health) on "
             "UNAVAILABLE, with exponential backoff from 100ms (default 3)",
             0, 100, &options->retries);
  AddSwitch(program, "tls", "use TLS (system roots unless --tls-ca)", &options->tls);
  AddText(program, "tls-ca", "FILE",
          "PEM root certificates to verify the server with (implies --tls)", &options->tls_ca);
  AddText(program, "tls-cert", "FILE",
          "PEM client certificate chain, for mutual TLS (implies --tls)", &options->tls_cert);
  AddText(program, "tls-key", "FILE", "PEM private key of --tls-cert (implies --tls)",
          &options->tls_key);
  AddSwitch(program, "verbose", "more detail on stderr (timings, ids)", &options->verbose, 'v');
  AddSwitch(program, "help", "show help (of the command, after one)", &options->help, 'h');
}

absl::Status ResolveClientOptions(GlobalOptions* options) {
  fwserve::ClientOptions& client = options->client;
  client.target = options->target;
  if (options->api_key_file.has_value()) {
    auto text = ReadFile(*options->api_key_file);
    if (!text.ok()) return text.status();
    const std::string first_line = text->substr(0, text->find('\n'));
    client.auth_token = std::string(absl::StripAsciiWhitespace(first_line));
    if (client.auth_token.empty()) {
      return absl::InvalidArgumentError("--api-key-file: the file's first line is empty");
    }
  } else {
    client.auth_token = options->token;
  }
  client.allow_plaintext_key = options->insecure;
  if (!options->lb_policy.empty()) client.load_balancing_policy = options->lb_policy;
  client.deadline = options->timeout;
  client.generate_deadline = options->stream_timeout;
  client.max_retries = static_cast<int>(options->retries);
  client.use_tls = options->tls || options->tls_ca.has_value() || options->tls_cert.has_value() ||
                   options->tls_key.has_value();
  if (options->tls_cert.has_value() != options->tls_key.has_value()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  return absl::OkStatus();
}

namespace {

std::unique_ptr<fwserve::Client> g_client;

}  // namespace

fwserve::Client& GetClient(const GlobalOptions& options) {
  if (g_client != nullptr) return *g_client;
  fwserve::ClientOptions client_options = options.client;
  const std::pair<const std::optional<std::string>*, std::string*> files[] = {
      {&options.tls_ca, &client_options.tls_root_certs_pem},
      {&options.tls_cert, &client_options.tls_client_cert_pem},
      {&options.tls_key, &client_options.tls_client_key_pem}};
  for (const auto& [path, pem] : files) {
    if (!path->has_value()) continue;
    auto text = ReadFile(**path);
    if (!text.ok()) std::exit(LocalError(std::string(text.status().message())));
    *pem = std::move(*text);
  }
  auto client = fwserve::Client::Connect(client_options);
  if (!client.ok()) std::exit(RpcError(client.status()));
  g_client = std::move(*client);
  return *g_client;
}

void CloseClient() { g_client.reset(); }

}  // namespace fwctl
