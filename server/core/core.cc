#include "server/core/core.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <filesystem>
#include <optional>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "models/checkpoints/state_format.h"
#include "models/tokenizers/tokenizer.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/base/session_id.h"
#include "server/base/utf8.h"
#include "server/core/choice_fan_in.h"
#include "server/engine/model_engine.h"
#include "server/metrics/metrics.h"
#include "server/sessions/prefix_index.h"
#include "server/sessions/session_directory.h"
#include "server/sessions/session_labels.h"
#include "server/sessions/store_errors.h"
#include "server/tenancy/tenant_quotas.h"
#include "server/tenancy/tenants.h"

namespace fwserve {
namespace {

constexpr int32_t kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;
constexpr int32_t kMaxRepetitionWindow = 4096;

std::string ModelNameOf(const std::string& dir) {
  std::filesystem::path path(dir);
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

// Errors name the flag (--max-tokens ...) and the bad value.
absl::Status ValidateCoreOptions(const CoreOptions& o) {
  const EngineOptions& e = o.engine;
  const SchedulerOptions& scheduler = e.scheduler;
  auto positive = [](const char* flag, int64_t value) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(absl::StrCat(flag, " must be > 0, got ", value));
  };
  for (absl::Status s :
       {positive("--max-prompt-bytes", o.max_prompt_bytes), positive("--max-tokens", o.max_tokens),
        positive("--max-sessions", e.max_sessions),
        positive("--max-state-memory-bytes", e.max_state_memory_bytes),
        positive("--max-queued-requests", e.max_queued_requests),
        positive("--max-active-streams", scheduler.max_active_streams),
        positive("--prefill-chunk-tokens", scheduler.prefill_chunk_tokens)}) {
    if (!s.ok()) return s;
  }
  if (o.prefix_reuse_entries < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--prefix-reuse-entries must be >= 0 (0 = off), got ", o.prefix_reuse_entries));
  }
  if (scheduler.prefill_batch_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill-batch-tokens must be >= 0 (0 = --prefill-chunk-tokens), got ",
                     scheduler.prefill_batch_tokens));
  }
  if (e.max_queue_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--max-queue-wait must be >= 0, got ",
                                                   absl::FormatDuration(e.max_queue_wait)));
  }
  if (e.codel_target < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--queue-codel-target must be >= 0, got ",
                                                   absl::FormatDuration(e.codel_target)));
  }
  if (e.codel_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--queue-codel-interval must be positive, got ",
                                                   absl::FormatDuration(e.codel_interval)));
  }
  if (e.session_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session-ttl must be positive");
  }
  if (scheduler.batch_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--batch-wait must not be negative");
  }
  if (e.intra_op_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be >= 0, got ", e.intra_op_threads));
  }
  if (e.prefill_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill-threads must be >= 0, got ", e.prefill_threads));
  }
  if (e.stream_flush_interval < absl::ZeroDuration() ||
      e.stream_flush_interval > absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream-flush-interval must be in [0, 1s], got ",
                     absl::FormatDuration(e.stream_flush_interval)));
  }
  if (e.stream_min_tokens_per_message < 0 ||
      e.stream_min_tokens_per_message > e.decode_lookahead) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream-min-tokens-per-message must be in [0, ", e.decode_lookahead,
                     "] (--decode-lookahead), got ", e.stream_min_tokens_per_message));
  }
  if (e.decode_steps_per_launch < 1 || e.decode_steps_per_launch > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--decode-steps-per-launch must be in [1, 64], got ", e.decode_steps_per_launch));
  }
  if (e.decode_lookahead < 1 || e.decode_lookahead > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-lookahead must be in [1, 4096], got ", e.decode_lookahead));
  }
  if (e.decode_kernel != "native" && e.decode_kernel != "graph" && e.decode_kernel != "libtorch") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--decode-kernel must be native, graph or libtorch, got '", e.decode_kernel, "'"));
  }
  if (e.native_gemm != "libxsmm" && e.native_gemm != "openblas") {
    return absl::InvalidArgumentError(
        absl::StrCat("--native-gemm must be libxsmm or openblas, got '", e.native_gemm, "'"));
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
        metrics_(Metrics::OrNull(options.metrics)),
        clock_(options.clock != nullptr ? options.clock : Clock::Real()),
        quotas_(options.tenants, clock_, metrics_),
        directory_(MakeSessionDirectory(DirectoryOptions(options, std::move(store)))),
        budget_(options.engine.max_state_memory_bytes),
        prefix_index_(static_cast<size_t>(std::max(0, options.prefix_reuse_entries))) {}

  ~CoreImpl() override { Stop(); }

  absl::Status Init() {
    if (options_.model_dirs.empty()) return absl::InvalidArgumentError("no model given (--model)");
    if (absl::Status device = CheckDeviceName(options_.device); !device.ok()) return device;
    std::set<std::string> names;
    for (const std::string& dir : options_.model_dirs) {
      const std::string name = ModelNameOf(dir);
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("--model: two models are named '", name, "' (names are directory names)"));
      }
      ModelDescription description;
      EngineContext context;
      context.directory = directory_.get();
      context.budget = &budget_;
      context.clock = clock_;
      auto engine = LoadModelEngine(
          ModelEngineSpec{name, dir, options_.device, options_.gpu_matrices, options_.gpu_tf32},
          options_.engine, std::move(context), [&](const ModelDescription& loaded) {
            description = loaded;
            description.is_default = engines_.empty();
            return metrics_->AddModel(ModelInfoLabels{name, loaded.architecture, loaded.parameters,
                                                      loaded.state_bytes_per_session});
          });
      if (!engine.ok()) return engine.status();
      descriptions_.push_back(description);
      engines_.push_back(std::move(*engine));
      Log(LogLevel::kInfo,
          absl::StrCat("loaded model ", name, " (", description.architecture, ", ",
                       description.parameters, " parameters, ", description.state_bytes_per_session,
                       " state bytes per session)"));
    }
