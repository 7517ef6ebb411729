#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace fwserve {
namespace {

// True if every address of `target` is this machine (127.0.0.0/8, localhost, [::1],
// unix sockets); "dns:///" and "ipv4:" forms are understood.
bool IsLoopbackTarget(absl::string_view target) {
  if (absl::ConsumePrefix(&target, "unix:")) return true;
  absl::ConsumePrefix(&target, "dns:///");
  const bool ipv4_list = absl::ConsumePrefix(&target, "ipv4:");
  absl::ConsumePrefix(&target, "ipv6:");
  for (absl::string_view address : absl::StrSplit(target, ',')) {
    if (!absl::StartsWith(address, "127.") && !absl::StartsWith(address, "localhost:") &&
        address != "localhost" && !absl::StartsWith(address, "[::1]:")) {
      return false;
    }
    if (!ipv4_list) break;
  }
  return true;
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// The server's retry hint on an overload refusal: the `grpc-retry-pushback-ms` trailer
// (what is left of the hint after the server held the refusal), else the RetryInfo in the
// rich error details. nullopt: no hint, or the server says not to retry.
std::optional<absl::Duration> OverloadHint(const grpc::Status& status,
                                           const grpc::ClientContext& context) {
  if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) return std::nullopt;
  const auto& trailers = context.GetServerTrailingMetadata();
  if (auto it = trailers.find("grpc-retry-pushback-ms"); it != trailers.end()) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &ms) || ms < 0) {
      return std::nullopt;
    }
    return absl::Milliseconds(ms);
  }
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return std::nullopt;
  }
  for (const auto& detail : details.details()) {
    google::rpc::RetryInfo retry;
    if (detail.UnpackTo(&retry)) {
      return absl::Seconds(retry.retry_delay().seconds()) +
             absl::Nanoseconds(retry.retry_delay().nanos());
    }
  }
  return std::nullopt;
}

}  // namespace

// The overload retry rule of ClientOptions::max_overload_retries: the budget (gRPC's
// retryThrottling) and the backoff. Thread-safe.
class OverloadRetries {
 public:
  explicit OverloadRetries(const ClientOptions& options)
      : options_(options), random_(std::random_device{}()) {}

  // A call was answered without an overload refusal.
  void Succeeded() {
    absl::MutexLock lock(&mu_);
    tokens_ = std::min(kMaxTokens, tokens_ + kTokenRatio);
  }
  // A call was refused with `hint` on its `attempt`-th retry (0 = the first try). Waits
  // and returns true if it should be retried; false to return the refusal.
  // `cancelled` (may be null) ends the wait early with false.
  bool WaitToRetry(int attempt, absl::Duration hint, const std::function<bool()>& cancelled) {
    absl::Duration wait;
    {
      absl::MutexLock lock(&mu_);
      tokens_ = std::max(0.0, tokens_ - 1);
      if (attempt >= options_.max_overload_retries || tokens_ <= kMaxTokens / 2) return false;
      const absl::Duration base =
          std::min(options_.overload_backoff * (int64_t{1} << std::min(attempt, 20)),
                   std::max(options_.max_backoff, options_.overload_backoff));
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      wait = hint + base * unit(random_);
    }
    if (options_.retry_wait_for_testing) {
      options_.retry_wait_for_testing(wait);
      return cancelled == nullptr || !cancelled();
    }
    const absl::Time until = absl::Now() + wait;
    while (absl::Now() < until) {
      if (cancelled != nullptr && cancelled()) return false;
      absl::SleepFor(std::min(until - absl::Now(), absl::Milliseconds(20)));
    }
    return cancelled == nullptr || !cancelled();
  }

 private:
  static constexpr double kMaxTokens = 10;
  static constexpr double kTokenRatio = 0.1;
  const ClientOptions& options_;  // the owning Client's
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_) = kMaxTokens;
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A Generate call, retried after an overload refusal (before its first message).
class RetryingGenerateStream : public GenerateStream {
 public:
  using NewContextFn = std::function<std::unique_ptr<grpc::ClientContext>()>;
  RetryingGenerateStream(NewContextFn new_context, v1::Fwserve::Stub* stub,
                         v1::GenerateRequest request, std::shared_ptr<OverloadRetries> retries)
      : new_context_(std::move(new_context)),
        stub_(stub),
        request_(std::move(request)),
        retries_(std::move(retries)) {
    StartAttempt();
  }

