#include "server/core/core.h"

#include <filesystem>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/checkpoint.h"
#include "models/file_util.h"
#include "models/state_codec.h"
#include "models/tokenizer.h"
#include "server/core/engine.h"
#include "server/core/log.h"
#include "server/core/metrics.h"
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
  return absl::OkStatus();
}

class CoreImpl : public Core {
 public:
  explicit CoreImpl(const CoreOptions& options)
      : options_(options), store_(options.max_sessions), budget_(options.max_state_memory_bytes) {}

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
    if (!options_.session_dir.empty()) {
      if (absl::Status made = fwmodel::MakeDirectories(options_.session_dir); !made.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--session-dir: cannot create it: ", made.message()));
      }
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
      engines_.push_back(std::make_unique<Engine>(name, std::move(*loaded), options_, &store_,
                                                  &budget_, model_metrics));
      Log(LogLevel::kInfo,
          absl::StrCat("loaded model ", name, " (", description.architecture, ", ",
                       description.parameters, " parameters, ", description.state_bytes_per_session,
                       " state bytes per session)"));
    }
    IndexSessionDirectory();
    for (auto& engine : engines_) engine->Start();
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
    auto engine = ResolveModelAndLease(params.model, params.session_id);
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
    auto engine = ResolveModelAndLease(params.model, params.session_id);
    if (!engine.ok()) return done(engine.status());
    auto item = std::make_unique<WorkItem>();
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
    if (absl::Status room = store_.CheckCapacity(); !room.ok()) return done(room);
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
    return store_.Get(session_id);
  }

  std::vector<SessionRecord> ListSessions(const std::string& model) const override {
    return store_.List(model);
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
    for (auto& engine : engines_) engine->StopAndPersist();
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
    if (!SessionStore::IsWellFormedId(id)) {
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

  // The engine serving the request; with a session, also takes its lease (released by
  // the engine, or by SubmitOrRelease on failure).
  absl::StatusOr<Engine*> ResolveModelAndLease(const std::string& model,
                                               const std::string& session_id) {
    if (session_id.empty()) return FindEngine(model);
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return valid;
    if (!model.empty()) {
      if (auto engine = FindEngine(model); !engine.ok()) return engine.status();
    }
    auto record = store_.Acquire(session_id);
    if (!record.ok()) return record.status();
    if (!model.empty() && record->model != model) {
      store_.ReleaseUnchanged(session_id);
      return absl::InvalidArgumentError(absl::StrCat("session_id '", session_id,
                                                     "' belongs to model '", record->model,
                                                     "', not '", model, "'"));
    }
    return FindEngine(record->model);
  }

  absl::Status SubmitOrRelease(Engine* engine, std::unique_ptr<WorkItem>& item) {
    const std::string session_id = item->session_id;
    absl::Status queued = engine->Submit(item);
    if (!queued.ok() && !session_id.empty()) store_.ReleaseUnchanged(session_id);
    return queued;
  }

  template <typename Fill, typename Fail>
  void SessionOperation(WorkItem::Kind kind, const std::string& session_id, Fill fill, Fail fail) {
    auto engine = ResolveModelAndLease("", session_id);
    if (!engine.ok()) return fail(engine.status());
    auto item = std::make_unique<WorkItem>();
    item->kind = kind;
    item->session_id = session_id;
    item->arrival = absl::Now();
    fill(*item);
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) fail(queued);
  }

  // Registers the sessions an earlier run persisted (spilled; restored on first use).
  void IndexSessionDirectory() {
    if (options_.session_dir.empty()) return;
    int64_t indexed = 0, skipped = 0;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(options_.session_dir, error)) {
      if (!entry.is_regular_file() || entry.path().extension() != ".fwstate") continue;
      const std::string id = entry.path().stem().string();
      auto bytes = fwmodel::ReadFile(entry.path().string());
      auto metadata = bytes.ok()
                          ? fwmodel::PeekStateMetadata(std::move(*bytes))
                          : absl::StatusOr<std::map<std::string, std::string>>(bytes.status());
      Engine* owner = nullptr;
      SessionRecord record;
      if (metadata.ok() && SessionStore::IsWellFormedId(id) && (*metadata)["x-session-id"] == id) {
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
        } else {
          owner = nullptr;
        }
      }
      if (owner == nullptr || !store_.Insert(record).ok()) {
        ++skipped;
        continue;
      }
      ++indexed;
    }
    Log(LogLevel::kInfo, absl::StrCat("session directory: restored ", indexed, " sessions",
                                      skipped > 0 ? absl::StrCat(" (", skipped,
                                                                 " files skipped: unreadable, "
                                                                 "another model's, or over "
                                                                 "--max-sessions)")
                                                  : ""));
  }

  const CoreOptions options_;
  SessionStore store_;
  StateMemoryBudget budget_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<ModelDescription> descriptions_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::Create(const CoreOptions& options) {
  if (absl::Status valid = ValidateCoreOptions(options); !valid.ok()) return valid;
  auto core = std::make_unique<CoreImpl>(options);
  if (absl::Status status = core->Init(); !status.ok()) return status;
  return std::unique_ptr<Core>(std::move(core));
}

}  // namespace fwserve
