// docs/serving.md, "Sampling": temperature in [0, 100], repetition_penalty in (0, 10],
// both limits inclusive and a value past them refused with INVALID_ARGUMENT naming the
// field; the penalty acts over the last `repetition_window` tokens (default 64) of the
// request's prompt and output. The window is checked against the model itself: every
// greedy token the server chose is the argmax of the model's logits penalised over the
// last 64 tokens, and not of the logits penalised over 63 or 65.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "client/client.h"
#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/tokenizers/tokenizer.h"
#include "tests/integration/harness.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;
using absl::StatusCode;

class SamplingLimitsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(MakeTempDir("sampling-model") + "/fast_weight");
    WriteTinyCheckpoint(*model_dir_, "fast_weight", 3);
  }
  static void TearDownTestSuite() { delete model_dir_; }

  static std::unique_ptr<Harness> Start() {
    fwserve::CoreOptions options;
    options.model_dirs = {*model_dir_};
    options.max_tokens = 1000;
    return Harness::Start(options);
  }

  static std::string* model_dir_;
};

std::string* SamplingLimitsTest::model_dir_ = nullptr;

TEST_F(SamplingLimitsTest, TemperatureAndPenaltyLimitsAreInclusiveAndPastThemRefused) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  struct Case {
    std::string field;
    std::function<void(v1::SamplingParams*, float)> set;
    float limit;
    float beyond;
  };
  const std::vector<Case> cases = {
      {"temperature", [](v1::SamplingParams* s, float v) { s->set_temperature(v); }, 100.0f,
       100.0001f},
      {"repetition_penalty", [](v1::SamplingParams* s, float v) { s->set_repetition_penalty(v); },
       10.0f, 10.0001f},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    ASSERT_GT(c.beyond, c.limit);  // 100.0001 and 10.0001 are distinct floats
    v1::GenerateRequest request;
    request.set_prompt("To be, or not");
    request.set_max_tokens(8);
    request.mutable_sampling()->set_seed(1);
    c.set(request.mutable_sampling(), c.limit);
    auto accepted = server->client().Generate(request);
    ASSERT_TRUE(accepted.ok()) << accepted.status();
    EXPECT_EQ(accepted->token_ids.size(), 8u);
    EXPECT_EQ(accepted->finish_reason, v1::FINISH_REASON_LENGTH);

    c.set(request.mutable_sampling(), c.beyond);
    auto refused = server->client().Generate(request);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find(c.field), std::string::npos) << refused.status();
  }
  // And the window's own limit.
  v1::GenerateRequest request = GreedyRequest("x", 2);
  request.mutable_sampling()->set_repetition_penalty(2);
  request.mutable_sampling()->set_repetition_window(4096);
  EXPECT_TRUE(server->client().Generate(request).ok());
  request.mutable_sampling()->set_repetition_window(4097);
  auto refused = server->client().Generate(request);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("repetition_window"), std::string::npos);
}

// The model's float32 logits after each token of `sequence` from a fresh state (the
// sequence form): row i follows token i. Empty after a failure (which it reports).
std::vector<std::vector<float>> LogitsAfterEachToken(const fwmodel::Model& model,
                                                     const std::vector<int64_t>& sequence) {
  c10::NoGradGuard no_grad;
  fwmodel::State state = model.InitialState(1);
  auto logits = model.Forward(torch::tensor(sequence, torch::kInt64).unsqueeze(0), &state);
  EXPECT_TRUE(logits.ok()) << logits.status();
  if (!logits.ok()) return {};
  const torch::Tensor rows = logits->squeeze(0).contiguous().to(torch::kFloat32);
  std::vector<std::vector<float>> table(static_cast<size_t>(rows.size(0)));
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const float* data = rows[i].data_ptr<float>();
    table[static_cast<size_t>(i)].assign(data, data + rows.size(1));
  }
  return table;
}

// How many of the generated `output` tokens (after `prompt`) are not the greedy choice
// of the model's logits with the repetition penalty applied over the last `window`
// tokens of prompt and output: a token counts when another one beats it by more than
// float noise (the server decodes step by step; the reference runs the sequence form).
int ChoicesNotExplainedByWindow(const std::vector<std::vector<float>>& logits,
                                const std::vector<int64_t>& sequence, size_t prompt_tokens,
                                float penalty, size_t window) {
  int unexplained = 0;
  for (size_t position = prompt_tokens; position < sequence.size(); ++position) {
    std::vector<float> row = logits[position - 1];
    std::set<int64_t> recent(
        sequence.begin() + static_cast<int64_t>(position - std::min(position, window)),
        sequence.begin() + static_cast<int64_t>(position));
    for (int64_t token : recent) {
      float& v = row[static_cast<size_t>(token)];
      v = v > 0 ? v / penalty : v * penalty;
    }
    const float best = *std::max_element(row.begin(), row.end());
    if (best - row[static_cast<size_t>(sequence[position])] > 1e-3f) ++unexplained;
  }
  return unexplained;
}

