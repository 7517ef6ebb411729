// fwserve serving DeltaNet and Gated DeltaNet (issue 49), random tiny byte-vocabulary
// models written by the model library, through the real client and HTTP: the greedy
// tokens and their log-probs equal the model library's own steps, Score equals its
// sequence form, a session continues the same after a fork and after an export and
// import (and as a fresh prompt of the same text), and a chat completion answers over
// HTTP.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "client/client.h"
#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/tokenizers/text_tokenizer.h"
#include "tests/integration/harness.h"
#include "tests/integration/http_client.h"
#include "tests/unit/temp_dir.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;

// A tiny model of `architecture` (bytes vocabulary), written to a new directory.
std::string WriteTinyModel(fwmodel::Architecture architecture,
                           std::optional<fwmodel::Model>* out) {
  fwmodel::ModelConfig c;
  c.architecture = architecture;
  c.ffn = fwmodel::FfnKind::kSwiglu;
  c.vocab_size = 256;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.head_k_dim = 8;
  c.head_v_dim = 8;
  c.d_ff = 48;
  if (architecture == fwmodel::Architecture::kGatedDeltaNet) {
    c.num_v_heads = 4;  // two value heads per q/k head
    c.use_gate = true;
  }
  auto model = fwmodel::Model::InitRandom(c, 23, {});
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return "";
  const std::string dir = MakeTempDir("delta-net");
  EXPECT_TRUE(fwmodel::SaveCheckpoint(*model, dir, fwmodel::DType::kF32).ok());
  out->emplace(std::move(*model));
  return dir;
}

class DeltaNetServingTest : public ::testing::TestWithParam<fwmodel::Architecture> {
 protected:
  void SetUp() override {
    dir_ = WriteTinyModel(GetParam(), &model_);
    ASSERT_FALSE(dir_.empty());
    fwserve::CoreOptions options;
    options.model_dirs = {dir_};
    server_ = Harness::Start(options, {}, false, fwserve::HttpServerOptions{});
    ASSERT_NE(server_, nullptr);
  }

  // The model library's greedy continuation of `prompt` (bytes): ids and log-probs.
  std::pair<std::vector<int64_t>, std::vector<double>> LibraryGreedy(const std::string& prompt,
                                                                    int tokens) const {
    c10::NoGradGuard no_grad;
    fwmodel::State state = model_->InitialState(1);
    std::vector<int64_t> ids(prompt.begin(), prompt.end());
    auto logits = model_->Forward(torch::tensor(ids, torch::kInt64).view({1, -1}), &state);
    EXPECT_TRUE(logits.ok()) << logits.status();
    torch::Tensor last = (*logits)[0][-1];
    std::vector<int64_t> out;
    std::vector<double> logprobs;
    for (int i = 0; i < tokens; ++i) {
      const torch::Tensor lp = torch::log_softmax(last.to(torch::kFloat64), -1);
      const int64_t next = lp.argmax().item<int64_t>();
      out.push_back(next);
      logprobs.push_back(lp[next].item<double>());
      auto step = model_->Step(torch::tensor({next}, torch::kInt64), &state);
      EXPECT_TRUE(step.ok()) << step.status();
      last = (*step)[0];
    }
    return {out, logprobs};
  }

  std::string dir_;
  std::optional<fwmodel::Model> model_;
  std::unique_ptr<Harness> server_;
};

TEST_P(DeltaNetServingTest, GreedyTokensAndScoreEqualTheModelLibrary) {
  v1::GenerateRequest request = GreedyRequest("To be, or not", 16);
  request.set_logprobs(true);
  auto result = server_->client().Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  const auto [ids, logprobs] = LibraryGreedy("To be, or not", 16);
  EXPECT_EQ(result->token_ids, ids);
  ASSERT_EQ(result->logprobs.size(), logprobs.size());
  for (size_t i = 0; i < logprobs.size(); ++i) {
    EXPECT_NEAR(result->logprobs[i], logprobs[i], 1e-4) << "token " << i;
  }
  const std::string text = "Now is the winter of our discontent";
  v1::ScoreRequest score;
  score.set_text(text);
  auto scored = server_->client().Score(score);
  ASSERT_TRUE(scored.ok()) << scored.status();
  c10::NoGradGuard no_grad;
  fwmodel::State state = model_->InitialState(1);
  std::vector<int64_t> tokens(text.begin(), text.end());
  auto logits = model_->Forward(torch::tensor(tokens, torch::kInt64).view({1, -1}), &state);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const torch::Tensor lp = torch::log_softmax((*logits)[0].to(torch::kFloat64), -1);
  ASSERT_EQ(scored->logprobs_size(), static_cast<int>(tokens.size()) - 1);
  for (size_t i = 1; i < tokens.size(); ++i) {
    EXPECT_NEAR(scored->logprobs(static_cast<int>(i) - 1),
                lp[static_cast<int64_t>(i) - 1][tokens[i]].item<double>(), 1e-4)
        << "token " << i;
  }
}

