// TokenMasker (models/constraints/token_masker.h): the mask equals brute force (each token's
// bytes advanced on a copy of the matcher) at many positions of generated documents, on a
// toy vocabulary, the byte vocabulary and the RWKV world vocabulary
// (tests/data/rwkv/rwkv_vocab_v20230424.txt); documents generated token by token with
// random allowed tokens are valid JSON of their schema.
#include "models/constraints/token_masker.h"

#include <atomic>
#include <chrono>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "models/constraints/json_schema.h"
#include "models/constraints/matcher.h"
#include "models/tokenizers/world_tokenizer.h"
#include "tests/unit/constraint_test_util.h"

namespace fwserve::constraints {
namespace {

using Json = nlohmann::ordered_json;

const fwmodel::WorldTokenizer& World() {
  static const fwmodel::WorldTokenizer* tokenizer = [] {
    auto t = fwmodel::WorldTokenizer::LoadFromDirectory(std::string(FWSERVE_SOURCE_DIR) +
                                                        "/tests/data/rwkv");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? new fwmodel::WorldTokenizer(std::move(*t)) : nullptr;
  }();
  return *tokenizer;
}

// The world vocabulary as a masker sees it: 65,536 ids (the model's padded vocabulary),
// id 0 the end of text, ids past the tokenizer's empty.
std::vector<std::string> WorldTokenBytes() {
  std::vector<std::string> bytes(65536);
  for (int64_t id = 1; id <= World().max_id(); ++id)
    bytes[id] = std::string(World().TokenBytes(id));
  return bytes;
}

const TokenMasker& WorldMasker() {
  static const TokenMasker* masker = new TokenMasker(WorldTokenBytes(), /*end_token=*/0);
  return *masker;
}

std::vector<std::string> ByteTokens() {
  std::vector<std::string> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[b] = std::string(1, static_cast<char>(b));
  return bytes;
}

// A toy vocabulary: JSON fragments of several lengths, duplicates, an empty token, the
// end token at id 1, and every single byte.
std::vector<std::string> ToyTokens() {
  std::vector<std::string> t = {"",
                                "<eos>",
                                "{",
                                "}",
                                "[",
                                "]",
                                "\"",
                                ",",
                                ":",
                                " ",
                                "  ",
                                "\n",
                                "{\"",
                                "\":",
                                "\": ",
                                "\",",
                                "\"}",
                                "\"]",
                                "},",
                                "}]",
                                "}}",
                                "]}",
                                "],",
                                ", \"",
                                ",\"",
                                "null",
                                "true",
                                "false",
                                "nul",
                                "12",
                                "3.5",
                                "-1",
                                "e5",
                                "name",
                                "na",
                                "me",
                                "age",
                                "\"name\"",
                                "\"age\":",
                                "children",
                                "\"children\":[",
                                "[]",
                                "[{",
                                "value",
                                "\\n",
                                "\\u00e9",
                                "\xC3\xA9",
                                "\xC3",
                                "\xA9",
                                "12\"",
                                "0,",
                                "1}",
                                "\"\"",
                                "\"x\"",
                                "x",
                                "ab",
                                "abc",
                                "ab",
                                "-",
                                "2024",
                                "-01",
                                "T12:",
                                "Z\"",
                                "@",
                                ".com"};
  for (int b = 0; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
  return t;
}

// allowed[id] by definition: every byte of the token accepted in order (end token: iff
// complete).
std::vector<uint8_t> BruteForce(const TokenMasker& masker, const Matcher& m) {
  std::vector<uint8_t> allowed(masker.vocab(), 0);
  for (int64_t id = 0; id < masker.vocab(); ++id) {
    if (id == masker.end_token()) {
      allowed[id] = m.IsComplete();
      continue;
    }
    const std::string& bytes = masker.token_bytes(id);
    if (bytes.empty()) continue;
    Matcher copy = m;
    allowed[id] = copy.AdvanceBytes(bytes);
  }
  return allowed;
}

void ExpectMaskMatchesBruteForce(const TokenMasker& masker, const Matcher& m,
                                 const std::string& context) {
  std::vector<uint8_t> mask;
  const int64_t count = masker.Allowed(m, &mask);
  const std::vector<uint8_t> expected = BruteForce(masker, m);
  ASSERT_EQ(mask.size(), expected.size());
  int64_t expected_count = 0;
  for (size_t id = 0; id < expected.size(); ++id) {
    expected_count += expected[id];
    if (mask[id] != expected[id]) {
      ADD_FAILURE() << "token " << id << " \"" << masker.token_bytes(id) << "\": mask "
                    << int{mask[id]} << ", brute force " << int{expected[id]} << " after "
                    << context;
      return;
    }
  }
  EXPECT_EQ(count, expected_count);
}

// Generates a document token by token: `random_tokens` random allowed tokens (the end token
// stops it), then single-byte tokens along the shortest completion. Checks the mask against
// brute force at every `check_every`-th step (0: never). Returns the document; empty on a
// failure.
std::string GenerateByTokens(const TokenMasker& masker, const std::shared_ptr<const Grammar>& g,
                             std::mt19937* rng, int check_every, int random_tokens,
                             int* checks = nullptr) {
  std::map<char, int64_t> byte_token;
  for (int64_t id = 0; id < masker.vocab(); ++id) {
    if (masker.token_bytes(id).size() == 1 && id != masker.end_token()) {
      byte_token.emplace(masker.token_bytes(id)[0], id);
    }
  }
  const std::vector<int64_t> dist = testing_util::RuleDistances(*g);
  Matcher m(g);
  std::string doc;
  std::vector<uint8_t> mask;
  for (int step = 0; step < random_tokens + 1000; ++step) {
    if (check_every > 0 && step % check_every == 0) {
      ExpectMaskMatchesBruteForce(masker, m, doc);
      if (checks != nullptr) ++*checks;
    }
    const int64_t count = masker.Allowed(m, &mask);
    if (count == 0) {
      EXPECT_TRUE(m.IsFinished()) << "no token allowed after " << doc;
      return m.IsFinished() ? doc : "";
    }
    int64_t pick = -1;
    if (step < random_tokens) {
      std::vector<int64_t> ids;
      for (size_t id = 0; id < mask.size(); ++id) {
        if (mask[id]) ids.push_back(static_cast<int64_t>(id));
      }
      pick = ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(*rng)];
    } else {
      if (m.IsComplete()) return doc;
      const std::string rest = testing_util::ShortestCompletion(m, dist);
      if (rest.empty() || !byte_token.count(rest[0])) {
        ADD_FAILURE() << "no single-byte token to complete " << doc;
        return "";
      }
      pick = byte_token[rest[0]];
      EXPECT_TRUE(mask[pick]) << "completion byte refused after " << doc;
    }
    if (pick == masker.end_token()) {
      EXPECT_TRUE(m.IsComplete());
      return doc;
    }
    EXPECT_TRUE(m.AdvanceBytes(masker.token_bytes(pick)));
    doc += masker.token_bytes(pick);
    if (m.IsFinished()) return doc;
  }
  ADD_FAILURE() << "no end: " << doc;
  return "";
}

const char* kPersonSchema = R"({"type":"object","properties":{
    "name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":150},
    "email":{"type":"string","format":"email"},
    "tags":{"type":"array","items":{"type":"string","enum":["a","bc","x y"]},"maxItems":3},
    "extra":{}},
    "required":["name","age"],"additionalProperties":false})";

