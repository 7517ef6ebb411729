// The RWKV world tokenizer (models/tokenizers/world_tokenizer.h) on BlinkDL's
// rwkv_vocab_v20230424.txt (tests/data/rwkv).
#include "models/tokenizers/world_tokenizer.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"

namespace fwmodel {
namespace {

const WorldTokenizer& Vocabulary() {
  static const WorldTokenizer* tokenizer = [] {
    auto t =
        WorldTokenizer::LoadFromDirectory(std::string(FWSERVE_SOURCE_DIR) + "/tests/data/rwkv");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? new WorldTokenizer(std::move(*t)) : nullptr;
  }();
  return *tokenizer;
}

// An independent greedy longest match: at each position, the longest prefix (up to
// the longest token) that is a token, by lookup in a map of every token's bytes.
std::vector<int64_t> BruteForceEncode(const WorldTokenizer& t, const std::string& text) {
  static std::map<std::string, int64_t>* by_bytes = nullptr;
  static size_t longest = 0;
  if (by_bytes == nullptr) {
    by_bytes = new std::map<std::string, int64_t>;
    for (int64_t id = 1; id <= t.max_id(); ++id) {
      (*by_bytes)[std::string(t.TokenBytes(id))] = id;
      longest = std::max(longest, t.TokenBytes(id).size());
    }
  }
  std::vector<int64_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    for (size_t n = std::min(longest, text.size() - i); n >= 1; --n) {
      auto it = by_bytes->find(text.substr(i, n));
      if (it != by_bytes->end()) {
        ids.push_back(it->second);
        i += n;
        break;
      }
    }
  }
  return ids;
}

TEST(WorldTokenizerTest, VocabularyParsesWithByteIdsAtBytePlusOne) {
  const WorldTokenizer& t = Vocabulary();
  EXPECT_EQ(t.max_id(), 65529);
  EXPECT_TRUE(t.TokenBytes(WorldTokenizer::kEndOfText).empty());
  for (int b = 0; b < 256; ++b) {
    ASSERT_EQ(t.TokenBytes(b + 1), std::string(1, static_cast<char>(b))) << "byte " << b;
  }
  EXPECT_EQ(t.TokenBytes(261), "\n\n");
  EXPECT_EQ(t.TokenBytes(33155), "Hello");
  EXPECT_EQ(t.TokenBytes(9804), "\u2002");  // a \u escape, UTF-8 encoded
  EXPECT_EQ(t.TokenBytes(65529), std::string(128, ' '));
}

// Every token's bytes encode to that token alone, and decode back.
TEST(WorldTokenizerTest, EveryTokenRoundTrips) {
  const WorldTokenizer& t = Vocabulary();
  for (int64_t id = 1; id <= t.max_id(); ++id) {
    const std::string bytes(t.TokenBytes(id));
    const std::vector<int64_t> ids = t.Encode(bytes);
    ASSERT_EQ(ids, std::vector<int64_t>{id}) << "token " << id;
    ASSERT_EQ(t.DecodeBytes(ids), bytes);
  }
}

TEST(WorldTokenizerTest, KnownEncodingAndGreedyLongestMatchOnMultilingualText) {
  const WorldTokenizer& t = Vocabulary();
  EXPECT_EQ(t.Encode("User: hi\n\nHello"), (std::vector<int64_t>{24281, 59, 4571, 261, 33155}));
  const std::vector<std::string> texts = {
      "The quick brown fox jumps over the lazy dog.\n\n",
      "User: Bonjour, ça va ? Très bien, merci !\n\nAssistant:",
      "你好，世界！今日は良い天気ですね。안녕하세요.",
      "Здравствуй, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם",
      "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 and a flag",
      "code:\n\tfor (int i = 0; i < n; ++i) {\r\n  x += \"\\\\\";\n}",
      std::string("split \xE4\xBD") + " bytes \xF0\x9F\x98 and \xFF\xFE stray",
      std::string("\0\x01 nul", 6) + std::string(300, ' ') + "--------",
  };
  for (const std::string& text : texts) {
    const std::vector<int64_t> ids = t.Encode(text);
    EXPECT_EQ(ids, BruteForceEncode(t, text)) << text;
    EXPECT_EQ(t.DecodeBytes(ids), text);
    EXPECT_LT(ids.size(), text.size()) << "no merges: " << text;
  }
}

// Streaming the tokens of a text through the UTF-8 decoder never emits a piece that
// splits a character, even where a token ends inside one.
TEST(WorldTokenizerTest, StreamedTextNeverSplitsACharacter) {
  const WorldTokenizer& t = Vocabulary();
  const std::string text = "😀👍🏽 你好世界 ça 안녕 🇫🇷";
  Utf8StreamDecoder decoder;
  std::string joined;
  bool some_token_splits = false;
  for (int64_t id : t.Encode(text)) {
    const std::string_view bytes = t.TokenBytes(id);
    some_token_splits |= DecodeBytesLossy(bytes) != bytes;
    const std::string piece = decoder.PushBytes(bytes);
    EXPECT_EQ(DecodeBytesLossy(piece), piece) << "a piece is not whole UTF-8";
    joined += piece;
  }
  joined += decoder.Finish();
  EXPECT_EQ(joined, text);
  EXPECT_TRUE(some_token_splits) << "the text should have a token ending inside a character";
}

absl::Status ParseError(const std::string& text) {
  auto t = WorldTokenizer::Parse(text);
  return t.ok() ? absl::OkStatus() : t.status();
}

// A vocabulary of the 256 single bytes (Python bytes literals), then `extra` lines.
std::string ByteVocabulary(const std::string& extra) {
  std::ostringstream out;
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "%02x", b);
    out << b + 1 << " b'\\x" << hex << "' 1\n";
  }
  return out.str() + extra;
}

