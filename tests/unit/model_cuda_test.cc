// CUDA == CPU (issues 26, 38): for every architecture x ffn x dconv (PKM included) and
// RWKV-7 and RWKV-4 (fwtest::RwkvConfigCases), the
// sequence form's and the recurrent step's logits and log-probs on CUDA equal the CPU
// reference's in float32 with TF32 off, within 1e-4 relative to the logits' magnitude
// (1e-4 * (1 + max |logit|), as the form-equivalence tests compare states). Skipped
// where this LibTorch has no usable CUDA device (Debian's is CPU-only); run on a GPU
// machine by scripts/gpu/check.sh, which reports the largest differences printed here.
#include <gtest/gtest.h>

#include <ATen/Context.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "models/kernels/graphed_step.h"
#include "models/sampling/batch_sampler.h"
#include "models/sampling/sampler.h"
#include "tests/unit/test_models.h"

namespace {

using Case = fwtest::ConfigCase;

class CudaEquivalenceTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no usable CUDA device in this LibTorch build";
    }
    // Exact float32 products on both sides: no TF32 in cuBLAS or cuDNN.
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }

  // Compares logits [.., vocab] and their log-softmax; records the largest differences.
  void ExpectNear(const torch::Tensor& cpu, const torch::Tensor& cuda, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(cuda.device().is_cuda());
    torch::Tensor gpu = cuda.to(torch::kCPU);
    ASSERT_EQ(cpu.sizes(), gpu.sizes());
    ASSERT_TRUE(torch::isfinite(gpu).all().item<bool>());
    const double magnitude = 1.0 + cpu.abs().max().item<double>();
    const double logits = fwtest::MaxAbsDiff(cpu, gpu);
    const double logp = fwtest::MaxAbsDiff(torch::log_softmax(cpu.to(torch::kFloat64), -1),
                                           torch::log_softmax(gpu.to(torch::kFloat64), -1));
    EXPECT_LE(logits, kTolerance * magnitude);
    EXPECT_LE(logp, kTolerance * magnitude);
    max_logits_ = std::max(max_logits_, logits / magnitude);
    max_logp_ = std::max(max_logp_, logp / magnitude);
  }

  void TearDown() override {
    if (IsSkipped()) return;
    // One line per case for check.sh's report (grep "cuda-vs-cpu").
    std::printf("cuda-vs-cpu %s max_rel_logits=%.3g max_rel_logprobs=%.3g\n",
                GetParam().Name().c_str(), max_logits_, max_logp_);
    RecordProperty("max_rel_logits", std::to_string(max_logits_));
    RecordProperty("max_rel_logprobs", std::to_string(max_logp_));
  }

  static constexpr double kTolerance = 1e-4;
  double max_logits_ = 0, max_logp_ = 0;
};

TEST_P(CudaEquivalenceTest, SequenceAndRecurrentFormsEqualCpu) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  fwmodel::Model cpu = fwtest::RandomModel(config, 7, torch::kFloat32, 0.5, torch::kCPU);
  fwmodel::Model cuda = fwtest::RandomModel(config, 7, torch::kFloat32, 0.5, torch::kCUDA);
  const int64_t B = 3, T = 13;
  torch::Tensor tokens = fwtest::RandomTokens(B, T, config.vocab_size, 11);

  // Sequence form (prefill), then recurrent steps from the state it leaves.
  fwmodel::State cpu_state = cpu.InitialState(B), cuda_state = cuda.InitialState(B);
  auto cpu_seq = cpu.Forward(tokens, &cpu_state);
  auto cuda_seq = cuda.Forward(tokens, &cuda_state);
  ASSERT_TRUE(cpu_seq.ok()) << cpu_seq.status();
  ASSERT_TRUE(cuda_seq.ok()) << cuda_seq.status();
  ExpectNear(*cpu_seq, *cuda_seq, "sequence form");
  torch::Tensor next = fwtest::RandomTokens(B, 8, config.vocab_size, 12);
  for (int64_t t = 0; t < next.size(1); ++t) {
    auto a = cpu.Step(next.select(1, t).contiguous(), &cpu_state);
    auto b = cuda.Step(next.select(1, t).contiguous(), &cuda_state);
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectNear(*a, *b, "recurrent step after the sequence form");
  }

  // Recurrent form from fresh states.
  fwmodel::State cpu_fresh = cpu.InitialState(B), cuda_fresh = cuda.InitialState(B);
  for (int64_t t = 0; t < T; ++t) {
    auto a = cpu.Step(tokens.select(1, t).contiguous(), &cpu_fresh);
    auto b = cuda.Step(tokens.select(1, t).contiguous(), &cuda_fresh);
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectNear(*a, *b, "recurrent form");
  }
}

