#include "server/core/core.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/blas_check.h"
#include "models/checkpoint.h"
#include "models/state_codec.h"
#include "models/tokenizer.h"
#include "server/core/engine.h"
#include "server/core/log.h"
#include "server/core/metrics.h"
#include "server/core/session_id.h"
#include "server/core/shared_session_store.h"
#include "server/core/tenants.h"
#include "server/core/validation.h"

namespace fwserve {
namespace {

constexpr int32_t kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;
constexpr int32_t kMaxRepetitionWindow = 4096;

class StreamHandle : public GenerateControl {
 public:
  StreamHandle(Engine* engine, uint64_t id) : engine_(engine), id_(id) {}
  void WriteDone(bool ok) override { engine_->PostWriteDone(id_, ok); }
  void Cancel() override { engine_->PostCancel(id_); }

 private:
  Engine* const engine_;  // outlives every stream (Core::Stop runs after the transport)
  const uint64_t id_;
};

// A stream whose engine is known only once its session's lease was taken in a shared
// store (the session names the model). WriteDone cannot come before Bind (no chunk is
// sent before). A Cancel before admission is seen by the engine through the item's
// is_cancelled (polled at admission); the PostCancel from Bind is only a best effort.
class LateStreamHandle : public GenerateControl {
 public:
  void Bind(Engine* engine, uint64_t id) {
    bool cancel;
    {
      absl::MutexLock lock(&mu_);
      engine_ = engine;
      id_ = id;
      cancel = cancelled_;
    }
    if (cancel) engine->PostCancel(id);
  }
  void WriteDone(bool ok) override {
    if (auto [engine, id] = Bound(); engine != nullptr) engine->PostWriteDone(id, ok);
  }
  void Cancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    if (auto [engine, id] = Bound(); engine != nullptr) engine->PostCancel(id);
  }

 private:
  std::pair<Engine*, uint64_t> Bound() {
    absl::MutexLock lock(&mu_);
    return {engine_, id_};
  }

  absl::Mutex mu_;
  Engine* engine_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// The outcome label of a store operation (Metrics::ObserveSessionStoreOperation).
const char* StoreOutcome(const absl::Status& status) {
  if (status.ok()) return "ok";
  if (absl::IsNotFound(status)) return "not_found";
  if (absl::IsAborted(status)) return "conflict";
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) return "unavailable";
  return "error";
}

std::string ModelNameOf(const std::string& dir) {
  std::filesystem::path path(dir);
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

// Errors name the flag (--max-tokens ...) and the bad value.
absl::Status ValidateCoreOptions(const CoreOptions& o) {
  auto positive = [](const char* flag, int64_t value) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(absl::StrCat(flag, " must be > 0, got ", value));
  };
  for (absl::Status s :
       {positive("--max-prompt-bytes", o.max_prompt_bytes), positive("--max-tokens", o.max_tokens),
        positive("--max-sessions", o.max_sessions),
        positive("--max-state-memory-bytes", o.max_state_memory_bytes),
        positive("--max-queued-requests", o.max_queued_requests),
        positive("--max-active-streams", o.max_active_streams),
        positive("--prefill-chunk-tokens", o.prefill_chunk_tokens)}) {
    if (!s.ok()) return s;
  }
  if (o.session_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session-ttl must be positive");
  }
  if (o.batch_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--batch-wait must not be negative");
  }
  if (o.intra_op_threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  if (o.stream_flush_interval < absl::ZeroDuration() ||
      o.stream_flush_interval > absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream-flush-interval must be in [0, 1s], got ",
                     absl::FormatDuration(o.stream_flush_interval)));
  }
  if (o.decode_lookahead < 1 || o.decode_lookahead > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-lookahead must be in [1, 4096], got ", o.decode_lookahead));
  }
  if (o.decode_kernel != "native" && o.decode_kernel != "libtorch") {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-kernel must be native or libtorch, got '", o.decode_kernel, "'"));
  }
  if (o.session_lease_ttl < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-lease-ttl must be at least 100ms, got ",
                     absl::FormatDuration(o.session_lease_ttl)));
  }
  if (o.session_store_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session-store-timeout must be positive");
  }
  if (o.store_threads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-store-threads must be > 0, got ", o.store_threads));
  }
  return absl::OkStatus();
}

class CoreImpl : public Core {
 public:
  CoreImpl(const CoreOptions& options, std::unique_ptr<SessionStore> store)
      : options_(options),
        store_(std::move(store)),
        shared_(dynamic_cast<SharedSessionStore*>(store_.get())),
        executor_(store_ != nullptr ? options.store_threads : 1),
        registry_(options.max_sessions),
        budget_(options.max_state_memory_bytes) {}

  ~CoreImpl() override { Stop(); }

