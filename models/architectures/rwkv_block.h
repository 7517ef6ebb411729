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
// The interface, and its thread-safety, are Block's (block.h).
#pragma once

#include <memory>

#include <torch/types.h>

#include "models/architectures/block.h"
#include "models/base/config.h"

namespace fwmodel {

// The interface is Block's (block.h); RWKV's blocks are made by MakeRwkvBlock.
class RwkvBlock : public Block {
 protected:
  RwkvBlock(const ModelConfig& config, int layer) : Block(config, layer) {}
};

// The block `layer` of an rwkv7 or rwkv4 config.
std::unique_ptr<RwkvBlock> MakeRwkvBlock(const ModelConfig& config, int layer);

// The token shift of a sequence: x [B, T, d] and the last token before it, *shift [B, d]
// (zeros for a fresh session). Returns the previous token of each position, [B, T, d],
// and replaces *shift with x's last token.
torch::Tensor TokenShift(const torch::Tensor& x, torch::Tensor* shift);

}  // namespace fwmodel
