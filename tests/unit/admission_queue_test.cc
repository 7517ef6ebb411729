// The engine's AdmissionQueue without an engine: queue limits, the per-tenant share of
// the queue, session operations past full stream slots, fair share between tenants and
// the drain order at shutdown, CoDel's shedding and newest-first order under a standing
// queue.
#include "server/engine/admission_queue.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fwserve {
namespace {

struct FakeItem {
  std::string tenant;
  bool stream = true;
  int id = 0;
};

class AdmissionQueueTest : public ::testing::Test {
 protected:
  AdmissionQueue<FakeItem> MakeQueue(int64_t max_queued, int64_t max_active) {
    AdmissionOptions options;
    options.model = "m";
    options.max_queued = max_queued;
    options.max_active_streams = max_active;
    return AdmissionQueue<FakeItem>(options, [](const FakeItem& item) { return item.stream; });
  }

  absl::Status Push(AdmissionQueue<FakeItem>& queue, std::string tenant, bool stream = true) {
    auto item = std::make_unique<FakeItem>();
    item->tenant = std::move(tenant);
    item->stream = stream;
    item->id = next_id_++;
    return queue.Push(item);
  }

  // Takes what may start with `active` running streams and the given running tenants;
  // returns the ids in admission order.
  std::vector<int> Take(AdmissionQueue<FakeItem>& queue, int64_t& active,
                        absl::flat_hash_map<std::string, int64_t> running = {},
                        bool admit_all = false) {
    std::vector<std::unique_ptr<FakeItem>> admitted;
    queue.TakeAdmissible(
        active, admit_all, [&running] { return running; }, admitted);
    std::vector<int> ids;
    for (const auto& item : admitted) {
      ids.push_back(item->id);
      last_tenants_.push_back(item->tenant);
    }
    return ids;
  }

  int next_id_ = 0;
  std::vector<std::string> last_tenants_;
};

TEST_F(AdmissionQueueTest, AFullQueueRefusesNamingTheFlagAndKeepsTheItem) {
  auto queue = MakeQueue(/*max_queued=*/2, /*max_active=*/1);
  ASSERT_TRUE(Push(queue, "").ok());
  ASSERT_TRUE(Push(queue, "").ok());
  auto item = std::make_unique<FakeItem>();
  item->id = 99;
  absl::Status refused = queue.Push(item);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max-queued-requests=2"), std::string::npos);
  EXPECT_NE(refused.message().find("model 'm'"), std::string::npos);
  ASSERT_NE(item, nullptr);  // handed back untouched
  EXPECT_EQ(item->id, 99);
  EXPECT_EQ(queue.size(), 2);
}

TEST_F(AdmissionQueueTest, OneTenantMayHoldAtMostHalfTheQueue) {
  auto queue = MakeQueue(/*max_queued=*/4, /*max_active=*/1);
  ASSERT_TRUE(Push(queue, "a").ok());
  ASSERT_TRUE(Push(queue, "a").ok());
  absl::Status refused = Push(queue, "a");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("tenant 'a' has 2 requests queued"), std::string::npos);
  EXPECT_TRUE(Push(queue, "b").ok());
  EXPECT_TRUE(Push(queue, "b").ok());
  // The anonymous tenant of an open server has no share limit (only the total).
  auto open = MakeQueue(/*max_queued=*/4, /*max_active=*/1);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Push(open, "").ok());
}