  // A stream dropped before Finish() is cancelled and finished here, so that the call
  // ends (and the server lets go of its session) as soon as the caller is done with it.
  ~RetryingGenerateStream() override {
    if (!finished_) {
      Cancel();
      v1::GenerateResponse ignored;
      while (reader_->Read(&ignored)) {
      }
      (void)Finish();
    }
  }

  bool Next(v1::GenerateResponse* message) override {
    while (true) {
      if (reader_->Read(message)) {
        if (!received_) retries_->Succeeded();
        received_ = true;
        return true;
      }
      if (received_ || finished_) return false;
      // Ended before its first message: a refusal may be retried.
      const grpc::Status status = reader_->Finish();
      const std::optional<absl::Duration> hint = OverloadHint(status, *context_);
      if (!hint.has_value() || cancelled_.load() ||
          !retries_->WaitToRetry(attempt_, *hint, [this] { return cancelled_.load(); })) {
        finished_ = true;
        status_ = FromGrpc(status);
        if (status.ok()) retries_->Succeeded();
        return false;
      }
      ++attempt_;
      StartAttempt();
    }
  }

  absl::Status Finish() override {
    if (!finished_) {
      finished_ = true;
      status_ = FromGrpc(reader_->Finish());
    }
    return status_;
  }

  void Cancel() override {
    cancelled_.store(true);
    absl::MutexLock lock(&context_mu_);
    context_->TryCancel();
  }

 private:
  void StartAttempt() {
    std::unique_ptr<grpc::ClientContext> context = new_context_();
    auto reader = stub_->Generate(context.get(), request_);
    absl::MutexLock lock(&context_mu_);
    // The previous attempt's reader is finished; its context can go.
    reader_ = std::move(reader);
    context_ = std::move(context);
    if (cancelled_.load()) context_->TryCancel();
  }

  const NewContextFn new_context_;
  v1::Fwserve::Stub* const stub_;
  const v1::GenerateRequest request_;
  const std::shared_ptr<OverloadRetries> retries_;
  absl::Mutex context_mu_;  // Cancel (any thread) against StartAttempt
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  std::atomic<bool> cancelled_{false};
  int attempt_ = 0;
  bool received_ = false;
  bool finished_ = false;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target must not be empty");
  if (!options.auth_token.empty() && !options.use_tls && !options.allow_plaintext_key &&
      !IsLoopbackTarget(options.target)) {
    return absl::FailedPreconditionError(
        absl::StrCat("refusing to send the API key without TLS to '", options.target,
                     "', which is not a loopback address: use TLS, or allow it explicitly "
                     "(ClientOptions::allow_plaintext_key, fwctl --insecure)"));
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.use_tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs_pem;
    ssl.pem_cert_chain = options.tls_client_cert_pem;
    ssl.pem_private_key = options.tls_client_key_pem;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(64 << 20);
  if (!options.load_balancing_policy.empty()) {
    if (options.load_balancing_policy != "pick_first" &&
        options.load_balancing_policy != "round_robin") {
      return absl::InvalidArgumentError(
          absl::StrCat("load_balancing_policy must be pick_first or round_robin, got '",
                       options.load_balancing_policy, "'"));
    }
    // The default service config: a config from the resolver (DNS TXT records, off by
    // default in gRPC) would take precedence.
    arguments.SetServiceConfigJSON(
        absl::StrCat(R"({"loadBalancingConfig":[{")", options.load_balancing_policy, R"(":{}}]})"));
  }
  // gRPC waits between reconnection attempts on its own (1 s, growing to 120 s, by
  // default), and while it waits every call fails at once with UNAVAILABLE. Align that
  // wait with the client's retry backoff, so that a retry can reach a server that came
  // (back) up in the meantime.
  const auto clamp_ms = [](absl::Duration d) {
    return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, 120000));
  };
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the deadline of each
  // connection attempt (min_connect_timeout, 20 s by default). At 100 ms, a TCP or TLS
  // handshake on a loaded machine was cut off ("handshaker shutdown") and every
  // attempt failed.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, clamp_ms(options.initial_backoff));
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                   clamp_ms(std::max(options.max_backoff, options.initial_backoff)));
  auto channel = grpc::CreateCustomChannel(options.target, credentials, arguments);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create a channel to '", options.target, "'"));
  }
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Fwserve::NewStub(channel_)),
      overload_retries_(std::make_shared<OverloadRetries>(options_)) {}