TEST(WorldTokenizerTest, MalformedVocabularyIsRefusedNamingTheLine) {
  EXPECT_TRUE(ParseError(ByteVocabulary("257 'ab' 2\n258 \"c'\" 2\n259 '\\u00e9' 2\n")).ok());
  const std::pair<std::string, std::string> cases[] = {
      {"257 'ab' 3\n", "line 257: literal has 2 bytes, the line says 3"},
      {"258 'ab' 2\n", "line 257: id 258 out of order"},
      {"257 'a\\qb' 3\n", "line 257: unsupported escape \\q"},
      {"257 ab 2\n", "line 257: not a quoted Python literal"},
      {"257 'ab\" 2\n", "line 257: not a quoted Python literal"},
      {"257 'a'b' 3\n", "line 257: unescaped quote"},
      {"257 b'\\u0041' 1\n", "line 257: \\u escape in a bytes literal"},
      {"257 '\\x4' 1\n", "line 257: bad hexadecimal escape"},
      {"257 'a' 1\n", "line 257: the same bytes as token 98"},
      {"257 'ab'\n", "line 257: expected `<id> <literal> <length>`"},
  };
  for (const auto& [extra, message] : cases) {
    absl::Status s = ParseError(ByteVocabulary(extra));
    EXPECT_FALSE(s.ok()) << extra;
    EXPECT_NE(s.message().find(message), std::string::npos) << s << " for " << extra;
  }
  absl::Status missing = ParseError("1 'a' 1\n");
  EXPECT_NE(missing.message().find("byte 0 is not a token"), std::string::npos) << missing;
}

}  // namespace
}  // namespace fwmodel

namespace fwmodel {
namespace {

TEST(TextTokenizerTest, ConfigPicksBytesOrTheWorldVocabularyFromTheDirectory) {
  ModelConfig config;
  auto bytes = TextTokenizer::ForModel(config, "/nonexistent");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(bytes->Encode("Hi"), (std::vector<int64_t>{72, 105}));
  EXPECT_EQ(bytes->TokenBytes(72), "H");
  EXPECT_EQ(bytes->end_of_text(), -1);

  config.tokenizer = "rwkv_world";
  config.vocab_size = 65536;
  const std::string dir = std::string(FWSERVE_SOURCE_DIR) + "/tests/data/rwkv";
  auto world = TextTokenizer::ForModel(config, dir);
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(world->Encode("User: hi\n\nHello"), Vocabulary().Encode("User: hi\n\nHello"));
  EXPECT_EQ(world->TokenBytes(33155), "Hello");
  EXPECT_EQ(world->end_of_text(), 0);

  auto missing = TextTokenizer::ForModel(config, "/nonexistent");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("rwkv_vocab_v20230424.txt"), std::string::npos);
  EXPECT_EQ(missing.status().message().find("/nonexistent"), std::string::npos) << "leaks the path";

  config.vocab_size = 65000;  // smaller than the vocabulary's ids
  auto small = TextTokenizer::ForModel(config, dir);
  EXPECT_FALSE(small.ok());
}

}  // namespace
}  // namespace fwmodel
