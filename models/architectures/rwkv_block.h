// A whole RWKV block, for the imported architectures rwkv7 (x070, "Goose") and rwkv4
// (docs/models.md): its time mix and channel mix, each after its own LayerNorm and with
// its own token shift, so unlike the contract's architectures (mixer.h) it owns the
// block's norms and FFN too. rwkv7.cc and rwkv4.cc; Model (model.cc) only calls this
// interface, and adds what is common: the embedding with `blocks.0.ln0`, and the head
// after `ln_out`.
//
// Weight names are BlinkDL's (`blocks.{i}.att.*`, `blocks.{i}.ffn.*`), squeezed to their
// essential rank ([1, 1, C] -> [C]); the low-rank matrices of rwkv7 are stored as linear
// weights [out, in], as rwkv.cpp and fla store them (transposed from BlinkDL's `.pth`).
// The state is float (the model's compute dtype): token shifts and the recurrence.
//
// Thread-safety: a bound block is immutable; its methods may run concurrently on
// distinct states.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "models/architectures/state.h"
#include "models/base/config.h"

namespace fwmodel {

class RwkvBlock {
 public:
  // A weight of this block by name relative to "blocks.{i}." (e.g. "att.w1").
  using WeightGetter = std::function<torch::Tensor(const std::string& suffix)>;

  virtual ~RwkvBlock() = default;

  // ---- The format (config only)
  // The block's weights, names relative to "blocks.{i}.", shapes.
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> WeightShapes() const = 0;
  // Multiply-adds per token of the block's matrix products.
  virtual int64_t MacsPerToken() const = 0;
  // Per-session state tensors, names relative to "blocks.{i}.".
  virtual std::vector<StateTensorSpec> StateSpec() const = 0;
  // The value of a fresh random weight for training or benchmarks (name relative to
  // "blocks.{i}."), shaped as WeightShapes() says; deterministic in `generator`.
  virtual torch::Tensor InitWeight(const std::string& name, const std::vector<int64_t>& shape,
                                   at::Generator& generator) const = 0;

  // ---- One block
  virtual void Bind(const WeightGetter& get) = 0;
  // Sets fresh-session values in the block's state tensors (allocated as zeros).
  virtual void InitState(torch::Tensor* state) const { (void)state; }
  // Sequence form: h [B, T, d] the residual stream entering the block; state points at
  // its StateSpec().size() tensors, advanced past the T tokens (replaced, not written in
  // place). `v_first` carries rwkv7's value residual between the blocks of one forward
  // pass: undefined before block 0, which sets it. Returns the residual stream after
  // the block, [B, T, d].
  virtual torch::Tensor Forward(const torch::Tensor& h, torch::Tensor* state,
                                torch::Tensor* v_first) const = 0;
  // Recurrent form, one token: h [B, d]. Equal to Forward over T = 1.
  virtual torch::Tensor Step(const torch::Tensor& h, torch::Tensor* state,
                             torch::Tensor* v_first) const {
    return Forward(h.unsqueeze(1), state, v_first).squeeze(1);
  }

 protected:
  RwkvBlock(const ModelConfig& config, int layer) : config_(config), layer_(layer) {}
  const ModelConfig config_;
  const int layer_;
};

// The block `layer` of an rwkv7 or rwkv4 config.
std::unique_ptr<RwkvBlock> MakeRwkvBlock(const ModelConfig& config, int layer);

// The token shift of a sequence: x [B, T, d] and the last token before it, *shift [B, d]
// (zeros for a fresh session). Returns the previous token of each position, [B, T, d],
// and replaces *shift with x's last token.
torch::Tensor TokenShift(const torch::Tensor& x, torch::Tensor* shift);

}  // namespace fwmodel
