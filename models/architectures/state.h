// The types a model's parts share below the Model class: where and in what precision it
// computes, and the recurrent state of a batch of sessions. The mixers
// (models/architectures/) include this, not models/architectures/model.h: a part never includes the
// whole.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

namespace fwmodel {

// Where and in what precision a model computes. Checkpoints are always stored and
// loaded as float32 first; then converted to `dtype` on `device`.
struct ModelOptions {
  torch::Device device = torch::kCPU;
  // Compute dtype: float32 (serving, training) or float64 (exactness tests).
  torch::ScalarType dtype = torch::kFloat32;
  // Time steps per chunk in the chunk-parallel sequence form. They trade memory for
  // fewer sequential steps; results do not depend on them beyond float rounding.
  int64_t attention_chunk = 64;  // linear_attention, fast_weight: [B, H, C, C] per chunk
  int64_t aft_chunk = 16;        // aft: [B, C, C, d] per chunk
  // RWKV-7 with float32 compute only (Create refuses anything else): its matrices (the
  // time mix's r, k, v, output and LoRA weights, the FFN's key and value and an untied
  // head, see Bf16MatrixName) are kept in bfloat16, half the memory and half the bytes
  // a decode step reads. Each product widens them exactly to float32 (the grouped GEMV
  // reads bf16; torch::linear gets a float32 copy of the matrix), so the results are the
  // float32 model's over the bf16-rounded matrices: exact for a bf16 file, a rounding of
  // a float32 one. Vectors, norms, the embedding and the state stay float32.
  bool bf16_matrices = false;
};

// Whether weight `name` of an RWKV-7 checkpoint is kept in bf16 under
// ModelOptions::bf16_matrices.
bool Bf16MatrixName(const std::string& name);

// Name and per-session shape of one state tensor. A batched State holds each with a
// leading batch dimension.
struct StateTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Recurrent state of a batch of sessions: tensors[i] has shape [B, spec[i].shape...].
// Sizes depend only on the config, never on how many tokens were absorbed.
struct State {
  std::vector<torch::Tensor> tensors;

  int64_t batch_size() const { return tensors.empty() ? 0 : tensors[0].size(0); }
  // Rows `rows` of every tensor, as a new (copied) State.
  State Gather(const torch::Tensor& rows) const;
  // Writes `source` (batch = rows.numel()) into rows `rows` of this state, in place.
  void Scatter(const torch::Tensor& rows, const State& source);
  // A deep copy that shares no storage with this state.
  State Clone() const;
  // Detaches every tensor from the autograd graph (truncated backprop).
  State Detach() const;
};

}  // namespace fwmodel