TEST_F(SamplingLimitsTest, TheRepetitionPenaltyLooksBackRepetitionWindowTokensDefault64) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  auto loaded = fwmodel::LoadCheckpoint(*model_dir_, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::string prompt = "The quality of mercy is not strained";
  const std::vector<int64_t> prompt_tokens = fwmodel::EncodeBytes(prompt);
  constexpr float kPenalty = 10.0f;

  // {window sent (0 = default), the window it must be, windows it must not be}
  struct Case {
    int32_t requested;
    size_t expected;
    std::vector<size_t> others;
  };
  for (const Case& c : {Case{0, 64, {63, 65}}, Case{8, 8, {7, 9, 64}}}) {
    SCOPED_TRACE(c.requested);
    v1::GenerateRequest request = GreedyRequest(prompt, 400);
    request.mutable_sampling()->set_repetition_penalty(kPenalty);
    request.mutable_sampling()->set_repetition_window(c.requested);
    auto generated = server->client().Generate(request);
    ASSERT_TRUE(generated.ok()) << generated.status();
    ASSERT_EQ(generated->token_ids.size(), 400u);

    std::vector<int64_t> sequence = prompt_tokens;
    sequence.insert(sequence.end(), generated->token_ids.begin(), generated->token_ids.end());
    const std::vector<std::vector<float>> table = LogitsAfterEachToken(loaded->model, sequence);
    ASSERT_EQ(table.size(), sequence.size());

    EXPECT_EQ(
        ChoicesNotExplainedByWindow(table, sequence, prompt_tokens.size(), kPenalty, c.expected),
        0);
    for (size_t other : c.others) {
      EXPECT_GT(ChoicesNotExplainedByWindow(table, sequence, prompt_tokens.size(), kPenalty, other),
                0)
          << "window " << other << " explains the output as well: the test cannot tell";
    }
  }
}

// OpenAI's presence and frequency penalties (issue 51), with a logit_bias beside them: every
// greedy token the server chose is the argmax of the model's logits with, for each token
// generated c times before it, c · frequency + (c > 0) · presence taken off, plus the bias;
// and the output differs from the unpenalised one. Values past [-2, 2] are refused.
TEST_F(SamplingLimitsTest, PresenceAndFrequencyPenaltiesFollowOpenAisRule) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  auto loaded = fwmodel::LoadCheckpoint(*model_dir_, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::string prompt = "The quality of mercy is not strained";
  const std::vector<int64_t> prompt_tokens = fwmodel::EncodeBytes(prompt);
  constexpr float kPresence = 0.7f, kFrequency = 1.3f;
  v1::GenerateRequest request = GreedyRequest(prompt, 120);
  request.mutable_sampling()->set_presence_penalty(kPresence);
  request.mutable_sampling()->set_frequency_penalty(kFrequency);
  (*request.mutable_sampling()->mutable_logit_bias())[' '] = 1.5f;
  auto generated = server->client().Generate(request);
  ASSERT_TRUE(generated.ok()) << generated.status();
  ASSERT_EQ(generated->token_ids.size(), 120u);
  auto plain = server->client().Generate(GreedyRequest(prompt, 120));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_NE(plain->token_ids, generated->token_ids);

  std::vector<int64_t> sequence = prompt_tokens;
  sequence.insert(sequence.end(), generated->token_ids.begin(), generated->token_ids.end());
  const std::vector<std::vector<float>> table = LogitsAfterEachToken(loaded->model, sequence);
  ASSERT_EQ(table.size(), sequence.size());
  std::map<int64_t, int> counts;
  for (size_t i = 0; i < generated->token_ids.size(); ++i) {
    std::vector<float> adjusted = table[prompt_tokens.size() + i - 1];
    for (const auto& [token, count] : counts) {
      adjusted[static_cast<size_t>(token)] -= static_cast<float>(count) * kFrequency + kPresence;
    }
    adjusted[' '] += 1.5f;
    const int64_t best = std::max_element(adjusted.begin(), adjusted.end()) - adjusted.begin();
    ASSERT_EQ(generated->token_ids[i], best) << "token " << i;
    ++counts[generated->token_ids[i]];
  }

  for (float bad : {2.5f, -2.01f}) {
    v1::GenerateRequest refused = GreedyRequest(prompt, 3);
    refused.mutable_sampling()->set_frequency_penalty(bad);
    auto r = server->client().Generate(refused);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("frequency_penalty"), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace fwtest
