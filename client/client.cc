#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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

class GrpcGenerateStream : public GenerateStream {
 public:
  GrpcGenerateStream(std::unique_ptr<grpc::ClientContext> context, v1::Fwserve::Stub* stub,
                     const v1::GenerateRequest& request)
      : context_(std::move(context)), reader_(stub->Generate(context_.get(), request)) {}

  // A stream dropped before Finish() is cancelled and finished here, so that the call
  // ends (and the server lets go of its session) as soon as the caller is done with it.
  ~GrpcGenerateStream() override {
    if (!finished_) {
      Cancel();
      v1::GenerateResponse ignored;
      while (reader_->Read(&ignored)) {
      }
      (void)Finish();
    }
  }

  bool Next(v1::GenerateResponse* message) override { return reader_->Read(message); }

  absl::Status Finish() override {
    if (!finished_) {
      finished_ = true;
      status_ = FromGrpc(reader_->Finish());
    }
    return status_;
  }

  void Cancel() override { context_->TryCancel(); }

 private:
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
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
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, clamp_ms(options.initial_backoff));
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, clamp_ms(options.initial_backoff));
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
      stub_(v1::Fwserve::NewStub(channel_)) {}

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

absl::Status Client::Call(bool idempotent,
                          const std::function<absl::Status(grpc::ClientContext*)>& call) const {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 0;; ++attempt) {
    auto context = NewContext(options_.deadline);
    absl::Status status = call(context.get());
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
  return std::make_unique<GrpcGenerateStream>(NewContext(options_.generate_deadline), stub_.get(),
                                              request);
}

absl::StatusOr<GenerateResult> Client::Generate(
    const v1::GenerateRequest& request,
    const std::function<bool(const v1::GenerateResponse&)>& on_message) {
  std::unique_ptr<GenerateStream> stream = StartGenerate(request);
  GenerateResult result;
  v1::GenerateResponse message;
  while (stream->Next(&message)) {
    result.text += message.text();
    result.token_ids.insert(result.token_ids.end(), message.token_ids().begin(),
                            message.token_ids().end());
    result.logprobs.insert(result.logprobs.end(), message.logprobs().begin(),
                           message.logprobs().end());
    if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      result.finish_reason = message.finish_reason();
      result.usage = message.usage();
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

#define FWSERVE_UNARY(idempotent, method, request, response_type)            \
  response_type response;                                                    \
  absl::Status status = Call(idempotent, [&](grpc::ClientContext* context) { \
    return FromGrpc(stub_->method(context, request, &response));             \
  });                                                                        \
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
  absl::Status status = Call(true, [&](grpc::ClientContext* context) {
    return FromGrpc(stub->Check(context, request, &response));
  });
  if (!status.ok()) return status;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace fwserve
