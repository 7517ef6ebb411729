// An in-process fwserve (Core + GrpcServer on port 0) and a real Client connected to
// it, for integration tests. The harness owns a temporary directory for checkpoints
// and session files.
#pragma once

#include <prometheus/exposer.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/client.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/transport/grpc/grpc_server.h"
#include "server/transport/http/http_server.h"
#include "tests/unit/temp_dir.h"

namespace fwtest {

// Writes a small random checkpoint (2 layers, d=32, bytes vocabulary) into `dir`.
// architecture: "linear_attention", "fast_weight" or "aft". Deterministic in seed.
void WriteTinyCheckpoint(const std::string& dir, const std::string& architecture, uint64_t seed);

// The contract's log-probs of `text` from a fresh state, computed with the model
// library directly (not through the server).
std::vector<double> ReferenceScore(const std::string& checkpoint_dir, const std::string& text);

// A Generate request with greedy sampling (temperature 0).
fwserve::v1::GenerateRequest GreedyRequest(const std::string& prompt, int max_tokens,
                                           const std::string& session_id = "");

// The session contract through `client`, on the default model: a session created with
// `prefix`, a fork of it, and an export of it imported again each continue with the same
// `tokens` greedy tokens, which a fresh prompt of `prefix` gets too. Returns the
// session's id (holding prefix and continuation), empty after a failure.
std::string ExpectSessionContinuesTheSameAfterForkAndExportImport(fwserve::Client& client,
                                                                  const std::string& prefix,
                                                                  int tokens);

// A loopback TCP port that was free a moment ago.
int FreeLoopbackPort();

class Harness {
 public:
  // Starts a server over `core_options` (model_dirs must be set) with metrics, and a
  // /metrics exposer on a free loopback port if `expose_metrics` (its shutdown takes
  // about 2 s: civetweb's poll interval). With `http`, also the HTTP API on a free
  // loopback port (its listen is replaced; see http_port()).
  static std::unique_ptr<Harness> Start(
      fwserve::CoreOptions core_options, fwserve::GrpcServerOptions server_options = {},
      bool expose_metrics = false, std::optional<fwserve::HttpServerOptions> http = std::nullopt);
  ~Harness();

  fwserve::Client& client() { return *client_; }
  int port() const { return server_->port(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port()); }
  int metrics_port() const { return metrics_port_; }
  fwserve::Metrics& metrics() { return *metrics_; }
  // Graceful shutdown (drain, persist). Idempotent.
  void Shutdown();
  fwserve::GrpcServer& server() { return *server_; }
  // Only with an HTTP listener.
  fwserve::HttpServer& http() { return *http_; }
  int http_port() const { return http_ != nullptr ? http_->port() : 0; }
  fwserve::Core& core() { return *core_; }

 private:
  void StartExposer();

  std::shared_ptr<fwserve::Metrics> metrics_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int metrics_port_ = 0;
  std::unique_ptr<fwserve::Core> core_;
  std::unique_ptr<fwserve::GrpcServer> server_;
  std::unique_ptr<fwserve::HttpServer> http_;
  absl::Duration drain_timeout_;
  std::unique_ptr<fwserve::Client> client_;
};

// The value of gauge `name` in `harness`'s metrics, summed over its series (0 if none).
double GaugeValue(Harness& harness, const std::string& name);
// The observations of histogram `name` in `harness`'s metrics, summed over its series.
uint64_t HistogramCount(Harness& harness, const std::string& name);

}  // namespace fwtest
