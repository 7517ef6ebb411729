// A whole block: for the imported architectures whose block differs from the contract's
// norm/mixer/norm/FFN block as a whole (docs/models.md): RWKV-7 and RWKV-4 (rwkv_block.h),
// DeltaNet and Gated DeltaNet (delta_net.h). A block owns its norms, its token mixing and
// its FFN; Model (model.cc) only calls this interface, and adds what each architecture
// has around the blocks (the embedding, the final norm and the head).
//
// Weight and state names are relative to "blocks.{i}.". The state is in the model's
// compute dtype.
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

class Block {
 public:
  // A weight of this block by name relative to "blocks.{i}." (e.g. "att.w1").
  using WeightGetter = std::function<torch::Tensor(const std::string& suffix)>;

  virtual ~Block() = default;

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
  // pass: undefined before block 0, which sets it (other blocks leave it alone). Returns
  // the residual stream after the block, [B, T, d].
  virtual torch::Tensor Forward(const torch::Tensor& h, torch::Tensor* state,
                                torch::Tensor* v_first) const = 0;
  // Recurrent form, one token: h [B, d]. Equal to Forward over T = 1.
  virtual torch::Tensor Step(const torch::Tensor& h, torch::Tensor* state,
                             torch::Tensor* v_first) const {
    return Forward(h.unsqueeze(1), state, v_first).squeeze(1);
  }

 protected:
  Block(const ModelConfig& config, int layer) : config_(config), layer_(layer) {}
  const ModelConfig config_;
  const int layer_;
};

// The block `layer` of a config with whole blocks (config.has_whole_blocks()); null
// otherwise. model.cc.
std::unique_ptr<Block> MakeWholeBlock(const ModelConfig& config, int layer);

}  // namespace fwmodel
