// The contract's blocks on their kernel path (model.cc's KernelPathApplies: on a GPU the
// fused kernels, here their CPU mirrors under SetModelHostKernelsForTesting): the
// mixer's three input projections as one grouped GEMV launch, the causal depthwise
// convolution of all three as one launch (models/gpu/depthwise_conv.h), the output product
// with the residual, the FFN's up product with relu² and its down product with the
// residual, and the head. For every architecture × FFN × dconv × PKM configuration in
// float32, the sequence form (B·T within the GEMV's 16 rows and past them: the
// convolution kernel alone) and the steps after it give the LibTorch path's logits and
// states within 1e-4; the kernel path ran (other bits where the GEMV ran). And the
// convolution's mirror against CausalDepthwiseConv's arithmetic, with its refusals.
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/gpu/depthwise_conv.h"
#include "models/gpu/depthwise_conv_host.h"
#include "tests/unit/test_models.h"

namespace fwmodel {
void SetModelHostKernelsForTesting(bool on);  // model.cc
}  // namespace fwmodel

namespace {

constexpr double kKernelPathTolerance = 1e-4;

class ModelKernelPathTest
    : public testing::TestWithParam<std::tuple<fwtest::ConfigCase, int64_t, int64_t>> {
 protected:
  void TearDown() override { fwmodel::SetModelHostKernelsForTesting(false); }
};

TEST_P(ModelKernelPathTest, EqualsLibTorchPath) {
  c10::NoGradGuard no_grad;
  const auto [config_case, B, T] = GetParam();
  const fwmodel::ModelConfig config = config_case.Config();
  const fwmodel::Model model = fwtest::RandomModel(config, 3, torch::kFloat32, 0.5);
  const torch::Tensor tokens = fwtest::RandomTokens(B, T, config.vocab_size, 5);
  const torch::Tensor next = fwtest::RandomTokens(B, 3, config.vocab_size, 6);

  torch::Tensor logits[2], steps[2];
  fwmodel::State states[2];
  for (int kernels = 0; kernels < 2; ++kernels) {
    fwmodel::SetModelHostKernelsForTesting(kernels == 1);
    states[kernels] = model.InitialState(B);
    auto forward = model.Forward(tokens, &states[kernels]);
    ASSERT_TRUE(forward.ok()) << forward.status();
    logits[kernels] = *forward;
    std::vector<torch::Tensor> stepped;
    for (int64_t t = 0; t < next.size(1); ++t) {
      auto step = model.Step(next.select(1, t).contiguous(), &states[kernels]);
      ASSERT_TRUE(step.ok()) << step.status();
      stepped.push_back(*step);
    }
    steps[kernels] = torch::stack(stepped, 1);
  }
  fwmodel::SetModelHostKernelsForTesting(false);
  fwtest::ExpectNearRelative(logits[1], logits[0], kKernelPathTolerance, "sequence form");
  fwtest::ExpectNearRelative(steps[1], steps[0], kKernelPathTolerance, "steps after it");
  for (size_t i = 0; i < states[0].tensors.size(); ++i) {
    fwtest::ExpectNearRelative(states[1].tensors[i], states[0].tensors[i], kTolerance,
                               model.state_spec()[i].name);
  }
  // The steps (B rows) always take the GEMV: its sums in another order give other bits.
  EXPECT_FALSE(torch::equal(steps[1], steps[0])) << "the kernel path did not run";
  if (B * T > 16 && !config.has_dconv()) {
    EXPECT_TRUE(torch::equal(logits[1], logits[0])) << "past 16 rows LibTorch runs";
  }
}

std::vector<fwtest::ConfigCase> ContractCases() {
  std::vector<fwtest::ConfigCase> cases;
  for (const fwtest::ConfigCase& c : fwtest::AllConfigCases()) {
    if (!c.Config().has_whole_blocks()) cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Contract, ModelKernelPathTest,
    testing::Combine(testing::ValuesIn(ContractCases()), testing::Values(int64_t{1}, int64_t{3}),
                     testing::Values(int64_t{5}, int64_t{9})),
    [](const testing::TestParamInfo<std::tuple<fwtest::ConfigCase, int64_t, int64_t>>& info) {
      return absl::StrCat(std::get<0>(info.param).Name(), "_B", std::get<1>(info.param), "_T",
                          std::get<2>(info.param));
    });

// The convolution's mirror: y = bias + Σ w_j · x'_j in order, over random inputs and a
// random state for K = 2, 3, 4 and 7 (a width off the compiled ones), in place and not,
// against the same sums in float64 (within 1e-5), with the state the last K − 1 inputs.
TEST(DepthwiseConvTest, MirrorComputesTheCausalConvolution) {
  for (const int K : {2, 3, 4, 7}) {
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(absl::StrCat("K = ", K, in_place ? " in place" : ""));
      const int64_t B = 2, T = 5, d = 6;
      torch::manual_seed(K);
      torch::Tensor x = torch::randn({3, B, T, d});
      torch::Tensor w = torch::randn({3, d, K});
      torch::Tensor bias = torch::randn({3, d});
      torch::Tensor state = torch::randn({B, 3, K - 1, d});
      torch::Tensor y = in_place ? x.clone() : torch::empty_like(x);
      torch::Tensor state_out = in_place ? state.clone() : torch::empty_like(state);
      fwmodel::kernels::DepthwiseConvArgs args;
      args.B = B;
      args.T = T;
      args.d = d;
      args.K = K;
      for (int p = 0; p < 3; ++p) {
        args.x[p] = (in_place ? y : x)[p].data_ptr<float>();
        args.y[p] = y[p].data_ptr<float>();
        args.weight[p] = w[p].data_ptr<float>();
        args.bias[p] = bias[p].data_ptr<float>();
      }
      args.state_in = (in_place ? state_out : state).data_ptr<float>();
      args.state_out = state_out.data_ptr<float>();
      ASSERT_TRUE(fwmodel::kernels::RunDepthwiseConvOnHost(args));
      for (int p = 0; p < 3; ++p) {
        // [B, K − 1 + T, d]: the state's inputs, then the tokens'.
        torch::Tensor padded = torch::cat({state.select(1, p), x[p]}, 1).to(torch::kFloat64);
        torch::Tensor expected = bias[p].to(torch::kFloat64).expand({B, T, d}).clone();
        for (int j = 0; j < K; ++j) {
          expected += w[p].select(1, j).to(torch::kFloat64) * padded.narrow(1, j, T);
        }
        EXPECT_LE(fwtest::MaxAbsDiff(y[p].to(torch::kFloat64), expected), 1e-5) << p;
        EXPECT_TRUE(
            torch::equal(state_out.select(1, p), padded.narrow(1, T, K - 1).to(torch::kFloat32)))
            << p;
      }
    }
  }
  fwmodel::kernels::DepthwiseConvArgs bad;
  bad.B = 1;
  bad.T = 1;
  bad.d = 4;
  bad.K = 1;
  EXPECT_FALSE(fwmodel::kernels::DepthwiseConvArgsValid(bad));
  bad.K = fwmodel::kernels::kDepthwiseConvMaxTaps + 1;
  EXPECT_FALSE(fwmodel::kernels::DepthwiseConvArgsValid(bad));
  bad.K = 4;
  EXPECT_FALSE(fwmodel::kernels::DepthwiseConvArgsValid(bad));  // no pointers
  EXPECT_FALSE(fwmodel::kernels::RunDepthwiseConvOnHost(bad));
}

}  // namespace
