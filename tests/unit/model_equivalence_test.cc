// Sequence form == recurrent form, and a span in pieces == the span whole, for every
// architecture x ffn x dconv (and nu in {1, 3} for fast_weight).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "tests/unit/test_models.h"

namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

using Case = fwtest::ConfigCase;

std::string CaseName(const testing::TestParamInfo<std::tuple<Case, bool>>& info) {
  return absl::StrCat(std::get<0>(info.param).Name(), std::get<1>(info.param) ? "_f64" : "_f32");
}

// Compares every state tensor by value, relative to its magnitude (sums over many
// tokens grow). The aft state (alpha, beta, p) means num = alpha·e^p and
// den = beta·e^p, and the two forms may choose different scales p; so compare
// what is scale-free: alpha/beta (the running weighted mean of v) and
// p + ln(beta) (ln den). Needs at least one absorbed token (beta > 0).
void ExpectStatesNearImpl(const fwmodel::Model& model, const fwmodel::State& a,
                          const fwmodel::State& b, double tolerance) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  ASSERT_EQ(a.tensors.size(), model.state_spec().size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const std::string& name = model.state_spec()[i].name;
    SCOPED_TRACE(name);
    ASSERT_EQ(a.tensors[i].sizes(), b.tensors[i].sizes());
    std::vector<std::pair<torch::Tensor, torch::Tensor>> compared;
    if (name.size() > 4 && name.substr(name.size() - 4) == ".wkv") {
      auto meaning = [](const torch::Tensor& packed) {
        torch::Tensor alpha = packed.select(1, 0), beta = packed.select(1, 1),
                      p = packed.select(1, 2);
        return std::make_pair(alpha / beta, p + torch::log(beta));
      };
      auto [mean_a, log_den_a] = meaning(a.tensors[i].to(torch::kFloat64));
      auto [mean_b, log_den_b] = meaning(b.tensors[i].to(torch::kFloat64));
      compared = {{mean_a, mean_b}, {log_den_a, log_den_b}};
    } else {
      compared = {{a.tensors[i], b.tensors[i]}};
    }
    for (const auto& [x, y] : compared) {
      const double magnitude = 1.0 + x.abs().max().item<double>();
      EXPECT_TRUE(torch::isfinite(x).all().item<bool>());
      EXPECT_LE(fwtest::MaxAbsDiff(x, y), tolerance * magnitude);
    }
  }
}

class FormEquivalenceTest : public testing::TestWithParam<std::tuple<Case, bool>> {
 protected:
  void SetUp() override {
    f64_ = std::get<1>(GetParam());
    config_ = std::get<0>(GetParam()).Config();
  }
  double tolerance() const { return f64_ ? 1e-9 : 1e-4; }
  torch::ScalarType dtype() const { return f64_ ? torch::kFloat64 : torch::kFloat32; }
  void ExpectStatesNear(const fwmodel::Model& model, const fwmodel::State& a,
                        const fwmodel::State& b) {
    ExpectStatesNearImpl(model, a, b, tolerance());
  }
  fwmodel::ModelConfig config_;
  bool f64_ = true;
};

TEST_P(FormEquivalenceTest, SequenceFormEqualsRecurrentSteps) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 7, dtype());
  const int64_t B = 3, T = 13;
  torch::Tensor tokens = fwtest::RandomTokens(B, T, config_.vocab_size, 11);

  fwmodel::State seq_state = model.InitialState(B);
  auto seq_logits = model.Forward(tokens, &seq_state);
  ASSERT_TRUE(seq_logits.ok()) << seq_logits.status();

  fwmodel::State step_state = model.InitialState(B);
  std::vector<torch::Tensor> step_logits;
  for (int64_t t = 0; t < T; ++t) {
    auto logits = model.Step(tokens.select(1, t).contiguous(), &step_state);
    ASSERT_TRUE(logits.ok()) << logits.status();
    step_logits.push_back(*logits);
  }
  torch::Tensor stepped = torch::stack(step_logits, 1);
  EXPECT_LE(fwtest::MaxAbsDiff(*seq_logits, stepped), tolerance());
  // Logits must actually vary: a constant network would pass trivially.
  EXPECT_GT(seq_logits->std().item<double>(), 1e-3);
  // The sequence form's final state is the recurrent steps' state.
  ExpectStatesNear(model, seq_state, step_state);

  // Both forms must leave the same state: the next token gives the same logits.
  torch::Tensor next = fwtest::RandomTokens(B, 1, config_.vocab_size, 12).squeeze(1);
  auto after_seq = model.Step(next, &seq_state);
  auto after_step = model.Step(next, &step_state);
  ASSERT_TRUE(after_seq.ok() && after_step.ok());
  EXPECT_LE(fwtest::MaxAbsDiff(*after_seq, *after_step), tolerance());
}

