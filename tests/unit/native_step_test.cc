// The native float32 CPU decode step equals Model::Step (the LibTorch reference) within
// 1e-5 on every configuration the form-equivalence tests cover, updating the pool's
// rows in place and leaving every other row alone.
#include "models/kernels/native_step.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/unit/test_models.h"

namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

constexpr double kTolerance = 1e-5;

// Every configuration of the form-equivalence tests.
class NativeStepTest : public testing::TestWithParam<fwtest::ConfigCase> {
 protected:
  void SetUp() override { config_ = GetParam().Config(); }
  fwmodel::ModelConfig config_;
};

// Six sessions in a pool of eight rows; each step a different subset of them, in a
// different order, absorbs a random token. Each session is mirrored by a batch-1
// LibTorch state stepped with Model::Step.
TEST_P(NativeStepTest, EqualsTheLibTorchStepRowByRowInPlace) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 7, torch::kFloat32);
  fwtest::ExpectNativeStepEqualsModelStepRowByRow(model, /*steps=*/14, kTolerance);
}

// Prefill: two sessions absorb nine tokens each in one Absorb call; the reference
// steps them one token at a time with Model::Step. Then one more decode Step.
TEST_P(NativeStepTest, AbsorbEqualsSteppingTokenByToken) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 5, torch::kFloat32);
  fwtest::ExpectAbsorbEqualsSteppingTokenByToken(model, kTolerance);
}

// Score on the kernel's prefill with every position's logits equals the sequence form.
TEST_P(NativeStepTest, ScoreEqualsTheSequenceForm) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 19, torch::kFloat32);
  fwtest::ExpectNativeScoreEqualsSequenceForm(model, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(AllConfigurations, NativeStepTest,
                         testing::ValuesIn(fwtest::AllConfigCases()), fwtest::ConfigCaseName);

// fast_weight's delta-rule kernel runs 8 features a vector plus a scalar tail: head width
// 6 gives d_phi 12 (nu 1: one vector and a tail) and 36 (nu 3: two pairs and a tail).
INSTANTIATE_TEST_SUITE_P(PartialVectors, NativeStepTest,
                         testing::Values(fwtest::ConfigCase{Architecture::kFastWeight,
                                                            FfnKind::kSquaredRelu, 3, 1, false, 12},
                                         fwtest::ConfigCase{Architecture::kFastWeight,
                                                            FfnKind::kRelu, 0, 3, false, 12}),
                         fwtest::ConfigCaseName);

// Splitting a call over threads (projections by rows, sessions over tasks) changes no
// result: 3 threads against 1 on the same pool, for a decode step of 70 sessions (two
// GEMM tasks, three session tasks) and a prefill of 3 sessions x 50 tokens (three GEMM
// tasks of 50 rows).
TEST(NativeStepThreadsTest, ThreeThreadsEqualOne) {
  c10::NoGradGuard no_grad;
  for (Architecture arch : {Architecture::kFastWeight, Architecture::kAft}) {
    fwmodel::ModelConfig config = fwtest::TinyConfig(arch, FfnKind::kSquaredRelu, 3);
    fwmodel::Model model = fwtest::RandomModel(config, 21, torch::kFloat32);
    fwtest::ExpectThreeThreadsEqualOne(model, /*sessions=*/70, /*capacity=*/80, {71, 75, 79},
                                       /*prompt_tokens=*/50, kTolerance,
                                       std::string(fwmodel::ArchitectureName(arch)) + ": ");
  }
  fwmodel::NativeStepOptions negative;
  negative.threads = -1;
  fwmodel::Model model = fwtest::RandomModel(
      fwtest::TinyConfig(Architecture::kAft, FfnKind::kRelu, 0), 1, torch::kFloat32);
  absl::Status refused = fwmodel::NativeStep::Create(model, negative).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("threads must be >= 0"), std::string::npos) << refused;
}

TEST(NativeStepInputTest, BadArgumentsAreRefusedAndChangeNothing) {
  c10::NoGradGuard no_grad;
  fwmodel::ModelConfig config =
      fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kSquaredRelu, 3);
  fwmodel::Model model = fwtest::RandomModel(config, 3, torch::kFloat32);
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok());
  fwmodel::State pool = model.InitialState(4);
  const fwmodel::State before = pool.Clone();
  std::vector<float> logits(2 * static_cast<size_t>(config.vocab_size));
  auto refused = [&](std::vector<int64_t> tokens, std::vector<int64_t> rows,
                     const std::string& message) {
    absl::Status s = (*native)->Step(tokens, rows, &pool, logits.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_NE(s.message().find(message), std::string::npos) << s.message();
  };
  refused({1, config.vocab_size}, {0, 1}, absl::StrCat("token id ", config.vocab_size));
  refused({1, -1}, {0, 1}, "token id -1");
  refused({1, 2}, {0, 4}, "row 4 is outside");
  refused({1, 2}, {2, 2}, "row 2 appears twice");
  refused({1, 2}, {0}, "differ in size");
  EXPECT_EQ((*native)->Absorb({1, 2, 3}, 2, {0, 1}, &pool, logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(pool.tensors[t], before.tensors[t]));
  }
  fwmodel::State wrong = model.InitialState(4);
  wrong.tensors[0] = wrong.tensors[0].to(torch::kFloat64);
  EXPECT_EQ((*native)->Step({1}, {0}, &wrong, logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  fwmodel::Model f64 = fwtest::RandomModel(config, 3, torch::kFloat64);
  EXPECT_EQ(fwmodel::NativeStep::Create(f64).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