// ModelOptions::bf16_matrices on CUDA (RWKV-7 only; others skip): the bf16 model's
// sequence form and steps (1 and 20 rows: the grouped GEMV reading bf16, and torch::linear
// over widened matrices) equal the CPU float32 model over the bf16-rounded matrices.
TEST_P(CudaEquivalenceTest, Bf16MatricesEqualCpuOverRoundedMatrices) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  if (config.architecture != fwmodel::Architecture::kRwkv7) GTEST_SKIP() << "RWKV-7 only";
  std::map<std::string, torch::Tensor> weights =
      fwtest::RandomModel(config, 7, torch::kFloat32, 0.5, torch::kCPU).ExportWeights();
  std::map<std::string, torch::Tensor> rounded = weights;
  for (auto& [name, t] : rounded) {
    if (fwmodel::Bf16MatrixName(name)) t = t.to(torch::kBFloat16).to(torch::kFloat32);
  }
  auto cpu = fwmodel::Model::Create(config, rounded);
  fwmodel::ModelOptions options;
  options.device = torch::kCUDA;
  options.bf16_matrices = true;
  auto cuda = fwmodel::Model::Create(config, weights, options);
  ASSERT_TRUE(cpu.ok() && cuda.ok()) << cuda.status();
  for (const int64_t B : {int64_t{1}, int64_t{20}}) {
    torch::Tensor tokens = fwtest::RandomTokens(B, 5, config.vocab_size, 11);
    fwmodel::State cpu_state = cpu->InitialState(B), cuda_state = cuda->InitialState(B);
    auto a = cpu->Forward(tokens, &cpu_state);
    auto b = cuda->Forward(tokens, &cuda_state);
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectNear(*a, *b, "bf16 matrices: sequence form");
    for (int64_t t = 0; t < tokens.size(1); ++t) {
      auto x = cpu->Step(tokens.select(1, t).contiguous(), &cpu_state);
      auto y = cuda->Step(tokens.select(1, t).contiguous(), &cuda_state);
      ASSERT_TRUE(x.ok() && y.ok());
      ExpectNear(*x, *y, "bf16 matrices: recurrent step");
    }
  }
}

