#include "server/engine/state_pool.h"

#include <algorithm>
#include <cstring>

namespace fwserve {

StatePool::StatePool(const fwmodel::Model& model, int64_t max_slots, StateMemoryBudget* budget,
                     bool preallocate)
    : model_(model),
      max_slots_(std::max<int64_t>(1, max_slots)),
      preallocated_(preallocate),
      state_bytes_(model.state_bytes_per_session()),
      vocab_(model.config().vocab_size),
      budget_(budget) {
  c10::NoGradGuard no_grad;
  fresh_row_ = model_.InitialState(1);
  for (const torch::Tensor& t : fresh_row_.tensors) row_floats_ += t.numel();
  pool_ = model_.InitialState(0);
  next_logits_ =
      torch::zeros({0, vocab_}, torch::dtype(torch::kFloat32).device(model_.options().device));
  if (preallocated_) {
    // Every slot and the pad row, once.
    pool_ = model_.InitialState(max_slots_ + 1);
    next_logits_ = torch::zeros({max_slots_ + 1, vocab_}, next_logits_.options());
    for (int64_t s = max_slots_ - 1; s >= 0; --s) free_slots_.push_back(static_cast<int>(s));
    capacity_ = max_slots_;
  }
}

bool StatePool::Grow() {
  if (capacity_ >= max_slots_) return false;
  const int64_t grown = std::min<int64_t>(max_slots_, std::max<int64_t>(16, capacity_ * 2));
  fwmodel::State extra = model_.InitialState(grown - capacity_);
  for (size_t i = 0; i < pool_.tensors.size(); ++i) {
    pool_.tensors[i] = torch::cat({pool_.tensors[i], extra.tensors[i]}, 0);
  }
  next_logits_ = torch::cat(
      {next_logits_, torch::zeros({grown - capacity_, vocab_}, next_logits_.options())}, 0);
  for (int64_t s = grown - 1; s >= capacity_; --s) free_slots_.push_back(static_cast<int>(s));
  capacity_ = grown;
  return true;
}

std::optional<int> StatePool::TryAllocate(Shortage* shortage) {
  *shortage = Shortage::kNone;
  if (free_slots_.empty() && !Grow()) {
    *shortage = Shortage::kSlots;
    return std::nullopt;
  }
  if (!budget_->TryReserve(state_bytes_)) {
    *shortage = Shortage::kBudget;
    return std::nullopt;
  }
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  ++slots_in_use_;
  return slot;
}

void StatePool::Free(int slot) {
  free_slots_.push_back(slot);
  --slots_in_use_;
  budget_->Release(state_bytes_);
}

torch::Tensor StatePool::Index(int64_t slot) const {
  return torch::tensor({slot}, torch::kInt64).to(model_.options().device);
}

void StatePool::Reset(int slot) {
  pool_.Scatter(Index(slot), fresh_row_);
  next_logits_[slot].zero_();
}

fwmodel::State StatePool::CopyRow(int slot) const {
  // index_select (Gather) allocates: the result shares nothing with the pool.
  return pool_.Gather(Index(slot));
}

torch::Tensor StatePool::CopyLogits(int slot) const { return next_logits_[slot].clone(); }

void StatePool::SetRow(int slot, const fwmodel::State& row, const torch::Tensor& logits) {
  pool_.Scatter(Index(slot), row);
  if (logits.defined()) {
    next_logits_[slot].copy_(logits);
  } else {
    next_logits_[slot].zero_();
  }
}

void StatePool::CopySlot(int from, int to) {
  pool_.Scatter(Index(to), pool_.Gather(Index(from)));
  next_logits_[to].copy_(next_logits_[from]);
}

bool StatePool::IsFlatCpu() const {
  if (!next_logits_.device().is_cpu()) return false;
  for (const torch::Tensor& t : pool_.tensors) {
    if (!t.device().is_cpu() || t.scalar_type() != torch::kFloat32 || !t.is_contiguous()) {
      return false;
    }
  }
  return true;
}

void StatePool::SaveRow(int slot, RowCopy* copy) const {
  if (!IsFlatCpu()) {
    copy->state = CopyRow(slot);
    copy->logits = CopyLogits(slot);
    return;
  }
  copy->values.resize(static_cast<size_t>(row_floats_ + vocab_));
  float* out = copy->values.data();
  for (const torch::Tensor& t : pool_.tensors) {
    const int64_t n = t.stride(0);
    std::memcpy(out, t.data_ptr<float>() + slot * n, sizeof(float) * n);
    out += n;
  }
  std::memcpy(out, next_logits_.data_ptr<float>() + slot * vocab_, sizeof(float) * vocab_);
}

void StatePool::RestoreRow(int slot, const RowCopy& copy) {
  if (copy.values.empty()) return SetRow(slot, copy.state, copy.logits);
  const float* in = copy.values.data();
  for (torch::Tensor& t : pool_.tensors) {
    const int64_t n = t.stride(0);
    std::memcpy(t.data_ptr<float>() + slot * n, in, sizeof(float) * n);
    in += n;
  }
  std::memcpy(next_logits_.data_ptr<float>() + slot * vocab_, in, sizeof(float) * vocab_);
}

void StatePool::SetLogits(const std::vector<int64_t>& rows, const float* logits) {
  float* base = next_logits_.data_ptr<float>();
  for (size_t b = 0; b < rows.size(); ++b) {
    std::memcpy(base + rows[b] * vocab_, logits + static_cast<int64_t>(b) * vocab_,
                sizeof(float) * vocab_);
  }
}

void StatePool::SetLogits(const torch::Tensor& rows, const torch::Tensor& logits) {
  next_logits_.index_copy_(0, rows.to(next_logits_.device()),
                           logits.to(next_logits_.device(), torch::kFloat32));
}

}  // namespace fwserve
