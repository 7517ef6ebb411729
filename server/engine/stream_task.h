// The token side of one Generate stream under decode pipelining (docs/serving.md): what
// was sampled, what went out, what the client confirmed, when the stream is done, and
// which rollback point undoes the tokens the client never got. Torch-free: the state
// rows of the rollback points are the engine's (it saves and restores them when this
// class says which); the text decoder's points are kept here.
//
// A token is sampled into the unsent chunk; the unsent chunk goes out as one write
// (TakeChunkForWrite) when no write is in flight; the write's return confirms it
// (ConfirmWrite). At most `lookahead` tokens are unconfirmed at once. Engine thread only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/time/time.h"
#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"
#include "server/api/requests.h"
#include "server/api/session_record.h"

namespace fwserve {

struct StreamLimits {
  // Tokens to sample at most (GenerateParams::max_tokens).
  int64_t max_tokens = 0;
  // Sampling stops after a token that completes one of these (matched on the generated
  // bytes, so across token and chunk edges alike).
  std::vector<std::string> stop;
  // Each chunk carries the sampled tokens' log-probs.
  bool logprobs = false;
  // With logprobs: each token's alternatives are kept too (GenerateChunk::top_logprobs).
  bool top_logprobs = false;
  // Unconfirmed tokens at most (--decode-lookahead), >= 1.
  int64_t lookahead = 16;
  // How long the unsent tokens may wait for company (--stream-flush-interval, or the
  // request's max_message_delay); InfiniteDuration = until min_tokens_per_message.
  absl::Duration flush_interval = absl::ZeroDuration();
  // A message waits for this many tokens (0 = for `lookahead` while flush_interval
  // lasts); in [0, lookahead].
  int64_t min_tokens_per_message = 0;
  // The model's tokenizer, for the bytes each token stands for and its end of text
  // (which ends the stream like a stop string). Null: token id = byte value. Not owned;
  // outlives the stream.
  const fwmodel::TextTokenizer* tokenizer = nullptr;
  // Keep the confirmed tokens' text (output()): a session stream's, whose session keeps
  // its last output. A throwaway stream's text is only sent, never kept.
  bool keep_output = true;
};

class StreamTask {
 public:
  // The state a rollback returns to: before the chunk in flight, before the unsent
  // chunk, or nothing to undo.
  enum class RollbackPoint { kNone, kBeforeInflight, kBeforeUnsent };

  explicit StreamTask(StreamLimits limits);

  // True when the next sampled token begins a new unsent chunk: the caller saves its
  // state as the kBeforeUnsent point before calling AddSampled.
  bool starts_chunk() const { return unsent_.token_ids.empty(); }
  // Records a sampled token (with its log-prob, kept if asked) in the unsent chunk.
  // `now` starts the chunk's flush clock when the token begins it.
  // `alternatives` (may be null): the token's top_logprobs, kept with limits().top_logprobs.
  void AddSampled(int64_t token, float logprob, absl::Time now,
                  const std::vector<std::pair<int64_t, float>>* alternatives = nullptr);
  // Whether another token may be sampled now (fewer than `lookahead` unconfirmed).
  bool CanSample() const;
  // Whether the unsent tokens go out now (when no write is in flight): at once unless
  // the flush interval holds them; always when the chunk is full or sampling is done.
  bool ShouldFlush(absl::Time now) const;
  // The unsent chunk becomes the write in flight (its rollback point moves along; the
  // caller swaps its saved states the same way). Precondition: no write in flight.
  GenerateChunk TakeChunkForWrite();
  // The write in flight returned OK: its tokens are confirmed.
  void ConfirmWrite();
  // Forgets every unconfirmed token (in flight or unsent) and restores the decoder to
  // before the first of them; returns the point whose saved state the caller restores.
  RollbackPoint DropUnconfirmed();
  // The rest of the text (an incomplete final character as U+FFFD); it ends output().
  // Call it once, after DropUnconfirmed if the stream was cut.
  std::string FinishText();
  // With limits().keep_output: the text of the confirmed tokens, as the client received
  // it (their chunks' text, bounded by LastOutput::kMaxBytes), then FinishText's once it
  // was called. Empty otherwise.
  const LastOutput& output() const { return output_; }

  // Sampling is over: a stop string was generated or max_tokens were sampled.
  bool done_sampling() const { return stop_hit_ || sampled_ >= limits_.max_tokens; }
  bool stop_hit() const { return stop_hit_; }
  bool write_in_flight() const { return write_in_flight_; }
  bool has_unsent() const { return !unsent_.token_ids.empty(); }
  int64_t unsent_tokens() const { return static_cast<int64_t>(unsent_.token_ids.size()); }
  int64_t inflight_tokens() const { return inflight_tokens_; }
  // Tokens whose write was confirmed.
  int64_t confirmed() const { return confirmed_; }
  // Tokens sampled: confirmed, in flight or unsent.
  int64_t sampled() const { return sampled_; }
  const StreamLimits& limits() const { return limits_; }

 private:
  StreamLimits limits_;
  // The stop strings against the tail of the generated bytes, after `bytes` were added.
  void MatchStops(std::string_view bytes);

  fwmodel::Utf8StreamDecoder decoder_;
  // The generated bytes' tail, long enough for the longest stop string (empty when the
  // stream has none): bounded, so a token costs the same however long the stream runs.
  std::string stop_tail_;
  size_t longest_stop_ = 0;
  int64_t confirmed_ = 0;
  int64_t sampled_ = 0;
  bool stop_hit_ = false;
  bool write_in_flight_ = false;
  int64_t inflight_tokens_ = 0;
  GenerateChunk unsent_;
  std::string inflight_text_;  // the text of the chunk in flight
  LastOutput output_;
  absl::Time unsent_since_;
  // The decoder before the chunk in flight / before the unsent chunk.
  fwmodel::Utf8StreamDecoder decoder_before_inflight_;
  fwmodel::Utf8StreamDecoder decoder_before_unsent_;
};

}  // namespace fwserve
