// fwserve serving rwkv.cpp's tiny trained RWKV-7 and RWKV-4 models (tests/data/rwkv,
// converted by tools/convert_rwkv_cpp.py), through the real client: the first greedy
// token after `"in` is the argmax of rwkv.cpp's expected logits with its log-probability,
// scoring equals the model library's, and a session continues the same after a fork and
// after an export and import.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "client/client.h"
#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"
#include "tests/integration/harness.h"
#include "tests/integration/http_client.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;

class RwkvServingTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    models_dir_ = new std::string(MakeTempDir("rwkv"));
    for (const char* version : {"7v0-834K", "4v0-660K"}) {
      const std::string command = std::string(FWSERVE_PYTHON3) + " " + FWSERVE_SOURCE_DIR +
                                  "/tools/convert_rwkv_cpp.py " + FWSERVE_SOURCE_DIR +
                                  "/tests/data/rwkv/tiny-rwkv-" + version + "-FP32.bin " +
                                  *models_dir_ + "/" + version + " >/dev/null";
      ASSERT_EQ(std::system(command.c_str()), 0) << command;
    }
  }
  std::string ModelDir() const { return *models_dir_ + "/" + GetParam(); }
  std::unique_ptr<Harness> Start() {
    fwserve::CoreOptions options;
    options.model_dirs = {ModelDir()};
    return Harness::Start(options);
  }
  static std::string* models_dir_;
};
std::string* RwkvServingTest::models_dir_ = nullptr;

std::vector<float> ExpectedLogits(const std::string& version) {
  std::ifstream in(
      std::string(FWSERVE_SOURCE_DIR) + "/tests/data/rwkv/expected-logits-" + version + ".bin",
      std::ios::binary);
  std::vector<float> logits(256);
  in.read(reinterpret_cast<char*>(logits.data()), 256 * sizeof(float));
  EXPECT_TRUE(in.good());
  return logits;
}

TEST_P(RwkvServingTest, FirstGreedyTokenAfterQuoteInIsRwkvCppsArgmax) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  const std::vector<float> expected = ExpectedLogits(GetParam());
  const int64_t argmax = std::max_element(expected.begin(), expected.end()) - expected.begin();
  double norm = 0;
  for (float l : expected) norm += std::exp(static_cast<double>(l - expected[argmax]));
  v1::GenerateRequest request = GreedyRequest("\"in", 1);
  request.set_logprobs(true);
  auto result = server->client().Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->token_ids.size(), 1u);
  EXPECT_EQ(result->token_ids[0], argmax);
  ASSERT_EQ(result->logprobs.size(), 1u);
  EXPECT_NEAR(result->logprobs[0], -std::log(norm), 1e-4);
}

TEST_P(RwkvServingTest, ScoreEqualsTheModelLibrary) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  const std::string text = "In the beginning was the word, and the word was \"in\".";
  v1::ScoreRequest request;
  request.set_text(text);
  auto scored = server->client().Score(request);
  ASSERT_TRUE(scored.ok()) << scored.status();
  const std::vector<double> reference = ReferenceScore(ModelDir(), text);
  ASSERT_EQ(static_cast<size_t>(scored->logprobs_size()), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_NEAR(scored->logprobs(static_cast<int>(i)), reference[i], 1e-4) << "token " << i;
  }
}

TEST_P(RwkvServingTest, SessionContinuesTheSameAfterForkAndAfterExportImport) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  EXPECT_FALSE(
      ExpectSessionContinuesTheSameAfterForkAndExportImport(server->client(), "The king said: ", 24)
          .empty());
}

INSTANTIATE_TEST_SUITE_P(Tiny, RwkvServingTest, ::testing::Values("7v0-834K", "4v0-660K"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return "v" + info.param.substr(0, 1);
                         });

// A world-vocabulary RWKV-7 of random weights (seed 11): its config.
fwmodel::ModelConfig WorldRwkv7Config() {
  fwmodel::ModelConfig config;
  config.architecture = fwmodel::Architecture::kRwkv7;
  config.d_model = 32;
  config.n_layers = 2;
  config.n_heads = 4;
  config.d_ff = 48;
  config.decay_low_rank_dim = 5;
  config.a_low_rank_dim = 6;
  config.v_low_rank_dim = 3;
  config.gate_low_rank_dim = 7;
  config.vocab_size = 65536;
  config.tokenizer = "rwkv_world";
  return config;
}

// Writes that model, with the vocabulary file beside it, to a new directory.
std::string WriteWorldRwkv7(const std::string& tag) {
  auto model = fwmodel::Model::InitRandom(WorldRwkv7Config(), 11, {});
  EXPECT_TRUE(model.ok()) << model.status();
  const std::string dir = MakeTempDir(tag);
  if (!model.ok()) return dir;
  EXPECT_TRUE(fwmodel::SaveCheckpoint(*model, dir, fwmodel::DType::kF32).ok());
  std::ifstream vocab(std::string(FWSERVE_SOURCE_DIR) + "/tests/data/rwkv/rwkv_vocab_v20230424.txt",
                      std::ios::binary);
  std::ofstream(dir + "/rwkv_vocab_v20230424.txt", std::ios::binary) << vocab.rdbuf();
  return dir;
}

