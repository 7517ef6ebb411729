// Which resident session gives its slot up: LRU within the tenant holding the most,
// never one in use, never one the caller vetoes.
#include "server/engine/residency.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace fwserve {
namespace {

const absl::Time kResidencyT0 = absl::FromUnixSeconds(1'700'000'000);

ResidentSession At(int minutes, const std::string& tenant, bool in_use = false) {
  ResidentSession r;
  r.last_used = kResidencyT0 + absl::Minutes(minutes);
  r.tenant = tenant;
  r.in_use = in_use;
  return r;
}

const auto kAny = [](const std::string&) { return true; };

TEST(ResidencyTest, OneTenantIsPlainLru) {
  ResidentSessions resident = {{"a", At(3, "")}, {"b", At(1, "")}, {"c", At(2, "")}};
  EXPECT_EQ(ChooseSessionToRelease(resident, kAny), "b");
}

TEST(ResidencyTest, SessionsInUseAreNeverChosen) {
  ResidentSessions resident = {{"a", At(3, "")}, {"b", At(1, "", /*in_use=*/true)}};
  EXPECT_EQ(ChooseSessionToRelease(resident, kAny), "a");
  resident["a"].in_use = true;
  EXPECT_EQ(ChooseSessionToRelease(resident, kAny), "");
}

TEST(ResidencyTest, TheTenantHoldingMostLosesItsOwnOldestFirst) {
  // Tenant x holds the oldest session, but y holds more: y's oldest goes.
  ResidentSessions resident = {
      {"x1", At(0, "x")}, {"y1", At(5, "y")}, {"y2", At(4, "y")}, {"y3", At(6, "y")}};
  EXPECT_EQ(ChooseSessionToRelease(resident, kAny), "y2");
}

TEST(ResidencyTest, AVetoedCandidateIsSkippedAndOnlyBetterOnesAreAsked) {
  ResidentSessions resident = {{"a", At(1, "")}, {"b", At(2, "")}, {"c", At(3, "")}};
  std::set<std::string> asked;
  const std::string chosen = ChooseSessionToRelease(resident, [&](const std::string& id) {
    asked.insert(id);
    return id != "a";  // e.g. busy, or not yet saved to the store
  });
  EXPECT_EQ(chosen, "b");
  EXPECT_TRUE(asked.count("a"));
  EXPECT_TRUE(asked.count("b"));
  EXPECT_EQ(ChooseSessionToRelease(resident, [](const std::string&) { return false; }), "");
}

}  // namespace
}  // namespace fwserve