#ifdef __GLIBC__
    // Loading widened each checkpoint, built the native kernels' copies through transient
    // buffers and released the RWKV models' own matrices (Engine); hand the freed heap
    // back to the system before serving (glibc keeps it otherwise: 0.25 GB at RWKV-7
    // 0.1B).
    malloc_trim(0);
#endif
    for (auto& engine : engines_) engine->Start();
    directory_->Start([this](const std::string& id, std::string blob) {
      return DescribeStoredSession(id, std::move(blob));
    });
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
    if (params.choices != 1) return StartChoices(caller, std::move(params), observer);
    if (params.prefix_reuse == GenerateParams::PrefixReuse::kOff || !params.session_id.empty() ||
        !params.fork_from.empty()) {
      params.prefix_reuse = GenerateParams::PrefixReuse::kOff;
      return StartGenerateOn(caller, std::move(params), observer, "", SessionSource::kAsGiven);
    }
    return StartReusingPrefix(caller, std::move(params), observer);
  }

  // GenerateParams::choices > 1: `choices` streams joined by a ChoiceFanIn. Choice 0 is
  // the request as asked (its prompt read once); choice i > 0 has no prompt, starts from
  // choice 0's state after it (server/engine/stream_driver.h, ChoiceGroup), and samples
  // with its own seed, derived from the request's.
  absl::Status StartChoices(const Caller& caller, GenerateParams params,
                            GenerateObserver* observer) {
    const int32_t n = params.choices;
    if (n < 1 || n > GenerateParams::kMaxChoices) {
      return absl::InvalidArgumentError(
          absl::StrCat("n must be in [1, ", GenerateParams::kMaxChoices, "], got ", n));
    }
    if (!params.session_id.empty() || !params.fork_from.empty() ||
        params.prefix_reuse == GenerateParams::PrefixReuse::kCallerSession) {
      return absl::InvalidArgumentError(
          absl::StrCat("n: ", n,
                       " choices need a request without a session (session_id, "
                       "fork_from or a stored response): each choice would be another "
                       "continuation of it"));
    }
    if (params.max_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("n: ", n, " choices need max_tokens >= 1, got ", params.max_tokens));
    }
    if (params.random_seed) {
      params.sampling.seed = RandomSeed();
      params.random_seed = false;
    }
    const uint64_t group = next_choice_group_.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<ChoiceFanIn> fan_in = ChoiceFanIn::Create(observer, n);
    for (int32_t i = 0; i < n; ++i) {
      GenerateParams choice = params;
      choice.choices = 1;
      choice.choice = {group, i, n};
      if (i > 0) {
        choice.prompt.clear();
        choice.prompt_tokens.reset();
        choice.prefix_reuse = GenerateParams::PrefixReuse::kOff;
        // A fixed odd step (2^64 / golden ratio): distinct seeds, the same for the same
        // request seed.
        choice.sampling.seed =
            params.sampling.seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
      }
      absl::Status started = StartGenerate(caller, std::move(choice), fan_in->member(i));
      if (started.ok()) {
        if (i == 0) fan_in->Start();
        continue;
      }
      if (i == 0) return started;  // nothing started: the caller's error
      for (int32_t j = i; j < n; ++j) fan_in->Refused(j, started);
      break;
    }
    return absl::OkStatus();
  }

  // The Generate observer of a request whose end state may be kept as a conversation
  // (GenerateParams::prefix_reuse): collects the reply's token bytes and, when the
  // request ends with the session holding exactly prompt and reply, indexes it (a
  // server-kept one, or a stored response). A server-kept session not indexed is
  // deleted. Deletes itself after OnFinish.
  class ConversationKeeper : public GenerateObserver {
   public:
    ConversationKeeper(CoreImpl* core, Caller caller, std::string model,
                       PrefixIndex::Tokens prompt, std::string session_id, bool server_kept,
                       bool indexed, GenerateObserver* inner)
        : core_(core),
          caller_(std::move(caller)),
          model_(std::move(model)),
          conversation_(std::move(prompt)),
          session_id_(std::move(session_id)),
          server_kept_(server_kept),
          indexed_(indexed),
          inner_(inner) {}
    void OnStart(std::shared_ptr<GenerateControl> stream) override { inner_->OnStart(stream); }
    void OnChunk(GenerateChunk chunk) override {
      conversation_.insert(conversation_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
      inner_->OnChunk(std::move(chunk));
    }
    void OnFinish(absl::Status status, GenerateSummary summary) override {
      const bool whole =
          indexed_ && status.ok() &&
          (summary.reason == FinishReason::kStop || summary.reason == FinishReason::kLength) &&
          summary.session_tokens == static_cast<int64_t>(conversation_.size());
      std::vector<std::string> unneeded;
      if (whole) {
        unneeded = core_->prefix_index_.Insert(caller_.tenant, model_, std::move(conversation_),
                                               session_id_, server_kept_);
      } else if (server_kept_) {
        unneeded.push_back(session_id_);
      }
      GenerateObserver* inner = inner_;
      CoreImpl* core = core_;
      const Caller caller = caller_;
      delete this;
      // Server-kept sessions evicted, replaced or not kept go (a missing one is no error).
      for (const std::string& id : unneeded) {
        core->DeleteSession(caller, id, [](absl::StatusOr<bool>) {});
      }
      inner->OnFinish(status, summary);
    }

   private:
    CoreImpl* const core_;
    const Caller caller_;
    const std::string model_;
    PrefixIndex::Tokens conversation_;  // the prompt's token ids, then the reply's
    const std::string session_id_;
    const bool server_kept_;  // else the caller's (a response)
    const bool indexed_;      // its end state is to be indexed
    GenerateObserver* const inner_;
  };

  // A request that may continue a kept conversation (docs/http.md "Replayed
  // histories"): forks the longest conversation of this tenant and model that the
  // prompt begins with and prefills only the rest (a hit), or runs on a new session
  // (a miss); the new session is then indexed as the conversation with this reply.
  // Conversations are matched by token ids (PrefixIndex), so every vocabulary reuses.
  // When reuse cannot serve it (off, --max-sessions reached) a stateless chat runs as a
  // plain throwaway stream and a response on a new session of its own.
  absl::Status StartReusingPrefix(const Caller& caller, GenerateParams params,
                                  GenerateObserver* observer) {
    const bool server_kept = params.prefix_reuse == GenerateParams::PrefixReuse::kServerKept;
    params.prefix_reuse = GenerateParams::PrefixReuse::kOff;
    const SessionSource plain = server_kept ? SessionSource::kAsGiven : SessionSource::kNewSession;
    auto engine = FindEngine(params.model);
    if (!engine.ok() || options_.prefix_reuse_entries <= 0) {
      return StartGenerateOn(caller, std::move(params), observer, "", plain);
    }
    const std::string model = (*engine)->name();
    params.model = model;
    if (!registry().CheckCapacity().ok()) {
      metrics_->CountPrefixReuse(model, "skipped");
      return StartGenerateOn(caller, std::move(params), observer, "", plain);
    }
    // The whole prompt's ids: a continuation absorbs the rest of these, never a fresh
    // encoding of the rest of the text (GenerateParams::prompt_tokens).
    if (absl::Status valid = ValidateText("prompt", params.prompt); !valid.ok()) return valid;
    const fwmodel::TextTokenizer& tokenizer = (*engine)->tokenizer();
    PrefixIndex::Tokens prompt_tokens = tokenizer.Encode(params.prompt);
    // The prompt starts a fresh state (a kept conversation began the same way).
    if (tokenizer.begin_of_text() >= 0) {
      prompt_tokens.insert(prompt_tokens.begin(), tokenizer.begin_of_text());
    }
    std::optional<PrefixIndex::Match> match =
        prefix_index_.Find(caller.tenant, model, prompt_tokens);
    if (match.has_value()) {
      // A session deleted, expired or in use by another request is no start point.
      auto record = registry().Get(match->session_id);
      if (!record.ok() || record->busy || record->tenant != caller.tenant) {
        if (!record.ok()) prefix_index_.Erase(caller.tenant, model, match->session_id);
        match.reset();
      }
    }
    metrics_->CountPrefixReuse(model, match.has_value() ? "hit" : "miss");
    const std::string new_session = NewSessionId();
    // A chat's end state is always kept; a response's when it is stored.
    if (server_kept) params.store = true;
    if (match.has_value()) {
      params.fork_from = match->session_id;
      params.prompt.clear();
      params.prompt_tokens.emplace(prompt_tokens.begin() + static_cast<ptrdiff_t>(match->length),
                                   prompt_tokens.end());
    } else {
      params.prompt.clear();
      params.prompt_tokens.emplace(prompt_tokens);
    }
    auto* keeper = new ConversationKeeper(this, caller, model, std::move(prompt_tokens),
                                          new_session, server_kept, params.store, observer);
    absl::Status started =
        StartGenerateOn(caller, std::move(params), keeper, new_session,
                        server_kept ? SessionSource::kServerKept : SessionSource::kNewSession);
    // Refused at once: the observer never hears of it.
    if (!started.ok()) delete keeper;
    return started;
  }

  // Where StartGenerateOn's request runs when it names no session (GenerateParams):
  //   kAsGiven: on its session_id, its fork_from's fork, or a throwaway stream;
  //   kNewSession: on a new session of the caller (without fork_from), within its quota;
  //   kServerKept: likewise, a kept conversation outside the tenant's quota (a fork_from
  //     fork too).
  enum class SessionSource { kAsGiven, kNewSession, kServerKept };

  // StartGenerate with the reuse decided. `new_session_id`: the id of the session a
  // fork_from request (or `source` kNewSession or kServerKept) creates; empty = chosen
  // here.
  absl::Status StartGenerateOn(const Caller& caller, GenerateParams params,
                               GenerateObserver* observer, const std::string& new_session_id,
                               SessionSource source) {
    const bool kept_conversation = source == SessionSource::kServerKept;
    const bool keep_new_session = source != SessionSource::kAsGiven && params.fork_from.empty();
    // Overload: refused before any per-request work (docs/serving.md "Overload").
    if (absl::Status early = EarlyRefusal(params.model, params.session_id, params.deadline);
        !early.ok()) {
      return early;
    }
    if (absl::Status valid = ValidateText("prompt", params.prompt); !valid.ok()) return valid;
    if (absl::Status valid = params.sampling.Validate(); !valid.ok()) return valid;
    if (params.top_logprobs < 0 || params.top_logprobs > GenerateParams::kMaxTopLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("top_logprobs must be in [0, ",
                                                     GenerateParams::kMaxTopLogprobs, "], got ",
                                                     params.top_logprobs));
    }
    if (params.max_tokens < 0 || params.max_tokens > options_.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [0, ",
                                                     options_.max_tokens, "] (--max-tokens), got ",
                                                     params.max_tokens));
    }
    if (params.min_tokens_per_message < 0 ||
        params.min_tokens_per_message > options_.engine.decode_lookahead) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream.min_tokens_per_message must be in [0, ", options_.engine.decode_lookahead,
          "] (--decode-lookahead), got ", params.min_tokens_per_message));
    }
    if (params.max_message_delay < absl::ZeroDuration() ||
        params.max_message_delay > absl::Seconds(60)) {
      return absl::InvalidArgumentError(
          absl::StrCat("stream.max_message_delay_ms must be in [0, 60000], got ",
                       absl::ToInt64Milliseconds(params.max_message_delay)));
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
    if (!params.fork_from.empty() && !params.session_id.empty()) {
      return absl::InvalidArgumentError(
          "fork_from: set either session_id (continue a session) or fork_from (continue a new "
          "fork of one), not both");
    }
    if (!params.store && params.fork_from.empty() && !keep_new_session) {
      return absl::InvalidArgumentError(
          "store: false is for a fork_from request (its new session is then not kept); a "
          "session's own changes are always stored");
    }
    const bool no_prompt = params.prompt_tokens.has_value() ? params.prompt_tokens->empty()
                                                            : params.prompt.empty();
    if (params.session_id.empty() && params.fork_from.empty() && no_prompt &&
        params.choice.index == 0) {
      return absl::InvalidArgumentError("prompt: must not be empty without a session_id");
    }
    if (keep_new_session) {
      if (absl::Status room = registry().CheckCapacity(); !room.ok()) return room;
      if (!kept_conversation) {
        if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return quota;
      }
    }
    const std::string model = params.model;
    // The session claimed: the one continued, or the one forked.
    const std::string session_id = params.fork_from.empty() ? params.session_id : params.fork_from;
    if (!params.fork_from.empty()) {
      if (absl::Status valid = ValidateSessionId(params.fork_from, "fork_from"); !valid.ok()) {
        return valid;
      }
      if (absl::Status room = registry().CheckCapacity(); !room.ok()) return room;
      if (!kept_conversation) {
        if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return quota;
      }
    }
    ModelEngine* engine = nullptr;
    if (session_id.empty()) {
      auto found = FindEngine(model);
      if (!found.ok()) return found.status();
      engine = *found;
    } else if (absl::Status valid = CheckSessionRequest(model, session_id); !valid.ok()) {
      return valid;
    }
    if (params.random_seed) params.sampling.seed = RandomSeed();

    // The tenant's stream quota is held from here: by `counted` until the request is
    // handed on (a refusal before destroys it, which gives the stream back, and the
    // observer never hears of the request), then until OnFinish.
    auto counted = quotas_.AdmitStream(caller.tenant, observer);
    if (!counted.ok()) return counted.status();
    if (*counted != nullptr) observer = counted->get();

    auto item = std::make_unique<WorkItem>();
    item->tenant = caller.tenant;
    item->session_id = session_id;
    GenerateWork generate;
    if (!params.fork_from.empty() || keep_new_session) {
      generate.fork_id = new_session_id.empty() ? NewSessionId() : new_session_id;
    }
    if (params.prompt_tokens.has_value()) {
      item->tokens = std::move(*params.prompt_tokens);  // the core encoded it (prefix reuse)
      params.prompt_tokens.reset();
    } else {
      item->text = std::move(params.prompt);  // encoded by the engine (its model's tokenizer)
      item->fresh_prompt = session_id.empty() && params.fork_from.empty();
    }
    item->is_cancelled = std::move(params.is_cancelled);
    params.is_cancelled = nullptr;
    generate.params = std::move(params);
    generate.observer = observer;
    item->work = std::move(generate);
    item->arrival = absl::Now();
    if (session_id.empty()) {
      // Submit hands the observer its stream control (OnStart).
      if (absl::Status queued = SubmitOrRelease(engine, item); !queued.ok()) return queued;
      (void)counted->release();  // OnFinish deletes it
      return absl::OkStatus();
    }
    // The session's engine is known once it is claimed (a shared store names the model).
    OpenStreamBeforeClaim(*item);
    GenerateObserver* const quota_holder = counted->release();
    absl::Status refused = ClaimAndSubmit(std::move(item), model);
    // Refused at once: the observer never hears of it; its stream is given back.
    if (!refused.ok()) std::unique_ptr<GenerateObserver> give_back(quota_holder);
    return refused;
  }

  void Score(const Caller& caller, ScoreParams params, Callback<ScoreResult> done) override {
    if (absl::Status valid = ValidateText("text", params.text); !valid.ok()) return done(valid);
    auto item = std::make_unique<WorkItem>();
    item->tenant = caller.tenant;
    item->session_id = params.session_id;
    item->is_cancelled = std::move(params.is_cancelled);
    item->text = std::move(params.text);
    item->work = ScoreWork{done};
    item->arrival = absl::Now();
    if (params.session_id.empty()) {
      auto engine = FindEngine(params.model);
      if (!engine.ok()) return done(engine.status());
      if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
      return;
    }
    if (absl::Status valid = CheckSessionRequest(params.model, params.session_id); !valid.ok()) {
      return done(valid);
    }
    if (absl::Status refused = ClaimAndSubmit(std::move(item), params.model); !refused.ok()) {
      done(refused);
    }
  }

  void CreateSession(const Caller& caller, const std::string& model, std::string prefix,
                     Callback<SessionRecord> done, std::function<bool()> is_cancelled) override {
    if (absl::Status valid = ValidateText("prefix", prefix); !valid.ok()) return done(valid);
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    if (absl::Status room = registry().CheckCapacity(); !room.ok()) return done(room);
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    auto item = std::make_unique<WorkItem>();
    item->tenant = caller.tenant;
    item->text = std::move(prefix);
    item->fresh_prompt = true;  // a new session's state
    item->is_cancelled = std::move(is_cancelled);
    item->work = CreateWork{done};
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  void ForkSession(const Caller& caller, const std::string& session_id,
                   Callback<SessionRecord> done) override {
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    SessionOperation<ForkWork>(caller, session_id, done);
  }

  void ExportSession(const Caller& caller, const std::string& session_id,
                     Callback<ExportResult> done) override {
    SessionOperation<ExportWork>(caller, session_id, done);
  }

  void DeleteSession(const Caller& caller, const std::string& session_id,
                     Callback<bool> done) override {
    SessionOperation<DeleteWork>(caller, session_id, done);
  }

  void ImportSession(const Caller& caller, const std::string& model, std::string blob,
                     Callback<SessionRecord> done) override {
    if (blob.empty()) return done(absl::InvalidArgumentError("blob: must not be empty"));
    auto engine = FindEngine(model);
    if (!engine.ok()) return done(engine.status());
    if (absl::Status quota = CheckSessionQuota(caller); !quota.ok()) return done(quota);
    auto item = std::make_unique<WorkItem>();
    item->tenant = caller.tenant;
    item->work = ImportWork{std::move(blob), done};
    item->arrival = absl::Now();
    if (absl::Status queued = SubmitOrRelease(*engine, item); !queued.ok()) done(queued);
  }

  absl::Status Readiness() const override {
    if (directory_->registry().indexing()) {
      return absl::UnavailableError("the session store is still being indexed");
    }
    return absl::OkStatus();
  }

  void GetSession(const Caller& caller, const std::string& session_id,
                  Callback<SessionRecord> done) override {
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return done(valid);
    directory_->Get(caller.tenant, session_id, std::move(done));
  }

  void GetSessionOutput(const Caller& caller, const std::string& session_id,
                        Callback<SessionOutput> done) override {
    SessionOperation<ReadOutputWork>(caller, session_id, done);
  }

  void ListSessions(const Caller& caller, ListSessionsParams params,
                    Callback<SessionList> done) override {
    if (params.page_size < 0) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("page_size must be >= 0, got ", params.page_size)));
    }
    const int page_size =
        params.page_size == 0 ? kDefaultPageSize : std::min(params.page_size, kMaxPageSize);
    directory_->List(caller.tenant, params.model, page_size, params.page_token, std::move(done));
  }

  void BeginShutdown() override {
    for (auto& engine : engines_) engine->BeginDrain();
  }

  bool WaitIdle(absl::Time deadline) override {
    bool idle = true;
    for (auto& engine : engines_) idle &= engine->WaitIdle(deadline);
    idle &= directory_->WaitIdle(deadline);
    return idle;
  }

  void EndAllWork() override {
    for (auto& engine : engines_) engine->EndAllWork();
  }

  void Stop() override {
    // Claims submit to the engines: the directory's background work and claims end
    // first (draining engines refuse the work).
    directory_->StopBackground();
    for (auto& engine : engines_) engine->Stop();
    // Answers made while the engines stopped may have started lease releases.
    directory_->AwaitJobs();
  }

 private:
  // Called in the constructor; the functions it hands on read descriptions_ later.
  SessionDirectoryOptions DirectoryOptions(const CoreOptions& options,
                                           std::unique_ptr<SessionStore> store) {
    SessionDirectoryOptions directory;
    directory.state_bytes_of = [this](const std::string& model) -> int64_t {
      for (const ModelDescription& d : descriptions_) {
        if (d.name == model) return d.state_bytes_per_session;
      }
      return 0;
    };
    directory.is_served = [this](const std::string& model) { return FindEngine(model).ok(); };
    directory.store = std::move(store);
    directory.store_threads = options.store_threads;
    directory.max_sessions = options.engine.max_sessions;
    directory.lease_ttl = options.session_lease_ttl;
    directory.store_timeout = options.session_store_timeout;
    return directory;
  }

  SessionRegistry& registry() { return directory_->registry(); }

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

  // `field`: the request field that carried `id`, for the message.
  static absl::Status ValidateSessionId(const std::string& id,
                                        absl::string_view field = "session_id") {
    if (!IsWellFormedSessionId(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", id.substr(0, 64), "' is not a session id (32 hex digits)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ModelEngine*> FindEngine(const std::string& model) const {
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

  // On failure the item comes back through `item` and is dropped here, before the
  // caller answers, so its lease is free by the time the client hears.
  absl::Status SubmitOrRelease(ModelEngine* engine, std::unique_ptr<WorkItem>& item) {
    absl::Status queued = engine->Submit(item);
    if (!queued.ok()) {
      CountRefusal(queued);
      item.reset();
    }
    return queued;
  }

  // Claims the item's session through the directory, binds the claim to the item (the
  // engine's session keeping ends it before every answer: SessionKeeper::BindClaim),
  // then submits the item to the engine of the session's model.
  //
  // Returns the error when it is known before this returns (a local directory: an
  // unknown or busy session, a full queue); the item's callbacks are then never
  // called. A later error (a shared store answers on a store thread) goes through the
  // item's callbacks.
  absl::Status ClaimAndSubmit(std::unique_ptr<WorkItem> item, const std::string& model) {
    // The claim's callback runs inline (a local directory) or on a store thread, maybe
    // before this returns: whether an error is returned or answered through the item
    // is decided under `mu`, once.
    struct Pending {
      std::unique_ptr<WorkItem> item;
      absl::Mutex mu;
      bool returned ABSL_GUARDED_BY(mu) = false;  // errors now go through the item
      absl::Status immediate ABSL_GUARDED_BY(mu);
    };
    auto pending = std::make_shared<Pending>();
    pending->item = std::move(item);
    const std::string id = pending->item->session_id;
    const std::string tenant = pending->item->tenant;
    // The errors name the field the caller set: fork_from for a fork-and-generate.
    const GenerateWork* generate = pending->item->As<GenerateWork>();
    const std::string field =
        generate != nullptr && !generate->fork_id.empty() ? "fork_from" : "session_id";
    directory_->ClaimNamed(
        tenant, id, model, field, [this, pending](absl::StatusOr<SessionClaim> claim) {
          absl::Status status = claim.ok() ? Submit(*pending, *claim) : claim.status();
          if (status.ok()) return;
          {
            absl::MutexLock lock(&pending->mu);
            // Before the return, the caller returns the error, unless a store claim is
            // bound to the item (SessionKeeper::BindClaim): its answers end the claim,
            // which dropping the item would leave held until its lease expired.
            const bool claim_bound = pending->item != nullptr && pending->item->ticket != nullptr;
            if (!pending->returned && !claim_bound) {
              pending->immediate = status;
              pending->item.reset();
              return;
            }
          }
          if (pending->item != nullptr) AnswerWorkItem(*pending->item, status);
        });
    absl::MutexLock lock(&pending->mu);
    pending->returned = true;
    return pending->immediate;
  }

  // Binds `claim` to the pending item and submits it; returns the refusal, which the
  // caller returns or answers through the item (which ends the claim first).
  template <typename Pending>
  absl::Status Submit(Pending& pending, SessionClaim& claim) {
    BindSessionClaim(*directory_, claim, *pending.item);
    auto engine = FindEngine(claim.model);
    if (!engine.ok()) return engine.status();  // the directory checked it is served
    absl::Status queued = (*engine)->SubmitClaimed(pending.item, std::move(claim.stored_state));
    if (!queued.ok()) CountRefusal(queued);
    return queued;
  }

  // A session operation (fork, export, delete, reading the last output) on
  // `session_id`, answered through `done`.
  template <typename Work, typename T>
  void SessionOperation(const Caller& caller, const std::string& session_id,
                        const Callback<T>& done) {
    if (absl::Status valid = ValidateSessionId(session_id); !valid.ok()) return done(valid);
    auto item = std::make_unique<WorkItem>();
    item->tenant = caller.tenant;
    item->session_id = session_id;
    item->arrival = absl::Now();
    item->work = Work{done};
    if (absl::Status refused = ClaimAndSubmit(std::move(item), ""); !refused.ok()) done(refused);
  }

  // The engine's lock-free admission check for a Generate, when its engine is known
  // without claiming anything: a throwaway stream's, or a session's when one model is
  // served. Counts the refusal by reason (fwserve_requests_refused_total).
  absl::Status EarlyRefusal(const std::string& model, const std::string& session_id,
                            absl::Time deadline) {
    ModelEngine* engine = nullptr;
    if (session_id.empty() || engines_.size() == 1) {
      auto found = FindEngine(session_id.empty() ? model : "");
      if (!found.ok()) return absl::OkStatus();  // answered by the checks that follow
      engine = *found;
    } else {
      return absl::OkStatus();
    }
    absl::Status refused = engine->CheckAdmission(deadline);
    if (!refused.ok()) CountRefusal(refused);
    return refused;
  }

  // Counts an engine's refusal (queue full, tenant's queue share, deadline).
  void CountRefusal(const absl::Status& refused) {
    if (auto reason = RefusalReasonOf(refused); reason.has_value()) {
      metrics_->CountRefused(RefusalReasonLabel(*reason));
    }
  }

  // A new session of the caller's tenant (Create, Fork, Import): refused at its
  // max_sessions quota.
  absl::Status CheckSessionQuota(const Caller& caller) {
    // Kept conversations (GenerateParams::prefix_reuse) are the server's cache, not the
    // tenant's sessions: they do not count.
    return quotas_.CheckSessions(caller.tenant, [&] {
      const int64_t kept = static_cast<int64_t>(prefix_index_.CountOfTenant(caller.tenant));
      return std::max<int64_t>(0, registry().CountOfTenant(caller.tenant) - kept);
    });
  }

  // The record of a session an earlier run stored in a local store (indexing at
  // start-up): its labels and the model whose fingerprint it carries. Trusts only
  // checksummed metadata.
  absl::StatusOr<SessionRecord> DescribeStoredSession(const std::string& id, std::string blob) {
    auto metadata = fwmodel::PeekStateMetadata(std::move(blob));
    if (!metadata.ok()) return metadata.status();
    auto labels = ParseStoredLabels(*metadata);
    ModelEngine* owner = nullptr;
    for (auto& engine : engines_) {
      if (engine->fingerprint() == (*metadata)["fingerprint"]) owner = engine.get();
    }
    SessionRecord record;
    if (!labels.ok() || labels->id != id || owner == nullptr ||
        !absl::SimpleAtoi((*metadata)["tokens"], &record.tokens)) {
      return absl::InvalidArgumentError(
          "no served model has its fingerprint, or its labels are malformed");
    }
    record.id = id;
    record.model = owner->name();
    record.tenant = labels->tenant;
    record.state_bytes = owner->state_bytes_per_session();
    record.created = labels->created;
    record.last_used = labels->last_used;
    record.resident = false;
    record.stored = true;
    return record;
  }

  const CoreOptions options_;
  Metrics* const metrics_;  // never null
  const Clock* const clock_;
  TenantQuotas quotas_;
  // Destroyed after the engines (which drain their store jobs); it joins its store
  // threads and closes the store.
  const std::unique_ptr<SessionDirectory> directory_;
  StateMemoryBudget budget_;
  // Stateless clients' kept conversations (GenerateParams::prefix_reuse).
  PrefixIndex prefix_index_;
  std::vector<std::unique_ptr<ModelEngine>> engines_;
  std::vector<ModelDescription> descriptions_;
  // The next GenerateParams::Choice::group (StartChoices).
  std::atomic<uint64_t> next_choice_group_{1};

  static constexpr int kDefaultPageSize = 100;
  static constexpr int kMaxPageSize = 1000;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::Create(const CoreOptions& options) {
  if (absl::Status valid = ValidateCoreOptions(options); !valid.ok()) return valid;
  SessionStoreOptions store_options;
  store_options.password_file = options.session_store_password_file;
  store_options.timeout = options.session_store_timeout;
  store_options.session_ttl = options.engine.session_ttl;
  // Every store thread, plus the lease-renewal thread, has a connection of its own.
  store_options.pool_size = options.store_threads + 1;
  if (options.session_lease_ttl < 3 * options.session_store_timeout) {
    Log(LogLevel::kWarning,
        absl::StrCat("--session-lease-ttl=", absl::FormatDuration(options.session_lease_ttl),
                     " is less than 3x --session-store-timeout=",
                     absl::FormatDuration(options.session_store_timeout),
                     ": one slow renewal can lose a running request's lease"));
  }
  Metrics* metrics = Metrics::OrNull(options.metrics);
  store_options.observer = [metrics](const char* op, absl::Duration took,
                                     const absl::Status& status) {
    metrics->ObserveSessionStoreOperation(op, StoreOutcome(status), absl::ToDoubleSeconds(took));
  };
  auto store = OpenSessionStore(options.session_store, store_options);
  if (!store.ok()) return store.status();
  if (*store != nullptr) Log(LogLevel::kInfo, "session store: " + (*store)->Describe());
  auto core = std::make_unique<CoreImpl>(options, std::move(*store));
  if (absl::Status status = core->Init(); !status.ok()) return status;
  return std::unique_ptr<Core>(std::move(core));
}

}  // namespace fwserve
