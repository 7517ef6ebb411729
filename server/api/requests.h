// The request and answer vocabulary shared by the transports, the core and the engine:
// what a caller asks for, what comes back, and the streaming observer/control bridge.
// Header-only and torch-free; it includes nothing of the server above server/base.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/sampling/sampler.h"
#include "server/api/session_record.h"

namespace fwserve {
namespace constraints {
class Grammar;  // models/constraints: a compiled constraint, immutable and shared
}  // namespace constraints

// Who is calling, as the transport authenticated it.
struct Caller {
  // The tenant (a name from the API-keys file); empty on an open server. A session
  // belongs to the tenant that created or imported it, and to any other caller it does
  // not exist (NOT_FOUND, never PERMISSION_DENIED).
  std::string tenant;
};

struct ModelDescription {
  std::string name;
  bool is_default = false;
  std::string architecture;
  std::string config_json;
  int64_t parameters = 0;
  int64_t state_bytes_per_session = 0;
  int64_t vocab_size = 0;
  std::string fingerprint;
  int64_t memory_slots = 0;  // product-key memory value slots (0: none)
};

struct GenerateParams {
  std::string model;       // empty = default
  std::string session_id;  // empty = throwaway
  // A session to fork (session_id empty): the request runs on a new session that
  // starts from this one's state, which stays unchanged. One admission, one store
  // write (docs/sessions.md "Fork and generate"). The new id: GenerateControl::session_id.
  std::string fork_from;
  // With fork_from: false = the new session is never stored and is gone when the
  // request ends (a one-off continuation). Must be true otherwise.
  bool store = true;
  // Replayed histories (docs/http.md; --prefix-reuse-entries), for a request with
  // neither session_id nor fork_from: its prompt may begin with a conversation this
  // tenant had with the model, and then continues from that conversation's state and
  // prefills only the rest (the tokens are those of a full prefill).
  //   kOff: a plain request.
  //   kServerKept: a stateless chat: a throwaway stream for the caller; its end state is
  //     kept by the server (outside the tenant's session quota) for the next turn.
  //   kCallerSession: a response: runs on a new session of the caller, kept as `store`
  //     says (its id: GenerateControl::session_id); while it exists, a stored one is
  //     found by later replays.
  enum class PrefixReuse { kOff, kServerKept, kCallerSession };
  PrefixReuse prefix_reuse = PrefixReuse::kOff;
  std::string prompt;
  // Set by the core alone (a replayed history's continuation): the token ids to absorb,
  // in place of encoding `prompt` (then empty), because a kept conversation is matched
  // by the ids of the whole prompt and the rest must be those ids, not a fresh encoding
  // of the rest of the text.
  std::optional<std::vector<int64_t>> prompt_tokens;
  SamplingParams sampling;
  // Tokens the repetition penalty looks back over (prompt and generated tokens of
  // this request).
  int32_t repetition_window = 64;
  bool random_seed = false;  // true: ignore sampling.seed and draw one
  int32_t max_tokens = 0;
  std::vector<std::string> stop;
  bool logprobs = false;
  // OpenAI's top_logprobs, with `logprobs`: each token's most likely alternatives
  // (GenerateChunk::top_logprobs). In [0, kMaxTopLogprobs].
  int32_t top_logprobs = 0;
  static constexpr int32_t kMaxTopLogprobs = 20;
  // Structured output (docs/structured-output.md): the reply is decoded under this
  // constraint (tokens that cannot continue a valid reply are never drawn) and ends,
  // with FinishReason::kStop, as soon as it is whole; null = free text.
  std::shared_ptr<const constraints::Grammar> constraint;
  // OpenAI's `n`: this many choices, each sampled on its own from the same prompt, whose
  // prompt is read once (docs/http.md "Several choices"). In [1, kMaxChoices]; above 1
  // the request has neither session_id nor fork_from, and its chunks carry their
  // choice's index (GenerateChunk::choice_index; GenerateSummary::choices).
  int32_t choices = 1;
  static constexpr int32_t kMaxChoices = 16;
  // Set by the core alone, for each stream of a request with choices > 1: the group's id
  // (unique in the process), this stream's index and the group's size. Choice 0 reads
  // the prompt; choice i > 0 has none and starts from choice 0's state after it.
  struct Choice {
    uint64_t group = 0;
    int32_t index = 0;
    int32_t count = 1;
  };
  Choice choice;
  // Per-request message grouping (v1::StreamOptions): a message waits for this many
  // tokens (0 = the server's --stream-flush-interval rule), at most `max_message_delay`
  // (zero = no limit when min_tokens_per_message is set, else the server's interval).
  int32_t min_tokens_per_message = 0;
  absl::Duration max_message_delay = absl::ZeroDuration();
  // Polled before the request starts and between prefill chunks (may be null): true =
  // the caller is gone, and the request ends without effect.
  std::function<bool()> is_cancelled;
  // The caller's deadline (the gRPC call's). A request that the queue's expected wait
  // says cannot start before it is refused at once with DEADLINE_EXCEEDED and a retry
  // hint, instead of queueing to die (docs/serving.md "Overload").
  absl::Time deadline = absl::InfiniteFuture();
};

enum class FinishReason { kLength, kStop, kCancelled, kShutdown };

struct GenerateChunk {
  // The choice these tokens belong to (GenerateParams::choices > 1); 0 otherwise.
  int32_t choice_index = 0;
  std::string text;  // valid UTF-8, possibly empty
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;  // empty unless requested
  // With logprobs: the bytes each token stands for in the model's vocabulary (one byte
  // for a byte-level model; a world-vocabulary token's UTF-8 piece, possibly part of a
  // character; empty for end of text).
  std::vector<std::string> token_bytes;
  // With GenerateParams::top_logprobs > 0: per token, its step's most likely tokens
  // (model's own log-probabilities, most likely first).
  struct Alternative {
    int64_t token_id = 0;
    float logprob = 0;
    std::string bytes;  // as token_bytes
  };
  std::vector<std::vector<Alternative>> top_logprobs;
};

struct GenerateSummary {
  FinishReason reason = FinishReason::kLength;
  std::string trailing_text;  // an incomplete final character, as U+FFFD
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t session_tokens = 0;
  // GenerateParams::choices > 1: how each choice ended, by index (the fields above then
  // count the prompt once and every choice's generated tokens); empty otherwise.
  struct ChoiceEnd {
    FinishReason reason = FinishReason::kLength;
    std::string trailing_text;
    int64_t generated_tokens = 0;
  };
  std::vector<ChoiceEnd> choices;
};

// Implemented by the transport, called on the engine thread; must not block. The
// engine sends one chunk at a time: after OnChunk it waits for
// GenerateControl::WriteDone. OnFinish is the last call; the engine never touches the
// observer after it. The observer must outlive that call.
class GenerateControl;
class GenerateObserver {
 public:
  virtual ~GenerateObserver() = default;
  // Called once, on the calling thread, inside StartGenerate before any other call:
  // the handle for WriteDone/Cancel.
  virtual void OnStart(std::shared_ptr<GenerateControl> stream) = 0;
  virtual void OnChunk(GenerateChunk chunk) = 0;
  // `status` not OK: the request failed after it was accepted (nothing was committed).
  virtual void OnFinish(absl::Status status, GenerateSummary summary) = 0;
};

// The transport's handle on an accepted Generate. Thread-safe; cheap.
class GenerateControl {
 public:
  virtual ~GenerateControl() = default;
  // The session the request runs on: the new one of a fork_from request (known from
  // OnStart on), else GenerateParams::session_id (empty for a throwaway).
  virtual std::string session_id() const = 0;
  // The last OnChunk's message was written (ok) or could not be (stream broken). A
  // token is committed to the session only after its write succeeded.
  virtual void WriteDone(bool ok) = 0;
  // The client cancelled or the deadline passed: stop before the next step.
  virtual void Cancel() = 0;
};

struct ScoreParams {
  std::string model;
  std::string session_id;  // empty = fresh state; else conditioned, session unchanged
  std::string text;
  // Polled by the engine between chunks (may be null); true = the caller is gone
  // (cancelled, deadline passed) and the work is dropped with CANCELLED.
  std::function<bool()> is_cancelled;
};

struct ScoreResult {
  std::vector<int64_t> token_ids;
  std::vector<double> logprobs;
};

struct ExportResult {
  std::string blob;
  std::string model;
  int64_t tokens = 0;
};

template <typename T>
using Callback = std::function<void(absl::StatusOr<T>)>;

struct ListSessionsParams {
  std::string model;  // empty = every model
  // Sessions per page: 0 = 100; values above 1000 are taken as 1000.
  int32_t page_size = 0;
  // Empty = the first page; else the next_page_token of the previous page.
  std::string page_token;
};

struct SessionList {
  std::vector<SessionRecord> sessions;  // oldest first
  std::string next_page_token;          // empty: the last page
};

}  // namespace fwserve
