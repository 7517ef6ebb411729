#include "server/core/core.h"

#include <filesystem>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/checkpoint.h"
#include "models/state_codec.h"
#include "models/tokenizer.h"
#include "server/core/engine.h"
#include "server/core/log.h"
#include "server/core/metrics.h"
#include "server/core/session_id.h"
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
        executor_(store_ != nullptr ? options.store_threads : 1),
        registry_(options.max_sessions),
        budget_(options.max_state_memory_bytes) {}

  ~CoreImpl() override { Stop(); }

  absl::Status Init() {
    if (options_.model_dirs.empty()) return absl::InvalidArgumentError("no model given (--model)");
    if (options_.intra_op_threads > 0) torch::set_num_threads(options_.intra_op_threads);
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
    if (store_ != nullptr) {
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

  absl::Status StartGenerate(GenerateParams params, GenerateObserver* observer) override {
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

    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kGenerate;
    auto engine = ResolveModelAndLease(params.model, params.session_id, &item->lease);
    if (!engine.ok()) return engine.status();
    item->session_id = params.session_id;
    item->tokens = fwmodel::EncodeBytes(params.prompt);
    item->is_cancelled = std::move(params.is_cancelled);
    params.is_cancelled = nullptr;
    // The tokens are what the engine uses; do not keep the prompt twice while queued.
    std::string().swap(params.prompt);
    item->generate = std::move(params);
    item->observer = observer;
    item->stream_id = (*engine)->NewStreamId();
    item->arrival = absl::Now();
    observer->OnStart(std::make_shared<StreamHandle>(*engine, item->stream_id));
    return SubmitOrRelease(*engine, item);
  }

  void Score(ScoreParams params, Callback<ScoreResult> done) override {
    if (absl::Status valid = ValidateText("text", params.text); !valid.ok()) return done(valid);
    auto item = std::make_unique<WorkItem>();
    auto engine = ResolveModelAndLease(params.model, params.session_id, &item->lease);
    if (!engine.ok()) return done(engine.status());
    item->kind = WorkItem::Kind::kScore;
    item->session_id = params.session_id;
    item->is_cancelled = std::move(params.is_cancelled);
    item->tokens = fwmodel::EncodeBytes(params.text);
    item->on_score = done;
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  void CreateSession(const std::string& model, std::string prefix, Callback<SessionRecord> done,
                     std::function<bool()> is_cancelled) override {
    if (absl::Status valid = ValidateText("prefix", prefix); !valid.ok()) return done(valid);
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    if (absl::Status room = registry_.CheckCapacity(); !room.ok()) return done(room);
    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kCreate;
    item->tokens = fwmodel::EncodeBytes(prefix);
    item->is_cancelled = std::move(is_cancelled);
    item->on_session = done;
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  void ForkSession(const std::string& session_id, Callback<SessionRecord> done) override {
    SessionOperation(
        WorkItem::Kind::kFork, session_id, [&](WorkItem& item) { item.on_session = done; },
        [&](absl::Status s) { done(s); });
  }

  void ExportSession(const std::string& session_id, Callback<ExportResult> done) override {
    SessionOperation(
        WorkItem::Kind::kExport, session_id, [&](WorkItem& item) { item.on_export = done; },
        [&](absl::Status s) { done(s); });
  }

  void DeleteSession(const std::string& session_id, Callback<bool> done) override {
    SessionOperation(
        WorkItem::Kind::kDelete, session_id, [&](WorkItem& item) { item.on_delete = done; },
        [&](absl::Status s) { done(s); });
  }

  void ImportSession(const std::string& model, std::string blob,
                     Callback<SessionRecord> done) override {
    if (blob.empty()) return done(absl::InvalidArgumentError("blob: must not be empty"));
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    auto item = std::make_unique<WorkItem>();
    item->kind = WorkItem::Kind::kImport;
    item->blob = std::move(blob);
    item->on_session = done;
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  absl::StatusOr<SessionRecord> GetSession(const std::string& session_id) const override {
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return valid;
    return registry_.Get(session_id);
  }

  std::vector<SessionRecord> ListSessions(const std::string& model) const override {
    return registry_.List(model);
  }

  void BeginShutdown() override {
    for (auto& engine : engines_) engine->BeginDrain();
  }

  bool WaitIdle(absl::Time deadline) override {
    bool idle = true;
    for (auto& engine : engines_) idle &= engine->WaitIdle(deadline);
    return idle;
  }

  void EndAllWork() override {
    for (auto& engine : engines_) engine->EndAllWork();
  }

  void Stop() override {
    stop_indexing_.store(true);
    if (indexer_.joinable()) indexer_.join();
    for (auto& engine : engines_) engine->Stop();
  }

 private:
  static absl::Status UnknownModel(const std::string& model) {
    return absl::NotFoundError(absl::StrCat("model '", model, "' not found"));
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

  // The engine serving the request; with a session, also takes its lease into `lease`
  // (released when the work item is answered or dropped).
  absl::StatusOr<Engine*> ResolveModelAndLease(const std::string& model,
                                               const std::string& session_id, SessionLease* lease) {
    if (session_id.empty()) return FindEngine(model);
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return valid;
    if (!model.empty()) {
      if (auto engine = FindEngine(model); !engine.ok()) return engine.status();
    }
    auto record = registry_.Get(session_id);
    if (!record.ok()) return record.status();
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
  void SessionOperation(WorkItem::Kind kind, const std::string& session_id, Fill fill, Fail fail) {
    auto item = std::make_unique<WorkItem>();
    auto engine = ResolveModelAndLease("", session_id, &item->lease);
    if (!engine.ok()) return fail(engine.status());
    item->kind = kind;
    item->session_id = session_id;
    item->arrival = absl::Now();
    fill(*item);
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) fail(queued);
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
  // Destroyed in reverse order: the engines (which drain their store jobs) first, the
  // executor (which joins its threads) next, the store last.
  std::unique_ptr<SessionStore> store_;  // null: --session-store=memory
  StoreExecutor executor_;
  SessionRegistry registry_;
  StateMemoryBudget budget_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<ModelDescription> descriptions_;
  std::thread indexer_;
  std::atomic<bool> stop_indexing_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::Create(const CoreOptions& options) {
  if (absl::Status valid = ValidateCoreOptions(options); !valid.ok()) return valid;
  auto store = OpenSessionStore(options.session_store);
  if (!store.ok()) return store.status();
  if (*store != nullptr) Log(LogLevel::kInfo, "session store: " + (*store)->Describe());
  auto core = std::make_unique<CoreImpl>(options, std::move(*store));
  if (absl::Status status = core->Init(); !status.ok()) return status;
  return std::unique_ptr<Core>(std::move(core));
}

}  // namespace fwserve
