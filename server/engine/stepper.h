// The model's compute, as the engine uses it: one batched decode step over pool rows,
// and prefill chunks on private rows. Picks the kernel once, at construction: the
// native float32 CPU kernels (models/native_step.h: fused sgemm projections, the pool's
// rows updated in place) where the model allows and "native" was asked for, else
// LibTorch (Model::Step / Model::Forward on gathered rows: the reference, and the path
// of CUDA and float64 models).
//
// Thread-safety: Step runs on the engine thread only, Prefill on the prefill thread
// only; each has kernels and scratch of its own, so the two may run at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/model.h"
#include "models/native_step.h"
#include "server/engine/state_pool.h"

namespace fwserve {

class Stepper {
 public:
  // `decode_kernel`: "native" or "libtorch" (EngineOptions::decode_kernel). `model`
  // is not owned and outlives this. `name` names the model in log lines.
  Stepper(const fwmodel::Model& model, const std::string& decode_kernel, const std::string& name);

  // "native" or "libtorch": the kernel in use.
  const char* kernel() const { return native_step_ != nullptr ? "native" : "libtorch"; }

  // Engine thread: the rows `rows` of `pool` absorb `tokens` (one each, in the same
  // order) in one batched step, and get their next-token logits.
  absl::Status Step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                    StatePool& pool);

  // Prefill thread: `tokens` [B, L] are absorbed into `state` (B private rows, in
  // place). Returns the logits after each row's last token, float32 on the CPU [B,
  // vocab].
  absl::StatusOr<torch::Tensor> Prefill(const torch::Tensor& tokens, fwmodel::State* state);

 private:
  const fwmodel::Model& model_;
  const int64_t vocab_;
  // Null: LibTorch.
  std::unique_ptr<fwmodel::NativeStep> native_step_;     // engine thread
  std::unique_ptr<fwmodel::NativeStep> native_prefill_;  // prefill thread
  std::vector<float> step_logits_;  // [batch, vocab] scratch of the native step
};

}  // namespace fwserve
