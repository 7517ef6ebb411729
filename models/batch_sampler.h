// Next-token sampling for a batch of rows on the logits' own device: the GPU path's
// sampler (models/graphed_step.h). The whole batch is sampled with tensor operations
// where the logits are, and the chosen tokens and their log-probabilities come back to
// the host in one small copy ([rows, 2] float64), not the [rows, vocab] logits.
//
// It draws what SampleToken (models/sampler.h) draws. Each row's random number comes
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

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "models/sampler.h"

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

}  // namespace fwserve
