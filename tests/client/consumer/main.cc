// Uses the installed fwserve client package: the client library, the generated
// fwserve.v1 messages and stubs, and the vendored health protocol. Against a loopback
// port where nothing listens, Health() must fail with UNAVAILABLE after its retries.
// Exit 0 when everything behaves.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "client/client.h"
#include "fwserve/v1/fwserve.grpc.pb.h"
#include "grpc/health/v1/health.pb.h"

namespace {

// A loopback port that was free a moment ago (bound, then closed).
int DeadLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace

int main() {
  fwserve::v1::GenerateRequest request;
  request.set_prompt("hello");
  request.set_max_tokens(3);
  grpc::health::v1::HealthCheckRequest health_request;
  health_request.set_service("fwserve.v1.Fwserve");
  if (request.ByteSizeLong() == 0 || health_request.service().empty()) return 1;

  fwserve::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(DeadLoopbackPort());
  options.max_retries = 1;
  options.initial_backoff = absl::Milliseconds(10);
  options.deadline = absl::Seconds(5);
  auto client = fwserve::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "Connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<bool> health = (*client)->Health();
  if (health.ok() || health.status().code() != absl::StatusCode::kUnavailable) {
    std::fprintf(stderr, "expected UNAVAILABLE from %s, got %s\n", options.target.c_str(),
                 health.ok() ? "OK" : health.status().ToString().c_str());
    return 1;
  }
  std::printf("consumer: Health() against %s -> %s (as expected)\n", options.target.c_str(),
              absl::StatusCodeToString(health.status().code()).c_str());
  return 0;
}