TEST_F(AdmissionQueueTest, ACapacityBelowTheFlagBoundsTheQueueAndTheTenantShare) {
  AdmissionOptions options;
  options.model = "m";
  options.max_queued = 100;
  options.max_queue_wait = absl::Milliseconds(50);
  AdmissionQueue<FakeItem> queue(options, [](const FakeItem& item) { return item.stream; });
  auto push = [&](std::string tenant, int64_t capacity) {
    auto item = std::make_unique<FakeItem>();
    item->tenant = std::move(tenant);
    return queue.Push(item, capacity);
  };
  // Capacity 4 (what drains within --max-queue-wait): tenant a gets half of it.
  ASSERT_TRUE(push("a", 4).ok());
  ASSERT_TRUE(push("a", 4).ok());
  absl::Status share = push("a", 4);
  EXPECT_EQ(share.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(share.message().find("its share of the queue (half of 4 requests, what drains "
                                 "within --max-queue-wait=50ms)"),
            std::string::npos)
      << share.message();
  ASSERT_TRUE(push("b", 4).ok());
  ASSERT_TRUE(push("b", 4).ok());
  absl::Status full = push("c", 4);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("is full (4 requests, what drains within --max-queue-wait=50ms)"),
            std::string::npos)
      << full.message();
  // A larger capacity (the drain rate rose) admits again; one above the flag is the flag.
  EXPECT_TRUE(push("c", 6).ok());
  EXPECT_EQ(queue.size(), 5);
  for (int i = 0; i < 95; ++i) ASSERT_TRUE(push("", 1000).ok()) << i;
  absl::Status flag = push("", 1000);
  EXPECT_NE(flag.message().find("--max-queued-requests=100"), std::string::npos) << flag.message();
  // Each refusal says why as data, not only in its text (fwserve_requests_refused_total).
  EXPECT_EQ(RefusalReasonOf(share), RefusalReason::kTenantQueueShare);
  EXPECT_EQ(RefusalReasonOf(full), RefusalReason::kQueueWait);
  EXPECT_EQ(RefusalReasonOf(flag), RefusalReason::kQueueFull);
  EXPECT_STREQ(RefusalReasonLabel(*RefusalReasonOf(share)), "tenant_queue_share");
  EXPECT_FALSE(RefusalReasonOf(absl::ResourceExhaustedError("its share of the queue")).has_value());
}

TEST_F(AdmissionQueueTest, OneTenantIsFifoAndStopsAtTheStreamSlots) {
  auto queue = MakeQueue(/*max_queued=*/10, /*max_active=*/3);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Push(queue, "").ok());
  int64_t active = 1;
  EXPECT_EQ(Take(queue, active), (std::vector<int>{0, 1}));
  EXPECT_EQ(active, 3);
  EXPECT_FALSE(queue.HasAdmissible(active));
  EXPECT_EQ(Take(queue, active), (std::vector<int>{}));
  active = 2;  // one stream ended
  EXPECT_TRUE(queue.HasAdmissible(active));
  EXPECT_EQ(Take(queue, active), (std::vector<int>{2}));
}

TEST_F(AdmissionQueueTest, SessionOperationsNeverWaitForStreamSlots) {
  auto queue = MakeQueue(/*max_queued=*/10, /*max_active=*/1);
  ASSERT_TRUE(Push(queue, "", /*stream=*/true).ok());   // 0
  ASSERT_TRUE(Push(queue, "", /*stream=*/true).ok());   // 1
  ASSERT_TRUE(Push(queue, "", /*stream=*/false).ok());  // 2: e.g. a fork
  int64_t active = 1;                                   // every slot taken
  EXPECT_TRUE(queue.HasAdmissible(active));
  EXPECT_EQ(Take(queue, active), (std::vector<int>{2}));
  EXPECT_EQ(active, 1);
  EXPECT_EQ(queue.size(), 2);
}

TEST_F(AdmissionQueueTest, AFreeSlotGoesToTheTenantWithFewestRunningStreams) {
  auto queue = MakeQueue(/*max_queued=*/20, /*max_active=*/4);
  // Tenant a queued first and more, but already runs 3 streams; b runs none.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Push(queue, "a").ok());  // 0..3
  ASSERT_TRUE(Push(queue, "b").ok());                              // 4
  ASSERT_TRUE(Push(queue, "b").ok());                              // 5
  int64_t active = 3;
  EXPECT_EQ(Take(queue, active, {{"a", 3}}), (std::vector<int>{4}));
  // Under FIFO item 0 (tenant a) would have started: this is what makes the test fail
  // for a plain queue.
  EXPECT_EQ(active, 4);
}

