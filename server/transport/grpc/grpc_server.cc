#include "server/transport/grpc/grpc_server.h"

#include <grpcpp/alarm.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "fwserve/v1/fwserve.grpc.pb.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/transport/grpc/proto_conversion.h"
#include "server/transport/grpc/status_mapping.h"
#include "server/transport/grpc/writer_thread.h"

namespace fwserve {
namespace {

namespace v1 = ::fwserve::v1;

constexpr char kServiceName[] = "fwserve.v1.Fwserve";

CallCredentials CredentialsOf(const grpc::CallbackServerContext* context) {
  CallCredentials out;
  for (const auto& [key, value] : context->client_metadata()) {
    out.metadata.emplace(std::string(key.data(), key.size()),
                         std::string(value.data(), value.size()));
  }
  std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& name : auth->FindPropertyValues("x509_common_name")) {
      out.certificate_common_name = std::string(name.data(), name.size());
    }
  }
  return out;
}

// Client-supplied names in log lines and metrics lookups: at most this many bytes
// (Log escapes control bytes; this keeps a 60 MB name from making a 60 MB line).
constexpr size_t kMaxLoggedNameBytes = 128;

std::string CappedName(const std::string& name) {
  return name.size() <= kMaxLoggedNameBytes
             ? name
             : absl::StrCat(name.substr(0, kMaxLoggedNameBytes), "...(", name.size(), " bytes)");
}

}  // namespace

class GrpcServer::Service : public v1::Fwserve::CallbackService {
 public:
  Service(Core* core, const GrpcServerOptions& options)
      : core_(core), options_(options), metrics_(Metrics::OrNull(options.metrics)) {
    if (options_.writer_thread_from_streams > 0) {
      writer_ = std::make_unique<WriterPool>(WriterThreadCount(options_.writer_threads),
                                             "fwserve-writer");
    }
  }

  void BeginShutdown() { shutting_down_.store(true); }
  absl::Duration max_refusal_delay() const { return options_.max_refusal_delay; }

  // Accounting of one call: the request metric and the structured log line.
  class CallRecord {
   public:
    CallRecord(Service* service, const char* rpc, const std::string& model,
               const std::string& session)
        : service_(service),
          rpc_(rpc),
          model_(CappedName(model)),
          session_(CappedName(session)),
          id_(service->next_request_id_.fetch_add(1)),
          start_(absl::Now()) {}
    void set_model(const std::string& model) { model_ = CappedName(model); }
    void set_session(const std::string& session) { session_ = CappedName(session); }
    void set_tenant(std::string tenant) { tenant_ = std::move(tenant); }
    void set_tokens(int64_t prompt, int64_t generated) {
      prompt_tokens_ = prompt;
      generated_tokens_ = generated;
    }
    void Done(const grpc::Status& status) {
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
      service_->metrics_->ObserveRequest(rpc_, model_, status.error_code(), seconds);
      service_->metrics_->ObserveTenantRequest(tenant_, rpc_, status.error_code());
      const LogLevel level = status.ok() ? LogLevel::kInfo : LogLevel::kWarning;
      if (LogEnabled(level)) {
        Log(level,
            absl::StrCat(
                "request id=", id_, " method=", rpc_, " tenant=", tenant_.empty() ? "-" : tenant_,
                " model=", model_.empty() ? "-" : model_,
                " session=", session_.empty() ? "-" : session_, " prompt_tokens=", prompt_tokens_,
                " generated_tokens=", generated_tokens_, " latency_ms=",
                static_cast<int64_t>(seconds * 1000), " status=", GrpcCodeName(status.error_code()),
                status.ok() ? "" : absl::StrCat(" error=\"", status.error_message(), "\"")));
      }
    }

   private:
    Service* service_;
    const char* rpc_;
    std::string model_;
    std::string session_;
    std::string tenant_;  // set once authenticated
    uint64_t id_;
    absl::Time start_;
    int64_t prompt_tokens_ = 0;
    int64_t generated_tokens_ = 0;
  };

