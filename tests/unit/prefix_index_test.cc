// PrefixIndex: the longest kept conversation a prompt begins with, per tenant and model,
// bounded with least-recently-used eviction.
#include "server/sessions/prefix_index.h"

#include <gtest/gtest.h>

namespace fwserve {
namespace {

// A byte-level model's token ids of `text`.
PrefixIndex::Tokens Ids(const std::string& text) {
  return PrefixIndex::Tokens(text.begin(), text.end());
}

TEST(PrefixIndexTest, FindsTheLongestConversationThePromptBeginsWith) {
  PrefixIndex index(8);
  EXPECT_TRUE(index.Insert("t", "m", Ids("USER:\nhi\n\nASSISTANT:\nhello"), "s1").empty());
  EXPECT_TRUE(
      index.Insert("t", "m", Ids("USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore"), "s2").empty());
  EXPECT_TRUE(index.Insert("t", "m", Ids("USER:\nother"), "s3").empty());
  auto match =
      index.Find("t", "m", Ids("USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore\n\nASSISTANT:\n"));
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s2");
  EXPECT_EQ(match->length, std::string("USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore").size());
  match = index.Find("t", "m", Ids("USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nless"));
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s1");
  // A whole prompt equal to a conversation continues it with nothing to prefill.
  match = index.Find("t", "m", Ids("USER:\nother"));
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s3");
  EXPECT_FALSE(index.Find("t", "m", Ids("USER:\nh")).has_value());  // shorter than any
  EXPECT_FALSE(index.Find("t", "m", Ids("ASSISTANT:\nhello")).has_value());
}

// Conversations are token ids, of any vocabulary: a prompt continues one only when its
// ids begin with all of the conversation's. A prompt whose text would begin with the
// conversation's text but whose tokenizer merged across the boundary (other ids) does
// not: its state would differ from a full prefill's.
TEST(PrefixIndexTest, ComparesTokenIdsOfAnyVocabulary) {
  PrefixIndex index(8);
  EXPECT_TRUE(index.Insert("t", "m", {40000, 11, 65529}, "s1").empty());
  auto match = index.Find("t", "m", PrefixIndex::Tokens{40000, 11, 65529, 7, 8});
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s1");
  EXPECT_EQ(match->length, 3u);
  // "ab" + "c" kept as [a, b, c]; the new prompt's tokenizer made [a, bc, d].
  EXPECT_FALSE(index.Find("t", "m", PrefixIndex::Tokens{40000, 12, 13}).has_value());
  EXPECT_FALSE(index.Find("t", "m", PrefixIndex::Tokens{40000, 11}).has_value());
}

TEST(PrefixIndexTest, NeverAcrossTenantsOrModels) {
  PrefixIndex index(8);
  index.Insert("alice", "m", Ids("USER:\nsecret"), "a1");
  EXPECT_FALSE(index.Find("bob", "m", Ids("USER:\nsecret and more")).has_value());
  EXPECT_FALSE(index.Find("alice", "other", Ids("USER:\nsecret and more")).has_value());
  EXPECT_FALSE(index.Find("", "m", Ids("USER:\nsecret and more")).has_value());
  EXPECT_TRUE(index.Find("alice", "m", Ids("USER:\nsecret and more")).has_value());
}

TEST(PrefixIndexTest, BoundedLeastRecentlyUsedFirstAndOneEntryPerConversation) {
  PrefixIndex index(2);
  EXPECT_TRUE(index.Insert("t", "m", Ids("a"), "s1").empty());
  EXPECT_TRUE(index.Insert("t", "m", Ids("b"), "s2").empty());
  ASSERT_TRUE(index.Find("t", "m", Ids("a!")).has_value());  // s1 is now the most recent
  EXPECT_EQ(index.Insert("t", "m", Ids("c"), "s3"), std::vector<std::string>{"s2"});
  EXPECT_FALSE(index.Find("t", "m", Ids("b!")).has_value());
  EXPECT_EQ(index.size(), 2u);
  // The same conversation again: the newer session replaces the older.
  EXPECT_EQ(index.Insert("t", "m", Ids("a"), "s4"), std::vector<std::string>{"s1"});
  EXPECT_EQ(index.Find("t", "m", Ids("a!"))->session_id, "s4");
  // Other owners have bounds of their own.
  EXPECT_TRUE(index.Insert("u", "m", Ids("a"), "u1").empty());
  EXPECT_EQ(index.size(), 3u);
  EXPECT_TRUE(index.Erase("t", "m", "s4"));
  EXPECT_FALSE(index.Erase("t", "m", "s4"));
  EXPECT_FALSE(index.Find("t", "m", Ids("a!")).has_value());
  EXPECT_EQ(index.size(), 2u);
}

TEST(PrefixIndexTest, CapacityZeroKeepsNothing) {
  PrefixIndex index(0);
  EXPECT_EQ(index.Insert("t", "m", Ids("a"), "s1"), std::vector<std::string>{"s1"});
  EXPECT_FALSE(index.Find("t", "m", Ids("a!")).has_value());
  EXPECT_EQ(index.size(), 0u);
}

}  // namespace
}  // namespace fwserve