// The in-place graph step (models/kernels/graphed_step.h) on CUDA, captured with its sampling:
// six sessions in a device pool of nine rows plus the pad row, buckets {1, 2, 4}, ten
// steps of 1 to 6 rows with greedy and sampled draws. The pool's logits rows equal the
// CPU model's Model::Step within the tolerance, the states likewise, and each drawn
// token equals SampleToken's on the same (device) logits copied to the host, with the
// same generator: at most one draw may differ, where a uniform falls within float
// rounding of a boundary (exp on the GPU is not the host's).
TEST_P(CudaEquivalenceTest, InPlaceGraphStepWithSamplingEqualsCpu) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  fwmodel::Model cpu = fwtest::RandomModel(config, 7, torch::kFloat32, 0.5, torch::kCPU);
  fwmodel::Model cuda = fwtest::RandomModel(config, 7, torch::kFloat32, 0.5, torch::kCUDA);
  const int64_t capacity = 9, vocab = config.vocab_size;
  fwmodel::State pool = cuda.InitialState(capacity + 1);
  torch::Tensor pool_logits =
      torch::zeros({capacity + 1, vocab}, torch::dtype(torch::kFloat32).device(torch::kCUDA));
  fwmodel::GraphedStepOptions options;
  options.buckets = {1, 2, 4};
  auto step = fwmodel::GraphedStep::Create(cuda, options, {&pool, &pool_logits, capacity});
  ASSERT_TRUE(step.ok()) << step.status();
  std::printf("in-place graph step %s: captured=%d\n", GetParam().Name().c_str(),
              (*step)->captured() ? 1 : 0);
  const std::vector<int64_t> session_rows = {6, 0, 3, 8, 1, 2};
  std::vector<fwmodel::State> reference;
  std::vector<fwserve::SamplingParams> params(session_rows.size());
  std::vector<std::mt19937_64> rngs;
  std::vector<std::vector<int64_t>> recent(session_rows.size());
  for (size_t s = 0; s < session_rows.size(); ++s) {
    reference.push_back(cpu.InitialState(1));
    rngs.emplace_back(200 + s);
    params[s].temperature = s % 2 == 0 ? 0.0f : 0.9f;
    if (s == 3) params[s].top_k = 7;
    if (s == 5) params[s].repetition_penalty = 1.3f;
  }
  std::mt19937_64 pick(13);
  int mismatches = 0, draws_made = 0;
  for (int step_index = 0; step_index < 10; ++step_index) {
    const size_t count = static_cast<size_t>(step_index % 6) + 1;
    std::vector<size_t> chosen = {0, 1, 2, 3, 4, 5};
    std::shuffle(chosen.begin(), chosen.end(), pick);
    chosen.resize(count);
    std::vector<int64_t> tokens, rows;
    std::vector<fwserve::RowDraw> draws;
    for (size_t s : chosen) {
      tokens.push_back(static_cast<int64_t>(pick() % static_cast<uint64_t>(vocab)));
      rows.push_back(session_rows[s]);
      recent[s].push_back(tokens.back());
      fwserve::RowDraw d;
      d.params = &params[s];
      d.recent = &recent[s];
      std::mt19937_64 copy = rngs[s];
      if (params[s].temperature != 0) d.uniform = fwserve::CanonicalDraw(copy);
      draws.push_back(d);
    }
    auto sampled = (*step)->StepInPlace(tokens, rows, draws);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    const torch::Tensor device_logits = pool_logits.to(torch::kCPU);
    for (size_t i = 0; i < chosen.size(); ++i) {
      const size_t s = chosen[i];
      auto expected = cpu.Step(torch::tensor({tokens[i]}, torch::kInt64), &reference[s]);
      ASSERT_TRUE(expected.ok());
      const torch::Tensor row = device_logits[rows[i]].contiguous();
      ExpectNear(*expected, row.unsqueeze(0).to(torch::kCUDA), "in-place step logits");
      const int64_t token =
          fwserve::SampleToken(row.data_ptr<float>(), vocab, params[s], rngs[s], recent[s]);
      ++draws_made;
      if ((*sampled)[i].token != token) ++mismatches;
    }
  }
  EXPECT_LE(mismatches, 1) << "of " << draws_made << " draws";
  for (size_t s = 0; s < session_rows.size(); ++s) {
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      const torch::Tensor got = pool.tensors[t].narrow(0, session_rows[s], 1).to(torch::kCPU);
      const double magnitude = 1.0 + reference[s].tensors[t].abs().max().item<double>();
      EXPECT_LE(fwtest::MaxAbsDiff(reference[s].tensors[t], got), kTolerance * magnitude)
          << "state " << cpu.state_spec()[t].name << ", session " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, CudaEquivalenceTest,
                         testing::ValuesIn(fwtest::AllConfigCases()),
                         [](const testing::TestParamInfo<Case>& info) {
                           return info.param.Name();
                         });
// RWKV-7 (with heads of 64, the real models') and RWKV-4 (issue 38).
INSTANTIATE_TEST_SUITE_P(Rwkv, CudaEquivalenceTest, testing::ValuesIn(fwtest::RwkvConfigCases()),
                         fwtest::ConfigCaseName);
// DeltaNet and Gated DeltaNet (issue 49).
INSTANTIATE_TEST_SUITE_P(DeltaNet, CudaEquivalenceTest,
                         testing::ValuesIn(fwtest::DeltaNetConfigCases()), fwtest::ConfigCaseName);

}  // namespace
