#include "server/core/choice_fan_in.h"

#include <utility>

namespace fwserve {

// One choice's observer: the fan-in's calls with the choice's index.
class ChoiceFanIn::Member : public GenerateObserver {
 public:
  Member(ChoiceFanIn* fan_in, int32_t index) : fan_in_(fan_in), index_(index) {}
  void OnStart(std::shared_ptr<GenerateControl> stream) override {
    fan_in_->OnMemberStart(index_, std::move(stream));
  }
  void OnChunk(GenerateChunk chunk) override { fan_in_->OnMemberChunk(index_, std::move(chunk)); }
  void OnFinish(absl::Status status, GenerateSummary summary) override {
    fan_in_->OnMemberFinish(index_, std::move(status), std::move(summary));
  }

 private:
  ChoiceFanIn* const fan_in_;
  const int32_t index_;
};

std::shared_ptr<ChoiceFanIn> ChoiceFanIn::Create(GenerateObserver* downstream, int32_t choices) {
  return std::shared_ptr<ChoiceFanIn>(new ChoiceFanIn(downstream, choices));
}

ChoiceFanIn::ChoiceFanIn(GenerateObserver* downstream, int32_t choices)
    : downstream_(downstream), choices_(choices) {
  for (int32_t i = 0; i < choices; ++i) members_.push_back(std::make_unique<Member>(this, i));
  absl::MutexLock lock(&mu_);
  controls_.resize(static_cast<size_t>(choices));
  member_done_.assign(static_cast<size_t>(choices), false);
  summary_.choices.resize(static_cast<size_t>(choices));
}

GenerateObserver* ChoiceFanIn::member(int32_t index) {
  return members_[static_cast<size_t>(index)].get();
}

void ChoiceFanIn::Start() {
  {
    absl::MutexLock lock(&mu_);
    self_ = shared_from_this();
  }
  downstream_->OnStart(shared_from_this());
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
  }
  Pump();
}

void ChoiceFanIn::Refused(int32_t index, absl::Status status) {
  OnMemberFinish(index, std::move(status), GenerateSummary{});
}

void ChoiceFanIn::OnMemberStart(int32_t index, std::shared_ptr<GenerateControl> control) {
  bool cancel = false;
  {
    absl::MutexLock lock(&mu_);
    controls_[static_cast<size_t>(index)] = control;
    cancel = cancelled_;
  }
  if (cancel) control->Cancel();
}

void ChoiceFanIn::OnMemberChunk(int32_t index, GenerateChunk chunk) {
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(Queued{index, std::move(chunk)});
  }
  Pump();
}

void ChoiceFanIn::OnMemberFinish(int32_t index, absl::Status status, GenerateSummary summary) {
  std::vector<std::shared_ptr<GenerateControl>> to_cancel;
  {
    absl::MutexLock lock(&mu_);
    const size_t i = static_cast<size_t>(index);
    if (member_done_[i]) return;
    member_done_[i] = true;
    ++finished_;
    if (index == 0) {
      summary_.reason = summary.reason;
      summary_.prompt_tokens = summary.prompt_tokens;
      summary_.session_tokens = summary.session_tokens;
    }
    summary_.generated_tokens += summary.generated_tokens;
    summary_.choices[i] = {summary.reason, std::move(summary.trailing_text),
                           summary.generated_tokens};
    if (!status.ok()) {
      if (status_.ok()) status_ = std::move(status);
      // One failed choice fails the request: the others stop now.
      if (!cancelled_) {
        cancelled_ = true;
        for (size_t j = 0; j < controls_.size(); ++j) {
          if (!member_done_[j] && controls_[j] != nullptr) to_cancel.push_back(controls_[j]);
        }
      }
    }
  }
  for (const auto& control : to_cancel) control->Cancel();
  Pump();
}

void ChoiceFanIn::WriteDone(bool ok) {
  std::shared_ptr<GenerateControl> writer;
  {
    absl::MutexLock lock(&mu_);
    if (!in_flight_.has_value()) return;
    const size_t who = static_cast<size_t>(*in_flight_);
    in_flight_.reset();
    if (!member_done_[who]) writer = controls_[who];
  }
  if (writer != nullptr) writer->WriteDone(ok);
  Pump();
}

void ChoiceFanIn::Cancel() {
  std::vector<std::shared_ptr<GenerateControl>> to_cancel;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (size_t j = 0; j < controls_.size(); ++j) {
      if (!member_done_[j] && controls_[j] != nullptr) to_cancel.push_back(controls_[j]);
    }
  }
  for (const auto& control : to_cancel) control->Cancel();
}

void ChoiceFanIn::Pump() {
  for (;;) {
    GenerateChunk chunk;
    std::shared_ptr<ChoiceFanIn> last_reference;  // released after the final OnFinish
    absl::Status status;
    GenerateSummary summary;
    {
      absl::MutexLock lock(&mu_);
      if (!started_ || sending_ || in_flight_.has_value() || answered_) return;
      if (!queue_.empty()) {
        chunk = std::move(queue_.front().chunk);
        chunk.choice_index = queue_.front().choice;
        queue_.pop_front();
        in_flight_ = chunk.choice_index;
        sending_ = true;
      } else if (finished_ == choices_) {
        answered_ = true;
        status = status_;
        summary = std::move(summary_);
        last_reference = std::move(self_);
      } else {
        return;
      }
    }
    if (last_reference != nullptr) {
      downstream_->OnFinish(std::move(status), std::move(summary));
      return;
    }
    downstream_->OnChunk(std::move(chunk));
    absl::MutexLock lock(&mu_);
    sending_ = false;
  }
}

}  // namespace fwserve
