// The gRPC front end: the fwserve.v1.Fwserve callback service, the standard health
// service and server reflection, over one Core. Never includes LibTorch.
//
// Thread-safety: handlers run on gRPC's callback threads and never block; they
// validate, translate and hand work to the core. Shutdown() may be called from any
// thread, once.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/tenancy/authenticator.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace fwserve {

struct GrpcServerOptions {
  // HOST:PORT to listen on; port 0 picks a free port (see GrpcServer::port()).
  std::string listen = "127.0.0.1:50051";
  // TLS: PEM certificate chain and private key of the server; both empty = plaintext.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // PEM CA bundle. When set (with TLS), clients must present a certificate it signed
  // (mutual TLS).
  std::string tls_client_ca_pem;
  // Largest request message, bytes. ImportSession blobs are the big ones; gRPC's C++
  // server has no per-method limit, so this bounds every method (docs/security.md).
  int max_receive_message_bytes = 64 << 20;
  // HTTP/2 streams one connection may have open at once (gRPC's
  // GRPC_ARG_MAX_CONCURRENT_STREAMS); further calls wait in the client.
  int max_streams_per_connection = 256;
  // An overload refusal of a Generate (RESOURCE_EXHAUSTED with a retry delay) is
  // answered after its retry delay, at most this long and never past the call's
  // deadline, so that a client retrying at once cannot make the server spend its CPU on
  // refusals (docs/serving.md "Overload"). Zero: refusals are answered at once.
  absl::Duration max_refusal_delay = absl::Milliseconds(250);
  // Memory gRPC itself may use for all connections (buffers, messages in flight),
  // bytes; past it gRPC refuses new work. 0 = no bound.
  int64_t grpc_memory_quota_bytes = int64_t{2} << 30;
  // Generate streams open at once from which their messages are started on a writer
  // thread instead of the engine thread (0 = never). Below it, the engine sends each
  // message itself: no thread hand-off, but no step while a message goes out. From it
  // on, the engine computes the next step while messages go out, and tokens sampled
  // meanwhile share a message (docs/serving.md, "The engine iteration"). 1: even a lone
  // stream gained 1.12-1.19x tokens/s with no TTFT cost (docs/benchmarks.md).
  int writer_thread_from_streams = 1;
  // Writer threads the streams' sends are sharded over (a stream always uses the same
  // one); 0 = one per 4 CPUs, 1 to 8; a positive count is used as given (--writer-threads
  // takes 0 to 64).
  int writer_threads = 0;
  // How long Shutdown() lets in-flight work finish before ending it.
  absl::Duration drain_timeout = absl::Seconds(30);
  // After the drain: how long the gRPC server waits for writes still in flight (a client
  // that stopped reading) before cancelling them. Not waited when nothing is in flight:
  // an idle connected client never holds the exit.
  absl::Duration stuck_write_timeout = absl::Seconds(5);
  // Not owned; null = no authentication (every caller is the anonymous tenant "").
  // The health service and reflection never ask it (probes stay open).
  Authenticator* authenticator = nullptr;
  // Not owned; may be null.
  Metrics* metrics = nullptr;
};

class GrpcServer {
 public:
  // Builds and starts the server over `core` (not owned; must outlive the server).
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options,
                                                           Core* core);
  ~GrpcServer();

  // The bound port (useful with port 0).
  int port() const { return port_; }

  // Graceful shutdown when this is the only transport: health NOT_SERVING and new
  // calls refused; in-flight work gets drain_timeout; what remains is ended; the gRPC
  // server stops; the core persists its sessions and stops. Blocks until done.
  // Idempotent. It is BeginShutdown, the core's BeginShutdown/WaitIdle/EndAllWork,
  // StopServing and the core's Stop.
  void Shutdown();

  // The transport's own steps, for an owner that interleaves several transports with
  // the core's (server/fwserve.cc):
  // Health NOT_SERVING; new calls get UNAVAILABLE. Returns at once. Idempotent.
  void BeginShutdown();
  // After Core::EndAllWork: stops the gRPC server (at once if `idle`, else giving
  // streams 5 s to end after their write) and waits for it. Idempotent; Shutdown()
  // does nothing after it.
  void StopServing(bool idle);

  class Service;  // implementation (grpc_server.cc)

 private:
  GrpcServer() = default;

  GrpcServerOptions options_;
  Core* core_ = nullptr;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<bool> shut_down_{false};       // Shutdown() called
  std::atomic<bool> began_shutdown_{false};  // BeginShutdown() called
  std::atomic<bool> stopped_{false};         // StopServing() called
};

}  // namespace fwserve