Client::~Client() = default;

std::unique_ptr<grpc::ClientContext> Client::NewContext(absl::Duration deadline) const {
  auto context = std::make_unique<grpc::ClientContext>();
  if (deadline != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  }
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  return context;
}

absl::Status Client::Call(
    bool idempotent,
    const std::function<absl::Status(grpc::ClientContext*, grpc::Status*)>& call) const {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 0, overload_attempt = 0;; ++attempt) {
    auto context = NewContext(options_.deadline);
    grpc::Status grpc_status;
    absl::Status status = call(context.get(), &grpc_status);
    // An overload refusal did nothing on the server: any call may be retried.
    if (const std::optional<absl::Duration> hint = OverloadHint(grpc_status, *context);
        hint.has_value()) {
      if (overload_retries_->WaitToRetry(overload_attempt++, *hint, nullptr)) continue;
      return status;
    }
    overload_retries_->Succeeded();
    if (!idempotent || status.code() != absl::StatusCode::kUnavailable ||
        attempt >= options_.max_retries) {
      return status;
    }
    if (options_.retry_wait_for_testing) {
      options_.retry_wait_for_testing(backoff);
    } else {
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(backoff));
    }
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

std::unique_ptr<GenerateStream> Client::StartGenerate(const v1::GenerateRequest& request) {
  return std::make_unique<RetryingGenerateStream>(
      [this] { return NewContext(options_.generate_deadline); }, stub_.get(), request,
      overload_retries_);
}

absl::StatusOr<GenerateResult> Client::Generate(
    const v1::GenerateRequest& request,
    const std::function<bool(const v1::GenerateResponse&)>& on_message) {
  std::unique_ptr<GenerateStream> stream = StartGenerate(request);
  GenerateResult result;
  v1::GenerateResponse message;
  const bool several = request.n() > 1;
  if (several) result.choices.resize(static_cast<size_t>(request.n()));
  while (stream->Next(&message)) {
    if (!message.session_id().empty()) result.session_id = message.session_id();
    const size_t index = static_cast<size_t>(std::max(0, message.choice_index()));
    if (several && index < result.choices.size()) {
      GenerateResult::Choice& choice = result.choices[index];
      choice.text += message.text();
      choice.token_ids.insert(choice.token_ids.end(), message.token_ids().begin(),
                              message.token_ids().end());
      choice.logprobs.insert(choice.logprobs.end(), message.logprobs().begin(),
                             message.logprobs().end());
    }
    if (index == 0) {
      result.text += message.text();
      result.token_ids.insert(result.token_ids.end(), message.token_ids().begin(),
                              message.token_ids().end());
      result.logprobs.insert(result.logprobs.end(), message.logprobs().begin(),
                             message.logprobs().end());
      result.top_logprobs.insert(result.top_logprobs.end(), message.top_logprobs().begin(),
                                 message.top_logprobs().end());
    }
    if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      result.finish_reason = message.finish_reason();
      result.usage = message.usage();
      for (const v1::ChoiceEnd& end : message.choices()) {
        if (end.index() < 0 || static_cast<size_t>(end.index()) >= result.choices.size()) continue;
        GenerateResult::Choice& choice = result.choices[static_cast<size_t>(end.index())];
        choice.text += end.text();
        choice.finish_reason = end.finish_reason();
        if (end.index() == 0) result.text += end.text();
      }
    }
    if (on_message && !on_message(message)) {
      stream->Cancel();
      while (stream->Next(&message)) {
      }
      break;
    }
  }
  absl::Status status = stream->Finish();
  if (!status.ok()) return status;
  return result;
}

