// Next-token sampling from logits: temperature, top-k, top-p. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace fwserve {

struct SamplingParams {
  // 0 = greedy (argmax); otherwise logits are divided by it. Range [0, 100].
  float temperature = 1.0f;
  // Keep only the k most likely tokens; 0 = no limit.
  int32_t top_k = 0;
  // Keep the smallest set of most likely tokens whose probability reaches p; 1 = off.
  // Range (0, 1].
  float top_p = 1.0f;
  // Drop tokens whose probability is below min_p times the top token's; 0 = off.
  // Range [0, 1].
  float min_p = 0.0f;
  // Tokens in the recent window get positive logits divided by it and negative ones
  // multiplied by it (CTRL-style). 1 = off. Range (0, 10].
  float repetition_penalty = 1.0f;
  // OpenAI's logit_bias: (token id, value) pairs, ids ascending and distinct, each value in
  // [-100, 100], added to those tokens' logits after the repetition penalty and before the
  // temperature and the filters (so -100 all but bans a token and +100 all but forces it).
  // Ids must be inside the model's vocabulary (checked where the vocabulary is known: the
  // engine); the log-probabilities reported stay the model's own (TokenLogProb).
  std::vector<std::pair<int64_t, float>> logit_bias;
  // OpenAI's presence and frequency penalties, in [-2, 2] (0 = off): a token generated c
  // times so far in this stream has c · frequency_penalty + (c > 0) · presence_penalty
  // taken off its logit. The sampler does not read them: the engine folds them, with the
  // request's logit_bias, into the stream's logit_bias before each draw.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Seed of this stream's generator.
  uint64_t seed = 0;

  // Errors name the field and value. At most kMaxLogitBias entries of logit_bias.
  absl::Status Validate() const;
  // Whether the logits are changed by anything but the repetition penalty (logit_bias,
  // presence or frequency penalty): such a stream is sampled on the host's rules, one
  // token per launch.
  bool AdjustsLogits() const {
    return !logit_bias.empty() || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  static constexpr size_t kMaxLogitBias = 1024;
};

// Draws one token id from `logits[0..vocab)`. Deterministic for a given generator
// state. Ties in greedy mode go to the lowest id. Non-finite logits are treated as
// -inf; if every logit is -inf, returns the argmax of the raw values (id 0).
// `recent` (may be empty) are the tokens the repetition penalty applies to; then
// params.logit_bias is added (ids outside the vocabulary are skipped). `allowed` (null:
// every token; else vocab entries, not owned): a constraint's mask, applied last: a
// token whose entry is 0 is never drawn (its logit counts as -inf). The caller makes
// sure at least one token is allowed; if none is, the result is the argmax of the
// unmasked logits.
int64_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params,
                    std::mt19937_64& rng, const std::vector<int64_t>& recent = {},
                    const uint8_t* allowed = nullptr);

// values[i] = exp(values[i]) for i < n; exp(-inf) = 0. On a CPU with AVX2 and FMA, and
// where glibc's libmvec was found at build time, 4 at a time by libmvec (within 4 ulp
// of std::exp, about 5x faster); std::exp otherwise.
void ExpInPlace(double* values, size_t n);

// log softmax(logits)[token] at temperature 1, before any sampling filter: the model's
// own log-probability of `token`.
double TokenLogProb(const float* logits, int64_t vocab, int64_t token);

// OpenAI's top_logprobs: the `k` tokens with the largest raw logits (k clamped to
// [0, vocab]; ties to the lowest id), most likely first, each with its TokenLogProb.
// Non-finite logits are never listed.
std::vector<std::pair<int64_t, float>> TopLogProbs(const float* logits, int64_t vocab, int k);

}  // namespace fwserve