  // Who the call comes from; fails it before it reaches the core when draining or
  // unauthenticated. Records the tenant in `record`.
  absl::StatusOr<Caller> Admit(grpc::CallbackServerContext* context, CallRecord& record) {
    if (shutting_down_.load()) return absl::UnavailableError("the server is shutting down");
    Caller caller;
    if (options_.authenticator != nullptr) {
      absl::StatusOr<std::string> tenant =
          options_.authenticator->Authenticate(CredentialsOf(context));
      if (!tenant.ok()) return tenant.status();
      caller.tenant = std::move(*tenant);
      record.set_tenant(caller.tenant);
    }
    return caller;
  }

  // A unary call finished by a core callback: `fill` writes the response.
  template <typename Result, typename Fill>
  Callback<Result> UnaryDone(grpc::CallbackServerContext* context,
                             grpc::ServerUnaryReactor* reactor, std::shared_ptr<CallRecord> record,
                             Fill fill) {
    return [context, reactor, record, fill](absl::StatusOr<Result> result) {
      AddRetryPushback(context, result.status());
      grpc::Status status = ToGrpcStatus(result.status());
      if (result.ok()) fill(*result);
      record->Done(status);
      reactor->Finish(status);
    };
  }

  grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                      std::shared_ptr<CallRecord> record,
                                      const absl::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    AddRetryPushback(context, status);
    const grpc::Status grpc_status = ToGrpcStatus(status);
    record->Done(grpc_status);
    reactor->Finish(grpc_status);
    return reactor;
  }

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* context,
                                  const v1::ScoreRequest* request,
                                  v1::ScoreResponse* response) override {
    auto record =
        std::make_shared<CallRecord>(this, "Score", request->model(), request->session_id());
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->Score(
        *caller,
        ScoreParams{request->model(), request->session_id(), request->text(),
                    [context] { return context->IsCancelled(); }},
        UnaryDone<ScoreResult>(context, reactor, record, [response, record](ScoreResult& result) {
          double total = 0;
          for (double v : result.logprobs) total += v;
          response->mutable_token_ids()->Add(result.token_ids.begin(), result.token_ids.end());
          response->mutable_logprobs()->Add(result.logprobs.begin(), result.logprobs.end());
          response->set_total_logprob(total);
          response->set_perplexity(
              result.logprobs.empty()
                  ? 0
                  : std::exp(-total / static_cast<double>(result.logprobs.size())));
          record->set_tokens(static_cast<int64_t>(result.token_ids.size()), 0);
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::SessionInfo* response) override {
    auto record = std::make_shared<CallRecord>(this, "CreateSession", request->model(), "");
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->CreateSession(*caller, request->model(), request->prefix(),
                         UnaryDone<SessionRecord>(context, reactor, record,
                                                  [response, record](SessionRecord& r) {
                                                    record->set_model(r.model);
                                                    record->set_session(r.id);
                                                    record->set_tokens(r.tokens, 0);
                                                    ToProto(r, response);
                                                  }),
                         [context] { return context->IsCancelled(); });
    return reactor;
  }

  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::SessionInfo* response) override {
    auto record = std::make_shared<CallRecord>(this, "GetSession", "", request->session_id());
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    // `done` may run at once, inside this call: finishing the default reactor before
    // the handler returns it is allowed.
    core_->GetSession(
        *caller, request->session_id(),
        UnaryDone<SessionRecord>(context, reactor, record, [response, record](SessionRecord& r) {
          record->set_model(r.model);
          ToProto(r, response);
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override {
    auto record = std::make_shared<CallRecord>(this, "ListSessions", request->model(), "");
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    if (request->page_size() < 0) {
      return FinishNow(context, record,
                       absl::InvalidArgumentError(absl::StrCat(
                           "page_size must not be negative, got ", request->page_size())));
    }
    if (!request->model().empty()) {
      if (auto model = core_->DescribeModel(request->model()); !model.ok()) {
        return FinishNow(context, record, model.status());
      }
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    ListSessionsParams params;
    params.model = request->model();
    params.page_size = request->page_size();
    params.page_token = request->page_token();
    // As in GetSession, `done` may run before this returns.
    core_->ListSessions(
        *caller, std::move(params),
        UnaryDone<SessionList>(context, reactor, record, [response](SessionList& list) {
          response->mutable_sessions()->Reserve(static_cast<int>(list.sessions.size()));
          for (const SessionRecord& r : list.sessions) {
            ToProto(r, response->add_sessions());
          }
          response->set_next_page_token(std::move(list.next_page_token));
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse*) override {
    auto record = std::make_shared<CallRecord>(this, "DeleteSession", "", request->session_id());
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->DeleteSession(*caller, request->session_id(),
                         UnaryDone<bool>(context, reactor, record, [](bool) {}));
    return reactor;
  }

  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::SessionInfo* response) override {
    auto record = std::make_shared<CallRecord>(this, "ForkSession", "", request->session_id());
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->ForkSession(
        *caller, request->session_id(),
        UnaryDone<SessionRecord>(context, reactor, record, [response, record](SessionRecord& r) {
          record->set_model(r.model);
          ToProto(r, response);
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* ExportSession(grpc::CallbackServerContext* context,
                                          const v1::ExportSessionRequest* request,
                                          v1::ExportSessionResponse* response) override {
    auto record = std::make_shared<CallRecord>(this, "ExportSession", "", request->session_id());
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->ExportSession(
        *caller, request->session_id(),
        UnaryDone<ExportResult>(context, reactor, record, [response, record](ExportResult& r) {
          record->set_model(r.model);
          response->set_blob(std::move(r.blob));
          response->set_model(r.model);
          response->set_tokens(r.tokens);
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* ImportSession(grpc::CallbackServerContext* context,
                                          const v1::ImportSessionRequest* request,
                                          v1::SessionInfo* response) override {
    auto record = std::make_shared<CallRecord>(this, "ImportSession", request->model(), "");
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    core_->ImportSession(
        *caller, request->model(), request->blob(),
        UnaryDone<SessionRecord>(context, reactor, record, [response, record](SessionRecord& r) {
          record->set_model(r.model);
          record->set_session(r.id);
          ToProto(r, response);
        }));
    return reactor;
  }

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest*,
                                       v1::ListModelsResponse* response) override {
    auto record = std::make_shared<CallRecord>(this, "ListModels", "", "");
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    for (const ModelDescription& d : core_->ListModels()) ToProto(d, response->add_models());
    return FinishNow(context, record, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* DescribeModel(grpc::CallbackServerContext* context,
                                          const v1::DescribeModelRequest* request,
                                          v1::ModelInfo* response) override {
    auto record = std::make_shared<CallRecord>(this, "DescribeModel", request->model(), "");
    absl::StatusOr<Caller> caller = Admit(context, *record);
    if (!caller.ok()) return FinishNow(context, record, caller.status());
    auto model = core_->DescribeModel(request->model());
    if (model.ok()) ToProto(*model, response);
    return FinishNow(context, record, model.status());
  }

  // Generate streams from their handler to OnDone.
  void GenerateOpened() { open_generates_.fetch_add(1, std::memory_order_relaxed); }
  void GenerateDone() { open_generates_.fetch_sub(1, std::memory_order_relaxed); }
  // Waits until no Generate reactor is open (its last message and status sent or its
  // call cancelled), or `deadline`; true when none is open.
  bool WaitForOpenGenerates(absl::Time deadline) const {
    while (open_generates_.load(std::memory_order_relaxed) > 0) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  // Runs a Generate stream's StartWrite: on the stream's writer thread while at least
  // writer_thread_from_streams streams are open, else on the calling thread.
  void StartGenerateWrite(const void* stream, absl::AnyInvocable<void() &&> start_write) {
    if (writer_ != nullptr &&
        open_generates_.load(std::memory_order_relaxed) >= options_.writer_thread_from_streams) {
      writer_->Post(reinterpret_cast<uintptr_t>(stream), std::move(start_write));
    } else {
      std::move(start_write)();
    }
  }

  Core* const core_;
  const GrpcServerOptions options_;
  Metrics* const metrics_;  // never null
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint64_t> next_request_id_{1};
  std::atomic<int64_t> open_generates_{0};
  // Outlives every call: the service is destroyed after the gRPC server has stopped.
  std::unique_ptr<WriterPool> writer_;
};

namespace {

// One Generate call. Lives from the handler until OnDone. The engine calls OnStart,
// OnChunk and OnFinish (one write in flight at a time); gRPC calls OnWriteDone,
// OnCancel and OnDone.
class GenerateReactor : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                        public GenerateObserver {
 public:
  using Service = GrpcServer::Service;
  using CallRecord = Service::CallRecord;

  // `service` (not owned) and `context` (gRPC's) outlive the call.
  GenerateReactor(Service* service, grpc::CallbackServerContext* context,
                  std::shared_ptr<CallRecord> record)
      : service_(service), context_(context), record_(std::move(record)) {
    service_->GenerateOpened();
  }

  // Answers a refusal before the stream began (at the door, or a queued stream shed by
  // CoDel). An overload refusal (RESOURCE_EXHAUSTED with a retry delay) is answered
  // after min(its delay, --max-refusal-delay, the time left to the call's deadline): a
  // client that retries at once then cannot spin the server on refusals; the pushback
  // trailer says what is left of the delay.
  void FailNow(const absl::Status& status) {
    finishing_ = true;
    const std::optional<absl::Duration> delay = RetryDelayOf(status);
    absl::Duration hold = absl::ZeroDuration();
    if (status.code() == absl::StatusCode::kResourceExhausted && delay.has_value()) {
      const absl::Duration to_deadline =
          absl::FromChrono(context_->deadline()) - absl::Now() - absl::Milliseconds(20);
      hold = std::max(absl::ZeroDuration(),
                      std::min({*delay, service_->max_refusal_delay(), to_deadline}));
    }
    AddRetryPushback(context_, status, hold);
    const grpc::Status grpc_status = ToGrpcStatus(status);
    record_->Done(grpc_status);
    if (hold <= absl::ZeroDuration()) {
      Finish(grpc_status);
      return;
    }
    refusal_alarm_.Set(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(hold),
                       [this, grpc_status](bool) { Finish(grpc_status); });
  }

  // GenerateRequest.store: false keeps no session to name. Set before StartGenerate.
  void set_keeps_session(bool keeps) { keeps_session_ = keeps; }

  void OnStart(std::shared_ptr<GenerateControl> stream) override {
    absl::MutexLock lock(&mu_);
    stream_ = std::move(stream);
  }

  // On the engine thread: hands the chunk over. The message is built where it is
  // written (the writer thread, when the service has one), so that the engine thread's
  // work per message stays a move and a hand-off (issue 48).
  void OnChunk(GenerateChunk chunk) override {
    const bool first = !chunk_started_.exchange(true);
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = true;
    }
    // Until OnWriteDone nothing else touches pending_chunk_ and chunk_message_ (the
    // writer's queue orders this write before the build), and the call cannot finish
    // (FinishAfterWrite waits), so the reactor outlives a write started later.
    pending_chunk_ = std::move(chunk);
    service_->StartGenerateWrite(this, [this, first] {
      chunk_message_.Clear();
      if (first) chunk_message_.set_session_id(KeptSessionId());
      chunk_message_.set_text(std::move(pending_chunk_.text));
      chunk_message_.set_choice_index(pending_chunk_.choice_index);
      chunk_message_.mutable_token_ids()->Add(pending_chunk_.token_ids.begin(),
                                              pending_chunk_.token_ids.end());
      chunk_message_.mutable_logprobs()->Add(pending_chunk_.logprobs.begin(),
                                             pending_chunk_.logprobs.end());
      for (const std::vector<GenerateChunk::Alternative>& token : pending_chunk_.top_logprobs) {
        v1::TopLogprobs* entry = chunk_message_.add_top_logprobs();
        for (const GenerateChunk::Alternative& a : token) {
          v1::TopLogprobs::Alternative* alternative = entry->add_alternatives();
          alternative->set_token_id(a.token_id);
          alternative->set_logprob(a.logprob);
          alternative->set_bytes(a.bytes);
        }
      }
      StartWrite(&chunk_message_);
    });
  }

  void OnFinish(absl::Status status, GenerateSummary summary) override {
    finishing_ = true;
    record_->set_tokens(summary.prompt_tokens, summary.generated_tokens);
    if (!status.ok()) {
      // Refused after it was queued (CoDel's shed): answered as a refusal at the door,
      // held and with the retry hint. Before the first chunk nothing else is in flight.
      if (!chunk_started_.load() && RetryDelayOf(status).has_value()) {
        FailNow(status);
        return;
      }
      const grpc::Status grpc_status = ToGrpcStatus(status);
      record_->Done(grpc_status);
      FinishAfterWrite(grpc_status);
      return;
    }
    if (summary.reason == FinishReason::kCancelled) {
      const grpc::Status cancelled(grpc::StatusCode::CANCELLED, "cancelled");
      record_->Done(cancelled);
      FinishAfterWrite(cancelled);
      return;
    }
    final_message_.set_session_id(KeptSessionId());
    final_message_.set_text(std::move(summary.trailing_text));
    final_message_.set_finish_reason(ToProto(summary.reason));
    v1::Usage* usage = final_message_.mutable_usage();
    usage->set_prompt_tokens(summary.prompt_tokens);
    usage->set_generated_tokens(summary.generated_tokens);
    usage->set_session_tokens(summary.session_tokens);
    for (size_t i = 0; i < summary.choices.size(); ++i) {
      v1::ChoiceEnd* choice = final_message_.add_choices();
      choice->set_index(static_cast<int32_t>(i));
      choice->set_finish_reason(ToProto(summary.choices[i].reason));
      choice->set_text(std::move(summary.choices[i].trailing_text));
      choice->set_generated_tokens(summary.choices[i].generated_tokens);
    }
    record_->Done(grpc::Status::OK);
    StartWriteAndFinish(&final_message_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> deferred;
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = false;
      deferred.swap(deferred_finish_);
    }
    if (deferred.has_value()) {
      Finish(*deferred);
      return;
    }
    if (finishing_) return;
    std::shared_ptr<GenerateControl> stream = Stream();
    if (stream != nullptr) stream->WriteDone(ok);
  }

  void OnCancel() override {
    std::shared_ptr<GenerateControl> stream = Stream();
    if (stream != nullptr) stream->Cancel();
  }

  void OnDone() override {
    service_->GenerateDone();
    delete this;
  }

 private:
  std::shared_ptr<GenerateControl> Stream() {
    absl::MutexLock lock(&mu_);
    return stream_;
  }

  // GenerateResponse.session_id: the session the request runs on, if it is kept.
  std::string KeptSessionId() {
    std::shared_ptr<GenerateControl> stream = Stream();
    return stream != nullptr && keeps_session_ ? stream->session_id() : "";
  }

  // Answers a paced refusal (FailNow) when it fires.
  grpc::Alarm refusal_alarm_;

  // Finish counts as a write: with a write in flight it waits for OnWriteDone (the
  // engine can end a stream mid-write only when it fails).
  void FinishAfterWrite(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (write_in_flight_) {
        deferred_finish_ = status;
        return;
      }
    }
    Finish(status);
  }

  Service* const service_;
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<CallRecord> record_;
  absl::Mutex mu_;
  std::shared_ptr<GenerateControl> stream_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> deferred_finish_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> finishing_{false};
  std::atomic<bool> chunk_started_{false};  // OnChunk was called at least once
  bool keeps_session_ = true;               // set before StartGenerate
  GenerateChunk pending_chunk_;             // OnChunk's, until its message is built
  v1::GenerateResponse chunk_message_;      // the one write in flight
  v1::GenerateResponse final_message_;
};

}  // namespace

grpc::ServerWriteReactor<v1::GenerateResponse>* GrpcServer::Service::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto record = std::make_shared<CallRecord>(
      this, "Generate", request->model(),
      request->session_id().empty() ? request->fork_from() : request->session_id());
  auto* reactor = new GenerateReactor(this, context, record);
  absl::StatusOr<Caller> caller = Admit(context, *record);
  if (!caller.ok()) {
    reactor->FailNow(caller.status());
    return reactor;
  }
  GenerateParams params = FromProto(*request);
  auto constraint = ConstraintFromProto(*request);
  if (!constraint.ok()) {
    reactor->FailNow(constraint.status());
    return reactor;
  }
  params.constraint = std::move(*constraint);
  reactor->set_keeps_session(params.store);
  params.is_cancelled = [context] { return context->IsCancelled(); };
  // No deadline reads as a time far ahead: only a real one is passed on.
  if (const auto deadline = context->deadline();
      deadline < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    params.deadline = absl::FromChrono(deadline);
  }
  if (params.model.empty()) {
    if (auto model = core_->DescribeModel(""); model.ok()) record->set_model(model->name);
  }
  if (absl::Status started = core_->StartGenerate(*caller, std::move(params), reactor);
      !started.ok()) {
    reactor->FailNow(started);
  }
  return reactor;
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              Core* core) {
  std::unique_ptr<GrpcServer> server(new GrpcServer());
  server->options_ = options;
  server->core_ = core;
  server->service_ = std::make_unique<Service>(core, options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("--tls-cert-file and --tls-key-file go together");
  }
  if (!options.tls_client_ca_pem.empty() && options.tls_cert_pem.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca-file needs --tls-cert-file/--tls-key-file");
  }
  if (!options.tls_cert_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        options.tls_client_ca_pem.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = options.tls_client_ca_pem;
    ssl.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  if (options.grpc_memory_quota_bytes > 0) {
    grpc::ResourceQuota quota("fwserve");
    quota.Resize(static_cast<size_t>(options.grpc_memory_quota_bytes));
    builder.SetResourceQuota(quota);
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("--listen: cannot listen on '", options.listen, "'"));
  }
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);
  return server;
}

GrpcServer::~GrpcServer() { Shutdown(); }

void GrpcServer::BeginShutdown() {
  if (server_ == nullptr || began_shutdown_.exchange(true)) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", false);
  health->SetServingStatus(kServiceName, false);
  service_->BeginShutdown();
}

void GrpcServer::StopServing(bool idle) {
  if (server_ == nullptr || stopped_.exchange(true)) return;
  BeginShutdown();
  // Nothing in flight: stop soon (an idle connected client must not hold the exit), once
  // every Generate's reactor is done and after a short grace, kGraceOnIdleStop: the core
  // is idle when its streams ended, before the reactors wrote their last messages, and a
  // connection closed at once can reset before the client read them (a client saw
  // "Connection reset by peer" 16 tokens short, 3 times in 300 runs of
  // ServerTest.HealthAndGracefulShutdown). Else streams end as soon as their in-flight
  // write returns, and a client that stopped reading is cancelled at stuck_write_timeout.
  constexpr absl::Duration kGraceOnIdleStop = absl::Milliseconds(250);
  if (idle) {
    service_->WaitForOpenGenerates(absl::Now() +
                                   std::min(options_.stuck_write_timeout, absl::Seconds(2)));
  }
  server_->Shutdown(absl::ToChronoTime(
      absl::Now() + (idle ? std::min(options_.stuck_write_timeout, kGraceOnIdleStop)
                          : options_.stuck_write_timeout)));
  server_->Wait();
}

void GrpcServer::Shutdown() {
  if (server_ == nullptr || stopped_.load() || shut_down_.exchange(true)) return;
  BeginShutdown();
  core_->BeginShutdown();
  const absl::Time deadline = absl::Now() + options_.drain_timeout;
  const bool idle = core_->WaitIdle(deadline);
  if (!idle) Log(LogLevel::kWarning, "drain timeout passed; ending the remaining streams");
  core_->EndAllWork();
  StopServing(idle);
  core_->Stop();
}

}  // namespace fwserve
