// The native float32 CPU step and prefill of DeltaNet and Gated DeltaNet (architectures
// delta_net, gated_deltanet; the math is models/architectures/delta_net.h's), for
// NativeStep (native_step.h), which validates the arguments and dispatches here. Per
// block: the RMSNorm, the q/k/v (and β, a, g) projections as GEMMs over all the call's
// tokens (native_gemm.h), the short convolutions, activations and norms per session and
// token, then the delta rule per (session, value head) with its state read and written
// in place in the pool (delta_rule.h, the body a CUDA kernel shares), the output norm and
// gate, o_proj added to the residual, and the SwiGLU MLP; the final norm and the head on
// each session's last token (or every token, for scoring). Every state value is float32.
// Equal to Model::Step within float32 rounding (tests/unit/delta_net_test.cc).
//
// Weights exactly representable in 16 bits (fla's checkpoints ship in bf16) are kept in
// 16 bits only, per projection, as NativeRwkv does; products compute in float32.
//
// Ownership: copies the weights it multiplies (packed) and keeps contiguous views of the
// others; the Model must outlive it. Thread-safety: Absorb uses the object's scratch;
// one call at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "models/architectures/model.h"
#include "models/kernels/native_gemm.h"

namespace fwmodel {

class NativeDeltaNet {
 public:
  // FailedPrecondition unless the model is a delta_net or gated_deltanet one computing in
  // float32 on the CPU. packed_gemm, narrow_weights: NativeStepOptions's.
  static absl::StatusOr<std::unique_ptr<NativeDeltaNet>> Create(const Model& model,
                                                                bool packed_gemm,
                                                                bool narrow_weights = true);
  // Another instance over `other`'s weights (shared, immutable), with scratch of its own.
  static std::unique_ptr<NativeDeltaNet> SharingWeights(const NativeDeltaNet& other);

  // NativeRwkv::Absorb's contract: rows[b] absorbs tokens[b·steps .. (b + 1)·steps) in
  // place in `pool` (arguments already checked, threads >= 1); logits [B, vocab] after
  // each row's last token, or [B·steps, vocab] after every token when every_position.
  void Absorb(absl::Span<const int64_t> tokens, int64_t steps, absl::Span<const int64_t> rows,
              State* pool, int threads, float* logits, bool every_position = false);

  ~NativeDeltaNet();

  // NativeRwkv::weight_format's and weight_bits's meaning.
  std::string weight_format() const;
  int weight_bits() const;

 private:
  struct Layer;
  struct Weights;
  explicit NativeDeltaNet(const Model& model);

  const Model& model_;
  std::shared_ptr<const Weights> weights_;
  // Scratch for the largest call seen, [tokens, width] each: the residual stream, the
  // normalised input, the projections before and after the convolutions, β, the decay,
  // the gate, the heads' outputs, the MLP's hidden units.
  std::vector<float> h_, x_, q_raw_, k_raw_, v_raw_, q_, k_, v_, beta_, decay_, g_, o_, gate_, up_;
};

}  // namespace fwmodel
