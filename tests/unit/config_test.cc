#include "models/base/config.h"

#include <gtest/gtest.h>

namespace {

using fwmodel::ParseModelConfig;

constexpr char kMinimal[] =
    R"({"format_version": 1, "architecture": "fast_weight", "d_model": 64, "n_layers": 2, "n_heads": 4})";

TEST(ConfigTest, MinimalConfigGetsContractDefaults) {
  auto c = ParseModelConfig(kMinimal);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, fwmodel::Architecture::kFastWeight);
  EXPECT_EQ(c->vocab_size, 256);
  EXPECT_EQ(c->bos_token_id, 10);
  EXPECT_EQ(c->d_ff, 256);  // 4 * d_model
  EXPECT_EQ(c->ffn, fwmodel::FfnKind::kSquaredRelu);
  EXPECT_EQ(c->dconv_kernel, 0);
  EXPECT_EQ(c->dpfp_nu, 1);
  EXPECT_DOUBLE_EQ(c->norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->attn_eps, 1e-6);
  EXPECT_FALSE(c->tie_embeddings);
  EXPECT_EQ(c->d_head(), 16);
  EXPECT_EQ(c->d_phi(), 32);
}

TEST(ConfigTest, CanonicalJsonRoundTrips) {
  auto c = ParseModelConfig(
      R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2,
          "ffn": "geglu", "dconv_kernel": 4, "tie_embeddings": true, "norm_eps": 1e-6})");
  ASSERT_TRUE(c.ok()) << c.status();
  auto again = ParseModelConfig(fwmodel::ModelConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*c == *again);
  EXPECT_EQ(again->ffn, fwmodel::FfnKind::kGeglu);
  EXPECT_TRUE(again->tie_embeddings);
  EXPECT_DOUBLE_EQ(again->norm_eps, 1e-6);
}

struct BadCase {
  const char* json;
  const char* expected_fragment;
};

class ConfigRejectionTest : public testing::TestWithParam<BadCase> {};

TEST_P(ConfigRejectionTest, ErrorNamesTheKey) {
  auto c = ParseModelConfig(GetParam().json);
  ASSERT_FALSE(c.ok()) << GetParam().json;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(GetParam().expected_fragment), std::string::npos)
      << c.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Rejections, ConfigRejectionTest,
    testing::Values(
        BadCase{"not json", "not valid JSON"}, BadCase{"[1, 2]", "must be an object"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "d_modle": 3})",
            "'d_modle' is unknown"},
        BadCase{R"({"architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2})",
                "'format_version' is required"},
        BadCase{
            R"({"format_version": 2, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2})",
            "'format_version' must be 1"},
        BadCase{R"({"format_version": 1, "d_model": 8, "n_layers": 1, "n_heads": 2})",
                "'architecture' is required"},
        BadCase{
            R"({"format_version": 1, "architecture": "rnn", "d_model": 8, "n_layers": 1, "n_heads": 2})",
            "'architecture' has unknown value \"rnn\""},
        BadCase{R"({"format_version": 1, "architecture": "aft", "n_layers": 1, "n_heads": 2})",
                "'d_model' is required"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8.0, "n_layers": 1, "n_heads": 2})",
            "'d_model' must be an integer"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 0, "n_heads": 2})",
            "'n_layers' must be positive"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 3})",
            "'n_heads' must divide d_model=8"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "ffn": "swish"})",
            "'ffn' has unknown value"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "tokenizer": "bpe"})",
            "'tokenizer' has unknown value"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 100})",
            "'vocab_size' must be at least 256"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "bos_token_id": 256})",
            "'bos_token_id' must be in [0, vocab_size)"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "dconv_kernel": -1})",
            "'dconv_kernel' must be in"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "dpfp_nu": 0})",
            "'dpfp_nu' must be in"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "norm_eps": 0})",
            "'norm_eps' must be a positive"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "attn_eps": "small"})",
            "'attn_eps' must be a number"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "tie_embeddings": 1})",
            "'tie_embeddings' must be true or false"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "d_ff": 0})",
            "'d_ff' must be positive"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": "ROLE: x"})",
            "'chat_template' must be an object"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{role}:", "generation_prompt": "A:"}})",
            "'chat_template' 'message' must contain {content}"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{content}", "prompt": "A:"}})",
            "'chat_template' has unknown key 'prompt'"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{content}"}})",
            "needs both 'message' and 'generation_prompt'"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{content}", "generation_prompt": 7}})",
            "'generation_prompt' must be a string"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{content}", "generation_prompt": "A:", "stop": "\n"}})",
            "'stop' must be an array of 1 to 4 strings"},
        BadCase{
            R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2, "chat_template": {"message": "{content}", "generation_prompt": "A:", "stop": [""]}})",
            "each 'stop' marker must be a string of 1 to 64 bytes"}));

TEST(ConfigTest, ChatTemplateRoundTrips) {
  auto c = ParseModelConfig(
      R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2,
          "chat_template": {"message": "<{role}> {content}\n", "generation_prompt": "<ASSISTANT> ",
                            "stop": ["\n<"]}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->chat_message_template, "<{role}> {content}\n");
  EXPECT_EQ(c->chat_generation_prompt, "<ASSISTANT> ");
  EXPECT_EQ(c->chat_stop, std::vector<std::string>{"\n<"});
  auto again = ParseModelConfig(fwmodel::ModelConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->chat_message_template, c->chat_message_template);
  EXPECT_EQ(again->chat_generation_prompt, c->chat_generation_prompt);
  EXPECT_EQ(again->chat_stop, c->chat_stop);
  // Without one, the canonical JSON has no chat_template key (old fingerprints hold).
  auto plain = ParseModelConfig(kMinimal);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(fwmodel::ModelConfigToJson(*plain).find("chat_template"), std::string::npos);
}

}  // namespace
