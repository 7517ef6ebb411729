// The native float32 CPU step of the RWKV architectures, RWKV-7 (x070,
// models/architectures/rwkv7.cc) and RWKV-4 (rwkv4.cc), for NativeStep (native_step.h), which
// validates the arguments and dispatches here: the embedding with ln0, and per block LN1,
// the token-shift mixes, the projections (and RWKV-7's LoRAs) as GEMMs over all the
// call's tokens, the recurrence in tight loops over the pool's rows in place (RWKV-7: the
// generalised delta rule per (session, head), then the per-head GroupNorm ln_x, the bonus
// and gate; RWKV-4: the α, β, p recurrence per session), then LN2 and the ReLU² channel
// mix (RWKV-4: gated by its receptance); ln_out and the head on each session's last
// token. The math is rwkv7.cc's and rwkv4.cc's header comments; every decay and state
// value is float32. Equal to Model::Step within float32 rounding
// (tests/unit/native_rwkv_test.cc).
//
// Every projection is cut into panels of output columns, and the panels of the products
// that share a stage are split over the threads by their multiply-adds (native_gemm.h).
//
// Weights exactly representable in 16 bits (real checkpoints ship in bf16 or f16 and the
// loader widens them) are kept in 16 bits only, per projection (every value must
// round-trip, PackedLinear::ExactFormat), halving what a batch-1 step reads; products
// still compute in float32 (packed_linear.h).
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
#include "models/kernels/native_weights.h"
#include "models/kernels/packed_linear.h"

namespace fwmodel {

class NativeRwkv {
 public:
  // FailedPrecondition unless the model is an rwkv7 or rwkv4 one computing in float32
  // on the CPU.
  // packed_gemm, narrow_weights: NativeStepOptions's.
  static absl::StatusOr<std::unique_ptr<NativeRwkv>> Create(const Model& model, bool packed_gemm,
                                                            bool narrow_weights = true);
  // Another instance over `other`'s weights (shared, immutable: no second copy), with
  // scratch of its own: the server's decode and prefill threads each hold one.
  static std::unique_ptr<NativeRwkv> SharingWeights(const NativeRwkv& other);

  // NativeStep::Absorb's contract, with its arguments already checked (CheckArguments)
  // and `threads` resolved (>= 1): rows[b] absorbs tokens[b * steps .. (b + 1) * steps)
  // in place in `pool`; logits [B, vocab] after each row's last token.
  // every_position: logits [B·steps, vocab], after each token (NativeStep::
  // AbsorbEveryPosition), instead of after each row's last.
  void Absorb(absl::Span<const int64_t> tokens, int64_t steps, absl::Span<const int64_t> rows,
              State* pool, int threads, float* logits, bool every_position = false);

  ~NativeRwkv();

  // The formats the projections (the head included) keep, in the order bf16, f16, f32,
  // joined by '+': "bf16", "bf16+f16", "f32"... A projection exact in both 16-bit
  // formats keeps bf16. weight_bits: 16 when every projection keeps 16 bits, else 32.
  std::string weight_format() const;
  int weight_bits() const;

  // A projection W [out, in] as panels (native_gemm.h).
  using Panels = native::Panels;

 private:
  struct Layer;
  // What the step multiplies and reads: built once, then shared by every instance made
  // with SharingWeights. Immutable after Create.
  struct Weights {
    std::vector<Layer> layers;
    std::vector<torch::Tensor> kept;  // contiguous views the raw pointers read
    NativeEmbedding emb;
    const float *ln0_w = nullptr, *ln0_b = nullptr, *ln_out_w = nullptr, *ln_out_b = nullptr;
    Panels head;
    WeightFormatCounts formats;  // of the projections
    ~Weights();
  };
  explicit NativeRwkv(const Model& model);

  const Model& model_;
  std::shared_ptr<const Weights> weights_;
  // Scratch for the largest call seen, [tokens, width] each (names as in rwkv7.cc; RWKV-4
  // uses r, k, v, g, y, mixed and ffn).
  std::vector<float> h_, x_, mixed_, r_, k_, v_, v_first_, lora_, w_, a_, vmix_, g_, y_, ffn_;
};

}  // namespace fwmodel