const char* kTreeSchema = R"({"$defs":{"node":{"type":"object","properties":{
    "name":{"type":"string"},"value":{"type":["number","null"]},
    "children":{"type":"array","items":{"$ref":"#/$defs/node"}}},
    "required":["name","children"],"additionalProperties":false}},"$ref":"#/$defs/node"})";

// Two recursive alternatives that share their first bytes: two stacks live at once.
const char* kAlternativesSchema = R"({"$defs":{
    "a":{"type":"object","properties":{"n":{"type":"integer"},"x":{"$ref":"#/$defs/a"}}},
    "b":{"type":"object","properties":{"name":{"type":"string"},"y":{"$ref":"#/$defs/b"}},
         "additionalProperties":false}},
    "anyOf":[{"$ref":"#/$defs/a"},{"$ref":"#/$defs/b"},{"type":"array","items":{"$ref":"#"}}]})";

std::shared_ptr<const Grammar> Compile(const char* schema) {
  auto g = CompileJsonSchema(Json::parse(schema));
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

TEST(TokenMaskerTest, ToyVocabularyMatchesBruteForce) {
  const TokenMasker masker(ToyTokens(), /*end_token=*/1);
  std::mt19937 rng(1);
  int checks = 0;
  for (const char* schema : {kPersonSchema, kTreeSchema, R"({"type":"integer"})"}) {
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    for (int i = 0; i < 30; ++i) {
      const std::string doc = GenerateByTokens(masker, g, &rng, /*check_every=*/1, 60, &checks);
      EXPECT_TRUE(Json::accept(doc)) << doc;
    }
  }
  // Several live stacks at once (two recursive alternatives, additional properties of any
  // value).
  auto alternatives = Compile(kAlternativesSchema);
  for (int i = 0; i < 30; ++i) {
    const std::string doc =
        GenerateByTokens(masker, alternatives, &rng, /*check_every=*/1, 60, &checks);
    EXPECT_TRUE(Json::accept(doc)) << doc;
  }
  EXPECT_GT(checks, 1000);
  EXPECT_GT(masker.stats().uncertain_checked, 0);
  // The duplicate "ab" tokens are allowed together.
  auto g = Compile(R"({"type":"string"})");
  Matcher m(g);
  ASSERT_TRUE(m.Advance('"'));
  std::vector<uint8_t> mask;
  masker.Allowed(m, &mask);
  std::vector<int64_t> ab;
  for (int64_t id = 0; id < masker.vocab(); ++id) {
    if (masker.token_bytes(id) == "ab") ab.push_back(id);
  }
  ASSERT_EQ(ab.size(), 2u);
  EXPECT_TRUE(mask[ab[0]] && mask[ab[1]]);
  EXPECT_FALSE(mask[0]);  // empty: never
  EXPECT_FALSE(mask[1]);  // end: not complete
}

// At every byte of fixed documents, on the toy and the world vocabularies: deep nesting at a
// low recursion bound (where the per-state results give way to a walk from the real
// stack), several live alternatives, escapes and multi-byte characters.
TEST(TokenMaskerTest, MaskMatchesBruteForceAlongDocuments) {
  const TokenMasker toy(ToyTokens(), /*end_token=*/1);
  JsonSchemaOptions shallow;
  shallow.max_recursion_depth = 5;
  struct Walk {
    const char* schema;
    JsonSchemaOptions options;
    const char* doc;
  };
  const Walk walks[] = {
      {kTreeSchema, shallow,
       R"({"name":"a","children":[{"name":"b","value":1.5,"children":[{"name":"c","children":[)"
       R"({"name":"d","children":[]}]}]}]})"},
      {kAlternativesSchema,
       {},
       R"([{"n":1,"x":{"x":{"n":2}},"k":[1,{"z":null}]},{"name":"\u00e9\n"}])"},
      {kPersonSchema,
       {},
       "{\"name\":\"Jos\xC3\xA9 \\\"J\\\"\",\"age\":42,\"email\":\"a.b@c.io\","
       "\"tags\":[\"a\",\"x y\"],\"extra\":{\"k\":[true]}}"},
  };
  for (const Walk& w : walks) {
    auto g = CompileJsonSchema(Json::parse(w.schema), w.options);
    ASSERT_TRUE(g.ok()) << g.status();
    Matcher m(*g);
    const std::string doc = w.doc;
    for (size_t i = 0; i <= doc.size(); ++i) {
      ExpectMaskMatchesBruteForce(toy, m, doc.substr(0, i));
      ExpectMaskMatchesBruteForce(WorldMasker(), m, doc.substr(0, i));
      if (i < doc.size()) {
        ASSERT_TRUE(m.Advance(static_cast<uint8_t>(doc[i]))) << doc.substr(0, i + 1);
      }
    }
    EXPECT_TRUE(m.IsComplete()) << doc;
  }
  EXPECT_GT(toy.stats().full_walks, 0);
  EXPECT_GT(toy.stats().uncertain_checked, 0);
}

TEST(TokenMaskerTest, ByteVocabularyIsNextBytes) {
  const TokenMasker masker(ByteTokens(), /*end_token=*/-1);
  auto g = Compile(kTreeSchema);
  std::mt19937 rng(2);
  for (int i = 0; i < 20; ++i) {
    Matcher m(g);
    std::vector<uint8_t> mask;
    while (true) {
      const int64_t count = masker.Allowed(m, &mask);
      const std::bitset<256> next = m.NextBytes();
      ASSERT_EQ(static_cast<size_t>(count), next.count());
      for (int b = 0; b < 256; ++b) ASSERT_EQ(mask[b] != 0, next[b]) << b;
      if (count == 0) {
        EXPECT_TRUE(m.IsFinished());  // without an end token, 0 allowed = the end
        break;
      }
      std::vector<int> ids;
      for (int b = 0; b < 256; ++b) {
        if (mask[b]) ids.push_back(b);
      }
      int pick = ids[rng() % ids.size()];
      for (int b : ids) {
        if ((b == ']' || b == '}' || b == '"') && rng() % 2) pick = b;
      }
      ASSERT_TRUE(m.Advance(static_cast<uint8_t>(pick)));
    }
  }
}

TEST(TokenMaskerTest, WorldVocabularyMatchesBruteForce) {
  const TokenMasker& masker = WorldMasker();
  ASSERT_EQ(masker.vocab(), 65536);
  std::mt19937 rng(3);
  int checks = 0;
  for (const char* schema : {kPersonSchema, kTreeSchema}) {
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    for (int i = 0; i < 6; ++i) {
      const std::string doc = GenerateByTokens(masker, g, &rng, /*check_every=*/4, 60, &checks);
      ASSERT_FALSE(doc.empty());
      EXPECT_TRUE(Json::accept(doc)) << doc;
    }
  }
  EXPECT_GT(checks, 40);
  // The end token (0) exactly when complete; never an empty (padding) id.
  auto g = Compile(R"({"type":"integer"})");
  Matcher m(g);
  std::vector<uint8_t> mask;
  masker.Allowed(m, &mask);
  EXPECT_FALSE(mask[0]);
  ASSERT_TRUE(m.AdvanceBytes("42"));
  masker.Allowed(m, &mask);
  EXPECT_TRUE(mask[0]);
  EXPECT_FALSE(mask[65535]);
}

TEST(TokenMaskerTest, WorldVocabularyDocumentsValidate) {
  const TokenMasker& masker = WorldMasker();
  std::mt19937 rng(4);
  auto g = Compile(kPersonSchema);
  for (int i = 0; i < 40; ++i) {
    const std::string doc = GenerateByTokens(masker, g, &rng, /*check_every=*/0, 80);
    ASSERT_FALSE(doc.empty());
    Json value;
    ASSERT_NO_THROW(value = Json::parse(doc)) << doc;
    ASSERT_TRUE(value.is_object()) << doc;
    EXPECT_TRUE(value.contains("name") && value.contains("age")) << doc;
    EXPECT_TRUE(value["name"].is_string() && value["name"].get<std::string>().size() <= 80);
    EXPECT_TRUE(value["age"].is_number_integer() && value["age"] >= 0 && value["age"] <= 150)
        << doc;
    if (value.contains("tags")) {
      EXPECT_LE(value["tags"].size(), 3u) << doc;
    }
  }
  auto any = AnyJsonObject();
  for (int i = 0; i < 20; ++i) {
    const std::string doc = GenerateByTokens(masker, any, &rng, /*check_every=*/0, 80);
    ASSERT_FALSE(doc.empty());
    Json value;
    ASSERT_NO_THROW(value = Json::parse(doc)) << doc;
    EXPECT_TRUE(value.is_object());
  }
}

TEST(TokenMaskerTest, EqualSchemasShareTheCache) {
  const TokenMasker masker(ToyTokens(), 1);
  auto a = Compile(kPersonSchema);
  auto b = Compile(kPersonSchema);
  std::vector<uint8_t> mask;
  Matcher ma(a);
  ASSERT_TRUE(ma.AdvanceBytes(R"({"name":")"));
  masker.Allowed(ma, &mask);
  const TokenMasker::Stats before = masker.stats();
  Matcher mb(b);
  ASSERT_TRUE(mb.AdvanceBytes(R"({"name":")"));
  std::vector<uint8_t> mask_b;
  masker.Allowed(mb, &mask_b);
  const TokenMasker::Stats after = masker.stats();
  EXPECT_EQ(after.state_masks_computed, before.state_masks_computed);
  EXPECT_GT(after.state_mask_hits, before.state_mask_hits);
  EXPECT_EQ(mask, mask_b);
}

TEST(TokenMaskerTest, CacheBudgetIsKept) {
  const TokenMasker masker(ToyTokens(), 1, /*cache_bytes=*/200 << 10);
  std::mt19937 rng(5);
  for (int i = 0; i < 20; ++i) {
    // Distinct grammars: the cache drops the least recently used.
    auto g = Compile(absl::StrCat(R"({"type":"object","properties":{"k)", i,
                                  R"(":{"type":"string"}},"required":["k)", i, R"("]})")
                         .c_str());
    ASSERT_NE(g, nullptr);
    const std::string doc = GenerateByTokens(masker, g, &rng, /*check_every=*/3, 30);
    EXPECT_FALSE(doc.empty());
  }
  EXPECT_LE(masker.stats().cache_bytes, size_t{200} << 10);
  EXPECT_LT(masker.stats().grammars_cached, 20);  // some were dropped
}