  absl::Status Init() {
    if (options_.model_dirs.empty()) return absl::InvalidArgumentError("no model given (--model)");
    LimitIntraOpThreads(options_.intra_op_threads);  // loading runs on this thread
    fwmodel::ModelOptions model_options;
    if (options_.device == "cuda" || options_.device.rfind("cuda:", 0) == 0) {
      if (!torch::cuda::is_available()) {
        return absl::FailedPreconditionError(
            "--device=cuda, but this LibTorch build has no usable CUDA device");
      }
      try {
        model_options.device = torch::Device(options_.device);
      } catch (const c10::Error&) {
        return absl::InvalidArgumentError(
            absl::StrCat("--device: bad value '", options_.device, "'"));
      }
    } else if (options_.device != "cpu") {
      return absl::InvalidArgumentError(
          absl::StrCat("--device must be cpu, cuda or cuda:N, got '", options_.device, "'"));
    }
    std::set<std::string> names;
    for (const std::string& dir : options_.model_dirs) {
      const std::string name = ModelNameOf(dir);
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("--model: two models are named '", name, "' (names are directory names)"));
      }
      auto loaded = fwmodel::LoadCheckpoint(dir, model_options);
      if (!loaded.ok()) {
        return absl::Status(loaded.status().code(),
                            absl::StrCat("--model ", dir, ": ", loaded.status().message()));
      }
      ModelDescription description;
      description.name = name;
      description.is_default = engines_.empty();
      const fwmodel::ModelConfig& config = loaded->model.config();
      description.architecture = fwmodel::ArchitectureName(config.architecture);
      description.config_json = fwmodel::ModelConfigToJson(config);
      description.parameters = loaded->model.parameter_count();
      description.state_bytes_per_session = loaded->model.state_bytes_per_session();
      description.vocab_size = config.vocab_size;
      description.fingerprint = loaded->fingerprint;
      description.memory_slots = loaded->model.memory_slots();
      ModelMetrics* model_metrics = nullptr;
      if (options_.metrics != nullptr) {
        model_metrics = options_.metrics->AddModel(
            ModelInfoLabels{name, description.architecture, description.parameters,
                            description.state_bytes_per_session});
      }
      descriptions_.push_back(description);
      EngineContext context;
      context.registry = &registry_;
      context.store = store_.get();
      context.shared_store = shared_;
      context.executor = &executor_;
      context.budget = &budget_;
      context.clock = options_.clock;
      context.metrics = model_metrics;
      engines_.push_back(std::make_unique<Engine>(name, std::move(*loaded), options_, context));
      Log(LogLevel::kInfo,
          absl::StrCat("loaded model ", name, " (", description.architecture, ", ",
                       description.parameters, " parameters, ", description.state_bytes_per_session,
                       " state bytes per session)"));
    }
    for (auto& engine : engines_) engine->Start();
    if (shared_ != nullptr) {
      // A shared store is its own index: sessions are looked up there on demand.
      renewer_ = std::thread([this] { RenewLeases(); });
    } else if (store_ != nullptr) {
      registry_.SetIndexing(true);
      indexer_ = std::thread([this] { IndexStore(); });
    }
    return absl::OkStatus();
  }

  std::vector<ModelDescription> ListModels() const override { return descriptions_; }

  absl::StatusOr<ModelDescription> DescribeModel(const std::string& model) const override {
    for (const ModelDescription& d : descriptions_) {
      if (d.name == model || (model.empty() && d.is_default)) return d;
    }
    return UnknownModel(model);
  }

  absl::Status StartGenerate(const Caller& caller, GenerateParams params,
                             GenerateObserver* observer) override {
    if (absl::Status valid = ValidateText("prompt", params.prompt); !valid.ok()) return valid;
    if (absl::Status valid = params.sampling.Validate(); !valid.ok()) return valid;
    if (params.max_tokens < 0 || params.max_tokens > options_.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [0, ",
                                                     options_.max_tokens, "] (--max-tokens), got ",
                                                     params.max_tokens));
    }
    if (params.repetition_window < 0 || params.repetition_window > kMaxRepetitionWindow) {
      return absl::InvalidArgumentError(absl::StrCat("repetition_window must be in [0, ",
                                                     kMaxRepetitionWindow, "], got ",
                                                     params.repetition_window));
    }
    if (params.stop.size() > kMaxStopStrings) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop: at most ", kMaxStopStrings, " strings, got ", params.stop.size()));
    }
    for (const std::string& stop : params.stop) {
      if (stop.empty() || stop.size() > kMaxStopBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("stop: each string must be 1 to ", kMaxStopBytes, " bytes"));
      }
    }
    if (params.session_id.empty() && params.prompt.empty()) {
      return absl::InvalidArgumentError("prompt: must not be empty without a session_id");
    }
    if (params.random_seed) params.sampling.seed = RandomSeed();

    // The tenant's stream quota is held from here until OnFinish (TenantObserver).
    if (absl::Status admitted = AdmitTenantStream(caller.tenant); !admitted.ok()) {
      return admitted;
    }
    TenantObserver* counted = nullptr;
    if (options_.tenants != nullptr) {
      counted = new TenantObserver(this, caller.tenant, observer);
      observer = counted;
    }
    // A refusal here: the observer never hears of the request.
    const auto refuse = [this, counted, &caller](absl::Status status) {
      if (counted != nullptr) {
        EndTenantStream(caller.tenant);
        delete counted;
      }
      return status;
    };

    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kGenerate;
    item->tenant = caller.tenant;
    const std::string model = params.model;
    // With a shared store the session's lease (and so its engine) is taken later, on a
    // store thread.
    const bool shared_session = shared_ != nullptr && !params.session_id.empty();
    Engine* engine = nullptr;
    if (shared_session) {
      if (absl::Status valid = CheckSessionRequest(model, params.session_id); !valid.ok()) {
        return refuse(valid);
      }
    } else {
      auto resolved = ResolveModelAndLease(caller, model, params.session_id, &item->lease);
      if (!resolved.ok()) return refuse(resolved.status());
      engine = *resolved;
    }
    item->session_id = params.session_id;
    item->tokens = fwmodel::EncodeBytes(params.prompt);
    item->is_cancelled = std::move(params.is_cancelled);
    params.is_cancelled = nullptr;
    // The tokens are what the engine uses; do not keep the prompt twice while queued.
    std::string().swap(params.prompt);
    item->generate = std::move(params);
    item->observer = observer;
    item->arrival = absl::Now();
    if (shared_session) {
      auto handle = std::make_shared<LateStreamHandle>();
      observer->OnStart(handle);
      AcquireAndSubmit(std::move(item), model, [handle](Engine* bound, WorkItem& w) {
        w.stream_id = bound->NewStreamId();
        handle->Bind(bound, w.stream_id);
      });
      return absl::OkStatus();
    }
    item->stream_id = engine->NewStreamId();
    observer->OnStart(std::make_shared<StreamHandle>(engine, item->stream_id));
    if (absl::Status queued = SubmitOrRelease(engine, item); !queued.ok()) return refuse(queued);
    return absl::OkStatus();
  }

  void Score(const Caller& caller, ScoreParams params, Callback<ScoreResult> done) override {
    if (absl::Status valid = ValidateText("text", params.text); !valid.ok()) return done(valid);
    auto item = std::make_unique<WorkItem>();
    const bool shared_session = shared_ != nullptr && !params.session_id.empty();
    Engine* engine = nullptr;
    if (shared_session) {
      if (absl::Status valid = CheckSessionRequest(params.model, params.session_id); !valid.ok()) {
        return done(valid);
      }
    } else {
      auto resolved = ResolveModelAndLease(caller, params.model, params.session_id, &item->lease);
      if (!resolved.ok()) return done(resolved.status());
      engine = *resolved;
    }
    item->kind = WorkItem::Kind::kScore;
    item->tenant = caller.tenant;
    item->session_id = params.session_id;
    item->is_cancelled = std::move(params.is_cancelled);
    item->tokens = fwmodel::EncodeBytes(params.text);
    item->on_score = done;
    item->arrival = absl::Now();
    if (shared_session) return AcquireAndSubmit(std::move(item), params.model, nullptr);
    if (absl::Status queued = SubmitOrRelease(engine, item); !queued.ok()) done(queued);
  }

  void CreateSession(const Caller& caller, const std::string& model, std::string prefix,
                     Callback<SessionRecord> done, std::function<bool()> is_cancelled) override {
    if (absl::Status valid = ValidateText("prefix", prefix); !valid.ok()) return done(valid);
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    if (absl::Status room = registry_.CheckCapacity(); !room.ok()) return done(room);
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kCreate;
    item->tenant = caller.tenant;
    item->tokens = fwmodel::EncodeBytes(prefix);
    item->is_cancelled = std::move(is_cancelled);
    item->on_session = done;
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  void ForkSession(const Caller& caller, const std::string& session_id,
                   Callback<SessionRecord> done) override {
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    SessionOperation(
        WorkItem::Kind::kFork, caller, session_id, [&](WorkItem& item) { item.on_session = done; },
        [&](absl::Status s) { done(s); });
  }

  void ExportSession(const Caller& caller, const std::string& session_id,
                     Callback<ExportResult> done) override {
    SessionOperation(
        WorkItem::Kind::kExport, caller, session_id, [&](WorkItem& item) { item.on_export = done; },
        [&](absl::Status s) { done(s); });
  }

  void DeleteSession(const Caller& caller, const std::string& session_id,
                     Callback<bool> done) override {
    SessionOperation(
        WorkItem::Kind::kDelete, caller, session_id, [&](WorkItem& item) { item.on_delete = done; },
        [&](absl::Status s) { done(s); });
  }

  void ImportSession(const Caller& caller, const std::string& model, std::string blob,
                     Callback<SessionRecord> done) override {
    if (blob.empty()) return done(absl::InvalidArgumentError("blob: must not be empty"));
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kImport;
    item->tenant = caller.tenant;
    item->blob = std::move(blob);
    item->on_session = done;
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  void GetSession(const Caller& caller, const std::string& session_id,
                  Callback<SessionRecord> done) override {
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return done(valid);
    if (shared_ == nullptr) {
      auto record = registry_.Get(session_id);
      if (record.ok() && record->tenant != caller.tenant) {
        return done(registry_.NotFoundError(session_id));
      }
      return done(std::move(record));
    }
    RunCoreJob([this, tenant = caller.tenant, session_id, done] {
      auto info = shared_->GetInfo(session_id);
      if (info.ok() && info->tenant != tenant) info = absl::NotFoundError("another tenant's");
      if (!info.ok()) return done(ClientStoreError(session_id, info.status()));
      done(RecordFromStore(*info));
    });
  }

  void ListSessions(const Caller& caller, ListSessionsParams params,
                    Callback<SessionList> done) override {
    if (params.page_size < 0) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("page_size must be >= 0, got ", params.page_size)));
    }
    const int page_size =
        params.page_size == 0 ? kDefaultPageSize : std::min(params.page_size, kMaxPageSize);
    if (shared_ == nullptr) {
      return done(ListLocal(caller.tenant, params.model, page_size, params.page_token));
    }
    RunCoreJob([this, tenant = caller.tenant, params = std::move(params), page_size, done] {
      auto page = shared_->List(params.model, tenant, page_size, params.page_token);
      if (!page.ok()) {
        return done(absl::IsInvalidArgument(page.status()) ? page.status()
                                                           : ClientStoreError("", page.status()));
      }
      SessionList list;
      list.next_page_token = std::move(page->next_page_token);
      for (const StoredSessionInfo& info : page->sessions) {
        list.sessions.push_back(RecordFromStore(info));
      }
      done(std::move(list));
    });
  }

  void BeginShutdown() override {
    for (auto& engine : engines_) engine->BeginDrain();
  }

  bool WaitIdle(absl::Time deadline) override {
    bool idle = true;
    for (auto& engine : engines_) idle &= engine->WaitIdle(deadline);
    absl::MutexLock lock(&core_jobs_mu_);
    idle &= core_jobs_mu_.AwaitWithDeadline(absl::Condition(this, &CoreImpl::NoCoreJobs), deadline);
    return idle;
  }

  void EndAllWork() override {
    for (auto& engine : engines_) engine->EndAllWork();
  }

  void Stop() override {
    stop_indexing_.store(true);
    if (indexer_.joinable()) indexer_.join();
    {
      // Lease-taking jobs submit to the engines: let them finish first (each store
      // call is bounded by --session-store-timeout; draining engines refuse the work).
      absl::MutexLock lock(&core_jobs_mu_);
      stop_renewing_ = true;
      core_jobs_mu_.Await(absl::Condition(this, &CoreImpl::NoCoreJobs));
    }
    if (renewer_.joinable()) renewer_.join();
    for (auto& engine : engines_) engine->Stop();
    // Answers made while the engines stopped may have started lease releases.
    absl::MutexLock lock(&core_jobs_mu_);
    core_jobs_mu_.Await(absl::Condition(this, &CoreImpl::NoCoreJobs));
  }

 private:
  static absl::Status UnknownModel(const std::string& model) {
    // The name is the client's: quoted back only in part (a status message travels in
    // the trailers, which gRPC limits to a few KiB).
    constexpr size_t kShown = 128;
    return absl::NotFoundError(absl::StrCat(
        "model '", model.substr(0, kShown),
        model.size() > kShown ? absl::StrCat("...' (", model.size(), " bytes)") : std::string("'"),
        " not found"));
  }

  static uint64_t RandomSeed() {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }

  absl::Status ValidateText(const char* field, const std::string& text) const {
    if (static_cast<int64_t>(text.size()) > options_.max_prompt_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is ", text.size(),
                       " bytes, above the limit --max-prompt-bytes=", options_.max_prompt_bytes));
    }
    if (auto bad = FirstInvalidUtf8Offset(text); bad >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is not valid UTF-8 (bad byte at offset ", bad, ")"));
    }
    return absl::OkStatus();
  }

  static absl::Status ValidateSessionId(const std::string& id) {
    if (!IsWellFormedSessionId(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_id '", id.substr(0, 64), "' is not a session id (32 hex digits)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Engine*> FindEngine(const std::string& model) const {
    if (model.empty()) return engines_.front().get();
    for (const auto& engine : engines_) {
      if (engine->name() == model) return engine.get();
    }
    return UnknownModel(model);
  }

  // A request naming session `id` (and `model`, if not empty): INVALID_ARGUMENT for a
  // malformed id, NOT_FOUND for a model this server does not serve.
  absl::Status CheckSessionRequest(const std::string& model, const std::string& id) const {
    if (absl::Status valid = ValidateSessionId(id); !valid.ok()) return valid;
    if (!model.empty()) {
      if (auto engine = FindEngine(model); !engine.ok()) return engine.status();
    }
    return absl::OkStatus();
  }

  // The engine serving the request; with a session, also takes its lease into `lease`
  // (released when the work item is answered or dropped).
  absl::StatusOr<Engine*> ResolveModelAndLease(const Caller& caller, const std::string& model,
                                               const std::string& session_id, SessionLease* lease) {
    if (session_id.empty()) return FindEngine(model);
    if (absl::Status valid = CheckSessionRequest(model, session_id); !valid.ok()) return valid;
    auto record = registry_.Get(session_id);
    if (!record.ok()) return record.status();
    // Another tenant's session does not exist for this caller.
    if (record->tenant != caller.tenant) return registry_.NotFoundError(session_id);
    if (!model.empty() && record->model != model) {
      return absl::InvalidArgumentError(absl::StrCat("session_id '", session_id,
                                                     "' belongs to model '", record->model,
                                                     "', not '", model, "'"));
    }
    auto acquired = registry_.Acquire(session_id);
    if (!acquired.ok()) return acquired.status();
    *lease = std::move(*acquired);
    return FindEngine(record->model);
  }

  // On failure the item comes back through `item` and is dropped here, before the
  // caller answers, so its lease is free by the time the client hears.
  absl::Status SubmitOrRelease(Engine* engine, std::unique_ptr<WorkItem>& item) {
    absl::Status queued = engine->Submit(item);
    if (!queued.ok()) item.reset();
    return queued;
  }

  template <typename Fill, typename Fail>
  void SessionOperation(WorkItem::Kind kind, const Caller& caller, const std::string& session_id,
                        Fill fill, Fail fail) {
    if (shared_ != nullptr) {
      if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return fail(valid);
      auto item = std::make_unique<WorkItem>();
      item->kind = kind;
      item->tenant = caller.tenant;
      item->session_id = session_id;
      item->arrival = absl::Now();
      fill(*item);
      return AcquireAndSubmit(std::move(item), "", nullptr);
    }
    auto item = std::make_unique<WorkItem>();
    auto engine = ResolveModelAndLease(caller, "", session_id, &item->lease);
    if (!engine.ok()) return fail(engine.status());
    item->kind = kind;
    item->tenant = caller.tenant;
    item->session_id = session_id;
    item->arrival = absl::Now();
    fill(*item);
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) fail(queued);
  }

  // ---------------------------------------------------------------------------------
  // Tenants' quotas (--api-keys-file). Checked when a request is accepted: a tenant at
  // its limit is refused at once, and never makes another tenant's requests wait.

  absl::Status QuotaRefusal(const char* reason, std::string message) {
    if (options_.metrics != nullptr) options_.metrics->CountRefused(reason);
    return absl::ResourceExhaustedError(std::move(message));
  }

  // The tenant's quota; nullopt on an open server (or for a tenant removed by a reload
  // after its request was authenticated: it runs without quotas this once).
  std::optional<TenantQuota> QuotaOf(const std::string& tenant) const {
    if (options_.tenants == nullptr) return std::nullopt;
    return options_.tenants->QuotaOf(tenant);
  }

  absl::Status CheckSessionQuota(const Caller& caller) {
    std::optional<TenantQuota> quota = QuotaOf(caller.tenant);
    if (!quota.has_value() || quota->max_sessions <= 0) return absl::OkStatus();
    const int64_t held = registry_.CountOfTenant(caller.tenant);
    if (held < quota->max_sessions) return absl::OkStatus();
    return QuotaRefusal("quota_sessions",
                        absl::StrCat("tenant '", caller.tenant, "' holds ", held,
                                     " sessions, its max_sessions quota; delete some first"));
  }

  // Counts a new Generate stream of `tenant`, or refuses it (max_streams, or an empty
  // tokens_per_second bucket). Every OK is matched by one EndTenantStream.
  absl::Status AdmitTenantStream(const std::string& tenant) {
    if (options_.tenants == nullptr) return absl::OkStatus();
    std::optional<TenantQuota> quota = QuotaOf(tenant);
    int64_t streams = 0;
    {
      absl::MutexLock lock(&usage_mu_);
      TenantUsage& usage = usage_[tenant];
      if (quota.has_value() && quota->max_streams > 0 && usage.streams >= quota->max_streams) {
        return QuotaRefusal("quota_streams",
                            absl::StrCat("tenant '", tenant, "' has ", usage.streams,
                                         " streams open, its max_streams quota; retry when one "
                                         "ends"));
      }
      if (quota.has_value() && quota->tokens_per_second > 0) {
        RefillLocked(usage, quota->tokens_per_second);
        if (usage.bucket <= 0) {
          const double wait_ms = std::ceil((1 - usage.bucket) / quota->tokens_per_second * 1000);
          return QuotaRefusal(
              "quota_tokens",
              absl::StrCat("tenant '", tenant, "' is over its tokens_per_second quota (",
                           quota->tokens_per_second, "); retry in ", wait_ms, " ms"));
        }
      }
      streams = ++usage.streams;
    }
    if (options_.metrics != nullptr) options_.metrics->SetTenantActiveStreams(tenant, streams);
    return absl::OkStatus();
  }

  void EndTenantStream(const std::string& tenant) {
    int64_t streams = 0;
    {
      absl::MutexLock lock(&usage_mu_);
      streams = --usage_[tenant].streams;
    }
    if (options_.metrics != nullptr) options_.metrics->SetTenantActiveStreams(tenant, streams);
  }

  void ChargeTokens(const std::string& tenant, int64_t tokens) {
    if (options_.metrics != nullptr) options_.metrics->AddTenantGeneratedTokens(tenant, tokens);
    std::optional<TenantQuota> quota = QuotaOf(tenant);
    if (!quota.has_value() || quota->tokens_per_second <= 0) return;
    absl::MutexLock lock(&usage_mu_);
    TenantUsage& usage = usage_[tenant];
    RefillLocked(usage, quota->tokens_per_second);
    usage.bucket -= static_cast<double>(tokens);
  }

  struct TenantUsage {
    int64_t streams = 0;  // Generate streams accepted and not finished
    // Token bucket: refilled at tokens_per_second, holding at most one second's worth;
    // generated tokens are taken out (it may go negative).
    double bucket = 0;
    absl::Time refilled = absl::InfinitePast();
  };

  void RefillLocked(TenantUsage& usage, double rate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(usage_mu_) {
    const absl::Time now = absl::Now();
    if (usage.refilled == absl::InfinitePast()) {
      usage.bucket = rate;
    } else {
      usage.bucket =
          std::min(rate, usage.bucket + rate * absl::ToDoubleSeconds(now - usage.refilled));
    }
    usage.refilled = now;
  }

  // The Generate observer of a tenant's stream: charges its tokens and ends its stream
  // quota at OnFinish. Deletes itself after OnFinish.
  class TenantObserver : public GenerateObserver {
   public:
    TenantObserver(CoreImpl* core, std::string tenant, GenerateObserver* inner)
        : core_(core), tenant_(std::move(tenant)), inner_(inner) {}
    void OnStart(std::shared_ptr<GenerateControl> stream) override { inner_->OnStart(stream); }
    void OnChunk(GenerateChunk chunk) override {
      core_->ChargeTokens(tenant_, static_cast<int64_t>(chunk.token_ids.size()));
      inner_->OnChunk(std::move(chunk));
    }
    void OnFinish(absl::Status status, GenerateSummary summary) override {
      core_->EndTenantStream(tenant_);
      inner_->OnFinish(std::move(status), std::move(summary));
      delete this;
    }

   private:
    CoreImpl* const core_;
    const std::string tenant_;
    GenerateObserver* const inner_;
  };

  // ---------------------------------------------------------------------------------
  // Shared store (redis://): leases in the store, taken on store threads.

  bool NoCoreJobs() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_jobs_mu_) { return core_jobs_ == 0; }

  // Runs `job` on a store thread, counted for WaitIdle/Stop.
  void RunCoreJob(std::function<void()> job) {
    {
      absl::MutexLock lock(&core_jobs_mu_);
      ++core_jobs_;
    }
    executor_.Run([this, job = std::move(job)] {
      job();
      absl::MutexLock lock(&core_jobs_mu_);
      --core_jobs_;
    });
  }

  // What a client hears of a store error (the details are in the store's log lines).
  absl::Status ClientStoreError(const std::string& id, const absl::Status& status) const {
    const std::string subject = id.empty() ? "" : absl::StrCat("session_id '", id, "': ");
    switch (status.code()) {
      case absl::StatusCode::kNotFound:
        return absl::NotFoundError(absl::StrCat("session_id '", id, "' not found"));
      case absl::StatusCode::kAborted:
        return absl::AbortedError(
            absl::StrCat("session_id '", id, "' is busy with another request"));
      case absl::StatusCode::kUnavailable:
      case absl::StatusCode::kDeadlineExceeded:
        Log(LogLevel::kWarning, absl::StrCat("session store: ", status.message()));
        return absl::UnavailableError(
            absl::StrCat(subject,
                         "session store unavailable (unreachable, or no answer within "
                         "--session-store-timeout=",
                         absl::FormatDuration(options_.session_store_timeout), "); retry later"));
      default:
        Log(LogLevel::kError, absl::StrCat("session store: ", status.message()));
        return absl::InternalError(
            absl::StrCat(subject, "session store error; see the server log"));
    }
  }

  SessionRecord RecordFromStore(const StoredSessionInfo& info) const {
    SessionRecord record;
    record.id = info.id;
    record.model = info.model;
    record.tenant = info.tenant;
    record.tokens = info.tokens;
    record.created = info.created;
    record.last_used = info.last_used;
    record.stored = true;
    record.resident = false;
    for (const ModelDescription& d : descriptions_) {
      if (d.name == info.model) record.state_bytes = d.state_bytes_per_session;
    }
    record.busy = info.busy;
    if (auto local = registry_.Get(info.id); local.ok()) {
      record.busy = record.busy || local->busy;
      record.resident = local->resident && local->version == info.version;
    }
    record.version = info.version;
    return record;
  }

  // Takes the lease of `item`'s session in the store on a store thread, then submits
  // it to the engine of the session's model; `bind` (may be null) runs just before.
  // Every answer after the lease is taken first ends the lease (EndTicketThen).
  void AcquireAndSubmit(std::unique_ptr<WorkItem> item, std::string model,
                        std::function<void(Engine*, WorkItem&)> bind) {
    auto holder = std::make_shared<std::unique_ptr<WorkItem>>(std::move(item));
    RunCoreJob([this, holder, model = std::move(model), bind = std::move(bind)] {
      try {
        AcquireAndSubmitNow(*holder, model, bind);
      } catch (const std::exception& e) {
        Log(LogLevel::kError, absl::StrCat("taking a session's lease failed: ", e.what()));
        if (*holder != nullptr) AnswerWorkItem(**holder, absl::InternalError("the server failed"));
      }
    });
  }

  void AcquireAndSubmitNow(std::unique_ptr<WorkItem>& item, const std::string& model,
                           const std::function<void(Engine*, WorkItem&)>& bind) {
    WorkItem& w = *item;
    const std::string id = w.session_id;
    int64_t cached_version = 0;
    if (auto local = registry_.Get(id); local.ok() && local->resident) {
      cached_version = local->version;
    }
    auto grant = shared_->AcquireLease(id, options_.session_lease_ttl, cached_version, w.tenant);
    if (!grant.ok()) return AnswerWorkItem(w, ClientStoreError(id, grant.status()));
    auto ticket =
        std::make_shared<StoreTicket>(id, grant->token, grant->info.version, grant->info.tag);
    EndTicketBeforeAnswers(w, ticket);
    w.ticket = ticket;
    auto engine = FindEngine(grant->info.model);
    if (!engine.ok()) {
      return AnswerWorkItem(w, absl::FailedPreconditionError(absl::StrCat(
                                   "session_id '", id, "' belongs to model '", grant->info.model,
                                   "', which this server does not serve")));
    }
    if (!model.empty() && model != grant->info.model) {
      return AnswerWorkItem(
          w, absl::InvalidArgumentError(absl::StrCat("session_id '", id, "' belongs to model '",
                                                     grant->info.model, "', not '", model, "'")));
    }
    auto local_lease = registry_.AcquireFromStore(RecordFromStore(grant->info));
    if (!local_lease.ok()) return AnswerWorkItem(w, local_lease.status());
    w.lease = std::move(*local_lease);
    if (grant->blob.has_value() && w.kind != WorkItem::Kind::kDelete) {
      torch::NoGradGuard no_grad;
      auto decoded = fwmodel::DecodeStateRow((*engine)->model(), (*engine)->fingerprint(),
                                             std::move(*grant->blob));
      if (!decoded.ok()) {
        Log(LogLevel::kError, absl::StrCat("session ", id, ": stored state unreadable: ",
                                           decoded.status().message()));
        return AnswerWorkItem(
            w, absl::DataLossError(
                   absl::StrCat("session_id '", id, "': its saved state could not be restored")));
      }
      w.loaded = std::move(*decoded);
    }
    {
      absl::MutexLock lock(&core_jobs_mu_);
      renewing_.push_back(ticket);
    }
    if (bind) bind(*engine, w);
    if (absl::Status queued = (*engine)->Submit(item); !queued.ok()) {
      AnswerWorkItem(*item, queued);
    }
  }

  // Wraps the item's answer callbacks so that each first ends `ticket` (a release in
  // the store unless a commit or delete already ended it), then answers.
  void EndTicketBeforeAnswers(WorkItem& w, const std::shared_ptr<StoreTicket>& ticket) {
    switch (w.kind) {
      case WorkItem::Kind::kGenerate:
        w.observer = new TicketObserver(this, ticket, w.observer);
        break;
      case WorkItem::Kind::kScore:
        w.on_score = EndTicketFirst(ticket, std::move(w.on_score));
        break;
      case WorkItem::Kind::kFork:
        w.on_session = EndTicketFirst(ticket, std::move(w.on_session));
        break;
      case WorkItem::Kind::kExport:
        w.on_export = EndTicketFirst(ticket, std::move(w.on_export));
        break;
      case WorkItem::Kind::kDelete:
        w.on_delete = EndTicketFirst(ticket, std::move(w.on_delete));
        break;
      default:
        break;
    }
  }

  template <typename T>
  Callback<T> EndTicketFirst(std::shared_ptr<StoreTicket> ticket, Callback<T> done) {
    return [this, ticket, done = std::move(done)](absl::StatusOr<T> result) {
      auto held = std::make_shared<absl::StatusOr<T>>(std::move(result));
      EndTicketThen(ticket, [done, held] { done(std::move(*held)); });
    };
  }

  // Releases `ticket`'s lease on a store thread unless it already ended, then runs
  // `answer` (there, or here at once).
  void EndTicketThen(const std::shared_ptr<StoreTicket>& ticket, std::function<void()> answer) {
    if (ticket->ended.exchange(true)) return answer();
    RunCoreJob([this, ticket, answer = std::move(answer)] {
      if (absl::Status released = shared_->ReleaseLease(ticket->id, ticket->token);
          !released.ok()) {
        // It expires by itself after --session-lease-ttl.
        Log(LogLevel::kWarning, absl::StrCat("session ", ticket->id,
                                             ": releasing its lease failed: ", released.message()));
      }
      answer();
    });
  }

  // The Generate observer of a request holding a lease in a shared store: ends the
  // lease before the final message. Deletes itself after OnFinish.
  class TicketObserver : public GenerateObserver {
   public:
    TicketObserver(CoreImpl* core, std::shared_ptr<StoreTicket> ticket, GenerateObserver* inner)
        : core_(core), ticket_(std::move(ticket)), inner_(inner) {}
    void OnStart(std::shared_ptr<GenerateControl> stream) override { inner_->OnStart(stream); }
    void OnChunk(GenerateChunk chunk) override { inner_->OnChunk(std::move(chunk)); }
    void OnFinish(absl::Status status, GenerateSummary summary) override {
      GenerateObserver* inner = inner_;
      core_->EndTicketThen(ticket_, [inner, status, summary] { inner->OnFinish(status, summary); });
      delete this;
    }

   private:
    CoreImpl* const core_;
    const std::shared_ptr<StoreTicket> ticket_;
    GenerateObserver* const inner_;
  };

  // Renews the leases of running requests every third of --session-lease-ttl.
  void RenewLeases() {
    const absl::Duration period = options_.session_lease_ttl / 3;
    while (true) {
      std::vector<std::shared_ptr<StoreTicket>> live;
      {
        absl::MutexLock lock(&core_jobs_mu_);
        const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_jobs_mu_) {
          return stop_renewing_;
        };
        core_jobs_mu_.AwaitWithTimeout(absl::Condition(&stop), period);
        if (stop_renewing_) return;
        renewing_.erase(std::remove_if(renewing_.begin(), renewing_.end(),
                                       [&live](const std::weak_ptr<StoreTicket>& weak) {
                                         std::shared_ptr<StoreTicket> t = weak.lock();
                                         if (t == nullptr || t->ended.load() || t->lost.load()) {
                                           return true;
                                         }
                                         live.push_back(std::move(t));
                                         return false;
                                       }),
                        renewing_.end());
      }
      for (const auto& ticket : live) {
        if (ticket->ended.load()) continue;
        absl::Status renewed =
            shared_->RenewLease(ticket->id, ticket->token, options_.session_lease_ttl);
        if (absl::IsAborted(renewed) && !ticket->ended.load() && !ticket->ending.load()) {
          ticket->lost.store(true);
          Log(LogLevel::kWarning,
              absl::StrCat("session ", ticket->id,
                           ": this request's lease expired and was lost; its write will be "
                           "refused"));
        }
      }
    }
  }

  absl::StatusOr<SessionList> ListLocal(const std::string& tenant, const std::string& model,
                                        int page_size, const std::string& token) const {
    // A local page token is "<created unix nanos>:<id>" of the last session returned
    // (the registry's order: creation time at full precision, then id).
    int64_t after_nanos = std::numeric_limits<int64_t>::min();
    std::string after_id;
    if (!token.empty()) {
      const size_t colon = token.find(':');
      if (colon == std::string::npos || !absl::SimpleAtoi(token.substr(0, colon), &after_nanos) ||
          !IsWellFormedSessionId(token.substr(colon + 1))) {
        return absl::InvalidArgumentError("page_token is malformed");
      }
      after_id = token.substr(colon + 1);
    }
    SessionList list;
    for (SessionRecord& record : registry_.List(model)) {
      if (record.tenant != tenant) continue;
      const int64_t nanos = absl::ToUnixNanos(record.created);
      if (!token.empty() &&
          (nanos < after_nanos || (nanos == after_nanos && record.id <= after_id))) {
        continue;
      }
      if (static_cast<int>(list.sessions.size()) == page_size) {
        const SessionRecord& last = list.sessions.back();
        list.next_page_token = absl::StrCat(absl::ToUnixNanos(last.created), ":", last.id);
        break;
      }
      list.sessions.push_back(std::move(record));
    }
    return list;
  }

  // Registers the sessions an earlier run stored (not resident; loaded on first use).
  // Runs on its own thread while the server serves; reads each blob once and trusts
  // only checksummed metadata.
  void IndexStore() {
    const absl::Time start = absl::Now();
    int64_t indexed = 0, skipped = 0;
    std::vector<std::string> ids;
    absl::Status listed = store_->ForEachId([&](const std::string& id) {
      ids.push_back(id);
      return !stop_indexing_.load();
    });
    for (const std::string& id : ids) {
      if (stop_indexing_.load()) break;
      if (registry_.Get(id).ok()) continue;  // already known (created since the start)
      auto blob = store_->Get(id);
      auto metadata = blob.ok() ? fwmodel::PeekStateMetadata(std::move(*blob))
                                : absl::StatusOr<std::map<std::string, std::string>>(blob.status());
      Engine* owner = nullptr;
      SessionRecord record;
      if (metadata.ok() && (*metadata)["x-session-id"] == id) {
        for (auto& engine : engines_) {
          if (engine->fingerprint() == (*metadata)["fingerprint"]) owner = engine.get();
        }
        int64_t created_ms = 0, used_ms = 0;
        if (owner != nullptr && absl::SimpleAtoi((*metadata)["tokens"], &record.tokens) &&
            absl::SimpleAtoi((*metadata)["x-created-ms"], &created_ms) &&
            absl::SimpleAtoi((*metadata)["x-last-used-ms"], &used_ms)) {
          record.id = id;
          record.model = owner->name();
          record.tenant = (*metadata)["x-tenant"];
          record.state_bytes = owner->model().state_bytes_per_session();
          record.created = absl::FromUnixMillis(created_ms);
          record.last_used = absl::FromUnixMillis(used_ms);
          record.resident = false;
          record.stored = true;
        } else {
          owner = nullptr;
        }
      }
      absl::Status inserted =
          owner != nullptr ? registry_.Insert(record) : absl::InvalidArgumentError("not indexed");
      if (!inserted.ok()) {
        const absl::Status why = !metadata.ok() ? metadata.status() : inserted;
        Log(LogLevel::kWarning,
            absl::StrCat("session store: skipped session ", id, ": ",
                         owner == nullptr && metadata.ok()
                             ? "no served model has its fingerprint, or its labels are malformed"
                             : std::string(why.message())));
        ++skipped;
        continue;
      }
      ++indexed;
    }
    registry_.SetIndexing(false);
    if (!listed.ok()) {
      Log(LogLevel::kError, absl::StrCat("session store: listing failed: ", listed.message()));
    }
    Log(LogLevel::kInfo,
        absl::StrCat(
            "session store ", store_->Describe(), ": found ", indexed, " sessions",
            skipped > 0 ? absl::StrCat(" (", skipped, " skipped)") : "", " in ",
            absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))));
  }

  const CoreOptions options_;
  absl::Mutex usage_mu_;
  absl::flat_hash_map<std::string, TenantUsage> usage_ ABSL_GUARDED_BY(usage_mu_);
  // Destroyed in reverse order: the engines (which drain their store jobs) first, the
  // executor (which joins its threads) next, the store last.
  std::unique_ptr<SessionStore> store_;  // null: --session-store=memory
  SharedSessionStore* const shared_;     // store_ when it is shared (redis://), else null
  // Declared before the executor, whose destructor may still run core jobs.
  // Jobs of the core itself on the executor (taking and releasing leases, reads).
  absl::Mutex core_jobs_mu_;
  int64_t core_jobs_ ABSL_GUARDED_BY(core_jobs_mu_) = 0;
  // Leases of running requests, renewed by renewer_.
  // Weak: a request dropped without an answer (a bug path) stops being renewed, and its
  // lease expires by itself.
  std::vector<std::weak_ptr<StoreTicket>> renewing_ ABSL_GUARDED_BY(core_jobs_mu_);
  bool stop_renewing_ ABSL_GUARDED_BY(core_jobs_mu_) = false;
  StoreExecutor executor_;
  SessionRegistry registry_;
  StateMemoryBudget budget_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<ModelDescription> descriptions_;
  std::thread indexer_;
  std::atomic<bool> stop_indexing_{false};

  static constexpr int kDefaultPageSize = 100;
  static constexpr int kMaxPageSize = 1000;
  std::thread renewer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::Create(const CoreOptions& options) {
  if (absl::Status valid = ValidateCoreOptions(options); !valid.ok()) return valid;
  SessionStoreOptions store_options;
  store_options.password_file = options.session_store_password_file;
  store_options.timeout = options.session_store_timeout;
  store_options.session_ttl = options.session_ttl;
  // Every store thread, plus the lease-renewal thread, has a connection of its own.
  store_options.pool_size = options.store_threads + 1;
  if (options.session_lease_ttl < 3 * options.session_store_timeout) {
    Log(LogLevel::kWarning,
        absl::StrCat("--session-lease-ttl=", absl::FormatDuration(options.session_lease_ttl),
                     " is less than 3x --session-store-timeout=",
                     absl::FormatDuration(options.session_store_timeout),
                     ": one slow renewal can lose a running request's lease"));
  }
  if (Metrics* metrics = options.metrics; metrics != nullptr) {
    store_options.observer = [metrics](const char* op, absl::Duration took,
                                       const absl::Status& status) {
      metrics->ObserveSessionStoreOperation(op, StoreOutcome(status), absl::ToDoubleSeconds(took));
    };
  }
  auto store = OpenSessionStore(options.session_store, store_options);
  if (!store.ok()) return store.status();
  if (*store != nullptr) Log(LogLevel::kInfo, "session store: " + (*store)->Describe());
  auto core = std::make_unique<CoreImpl>(options, std::move(*store));
  if (absl::Status status = core->Init(); !status.ok()) return status;
  return std::unique_ptr<Core>(std::move(core));
}

}  // namespace fwserve