// A world-vocabulary RWKV-7 (random weights, 65,536 ids, the vocabulary file beside
// them) is served with its own tokenizer: the prompt is encoded by the world vocabulary
// (its token count in the usage), and the streamed text is each token's bytes, decoded
// as UTF-8 across token edges.
TEST(RwkvWorldServingTest, PromptsAndTextGoThroughTheWorldVocabulary) {
  const fwmodel::ModelConfig config = WorldRwkv7Config();
  const std::string dir = WriteWorldRwkv7("rwkv-world");
  auto tokenizer = fwmodel::TextTokenizer::ForModel(config, dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  fwserve::CoreOptions options;
  options.model_dirs = {dir};
  auto server = Harness::Start(options, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(server, nullptr);
  const std::string prompt = "User: Hello, world! \xe4\xb8\x96\xe7\x95\x8c\n\nAssistant:";
  const std::vector<int64_t> prompt_ids = tokenizer->Encode(prompt);
  ASSERT_LT(prompt_ids.size(), prompt.size());  // words, not bytes
  auto session = server->client().CreateSession("", prompt);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->tokens(), static_cast<int64_t>(prompt_ids.size()));
  auto result = server->client().Generate(GreedyRequest(" Hi", 12, session->session_id()));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->usage.prompt_tokens(), static_cast<int64_t>(tokenizer->Encode(" Hi").size()));
  // The text is the tokens' bytes (a stream that ended at end of text has one token
  // without bytes), as UTF-8 with an incomplete last character as U+FFFD.
  fwmodel::Utf8StreamDecoder decoder;
  std::string expected;
  for (int64_t id : result->token_ids) {
    EXPECT_LT(id, 65536);
    expected += decoder.PushBytes(tokenizer->TokenBytes(id));
  }
  expected += decoder.Finish();
  EXPECT_EQ(result->text, expected);
  const bool ended = !result->token_ids.empty() && result->token_ids.back() == 0;
  EXPECT_EQ(result->token_ids.size(), ended ? result->token_ids.size() : 12u);
  // The same model through a throwaway request and Score agrees on the prompt's ids.
  v1::ScoreRequest score;
  score.set_text(prompt);
  auto scored = server->client().Score(score);
  ASSERT_TRUE(scored.ok()) << scored.status();
  EXPECT_EQ(std::vector<int64_t>(scored->token_ids().begin(), scored->token_ids().end()),
            prompt_ids);
  // HTTP logprobs show each token as the bytes it stands for: together, the reply.
  Reply chat = Post(server->http_port(), "/v1/chat/completions",
                    {{"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"max_tokens", 10},
                     {"temperature", 0},
                     {"logprobs", true}});
  ASSERT_EQ(chat.status, 200) << chat.body;
  const json body = chat.Json();
  const json& entries = body["choices"][0]["logprobs"]["content"];
  EXPECT_EQ(entries.size(), body["usage"]["completion_tokens"].get<size_t>());
  std::string all;
  for (const json& entry : entries) {
    for (const json& b : entry["bytes"]) all.push_back(static_cast<char>(b.get<int>()));
  }
  fwmodel::Utf8StreamDecoder whole;
  EXPECT_EQ(whole.PushBytes(all) + whole.Finish(), body["choices"][0]["message"]["content"]);
}

// Replayed histories on a world-vocabulary model (issue 49): kept conversations are
// matched by token ids, so a stateless client replaying a 10-turn chat (greedy, short
// replies) continues from the kept state whenever the previous turn's ids (prompt, then
// reply) begin the new prompt's ids, and its replies and usage equal a server with
// reuse off on every turn. A continued turn's cached tokens are a whole earlier
// conversation: the last one's, or, when the last reply's tokens are not what the
// vocabulary encodes its text as (then it cannot be continued exactly, and is not), an
// earlier one's.
TEST(RwkvWorldServingTest, AReplayedChatContinuesTheKeptConversationByTokenIds) {
  const std::string dir = WriteWorldRwkv7("rwkv-world-replay");
  fwserve::CoreOptions options;
  options.model_dirs = {dir};
  auto server = Harness::Start(options, {}, false, fwserve::HttpServerOptions{});
  fwserve::CoreOptions off = options;
  off.prefix_reuse_entries = 0;
  auto reference = Harness::Start(off, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(server, nullptr);
  ASSERT_NE(reference, nullptr);
  json messages = json::array({{{"role", "user"}, {"content", "Hello"}}});
  std::set<int64_t> kept;  // tokens of each conversation the reuse server kept
  int continued = 0;
  for (int turn = 0; turn < 10; ++turn) {
    const json request = {{"messages", messages}, {"max_tokens", 2}, {"temperature", 0}};
    Reply got = Post(server->http_port(), "/v1/chat/completions", request);
    Reply want = Post(reference->http_port(), "/v1/chat/completions", request);
    ASSERT_EQ(got.status, 200) << got.body;
    ASSERT_EQ(want.status, 200) << want.body;
    const json g = got.Json(), w = want.Json();
    const std::string reply = g["choices"][0]["message"]["content"];
    EXPECT_EQ(reply, w["choices"][0]["message"]["content"]) << "turn " << turn;
    EXPECT_EQ(g["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"]) << "turn " << turn;
    EXPECT_EQ(g["usage"]["completion_tokens"], w["usage"]["completion_tokens"]) << "turn " << turn;
    EXPECT_EQ(w["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    const int64_t cached = g["usage"]["prompt_tokens_details"]["cached_tokens"];
    if (cached > 0) {
      EXPECT_EQ(kept.count(cached), 1u) << "turn " << turn << ": not a whole kept conversation";
      ++continued;
    }
    kept.insert(g["usage"]["prompt_tokens"].get<int64_t>() +
                g["usage"]["completion_tokens"].get<int64_t>());
    messages.push_back({{"role", "assistant"}, {"content", reply}});
    messages.push_back({{"role", "user"}, {"content", absl::StrCat("And ", turn)}});
  }
  EXPECT_GE(continued, 3) << "too few of 9 replayed turns continued a kept conversation";
}

}  // namespace
}  // namespace fwtest
