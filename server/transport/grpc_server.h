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
#include "server/core/metrics.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace fwserve {

// Room for authentication through call metadata (a later issue fills it in).
class Authenticator {
 public:
  virtual ~Authenticator() = default;
  // UNAUTHENTICATED / PERMISSION_DENIED to refuse the call. `metadata` holds the
  // client's call metadata (lowercase keys).
  virtual absl::Status Authenticate(const std::multimap<std::string, std::string>& metadata) = 0;
};

struct GrpcServerOptions {
  // HOST:PORT to listen on; port 0 picks a free port (see GrpcServer::port()).
  std::string listen = "127.0.0.1:50051";
  // TLS: PEM certificate chain and private key of the server; both empty = plaintext.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // PEM CA bundle. When set (with TLS), clients must present a certificate it signed
  // (mutual TLS).
  std::string tls_client_ca_pem;
  // Largest request message, bytes (ImportSession blobs are the big ones).
  int max_receive_message_bytes = 64 << 20;
  // How long Shutdown() lets in-flight work finish before ending it.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Not owned; null = no authentication.
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

  // Graceful shutdown: health NOT_SERVING and new calls refused; in-flight work gets
  // drain_timeout; what remains is ended; the gRPC server stops; the core persists its
  // sessions and stops. Blocks until done. Idempotent.
  void Shutdown();

  class Service;  // implementation (grpc_server.cc)

 private:
  GrpcServer() = default;

  GrpcServerOptions options_;
  Core* core_ = nullptr;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<bool> shut_down_{false};
};

}  // namespace fwserve