#define FWSERVE_UNARY(idempotent, method, request, response_type)                     \
  response_type response;                                                             \
  absl::Status status =                                                               \
      Call(idempotent, [&](grpc::ClientContext* context, grpc::Status* grpc_status) { \
        *grpc_status = stub_->method(context, request, &response);                    \
        return FromGrpc(*grpc_status);                                                \
      });                                                                             \
  if (!status.ok()) return status;

absl::StatusOr<v1::ScoreResponse> Client::Score(const v1::ScoreRequest& request) {
  FWSERVE_UNARY(true, Score, request, v1::ScoreResponse);
  return response;
}

absl::StatusOr<v1::SessionInfo> Client::CreateSession(const std::string& model,
                                                      const std::string& prefix) {
  v1::CreateSessionRequest request;
  request.set_model(model);
  request.set_prefix(prefix);
  FWSERVE_UNARY(false, CreateSession, request, v1::SessionInfo);
  return response;
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const std::string& session_id) {
  v1::GetSessionRequest request;
  request.set_session_id(session_id);
  FWSERVE_UNARY(true, GetSession, request, v1::SessionInfo);
  return response;
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions(const std::string& model,
                                                              int32_t page_size,
                                                              const std::string& page_token) {
  v1::ListSessionsRequest request;
  request.set_model(model);
  request.set_page_size(page_size);
  request.set_page_token(page_token);
  FWSERVE_UNARY(true, ListSessions, request, v1::ListSessionsResponse);
  return response;
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListAllSessions(const std::string& model) {
  constexpr int32_t kPageSize = 1000;
  std::vector<v1::SessionInfo> sessions;
  std::string page_token;
  do {
    absl::StatusOr<v1::ListSessionsResponse> page = ListSessions(model, kPageSize, page_token);
    if (!page.ok()) return page.status();
    for (v1::SessionInfo& info : *page->mutable_sessions()) sessions.push_back(std::move(info));
    // A server that hands back the token it was given would never end the walk.
    if (!page->next_page_token().empty() && page->next_page_token() == page_token) {
      return absl::InternalError("ListSessions returned the page_token it was given");
    }
    page_token = page->next_page_token();
  } while (!page_token.empty());
  return sessions;
}

absl::Status Client::DeleteSession(const std::string& session_id) {
  v1::DeleteSessionRequest request;
  request.set_session_id(session_id);
  FWSERVE_UNARY(false, DeleteSession, request, v1::DeleteSessionResponse);
  return absl::OkStatus();
}

absl::StatusOr<v1::SessionInfo> Client::ForkSession(const std::string& session_id) {
  v1::ForkSessionRequest request;
  request.set_session_id(session_id);
  FWSERVE_UNARY(false, ForkSession, request, v1::SessionInfo);
  return response;
}

absl::StatusOr<v1::ExportSessionResponse> Client::ExportSession(const std::string& session_id) {
  v1::ExportSessionRequest request;
  request.set_session_id(session_id);
  FWSERVE_UNARY(true, ExportSession, request, v1::ExportSessionResponse);
  return response;
}

absl::StatusOr<v1::SessionInfo> Client::ImportSession(const std::string& blob,
                                                      const std::string& model) {
  v1::ImportSessionRequest request;
  request.set_model(model);
  request.set_blob(blob);
  FWSERVE_UNARY(false, ImportSession, request, v1::SessionInfo);
  return response;
}

absl::StatusOr<std::vector<v1::ModelInfo>> Client::ListModels() {
  v1::ListModelsRequest request;
  FWSERVE_UNARY(true, ListModels, request, v1::ListModelsResponse);
  return std::vector<v1::ModelInfo>(response.models().begin(), response.models().end());
}

absl::StatusOr<v1::ModelInfo> Client::DescribeModel(const std::string& model) {
  v1::DescribeModelRequest request;
  request.set_model(model);
  FWSERVE_UNARY(true, DescribeModel, request, v1::ModelInfo);
  return response;
}

#undef FWSERVE_UNARY

absl::StatusOr<bool> Client::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  absl::Status status = Call(true, [&](grpc::ClientContext* context, grpc::Status* grpc_status) {
    *grpc_status = stub->Check(context, request, &response);
    return FromGrpc(*grpc_status);
  });
  if (!status.ok()) return status;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace fwserve