TEST_F(AdmissionQueueTest, TiesGoToTheTenantServedLeastRecently) {
  auto queue = MakeQueue(/*max_queued=*/20, /*max_active=*/2);
  ASSERT_TRUE(Push(queue, "a").ok());  // 0
  ASSERT_TRUE(Push(queue, "a").ok());  // 1
  ASSERT_TRUE(Push(queue, "b").ok());  // 2
  ASSERT_TRUE(Push(queue, "b").ok());  // 3
  ASSERT_TRUE(Push(queue, "a").ok());  // 4
  ASSERT_TRUE(Push(queue, "b").ok());  // 5
  int64_t active = 1;
  // Nobody runs, nobody was served: the oldest (a) goes first.
  EXPECT_EQ(Take(queue, active), (std::vector<int>{0}));
  active = 1;  // a's stream ended, b's turn: equal running counts, b served less recently
  EXPECT_EQ(Take(queue, active), (std::vector<int>{2}));
  active = 1;
  EXPECT_EQ(Take(queue, active), (std::vector<int>{1}));
  active = 1;
  EXPECT_EQ(Take(queue, active), (std::vector<int>{3}));
}

TEST_F(AdmissionQueueTest, SeveralFreeSlotsAlternateBetweenTenants) {
  auto queue = MakeQueue(/*max_queued=*/20, /*max_active=*/4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Push(queue, "a").ok());  // 0..3
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Push(queue, "b").ok());  // 4, 5
  int64_t active = 0;
  EXPECT_EQ(Take(queue, active), (std::vector<int>{0, 4, 1, 5}));
  EXPECT_EQ(active, 4);
}

