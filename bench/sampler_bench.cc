// SampleToken (models/sampling/sampler.h) over one row of logits, the engine's per-token host work
// on the CPU (a sixth of the served RWKV-7 0.1B's time at 16 streams before it was
// reworked: docs/benchmarks.md). Torch-free.
//   BM_SampleToken/V/mode  one draw over V logits, normal(0, 3) as a peaked model's;
//                          mode 0 greedy, 1 temperature 1, 2 top_p 0.9, 3 top_k 40,
//                          4 repetition penalty 1.2 over 64 recent tokens.
//   BM_TokenLogProb/V      the log-probability of one token (requests with logprobs).
// The reference for speed-ups is the previous build's binary on the same machine, in
// interleaved rounds.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "models/sampling/sampler.h"

namespace {

// normal(0, 3) logits, as a peaked model's.
std::vector<float> RandomLogits(int64_t vocab) {
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::mt19937_64 fill(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : logits) v = normal(fill);
  return logits;
}

void BM_SampleToken(benchmark::State& state) {
  const int64_t vocab = state.range(0);
  const std::vector<float> logits = RandomLogits(vocab);
  fwserve::SamplingParams params;
  std::vector<int64_t> recent;
  switch (state.range(1)) {
    case 0:
      params.temperature = 0;
      break;
    case 2:
      params.top_p = 0.9f;
      break;
    case 3:
      params.top_k = 40;
      break;
    case 4:
      params.repetition_penalty = 1.2f;
      for (int64_t i = 0; i < 64; ++i) recent.push_back((i * 977) % vocab);
      break;
    default:
      break;
  }
  std::mt19937_64 rng(1);
  int64_t sum = 0;
  for (auto _ : state) {
    sum += fwserve::SampleToken(logits.data(), vocab, params, rng, recent);
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SampleToken)->ArgsProduct({{65536}, {0, 1, 2, 3, 4}})->Unit(benchmark::kMicrosecond);

// TokenLogProb: the log-probability a request with logprobs gets for each token.
void BM_TokenLogProb(benchmark::State& state) {
  const int64_t vocab = state.range(0);
  const std::vector<float> logits = RandomLogits(vocab);
  double sum = 0;
  int64_t token = 0;
  for (auto _ : state) {
    sum += fwserve::TokenLogProb(logits.data(), vocab, token);
    token = (token + 7919) % vocab;
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_TokenLogProb)->Arg(65536)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
