// PrefixIndex: the longest kept conversation a prompt begins with, per tenant and model,
// bounded with least-recently-used eviction.
#include "server/sessions/prefix_index.h"

#include <gtest/gtest.h>

namespace fwserve {
namespace {

TEST(PrefixIndexTest, FindsTheLongestConversationThePromptBeginsWith) {
  PrefixIndex index(8);
  EXPECT_TRUE(index.Insert("t", "m", "USER:\nhi\n\nASSISTANT:\nhello", "s1").empty());
  EXPECT_TRUE(
      index.Insert("t", "m", "USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore", "s2").empty());
  EXPECT_TRUE(index.Insert("t", "m", "USER:\nother", "s3").empty());
  auto match =
      index.Find("t", "m", "USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore\n\nASSISTANT:\n");
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s2");
  EXPECT_EQ(match->length, std::string("USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nmore").size());
  match = index.Find("t", "m", "USER:\nhi\n\nASSISTANT:\nhello\n\nUSER:\nless");
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s1");
  // A whole prompt equal to a conversation continues it with nothing to prefill.
  match = index.Find("t", "m", "USER:\nother");
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->session_id, "s3");
  EXPECT_FALSE(index.Find("t", "m", "USER:\nh").has_value());  // shorter than any
  EXPECT_FALSE(index.Find("t", "m", "ASSISTANT:\nhello").has_value());
}

TEST(PrefixIndexTest, NeverAcrossTenantsOrModels) {
  PrefixIndex index(8);
  index.Insert("alice", "m", "USER:\nsecret", "a1");
  EXPECT_FALSE(index.Find("bob", "m", "USER:\nsecret and more").has_value());
  EXPECT_FALSE(index.Find("alice", "other", "USER:\nsecret and more").has_value());
  EXPECT_FALSE(index.Find("", "m", "USER:\nsecret and more").has_value());
  EXPECT_TRUE(index.Find("alice", "m", "USER:\nsecret and more").has_value());
}

TEST(PrefixIndexTest, BoundedLeastRecentlyUsedFirstAndOneEntryPerConversation) {
  PrefixIndex index(2);
  EXPECT_TRUE(index.Insert("t", "m", "a", "s1").empty());
  EXPECT_TRUE(index.Insert("t", "m", "b", "s2").empty());
  ASSERT_TRUE(index.Find("t", "m", "a!").has_value());  // s1 is now the most recent
  EXPECT_EQ(index.Insert("t", "m", "c", "s3"), std::vector<std::string>{"s2"});
  EXPECT_FALSE(index.Find("t", "m", "b!").has_value());
  EXPECT_EQ(index.size(), 2u);
  // The same conversation again: the newer session replaces the older.
  EXPECT_EQ(index.Insert("t", "m", "a", "s4"), std::vector<std::string>{"s1"});
  EXPECT_EQ(index.Find("t", "m", "a!")->session_id, "s4");
  // Other owners have bounds of their own.
  EXPECT_TRUE(index.Insert("u", "m", "a", "u1").empty());
  EXPECT_EQ(index.size(), 3u);
  EXPECT_TRUE(index.Erase("t", "m", "s4"));
  EXPECT_FALSE(index.Erase("t", "m", "s4"));
  EXPECT_FALSE(index.Find("t", "m", "a!").has_value());
  EXPECT_EQ(index.size(), 2u);
}

TEST(PrefixIndexTest, CapacityZeroKeepsNothing) {
  PrefixIndex index(0);
  EXPECT_EQ(index.Insert("t", "m", "a", "s1"), std::vector<std::string>{"s1"});
  EXPECT_FALSE(index.Find("t", "m", "a!").has_value());
  EXPECT_EQ(index.size(), 0u);
}

}  // namespace
}  // namespace fwserve