TEST_P(FormEquivalenceTest, PiecesWithCarriedStateEqualWholeSpan) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 8, dtype());
  const int64_t B = 2, T = 17;
  torch::Tensor tokens = fwtest::RandomTokens(B, T, config_.vocab_size, 21);

  fwmodel::State whole_state = model.InitialState(B);
  auto whole = model.Forward(tokens, &whole_state);
  ASSERT_TRUE(whole.ok());

  fwmodel::State piece_state = model.InitialState(B);
  std::vector<torch::Tensor> pieces;
  for (auto [start, len] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 6}, {7, 2}, {9, 8}}) {
    auto logits = model.Forward(tokens.narrow(1, start, len), &piece_state);
    ASSERT_TRUE(logits.ok());
    pieces.push_back(*logits);
  }
  EXPECT_LE(fwtest::MaxAbsDiff(*whole, torch::cat(pieces, 1)), tolerance());
  ExpectStatesNear(model, whole_state, piece_state);
  torch::Tensor next = fwtest::RandomTokens(B, 4, config_.vocab_size, 22);
  auto a = model.Forward(next, &whole_state);
  auto b = model.Forward(next, &piece_state);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LE(fwtest::MaxAbsDiff(*a, *b), tolerance());
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, FormEquivalenceTest,
                         testing::Combine(testing::ValuesIn(fwtest::AllConfigCases()),
                                          testing::Bool()),
                         CaseName);

