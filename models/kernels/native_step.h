// A native float32 CPU implementation of Model::Step, the contract's recurrent form,
// for serving: one GEMM per projection group over the whole batch (packed_linear.h), the
// per-token elementwise work (dconv, φ / DPFP, delta rule, AFT's WKV recurrence, layer
// norms, activations, product-key memory lookups) in tight loops over contiguous
// memory, and every session's state updated in place in a pool through a row index (no
// gather or scatter copies). Model::Step stays the reference, the trainer's, the
// sequence form's and the CUDA path; this equals it within float32 rounding
// (tests/unit/native_step_test.cc: 1e-5 on every configuration of the equivalence
// tests). RWKV-7 and RWKV-4 models go to their own kernel (native_rwkv.h), DeltaNet and
// Gated DeltaNet to theirs (native_delta_net.h), behind the same calls.
//
// Ownership: a NativeStep reads the Model's weight tensors in place (and owns a fused
// copy of the input projections); the Model must outlive it.
// Thread-safety: Step uses the object's scratch buffers; one thread at a time (the
// engine's loop owns one).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "models/architectures/model.h"
#include "models/kernels/packed_linear.h"

namespace fwmodel {

class NativeRwkv;      // models/kernels/native_rwkv.h
class NativeDeltaNet;  // models/kernels/native_delta_net.h

struct NativeStepOptions {
  // The projections' GEMMs on weights laid out once at load with libxsmm's JIT kernels
  // (models/kernels/packed_linear.h) where the build and CPU have them; false: OpenBLAS's
  // cblas_sgemm on every call (the server's --native-gemm openblas).
  bool packed_gemm = true;
  // Threads one Step or Absorb call may use (OpenMP workers beside the calling thread),
  // splitting the projections by rows and the per-session kernels by session; 0:
  // LibTorch's intra-op count (at::get_num_threads(), --threads) at each call. Each
  // instance's calls run one at a time, so two instances on two threads (the server's
  // engine and prefill threads) may be given different counts.
  int32_t threads = 0;
  // The RWKV and DeltaNet kernels keep a projection's weights in 16 bits (bf16 or
  // f16) when every value of it is exact in them, computing in float32 all the same;
  // false: float32 weights always (the A/B baseline). The other kernels keep float32.
  bool narrow_weights = true;
};

class NativeStep {
 public:
  // FailedPrecondition unless the model computes in float32 on the CPU.
  static absl::StatusOr<std::unique_ptr<NativeStep>> Create(const Model& model,
                                                            const NativeStepOptions& options = {});
  // Another instance for `other`'s model with `options` (its threads; packed_gemm is
  // other's): the RWKV kernel shares `other`'s laid-out weights (no second copy, which
  // is most of a real model's size), with scratch of its own; the other kernels copy
  // theirs, as Create does. `other` must outlive the new instance's use of them.
  static absl::StatusOr<std::unique_ptr<NativeStep>> CreateSharing(
      const NativeStep& other, const NativeStepOptions& options);

  // Row rows[b] of every tensor of `pool` (each [capacity, spec shape...], float32,
  // contiguous, on the CPU) absorbs tokens[b], in place; logits [B, vocab] row-major are
  // written to `logits` (B = tokens.size(), caller-allocated). Rows must be distinct and
  // inside the pool. Validates tokens, rows and the pool's layout (InvalidArgument,
  // nothing changed); never throws.
  absl::Status Step(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows, State* pool,
                    float* logits);
  // Prefill: row rows[b] absorbs `steps` tokens, tokens[b * steps .. (b + 1) * steps),
  // in order; logits [B, vocab] are those after each row's last token. Equal to `steps`
  // calls of Step, but every projection runs once over all B·steps tokens. Same
  // contract as Step otherwise.
  absl::Status Absorb(absl::Span<const int64_t> tokens, int64_t steps,
                      absl::Span<const int64_t> rows, State* pool, float* logits);
  // Absorb with the logits after every token, for scoring: logits [B·steps, vocab], row
  // b·steps + t after token t of row rows[b]. Same contract as Absorb otherwise.
  absl::Status AbsorbEveryPosition(absl::Span<const int64_t> tokens, int64_t steps,
                                   absl::Span<const int64_t> rows, State* pool, float* logits);

  ~NativeStep();

  // The formats the projections' weights are kept in (NativeRwkv::weight_format: "bf16",
  // "bf16+f16", "f32"...; always "f32" outside the RWKV kernel), and their bits (16 when
  // every projection keeps 16, else 32).
  std::string weight_format() const;
  int weight_bits() const;

 private:
  struct Layer;
  NativeStep(const Model& model, int32_t threads);
  // The threads this call may use (NativeStepOptions::threads resolved).
  int Threads() const;
  absl::Status AbsorbTokens(absl::Span<const int64_t> tokens, int64_t steps,
                            absl::Span<const int64_t> rows, State* pool, float* logits,
                            bool every_position);
  absl::Status CheckArguments(absl::Span<const int64_t> tokens, int64_t steps,
                              absl::Span<const int64_t> rows, const State& pool) const;
  // out [B, d] := the product-key memory FFN of x [B, d], its rows over `threads`.
  void PkmFfn(const Layer& layer, const float* x, int64_t B, int threads, float* out);

  const Model& model_;
  const int32_t threads_;  // NativeStepOptions::threads
  // The RWKV kernel, which serves every call when set (architectures rwkv7 and rwkv4);
  // the members below serve the contract's architectures.
  std::unique_ptr<NativeRwkv> rwkv_;
  // The DeltaNet kernel, likewise for delta_net and gated_deltanet.
  std::unique_ptr<NativeDeltaNet> delta_net_;
  std::vector<Layer> layers_;
  // Contiguous views of the model's weights that the raw pointers below read.
  std::vector<torch::Tensor> kept_;
  const float* embed_ = nullptr;
  const float* norm_f_w_ = nullptr;
  const float* norm_f_b_ = nullptr;
  PackedLinear head_;  // head.weight, or embed.weight when tied
  // PkmCandidatePairs(pkm_topk), computed once (empty without PKM blocks).
  std::vector<int64_t> pkm_pairs_;
  // Scratch, sized for the largest batch seen: residual stream, normalised input,
  // projections, mixer output, FFN hidden units, PKM queries and scores.
  std::vector<float> h_, x_, proj_, y_, hidden_, act_, pkm_query_, pkm_scores_;
};

}  // namespace fwmodel