TEST_F(AdmissionQueueTest, AdmitAllTakesEverythingOldestFirst) {
  auto queue = MakeQueue(/*max_queued=*/20, /*max_active=*/1);
  ASSERT_TRUE(Push(queue, "a").ok());
  ASSERT_TRUE(Push(queue, "b", /*stream=*/false).ok());
  ASSERT_TRUE(Push(queue, "b").ok());
  int64_t active = 1;
  EXPECT_EQ(Take(queue, active, {}, /*admit_all=*/true), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(queue.empty());
}

// CoDel: a queue of streams that has not been empty for the interval stands; then what
// waited past the target is shed, session operations never.
class CodelQueueTest : public AdmissionQueueTest {
 protected:
  AdmissionQueue<FakeItem> MakeCodelQueue(int64_t max_active) {
    AdmissionOptions options;
    options.model = "m";
    options.max_queued = 100;
    options.max_active_streams = max_active;
    options.codel_target = absl::Milliseconds(10);
    options.codel_interval = absl::Milliseconds(100);
    return AdmissionQueue<FakeItem>(options, [](const FakeItem& item) { return item.stream; });
  }
  absl::Status PushAt(AdmissionQueue<FakeItem>& queue, absl::Duration at, std::string tenant = "",
                      bool stream = true) {
    auto item = std::make_unique<FakeItem>();
    item->tenant = std::move(tenant);
    item->stream = stream;
    item->id = next_id_++;
    return queue.Push(item, 0, t0_ + at);
  }
  std::vector<int> ShedAt(AdmissionQueue<FakeItem>& queue, absl::Duration at,
                          absl::flat_hash_map<std::string, int64_t> running = {{"", 1}}) {
    std::vector<std::unique_ptr<FakeItem>> shed;
    queue.TakeShed(
        t0_ + at, [&running] { return running; }, shed);
    std::vector<int> ids;
    for (const auto& item : shed) ids.push_back(item->id);
    return ids;
  }
  std::vector<int> TakeAt(AdmissionQueue<FakeItem>& queue, absl::Duration at, int64_t& active,
                          absl::flat_hash_map<std::string, int64_t> running = {}) {
    std::vector<std::unique_ptr<FakeItem>> admitted;
    queue.TakeAdmissible(
        active, false, [&running] { return running; }, admitted, t0_ + at);
    std::vector<int> ids;
    for (const auto& item : admitted) ids.push_back(item->id);
    return ids;
  }
  const absl::Time t0_ = absl::FromUnixSeconds(1'700'000'000);
};

TEST_F(CodelQueueTest, OnlyAStandingQueueShedsAndOnlyWhatWaitedPastTheTarget) {
  auto queue = MakeCodelQueue(/*max_active=*/1);
  const auto ms = [](int n) { return absl::Milliseconds(n); };
  ASSERT_TRUE(PushAt(queue, ms(0)).ok());                        // 0
  ASSERT_TRUE(PushAt(queue, ms(1), "", /*stream=*/false).ok());  // 1: a fork
  ASSERT_TRUE(PushAt(queue, ms(2)).ok());                        // 2
  ASSERT_TRUE(PushAt(queue, ms(95)).ok());                       // 3
  EXPECT_FALSE(queue.Standing(t0_ + ms(99)));
  // Waited 99 ms, far past the target, but the queue does not stand yet: kept.
  EXPECT_EQ(ShedAt(queue, ms(99)), (std::vector<int>{}));
  EXPECT_TRUE(queue.Standing(t0_ + ms(100)));
  // Standing: 0 and 2 waited past 10 ms; 3 (5 ms) stays, and so does the fork.
  EXPECT_EQ(ShedAt(queue, ms(100)), (std::vector<int>{0, 2}));
  EXPECT_EQ(queue.size(), 2);
}

TEST_F(CodelQueueTest, AStandingQueueStartsTheNewestFirstWithinTheFairShare) {
  auto queue = MakeCodelQueue(/*max_active=*/1);
  const auto ms = [](int n) { return absl::Milliseconds(n); };
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(PushAt(queue, ms(i), "a").ok());  // 0, 1, 2
  int64_t active = 0;
  // Not standing yet: first come, first served.
  EXPECT_EQ(TakeAt(queue, ms(50), active, {{"a", 0}}), (std::vector<int>{0}));
  ASSERT_TRUE(PushAt(queue, ms(60), "a").ok());  // 3
  ASSERT_TRUE(PushAt(queue, ms(61), "b").ok());  // 4
  ASSERT_TRUE(PushAt(queue, ms(62), "a").ok());  // 5
  active = 0;
  // Standing (not empty since 0 ms): the newest, 5, but the fair share comes first, so
  // tenant b (nothing running) goes before a's newer request.
  EXPECT_EQ(TakeAt(queue, ms(150), active, {{"a", 1}}), (std::vector<int>{4}));
  active = 0;
  EXPECT_EQ(TakeAt(queue, ms(151), active, {{"a", 0}, {"b", 1}}), (std::vector<int>{5}));
  active = 0;
  EXPECT_EQ(TakeAt(queue, ms(152), active, {{"a", 0}, {"b", 1}}), (std::vector<int>{3}));
}

TEST_F(CodelQueueTest, AnEmptiedQueueStandsAgainOnlyAfterAFullInterval) {
  auto queue = MakeCodelQueue(/*max_active=*/1);
  const auto ms = [](int n) { return absl::Milliseconds(n); };
  ASSERT_TRUE(PushAt(queue, ms(0)).ok());  // 0
  ASSERT_TRUE(PushAt(queue, ms(1)).ok());  // 1
  int64_t active = 0;
  EXPECT_EQ(TakeAt(queue, ms(120), active), (std::vector<int>{1}));  // standing: newest
  EXPECT_EQ(ShedAt(queue, ms(120)), (std::vector<int>{0}));          // and the rest shed
  EXPECT_TRUE(queue.empty());
  ASSERT_TRUE(PushAt(queue, ms(130)).ok());  // 2: the queue was empty until 130 ms
  EXPECT_FALSE(queue.Standing(t0_ + ms(229)));
  EXPECT_EQ(ShedAt(queue, ms(229)), (std::vector<int>{}));
  EXPECT_TRUE(queue.Standing(t0_ + ms(230)));
  EXPECT_EQ(ShedAt(queue, ms(230)), (std::vector<int>{2}));
}

TEST_F(CodelQueueTest, OffByDefaultNothingStandsOrIsShed) {
  auto queue = MakeQueue(/*max_queued=*/10, /*max_active=*/1);
  auto item = std::make_unique<FakeItem>();
  ASSERT_TRUE(queue.Push(item, 0, t0_).ok());
  EXPECT_FALSE(queue.Standing(t0_ + absl::Hours(1)));
  std::vector<std::unique_ptr<FakeItem>> shed;
  queue.TakeShed(
      t0_ + absl::Hours(1),
      [] {
        return absl::flat_hash_map<std::string, int64_t>{{"", 1}};
      },
      shed);
  EXPECT_TRUE(shed.empty());
}

TEST_F(CodelQueueTest, AQueueFullWithinTheIntervalStandsAtOnce) {
  AdmissionOptions options;
  options.model = "m";
  options.max_queued = 2;
  options.max_active_streams = 1;
  options.codel_target = absl::Milliseconds(10);
  options.codel_interval = absl::Milliseconds(100);
  AdmissionQueue<FakeItem> queue(options, [](const FakeItem& item) { return item.stream; });
  const auto ms = [](int n) { return absl::Milliseconds(n); };
  ASSERT_TRUE(PushAt(queue, ms(0)).ok());  // 0
  EXPECT_FALSE(queue.Standing(t0_ + ms(20)));
  ASSERT_TRUE(PushAt(queue, ms(20)).ok());  // 1: the queue is full
  EXPECT_TRUE(queue.Standing(t0_ + ms(21)));
  EXPECT_EQ(ShedAt(queue, ms(21)), (std::vector<int>{0}));
  EXPECT_EQ(ShedAt(queue, ms(31)), (std::vector<int>{1}));  // empty now, at 31 ms
  ASSERT_TRUE(PushAt(queue, ms(40)).ok());                  // 2
  // Emptied 9 ms ago, but full 20 ms ago: a storm still on. Standing.
  EXPECT_TRUE(queue.Standing(t0_ + ms(51)));
  EXPECT_EQ(ShedAt(queue, ms(51)), (std::vector<int>{2}));
  ASSERT_TRUE(PushAt(queue, ms(130)).ok());  // 3: full 110 ms ago, empty 79 ms ago
  EXPECT_FALSE(queue.Standing(t0_ + ms(141)));
  EXPECT_EQ(ShedAt(queue, ms(141)), (std::vector<int>{}));
}

TEST_F(CodelQueueTest, ATenantBelowItsFairShareIsNeverShed) {
  auto queue = MakeCodelQueue(/*max_active=*/4);
  const auto ms = [](int n) { return absl::Milliseconds(n); };
  ASSERT_TRUE(PushAt(queue, ms(0), "storm").ok());  // 0
  ASSERT_TRUE(PushAt(queue, ms(1), "calm").ok());   // 1
  ASSERT_TRUE(PushAt(queue, ms(2), "storm").ok());  // 2
  // Two tenants, a share of 2 slots each: storm runs 3, calm 1. Storm's old requests
  // go; calm's, as old, stays.
  EXPECT_EQ(ShedAt(queue, ms(150), {{"storm", 3}, {"calm", 1}}), (std::vector<int>{0, 2}));
  EXPECT_EQ(queue.size(), 1);
  // At its share calm is shed like anyone else.
  EXPECT_EQ(ShedAt(queue, ms(160), {{"storm", 2}, {"calm", 2}}), (std::vector<int>{1}));
}

}  // namespace
}  // namespace fwserve