// Model::Prefill (the server's GPU prefill) returns Forward's logits after the last token
// and leaves the same state, on every architecture: the contract's, RWKV and DeltaNet;
// and validates its input as Forward does.
TEST(PrefillTest, LastLogitsAndStateEqualForward) {
  c10::NoGradGuard no_grad;
  std::vector<Case> cases = fwtest::AllConfigCases();
  for (const auto& more : {fwtest::RwkvConfigCases(), fwtest::DeltaNetConfigCases()}) {
    cases.insert(cases.end(), more.begin(), more.end());
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.Name());
    const fwmodel::ModelConfig config = c.Config();
    fwmodel::Model model = fwtest::RandomModel(config, 31, torch::kFloat32);
    const int64_t B = 2, T = 9;
    torch::Tensor tokens = fwtest::RandomTokens(B, T, config.vocab_size, 32);
    fwmodel::State forward_state = model.InitialState(B);
    auto all = model.Forward(tokens, &forward_state);
    ASSERT_TRUE(all.ok()) << all.status();
    fwmodel::State prefill_state = model.InitialState(B);
    auto last = model.Prefill(tokens, &prefill_state);
    ASSERT_TRUE(last.ok()) << last.status();
    ASSERT_EQ(last->sizes(), (std::vector<int64_t>{B, config.vocab_size}));
    EXPECT_LE(fwtest::MaxAbsDiff(*last, all->select(1, T - 1)), 1e-5);
    EXPECT_GT(last->std().item<double>(), 1e-3);
    // The same ops before the head: the same state, bit for bit.
    ASSERT_EQ(prefill_state.tensors.size(), forward_state.tensors.size());
    for (size_t i = 0; i < prefill_state.tensors.size(); ++i) {
      EXPECT_TRUE(torch::equal(prefill_state.tensors[i], forward_state.tensors[i]))
          << model.state_spec()[i].name;
    }
  }
  fwmodel::Model model = fwtest::RandomModel(cases[0].Config(), 31, torch::kFloat32);
  fwmodel::State state = model.InitialState(1);
  torch::Tensor bad = torch::full({1, 3}, cases[0].Config().vocab_size, torch::kInt64);
  EXPECT_EQ(model.Prefill(bad, &state).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.Prefill(torch::zeros({2, 3}, torch::kInt64), &state).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The state comparison itself can fail: it accepts an aft state rescaled to another
// p (same meaning) and rejects a state whose running mean differs by 1e-3.
TEST(StateComparisonTest, AftStatesCompareByMeaning) {
  c10::NoGradGuard no_grad;
  auto config = fwtest::TinyConfig(Architecture::kAft, FfnKind::kRelu, 3);
  fwmodel::Model model = fwtest::RandomModel(config, 5, torch::kFloat64);
  fwmodel::State s = model.InitialState(2);
  ASSERT_TRUE(model.Forward(fwtest::RandomTokens(2, 9, 256, 1), &s).ok());
  ASSERT_EQ(model.state_spec()[0].name, "blocks.0.wkv");
  fwmodel::State rescaled = s.Clone();
  rescaled.tensors[0].select(1, 0).mul_(std::exp(2.0));
  rescaled.tensors[0].select(1, 1).mul_(std::exp(2.0));
  rescaled.tensors[0].select(1, 2).sub_(2.0);
  ExpectStatesNearImpl(model, s, rescaled, 1e-9);
  fwmodel::State moved = s.Clone();
  moved.tensors[0].select(1, 0)[0][3] += 1e-3 * moved.tensors[0].select(1, 1)[0][3];
  EXPECT_NONFATAL_FAILURE(ExpectStatesNearImpl(model, s, moved, 1e-9), "MaxAbsDiff");
  fwmodel::State conv_moved = s.Clone();
  conv_moved.tensors[1][1][0][0][0] += 1e-3;
  EXPECT_NONFATAL_FAILURE(ExpectStatesNearImpl(model, s, conv_moved, 1e-9), "MaxAbsDiff");
}

// Sessions at different positions stepped together equal each stepped alone.
TEST(BatchedStepTest, BatchOfSessionsAtDifferentPositionsEqualsEachAlone) {
  c10::NoGradGuard no_grad;
  for (auto [arch, pkm] :
       std::vector<std::pair<Architecture, bool>>{{Architecture::kLinearAttention, false},
                                                  {Architecture::kFastWeight, false},
                                                  {Architecture::kAft, false},
                                                  {Architecture::kAft, true}}) {
    SCOPED_TRACE(absl::StrCat(fwmodel::ArchitectureName(arch), pkm ? " pkm" : ""));
    auto config = fwtest::TinyConfig(arch, FfnKind::kGeglu, 4, 2);
    if (pkm) config = fwtest::WithPkm(config, 0);
    fwmodel::Model model = fwtest::RandomModel(config, 31, torch::kFloat64);
    // Three sessions with histories of 0, 3 and 9 tokens.
    std::vector<fwmodel::State> alone;
    std::vector<int64_t> lengths = {0, 3, 9};
    for (size_t i = 0; i < lengths.size(); ++i) {
      fwmodel::State s = model.InitialState(1);
      if (lengths[i] > 0) {
        ASSERT_TRUE(model.Forward(fwtest::RandomTokens(1, lengths[i], 256, 40 + i), &s).ok());
      }
      alone.push_back(s);
    }
    // Pool them into one batch (in a different row order) and step twice.
    fwmodel::State pool = model.InitialState(3);
    const std::vector<int64_t> rows = {2, 0, 1};
    for (size_t i = 0; i < alone.size(); ++i) {
      pool.Scatter(torch::tensor({rows[i]}, torch::kInt64), alone[i]);
    }
    for (int step = 0; step < 2; ++step) {
      torch::Tensor tokens = fwtest::RandomTokens(1, 3, 256, 50 + step).squeeze(0);
      // Row rows[i] of the batch carries session i's token.
      torch::Tensor batch_tokens = torch::zeros({3}, torch::kInt64);
      batch_tokens.index_copy_(0, torch::tensor(rows), tokens);
      auto batched = model.Step(batch_tokens, &pool);
      ASSERT_TRUE(batched.ok());
      for (size_t i = 0; i < alone.size(); ++i) {
        auto single =
            model.Step(tokens.narrow(0, static_cast<int64_t>(i), 1).contiguous(), &alone[i]);
        ASSERT_TRUE(single.ok());
        EXPECT_LE(fwtest::MaxAbsDiff((*batched)[rows[i]], (*single)[0]), 1e-12);
      }
    }
  }
}

// State size depends on the config alone, and the state is a value: a clone evolves
// independently (fork).
TEST(StateTest, SizeIsFixedAndCloneIsIndependent) {
  c10::NoGradGuard no_grad;
  auto config = fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kRelu, 3, 1);
  fwmodel::Model model = fwtest::RandomModel(config, 5, torch::kFloat32);
  fwmodel::State s = model.InitialState(1);
  std::vector<std::vector<int64_t>> before;
  for (auto& t : s.tensors) before.push_back(t.sizes().vec());
  ASSERT_TRUE(model.Forward(fwtest::RandomTokens(1, 50, 256, 1), &s).ok());
  for (size_t i = 0; i < s.tensors.size(); ++i) EXPECT_EQ(s.tensors[i].sizes().vec(), before[i]);
  // 2 layers x (W [2, 8, 16] + conv [3, 2, 16]) floats.
  EXPECT_EQ(model.state_bytes_per_session(), 2 * (2 * 8 * 16 + 3 * 2 * 16) * 4);

  fwmodel::State fork = s.Clone();
  torch::Tensor token = torch::tensor({65}, torch::kInt64);
  auto a = model.Step(token, &s);
  auto b = model.Step(token, &fork);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(fwtest::MaxAbsDiff(*a, *b), 0.0);
  ASSERT_TRUE(model.Step(torch::tensor({66}, torch::kInt64), &s).ok());
  EXPECT_GT(fwtest::MaxAbsDiff(s.tensors[0], fork.tensors[0]), 0.0);
}

TEST(ModelInputTest, BadTokensAndStatesAreRejected) {
  auto config = fwtest::TinyConfig(Architecture::kAft, FfnKind::kRelu, 0);
  fwmodel::Model model = fwtest::RandomModel(config, 5, torch::kFloat32);
  fwmodel::State s = model.InitialState(1);
  auto out_of_range = model.Step(torch::tensor({256}, torch::kInt64), &s);
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_range.status().message().find("256"), std::string::npos);
  fwmodel::State wrong_batch = model.InitialState(2);
  EXPECT_FALSE(model.Step(torch::tensor({1}, torch::kInt64), &wrong_batch).ok());
  EXPECT_FALSE(model.Forward(torch::tensor({1, 2}, torch::kInt64), &s).ok());  // rank 1
}

}  // namespace
