// CUDA == CPU (issue 26): for every architecture x ffn x dconv (PKM included), the
// sequence form's and the recurrent step's logits and log-probs on CUDA equal the CPU
// reference's in float32 with TF32 off, within 1e-4 relative to the logits' magnitude
// (1e-4 * (1 + max |logit|), as the form-equivalence tests compare states). Skipped
// where this LibTorch has no usable CUDA device (Debian's is CPU-only); run on a GPU
// machine by scripts/gpu/check.sh, which reports the largest differences printed here.
#include <gtest/gtest.h>

#include <ATen/Context.h>

#include <algorithm>
#include <cstdio>
#include <vector>

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
    const double logp =
        fwtest::MaxAbsDiff(torch::log_softmax(cpu.to(torch::kFloat64), -1),
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
  torch::NoGradGuard no_grad;
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

INSTANTIATE_TEST_SUITE_P(AllArchitectures, CudaEquivalenceTest,
                         testing::ValuesIn(fwtest::AllConfigCases()),
                         [](const testing::TestParamInfo<Case>& info) {
                           return info.param.Name();
                         });

}  // namespace
