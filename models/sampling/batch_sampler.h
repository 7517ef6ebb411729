// Next-token sampling for a batch of rows on the logits' own device: the GPU path's
// sampler (models/kernels/graphed_step.h). The whole batch is sampled with tensor operations
// where the logits are, and the chosen tokens and their log-probabilities come back to
// the host in one small copy ([rows, 2] float64), not the [rows, vocab] logits.
//
// It draws what SampleToken (models/sampling/sampler.h) draws. Each row's random number comes
// from its own stream's generator, on the host, consumed exactly as SampleToken consumes
// it (one CanonicalDraw per row that is not greedy). So a seeded stream gets the same
// tokens from either sampler. On the CPU, the results are equal to SampleToken's,
// except when a draw falls within float rounding of a boundary between two tokens
// (tests/unit/batch_sampler_test.cc: thousands of draws, every row's token equal).
// One difference in rng use: a row whose logits are all non-finite consumes a draw
// here, but not in SampleToken.
//
// Thread-safety: a pure function of its arguments.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "models/sampling/sampler.h"

namespace fwserve {

// One row to sample.
struct RowDraw {
  // The row of the logits to sample from; -1: the draw's own position.
  int64_t row = -1;
  const SamplingParams* params = nullptr;  // not owned; outlives the call
  // CanonicalDraw(rng) of the row's stream when params->temperature != 0; else unused.
  double uniform = 0;
  // The tokens the repetition penalty applies to (may be empty); not owned.
  const std::vector<int64_t>* recent = nullptr;
  // A constraint's mask (vocab entries, 0 = never drawn) or null; not owned. As
  // SampleToken's `allowed`. A captured step never samples such a row (GraphedStep::
  // CanSampleInStep): SampleRows uploads the masks with the draw's parameters.
  const uint8_t* allowed = nullptr;
};

struct SampledToken {
  int64_t token = 0;
  // TokenLogProb of the raw logits (temperature 1, no filter), as a float.
  float logprob = 0;
};

// The number SampleToken scales to its probability mass: [0, 1), consuming `rng` as
// std::uniform_real_distribution<double> does.
double CanonicalDraw(std::mt19937_64& rng);

// Samples, for each draw, its row of `logits` ([rows, vocab], float32, any device).
// Returns one SampledToken per draw, in order. The draws' parameters go to the device in
// one copy (a second one when a repetition penalty applies), the results come back in
// one. InvalidArgument when a draw has no params or its row is outside `logits`, or when
// draws without a row are not one per row of `logits`. LibTorch errors become
// Internal. Never throws.
absl::StatusOr<std::vector<SampledToken>> SampleRows(const torch::Tensor& logits,
                                                     absl::Span<const RowDraw> draws);

// The parts of SampleRows, for a caller that keeps the parameters in buffers of its own
// (fwmodel::GraphedStep samples inside its CUDA Graph).
//
// The parameter columns of a draw, [kSampleColumns, rows] float64, row-major.
enum SampleColumn {
  kSampleTemperature,
  kSampleTopK,  // k, or vocab when off
  kSampleTopP,
  kSampleMinP,
  kSampleUniform,
  kSampleRow,  // the logits row (SampleRows only)
  kSampleColumns
};
// The widest repetition-penalty set among `draws` (0: no penalty applies).
int64_t PenaltyWidth(absl::Span<const RowDraw> draws);
// Writes `draws`' parameters: columns [kSampleColumns * rows], and, when penalty_width > 0,
// penalty_index [rows * penalty_width] (the penalised token ids, padded with repeats;
// 0 where no penalty applies) and penalty_factor [rows] (1 where none applies). False
// when a draw's penalty set is wider than penalty_width (its buffers are then partly
// written). Every draw must have params.
bool PackDraws(absl::Span<const RowDraw> draws, int64_t vocab, int64_t penalty_width,
               double* columns, int64_t* penalty_index, double* penalty_factor);
// Whether a row drawn with `params` over `vocab` tokens needs the ranked filters (top_k
// below the vocabulary, top_p below 1 or min_p above 0); without them SampleOnDevice's
// `filters` may be false with the same result.
bool NeedsFilters(const SamplingParams& params, int64_t vocab);
// Samples every row of `raw_logits` ([rows, vocab], any float dtype) with its parameters:
// columns [kSampleColumns, rows] float64, penalty_index [rows, W] int64 and penalty_factor
// [rows, 1] float64 (both undefined, or W = 0: no penalty), all on the logits' device.
// Returns [rows, 2] float64 (token, logprob) there. Only device work: no host
// synchronisation and no host-to-device copy, so it can be captured in a CUDA Graph.
// filters false: no row needs top_k, top_p or min_p (NeedsFilters), and the sort over the
// vocabulary and the ranked filters are left out (the same draws, much less device work:
// a stable float64 sort of every row). bias_index [rows, B] int64 and bias_value [rows, B]
// float32 (both undefined: none): each row's logit_bias, padded with (0, 0), added after
// the repetition penalty as SampleToken adds it. allowed [rows, vocab] bool (undefined:
// none): a constraint's mask, false = never drawn, applied after the bias. On CUDA
// float32 logits, where the CUDA kernels are built, the whole draw is the sampling
// kernel's (models/gpu/sample.h: one launch, or, with filters false and no mask, four
// over many blocks for fewer than 64 rows), with the same draws. Throws c10::Error.
torch::Tensor SampleOnDevice(const torch::Tensor& raw_logits, const torch::Tensor& columns,
                             const torch::Tensor& penalty_index,
                             const torch::Tensor& penalty_factor, bool filters = true,
                             const torch::Tensor& bias_index = {},
                             const torch::Tensor& bias_value = {},
                             const torch::Tensor& allowed = {});

}  // namespace fwserve