TEST_P(DeltaNetServingTest, SessionContinuesTheSameAfterForkAndAfterExportImport) {
  auto& client = server_->client();
  const std::string session =
      ExpectSessionContinuesTheSameAfterForkAndExportImport(client, "The king said: ", 20);
  ASSERT_FALSE(session.empty());
  // The session holds prefix and reply, and goes on from them.
  auto more = client.Generate(GreedyRequest("", 5, session));
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->usage.session_tokens(), 15 + 20 + 5);
}

TEST_P(DeltaNetServingTest, AChatCompletionAnswersOverHttp) {
  Reply chat = Post(server_->http_port(), "/v1/chat/completions",
                    {{"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"max_tokens", 6},
                     {"temperature", 0}});
  ASSERT_EQ(chat.status, 200) << chat.body;
  const nlohmann::json body = chat.Json();
  EXPECT_EQ(body["usage"]["completion_tokens"], 6);
  EXPECT_TRUE(body["choices"][0]["message"]["content"].is_string());
}

// A Gated DeltaNet with a SentencePiece tokenizer (tests/data/sentencepiece, 400 pieces,
// <s> = 1, </s> = 2): a prompt that starts a fresh state begins with BOS, as the model's
// training sequences did, so the served greedy tokens are the model library's after
// [BOS] + the prompt's ids, and the usage counts BOS; a session's continuation adds none.
TEST(DeltaNetSentencePieceServingTest, AFreshPromptBeginsWithBos) {
  fwmodel::ModelConfig c;
  c.architecture = fwmodel::Architecture::kGatedDeltaNet;
  c.ffn = fwmodel::FfnKind::kSwiglu;
  c.vocab_size = 400;
  c.tokenizer = "sentencepiece";
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.head_k_dim = 8;
  c.head_v_dim = 8;
  c.d_ff = 48;
  c.use_gate = true;
  auto model = fwmodel::Model::InitRandom(c, 29, {});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string dir = MakeTempDir("delta-net-sp");
  ASSERT_TRUE(fwmodel::SaveCheckpoint(*model, dir, fwmodel::DType::kF32).ok());
  {
    std::ifstream in(std::string(FWSERVE_SOURCE_DIR) +
                         "/tests/data/sentencepiece/shakespeare-bpe400.model",
                     std::ios::binary);
    std::ofstream(dir + "/tokenizer.model", std::ios::binary) << in.rdbuf();
  }
  auto tokenizer = fwmodel::TextTokenizer::ForModel(c, dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ(tokenizer->begin_of_text(), 1);
  fwserve::CoreOptions options;
  options.model_dirs = {dir};
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);

  const std::string prompt = "First Citizen: Before we proceed";
  std::vector<int64_t> ids = tokenizer->Encode(prompt);
  ids.insert(ids.begin(), 1);
  // The library's greedy continuation of [BOS] + ids, never drawing </s> (its logit is
  // what it is; the comparison stops where either ends).
  c10::NoGradGuard no_grad;
  fwmodel::State state = model->InitialState(1);
  auto logits = model->Forward(torch::tensor(ids, torch::kInt64).view({1, -1}), &state);
  ASSERT_TRUE(logits.ok()) << logits.status();
  torch::Tensor last = (*logits)[0][-1];
  std::vector<int64_t> want;
  for (int i = 0; i < 12; ++i) {
    const int64_t next = last.argmax().item<int64_t>();
    want.push_back(next);
    if (next == 2) break;  // end of text ends the stream
    auto step = model->Step(torch::tensor({next}, torch::kInt64), &state);
    ASSERT_TRUE(step.ok()) << step.status();
    last = (*step)[0];
  }
  auto served = server->client().Generate(GreedyRequest(prompt, 12));
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->token_ids, want);
  EXPECT_EQ(served->usage.prompt_tokens(), static_cast<int64_t>(ids.size()));
  // A session's prefix is a fresh state too; its continuation adds no BOS.
  auto kept = server->client().CreateSession("", prompt);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->tokens(), static_cast<int64_t>(ids.size()));
  auto more = server->client().Generate(GreedyRequest(" and", 3, kept->session_id()));
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->usage.prompt_tokens(), static_cast<int64_t>(tokenizer->Encode(" and").size()));
  // A session created with an empty prefix holds BOS, so its first text continues from it:
  // the same tokens as the fresh prompt above.
  auto empty = server->client().CreateSession("", "");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->tokens(), 1);
  auto first = server->client().Generate(GreedyRequest(prompt, 12, empty->session_id()));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->token_ids, want);
  EXPECT_EQ(first->usage.prompt_tokens(), static_cast<int64_t>(ids.size()) - 1);
}

INSTANTIATE_TEST_SUITE_P(Architectures, DeltaNetServingTest,
                         ::testing::Values(fwmodel::Architecture::kDeltaNet,
                                           fwmodel::Architecture::kGatedDeltaNet),
                         [](const ::testing::TestParamInfo<fwmodel::Architecture>& info) {
                           return std::string(info.param == fwmodel::Architecture::kDeltaNet
                                                  ? "DeltaNet"
                                                  : "GatedDeltaNet");
                         });

}  // namespace
}  // namespace fwtest
