#include "server/engine/stream_task.h"

#include <utility>

namespace fwserve {

void StreamTask::AddSampled(int64_t token, float logprob, absl::Time now) {
  if (unsent_.token_ids.empty()) {
    unsent_since_ = now;
    decoder_before_unsent_ = decoder_;
  }
  unsent_.token_ids.push_back(token);
  if (limits_.logprobs) unsent_.logprobs.push_back(logprob);
  ++sampled_;
  if (limits_.tokenizer != nullptr) {
    const std::string bytes = limits_.tokenizer->TokenBytes(token);
    unsent_.text += decoder_.PushBytes(bytes);
    generated_bytes_ += bytes;
    if (limits_.logprobs) unsent_.token_bytes.push_back(bytes);
    if (token == limits_.tokenizer->end_of_text()) stop_hit_ = true;
  } else {
    unsent_.text += decoder_.Push(token);
    if (token < 256) generated_bytes_.push_back(static_cast<char>(token));
    if (limits_.logprobs) {
      unsent_.token_bytes.push_back(
          token >= 0 && token < 256 ? std::string(1, static_cast<char>(token)) : std::string());
    }
  }
  for (const std::string& stop : limits_.stop) {
    if (generated_bytes_.size() >= stop.size() &&
        generated_bytes_.compare(generated_bytes_.size() - stop.size(), stop.size(), stop) == 0) {
      stop_hit_ = true;
    }
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
  inflight_tokens_ = static_cast<int64_t>(unsent_.token_ids.size());
  write_in_flight_ = true;
  inflight_text_ = unsent_.text;
  GenerateChunk chunk = std::move(unsent_);
  unsent_ = GenerateChunk();
  return chunk;
}

void StreamTask::ConfirmWrite() {
  write_in_flight_ = false;
  confirmed_ += inflight_tokens_;
  inflight_tokens_ = 0;
  output_.Append(inflight_text_);
  inflight_text_.clear();
}

StreamTask::RollbackPoint StreamTask::DropUnconfirmed() {
  RollbackPoint point = RollbackPoint::kNone;
  if (write_in_flight_) {
    point = RollbackPoint::kBeforeInflight;
    decoder_ = decoder_before_inflight_;
  } else if (!unsent_.token_ids.empty()) {
    point = RollbackPoint::kBeforeUnsent;
    decoder_ = decoder_before_unsent_;
  }
  write_in_flight_ = false;
  inflight_tokens_ = 0;
  inflight_text_.clear();
  unsent_ = GenerateChunk();
  return point;
}

std::string StreamTask::FinishText() {
  std::string rest = decoder_.Finish();
  output_.Append(rest);
  return rest;
}

}  // namespace fwserve
