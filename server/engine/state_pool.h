// One model's resident session states: a [capacity, ...] tensor per state tensor plus
// the next-token logits of every row, grown on demand up to a slot limit, with every
// slot in use reserved against the process-wide StateMemoryBudget. Internal to
// server/core (LibTorch).
//
// Thread-safety: StatePool is not thread-safe; its engine thread alone uses it.
// StateMemoryBudget is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "models/architectures/model.h"
#include "server/engine/state_memory_budget.h"

namespace fwserve {

class StatePool {
 public:
  // `budget` is not owned and must outlive the pool. `preallocate`: every row is
  // allocated now, plus one pad row that is never handed out (pad_row), and the tensors
  // are never reallocated, so a step may bind them (fwmodel::PoolBinding: the in-place
  // graph step on a CUDA model). Otherwise the pool grows on demand.
  StatePool(const fwmodel::Model& model, int64_t max_slots, StateMemoryBudget* budget,
            bool preallocate = false);

  enum class Shortage { kNone, kSlots, kBudget };
  // A free slot (its state undefined), its bytes reserved in the budget; nullopt when
  // the pool is at max_slots with every slot taken (kSlots) or the budget is spent
  // (kBudget), reported through `shortage`.
  std::optional<int> TryAllocate(Shortage* shortage);
  void Free(int slot);

  // Row `slot` := the initial state, logits zero.
  void Reset(int slot);
  // The index tensor {slot} on the model's device.
  torch::Tensor Index(int64_t slot) const;
  // A private copy of row `slot` (batch 1) and of its logits.
  fwmodel::State CopyRow(int slot) const;
  torch::Tensor CopyLogits(int slot) const;
  // Row `slot` := `row` (batch 1); logits := `logits`, or zero if undefined.
  void SetRow(int slot, const fwmodel::State& row, const torch::Tensor& logits);
  // Row `to` := row `from`, logits too.
  void CopySlot(int from, int to);

  // A copy of one row and its logits, to put back later (decode pipelining undoes
  // tokens absorbed before their write was confirmed). On a CPU float32 pool it is one
  // flat buffer filled by memcpy; otherwise tensors.
  struct RowCopy {
    std::vector<float> values;
    fwmodel::State state;
    torch::Tensor logits;
  };
  void SaveRow(int slot, RowCopy* copy) const;
  void RestoreRow(int slot, const RowCopy& copy);

  // Batched access for prefill and decode: rows [B] on the model's device.
  fwmodel::State Gather(const torch::Tensor& rows) const { return pool_.Gather(rows); }
  void Scatter(const torch::Tensor& rows, const fwmodel::State& state) {
    pool_.Scatter(rows, state);
  }
  // float32 [vocab] view of a row's next-token logits, on the model's device.
  torch::Tensor logits(int slot) const { return next_logits_[slot]; }
  // next_logits[rows] := logits ([B, vocab], any device/dtype; rows on any device).
  void SetLogits(const torch::Tensor& rows, const torch::Tensor& logits);
  // next_logits[rows[b]] := logits[b * vocab .. (b + 1) * vocab) (float32 row-major; a
  // CPU pool only).
  void SetLogits(const std::vector<int64_t>& rows, const float* logits);
  // Every row's next-token logits, [capacity, vocab] float32 on the model's device, for
  // steps that write them in place (fwmodel::GraphedStep). Valid until the next
  // TryAllocate.
  torch::Tensor* mutable_logits() { return &next_logits_; }
  const torch::Tensor& all_logits() const { return next_logits_; }
  // The pool itself ([capacity, ...] per state tensor, contiguous), for steps that
  // update rows in place (fwmodel::NativeStep). Valid until the next TryAllocate.
  fwmodel::State* mutable_state() { return &pool_; }

  bool preallocated() const { return preallocated_; }
  // Preallocated: the row padding reads and writes (max_slots); else -1.
  int64_t pad_row() const { return preallocated_ ? max_slots_ : -1; }

  const fwmodel::State& fresh_row() const { return fresh_row_; }
  int64_t capacity() const { return capacity_; }
  int64_t slots_in_use() const { return slots_in_use_; }
  int64_t state_bytes() const { return state_bytes_; }
  int64_t max_slots() const { return max_slots_; }

 private:
  bool Grow();
  // Every state tensor, and the logits, are contiguous float32 CPU tensors.
  bool IsFlatCpu() const;

  const fwmodel::Model& model_;
  const int64_t max_slots_;
  const bool preallocated_;
  const int64_t state_bytes_;
  const int64_t vocab_;
  StateMemoryBudget* const budget_;
  fwmodel::State pool_;        // [capacity, ...] per state tensor
  torch::Tensor next_logits_;  // float32 [capacity, vocab], on the model's device
  fwmodel::State fresh_row_;   // InitialState(1)
  int64_t capacity_ = 0;
  int64_t row_floats_ = 0;  // elements of one row over all state tensors
  std::vector<int> free_slots_;
  int64_t slots_in_use_ = 0;
};

}  // namespace fwserve
