// The HTTP front door: an OpenAI-compatible API (/v1/models, /v1/completions,
// /v1/chat/completions, /v1/responses, /v1/conversations), fwserve's own session API
// (/fwserve/v1/sessions) and the probes (/health, /ready), over one Core. Boost.Beast,
// HTTP/1.1 with keep-alive, on one io_context run by a small fixed pool of threads: no
// thread per connection or per stream. Never includes LibTorch. docs/http.md describes
// every endpoint.
//
// Thread-safety: each connection runs on its own strand; handlers never block: they
// validate, translate and hand work to the core, whose callbacks post back to the
// connection's strand. Streams follow the core's write-done flow control: one SSE
// write in flight per stream, its completion is GenerateControl::WriteDone.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/tenancy/authenticator.h"

namespace fwserve {

struct HttpServerOptions {
  // HOST:PORT to listen on; port 0 picks a free port (see HttpServer::port()).
  std::string listen = "127.0.0.1:8000";
  // Threads running the io_context (all connections and streams share them).
  int threads = 2;
  // Largest request body, bytes; larger gets 413 (session imports are the big ones).
  int64_t max_body_bytes = int64_t{4} << 20;
  // Largest request line plus headers, bytes; larger gets 431.
  int32_t max_header_bytes = 16 << 10;
  // A connection with no request in progress, or a write the client does not read,
  // is closed after this long.
  absl::Duration idle_timeout = absl::Seconds(60);
  // Origins allowed to call the API from a browser (CORS); "*" allows any. Empty:
  // no CORS headers are sent.
  std::vector<std::string> cors_origins;
  // max_tokens of chat and responses requests that give none (completions: 16, as
  // OpenAI).
  int32_t default_max_tokens = 256;
  // Not owned; null = an open server (every caller is the anonymous tenant ""). Else
  // every API call is authenticated by it (the same one as gRPC's: the
  // "Authorization: Bearer <key>" header); the probes stay open.
  Authenticator* authenticator = nullptr;
  // Not owned; may be null.
  Metrics* metrics = nullptr;
};

class HttpServer {
 public:
  // Binds, then serves over `core` (not owned; must outlive the server).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Core* core);
  // Stops (as Stop(absl::ZeroDuration())) if not stopped yet.
  ~HttpServer();

  // The bound port (useful with port 0).
  int port() const;

  // Shutdown, interleaved with the core's steps by the owner (server/fwserve.cc):
  // 1. BeginShutdown: stop accepting connections; /ready answers 503 and new API
  //    requests get 503; accepted streams go on. Returns at once.
  void BeginShutdown();
  // 2. (after Core::EndAllWork) Waits up to `grace` for the streams to end, closes
  //    every connection, waits until the core has finished every stream it was
  //    given, and stops the threads. Idempotent.
  void Stop(absl::Duration grace);

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fwserve