TEST(TokenMaskerTest, ConcurrentCallersAgree) {
  const TokenMasker& masker = WorldMasker();
  auto g = Compile(kTreeSchema);
  std::vector<Matcher> positions;
  Matcher m(g);
  for (const char* step : {"{", "\"name\"", ":\"ab", "c\",\"value\":", "1", "2,", "\"children\":[",
                           "{\"name\":\"", "x\",\"children\":[]", "}"}) {
    ASSERT_TRUE(m.AdvanceBytes(step)) << step;
    positions.push_back(m);
  }
  std::vector<std::vector<uint8_t>> expected;
  for (const Matcher& p : positions) expected.push_back(BruteForce(masker, p));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint8_t> mask;
      for (int k = 0; k < 3; ++k) {
        for (size_t i = 0; i < positions.size(); ++i) {
          const size_t at = (i + t) % positions.size();
          masker.Allowed(positions[at], &mask);
          if (mask != expected[at]) ++mismatches;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// Prints the cost of Allowed on the world vocabulary at several positions (the first call
// computes the top state's walk; later ones hit the cache). A measurement, not a timed
// test: the numbers go to docs/structured-output.md.
TEST(TokenMaskerTest, WorldVocabularyCost) {
  const TokenMasker masker(WorldTokenBytes(), 0);
  struct Position {
    const char* name;
    std::shared_ptr<const Grammar> grammar;
    const char* prefix;
  };
  auto person = Compile(kPersonSchema);
  auto tree = Compile(kTreeSchema);
  auto any = AnyJsonObject();
  const Position positions[] = {
      {"person: start", person, ""},
      {"person: inside a string", person, R"({"name":"Jo)"},
      {"person: between keys", person, R"({"name":"Jo","age":41,)"},
      {"person: inside a number", person, R"({"name":"Jo","age":4)"},
      {"tree (recursive): inside a nested string", tree,
       R"({"name":"a","children":[{"name":"b","children":[{"name":"c)"},
      {"tree (recursive): after a nested value", tree,
       R"({"name":"a","children":[{"name":"b","value":12)"},
      {"json_object: inside a nested string", any, R"({"a":[1,{"b":"xy)"},
      {"json_object: inside a nested number", any, R"({"a":[1,{"b":12)"},
  };
  for (const Position& p : positions) {
    Matcher m(p.grammar);
    ASSERT_TRUE(m.AdvanceBytes(p.prefix)) << p.prefix;
    std::vector<uint8_t> mask;
    auto t0 = std::chrono::steady_clock::now();
    const int64_t count = masker.Allowed(m, &mask);
    auto t1 = std::chrono::steady_clock::now();
    constexpr int kRepeats = 50;
    for (int i = 0; i < kRepeats; ++i) masker.Allowed(m, &mask);
    auto t2 = std::chrono::steady_clock::now();
    std::cout << "world vocabulary, " << p.name << ": " << count << " allowed; first call "
              << std::chrono::duration<double, std::milli>(t1 - t0).count() << " ms, then "
              << std::chrono::duration<double, std::milli>(t2 - t1).count() / kRepeats << " ms\n";
  }
  const TokenMasker::Stats stats = masker.stats();
  std::cout << "state walks " << stats.state_masks_computed << ", uncertain tokens checked "
            << stats.uncertain_checked << ", cache " << stats.cache_bytes << " bytes\n";
}

}  // namespace
}  // namespace fwserve::constraints
