// fwserve::Client: a thin C++ client over the generated fwserve.v1 stubs.
//
// Errors come back as absl::Status with the gRPC code preserved (UNAVAILABLE stays
// UNAVAILABLE, and so on). Idempotent calls (GetSession, ListSessions, Score,
// ExportSession, ListModels, DescribeModel, Health) are retried on UNAVAILABLE with
// exponential backoff; calls that change state are never retried.
//
// Thread-safety: a Client may be used from many threads at once. A GenerateStream is
// used from one thread, except Cancel(), which may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fwserve/v1/fwserve.grpc.pb.h"
#include "fwserve/v1/fwserve.pb.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace fwserve {

struct ClientOptions {
  // The server: HOST:PORT, or any gRPC target string, e.g. "dns:///fwserve.internal:50051"
  // (every address the name resolves to), "ipv4:10.0.0.1:50051,10.0.0.2:50051".
  std::string target = "127.0.0.1:50051";
  // How calls are spread over the target's addresses: "" (gRPC's default, pick_first),
  // "pick_first" (one connection, to the first address that answers) or "round_robin"
  // (a connection to every address, calls in turn). Set as the channel's default
  // service config ({"loadBalancingConfig":[{"round_robin":{}}]}). Other names fail
  // Connect with INVALID_ARGUMENT. Sessions live on one server unless the servers share
  // a session store (redis://), so round_robin over replicas needs a shared store.
  std::string load_balancing_policy;
  // TLS: off by default. With use_tls and empty root_certs_pem, the system roots are used.
  bool use_tls = false;
  std::string tls_root_certs_pem;
  std::string tls_client_cert_pem;  // mutual TLS, optional
  std::string tls_client_key_pem;
  // The API key, sent on every call as "authorization: Bearer <key>" when not empty.
  std::string auth_token;
  // Without TLS, Connect refuses to send auth_token to a target that is not loopback
  // (127.0.0.0/8, localhost, [::1], unix:) unless this is true: anyone on the path
  // could read the key.
  bool allow_plaintext_key = false;
  // Deadline of unary calls.
  absl::Duration deadline = absl::Seconds(60);
  // Deadline of a Generate stream (infinite = none).
  absl::Duration generate_deadline = absl::InfiniteDuration();
  // Retries of idempotent calls on UNAVAILABLE: attempts after the first, and the
  // backoff before the first retry (doubling, capped at max_backoff). The channel's own
  // reconnection backoff follows the same bounds, so a retry reaches a server that came
  // up during the wait.
  int max_retries = 3;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // Retries of any call the server refused for overload (RESOURCE_EXHAUSTED with a retry
  // hint: the `grpc-retry-pushback-ms` trailer, else a google.rpc.RetryInfo detail;
  // docs/serving.md "Overload"). Such a call did nothing on the server, so every kind is
  // retried, a Generate before its first message included. Each retry waits the hint
  // plus a jitter drawn uniformly from [0, b), b doubling from overload_backoff up to
  // max_backoff. A retry budget shared by the client's calls (gRPC's retryThrottling
  // rule: 10 tokens, -1 per overload refusal, +0.1 per success, retries only above 5)
  // stops retries while most calls are refused. 0 = return the refusal at once.
  int max_overload_retries = 3;
  absl::Duration overload_backoff = absl::Milliseconds(50);
  // Test-only; empty = sleep. How the client waits out each backoff before a retry:
  // tests record the backoffs, or start a server during one, instead of timing calls.
  std::function<void(absl::Duration backoff)> retry_wait_for_testing;
};

// What a whole Generate produced.
struct GenerateResult {
  std::string text;  // every message's text, concatenated
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;
  // With top_logprobs: each token's most likely alternatives (one entry per token).
  std::vector<v1::TopLogprobs> top_logprobs;
  v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  // The session it ran on (GenerateResponse.session_id): the new one of a fork_from
  // request; empty for a throwaway or store:false request.
  std::string session_id;
  // GenerateRequest.n > 1: each choice, by index (the fields above are then choice 0's,
  // but usage, which counts the prompt once and every choice's tokens).
  struct Choice {
    std::string text;
    std::vector<int64_t> token_ids;
    std::vector<float> logprobs;
    v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
  };
  std::vector<Choice> choices;
};

// Iterator-style Generate: Next() until it returns false, then Finish().
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  // The next message; false at the end of the stream (then call Finish).
  virtual bool Next(v1::GenerateResponse* message) = 0;
  // The call's status. OK after a complete stream (the last message carried the
  // finish reason and usage); CANCELLED after Cancel().
  virtual absl::Status Finish() = 0;
  // Cancels the call; thread-safe. The server keeps exactly the tokens it streamed.
  // Destroying a stream before Finish() cancels it too.
  virtual void Cancel() = 0;
};

class OverloadRetries;

class Client {
 public:
  // Creates the channel (connection is lazy: errors show on the first call).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();

  // Streams a generation. `on_message` sees every message (the last carries the finish
  // reason and usage); returning false cancels the call, and the result is then
  // CANCELLED. Returns the whole result.
  absl::StatusOr<GenerateResult> Generate(
      const v1::GenerateRequest& request,
      const std::function<bool(const v1::GenerateResponse&)>& on_message = nullptr);
  std::unique_ptr<GenerateStream> StartGenerate(const v1::GenerateRequest& request);

  absl::StatusOr<v1::ScoreResponse> Score(const v1::ScoreRequest& request);

  absl::StatusOr<v1::SessionInfo> CreateSession(const std::string& model = "",
                                                const std::string& prefix = "");
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id);
  // One page of sessions (of `model`; empty = all), oldest first. page_size: 0 = 100,
  // at most 1000 (larger is taken as 1000), negative is INVALID_ARGUMENT. page_token:
  // empty = the first page, else the previous page's next_page_token (with the same
  // model). The response's next_page_token is empty on the last page.
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const std::string& model = "",
                                                        int32_t page_size = 0,
                                                        const std::string& page_token = "");
  // Every session (of `model`), oldest first: ListSessions page after page (1000 a
  // page), each page retried on its own. Not a snapshot: a session created or deleted
  // meanwhile may or may not be listed.
  absl::StatusOr<std::vector<v1::SessionInfo>> ListAllSessions(const std::string& model = "");
  absl::Status DeleteSession(const std::string& session_id);
  absl::StatusOr<v1::SessionInfo> ForkSession(const std::string& session_id);
  absl::StatusOr<v1::ExportSessionResponse> ExportSession(const std::string& session_id);
  absl::StatusOr<v1::SessionInfo> ImportSession(const std::string& blob,
                                                const std::string& model = "");

  absl::StatusOr<std::vector<v1::ModelInfo>> ListModels();
  absl::StatusOr<v1::ModelInfo> DescribeModel(const std::string& model = "");

  // The standard gRPC health check of `service` ("" = the whole server): true if
  // SERVING, false if NOT_SERVING.
  absl::StatusOr<bool> Health(const std::string& service = "");

  const ClientOptions& options() const { return options_; }

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // A context with the deadline and auth metadata.
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Duration deadline) const;
  // Runs `call` (one attempt with a fresh context), retrying on UNAVAILABLE if
  // `idempotent`.
  // Also retries any call refused for overload (max_overload_retries). `call` returns
  // its status both ways (the grpc::Status carries the retry hint).
  absl::Status Call(
      bool idempotent,
      const std::function<absl::Status(grpc::ClientContext*, grpc::Status*)>& call) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Fwserve::Stub> stub_;
  // The overload retry budget and backoff (client.cc); shared by every call.
  std::shared_ptr<OverloadRetries> overload_retries_;
};

}  // namespace fwserve
