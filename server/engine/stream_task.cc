#include "server/engine/stream_task.h"

#include <algorithm>
#include <utility>

namespace fwserve {

StreamTask::StreamTask(StreamLimits limits) : limits_(std::move(limits)) {
  for (const std::string& stop : limits_.stop) longest_stop_ = std::max(longest_stop_, stop.size());
  if (limits_.constraint != nullptr) matcher_.emplace(limits_.constraint);
}

void StreamTask::MatchStops(std::string_view bytes) {
  // Keep the last longest_stop_ bytes at most (trimmed in bulk: amortised O(1)).
  stop_tail_.append(bytes);
  if (stop_tail_.size() > 4 * longest_stop_ + 64) {
    stop_tail_.erase(0, stop_tail_.size() - longest_stop_);
  }
  for (const std::string& stop : limits_.stop) {
    if (stop_tail_.size() >= stop.size() &&
        stop_tail_.compare(stop_tail_.size() - stop.size(), stop.size(), stop) == 0) {
      stop_hit_ = true;
    }
  }
}

namespace {
// The bytes `token` stands for: the tokenizer's piece, or the byte of a byte-level id.
std::string_view TokenBytes(const fwmodel::TextTokenizer* tokenizer, int64_t token, char* byte) {
  if (tokenizer != nullptr) return tokenizer->TokenBytesView(token);
  if (token < 0 || token >= 256) return {};
  *byte = static_cast<char>(token);
  return std::string_view(byte, 1);
}
}  // namespace

void StreamTask::AddSampled(int64_t token, float logprob, absl::Time now,
                            const std::vector<std::pair<int64_t, float>>* alternatives) {
  if (unsent_.token_ids.empty()) {
    unsent_since_ = now;
    decoder_before_unsent_ = decoder_;
    if (matcher_.has_value()) matcher_before_unsent_ = matcher_;
  }
  unsent_.token_ids.push_back(token);
  if (limits_.logprobs) unsent_.logprobs.push_back(logprob);
  ++sampled_;
  const fwmodel::TextTokenizer* tokenizer = limits_.tokenizer;
  char byte = 0;
  const std::string_view bytes = TokenBytes(tokenizer, token, &byte);
  if (tokenizer != nullptr) {
    decoder_.AppendBytes(bytes, &unsent_.text);
    if (token == tokenizer->end_of_text()) stop_hit_ = true;
  } else {
    decoder_.Append(token, &unsent_.text);
  }
  if (limits_.logprobs) unsent_.token_bytes.emplace_back(bytes);
  if (limits_.logprobs && limits_.top_logprobs) {
    std::vector<GenerateChunk::Alternative>& top = unsent_.top_logprobs.emplace_back();
    if (alternatives != nullptr) {
      top.reserve(alternatives->size());
      for (const auto& [id, value] : *alternatives) {
        char alternative_byte = 0;
        top.push_back({id, value, std::string(TokenBytes(tokenizer, id, &alternative_byte))});
      }
    }
  }
  if (longest_stop_ > 0) MatchStops(bytes);
  if (matcher_.has_value() && !stop_hit_) {
    // The sampler only draws tokens the constraint allows; one it refuses anyway (an
    // end of text before the document is whole cannot be) ends the stream all the same.
    if (!matcher_->AdvanceBytes(bytes) || matcher_->IsFinished()) stop_hit_ = true;
  }
}

bool StreamTask::CanSample() const {
  return inflight_tokens_ + static_cast<int64_t>(unsent_.token_ids.size()) < limits_.lookahead;
}

bool StreamTask::ShouldFlush(absl::Time now) const {
  const int64_t unsent = static_cast<int64_t>(unsent_.token_ids.size());
  if (done_sampling() || unsent >= limits_.lookahead) return true;
  if (limits_.min_tokens_per_message > 0) {
    return unsent >= limits_.min_tokens_per_message ||
           now - unsent_since_ >= limits_.flush_interval;
  }
  return limits_.flush_interval <= absl::ZeroDuration() ||
         now - unsent_since_ >= limits_.flush_interval;
}

GenerateChunk StreamTask::TakeChunkForWrite() {
  std::swap(decoder_before_inflight_, decoder_before_unsent_);
  std::swap(matcher_before_inflight_, matcher_before_unsent_);
  inflight_tokens_ = static_cast<int64_t>(unsent_.token_ids.size());
  write_in_flight_ = true;
  if (limits_.keep_output) inflight_text_ = unsent_.text;
  GenerateChunk chunk = std::move(unsent_);
  unsent_ = GenerateChunk();
  return chunk;
}

void StreamTask::ConfirmWrite() {
  write_in_flight_ = false;
  confirmed_ += inflight_tokens_;
  inflight_tokens_ = 0;
  if (limits_.keep_output) {
    output_.Append(inflight_text_);
    inflight_text_.clear();
  }
}

StreamTask::RollbackPoint StreamTask::DropUnconfirmed() {
  RollbackPoint point = RollbackPoint::kNone;
  if (write_in_flight_) {
    point = RollbackPoint::kBeforeInflight;
    decoder_ = decoder_before_inflight_;
    if (matcher_.has_value()) matcher_ = matcher_before_inflight_;
  } else if (!unsent_.token_ids.empty()) {
    point = RollbackPoint::kBeforeUnsent;
    decoder_ = decoder_before_unsent_;
    if (matcher_.has_value()) matcher_ = matcher_before_unsent_;
  }
  write_in_flight_ = false;
  inflight_tokens_ = 0;
  inflight_text_.clear();
  unsent_ = GenerateChunk();
  return point;
}

std::string StreamTask::FinishText() {
  std::string rest = decoder_.Finish();
  if (limits_.keep_output) output_.Append(rest);
  return rest;
}

}  // namespace fwserve
