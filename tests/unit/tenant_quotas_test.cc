// TenantQuotas without a server: stream counts, the token bucket on a FakeClock, the
// session quota, and the stream observer's hand-back on refusal and on finish.
#include "server/tenancy/tenant_quotas.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/base/clock.h"
#include "server/metrics/metrics.h"
#include "server/tenancy/tenants.h"

namespace fwserve {
namespace {

// Records what reaches the transport's side of the stream.
class RecordingObserver : public GenerateObserver {
 public:
  void OnStart(std::shared_ptr<GenerateControl>) override { ++starts; }
  void OnChunk(GenerateChunk chunk) override { tokens += chunk.token_ids.size(); }
  void OnFinish(absl::Status status, GenerateSummary) override {
    ++finishes;
    last_status = status;
  }
  int starts = 0;
  size_t tokens = 0;
  int finishes = 0;
  absl::Status last_status;
};

GenerateChunk ChunkOf(int tokens) {
  GenerateChunk chunk;
  chunk.token_ids.assign(static_cast<size_t>(tokens), 65);
  return chunk;
}

std::unique_ptr<Tenants> TenantsFrom(const std::string& text) {
  auto tenants = Tenants::FromText(text);
  EXPECT_TRUE(tenants.ok()) << tenants.status();
  return std::move(*tenants);
}

constexpr char kHash[] = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

TEST(TenantQuotasTest, OpenServerHasNoQuotasAndNoWrapper) {
  FakeClock clock;
  TenantQuotas quotas(nullptr, &clock, Metrics::Null());
  RecordingObserver inner;
  for (int i = 0; i < 100; ++i) {
    auto admitted = quotas.AdmitStream("", &inner);
    ASSERT_TRUE(admitted.ok());
    EXPECT_EQ(*admitted, nullptr);
  }
  EXPECT_TRUE(quotas.CheckSessions("", [] { return int64_t{1'000'000}; }).ok());
  EXPECT_FALSE(quotas.TokensAvailable("").has_value());
}

TEST(TenantQuotasTest, MaxStreamsRefusesTheNextAndAFinishGivesOneBack) {
  FakeClock clock;
  auto tenants = TenantsFrom(std::string(kHash) + " tenant=a max_streams=2\n");
  TenantQuotas quotas(tenants.get(), &clock, Metrics::Null());
  RecordingObserver inner;
  auto first = quotas.AdmitStream("a", &inner);
  auto second = quotas.AdmitStream("a", &inner);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_NE(*first, nullptr);
  EXPECT_EQ(quotas.OpenStreams("a"), 2);
  auto third = quotas.AdmitStream("a", &inner);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("max_streams"), std::string::npos);
  EXPECT_NE(third.status().message().find("'a'"), std::string::npos);

  // The engine took the first: it deletes itself after OnFinish, which ends its stream.
  GenerateObserver* running = first->release();
  running->OnChunk(ChunkOf(3));
  running->OnFinish(absl::OkStatus(), GenerateSummary{});
  EXPECT_EQ(inner.tokens, 3u);
  EXPECT_EQ(inner.finishes, 1);
  EXPECT_EQ(quotas.OpenStreams("a"), 1);
  EXPECT_TRUE(quotas.AdmitStream("a", &inner).ok());  // destroyed at once: refused later
  EXPECT_EQ(quotas.OpenStreams("a"), 1);
}

TEST(TenantQuotasTest, ARequestRefusedAfterAdmissionGivesItsStreamBackSilently) {
  FakeClock clock;
  auto tenants = TenantsFrom(std::string(kHash) + " tenant=a max_streams=1\n");
  TenantQuotas quotas(tenants.get(), &clock, Metrics::Null());
  RecordingObserver inner;
  {
    auto admitted = quotas.AdmitStream("a", &inner);
    ASSERT_TRUE(admitted.ok());
    EXPECT_EQ(quotas.OpenStreams("a"), 1);
    // The core refuses the request (e.g. a full queue): the wrapper is destroyed.
  }
  EXPECT_EQ(quotas.OpenStreams("a"), 0);
  EXPECT_EQ(inner.finishes, 0);  // the transport answers the refusal itself
  EXPECT_TRUE(quotas.AdmitStream("a", &inner).ok());
}

TEST(TenantQuotasTest, TokenBucketRefillsWithTheClockUpToOneSecond) {
  FakeClock clock;
  auto tenants = TenantsFrom(std::string(kHash) + " tenant=a tokens_per_second=100\n");
  TenantQuotas quotas(tenants.get(), &clock, Metrics::Null());
  RecordingObserver inner;
  ASSERT_EQ(quotas.TokensAvailable("a"), 100.0);  // starts full: one second's worth

  auto stream = quotas.AdmitStream("a", &inner);
  ASSERT_TRUE(stream.ok());
  GenerateObserver* running = stream->release();
  running->OnChunk(ChunkOf(150));  // a running stream is not cut short: goes negative
  EXPECT_DOUBLE_EQ(*quotas.TokensAvailable("a"), -50.0);

  auto refused = quotas.AdmitStream("a", &inner);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  // 51 tokens at 100/s are needed to get above zero: 510 ms.
  EXPECT_NE(refused.status().message().find("retry in 510 ms"), std::string::npos)
      << refused.status().message();

  clock.Advance(absl::Milliseconds(500));  // +50: exactly empty, still refused
  EXPECT_DOUBLE_EQ(*quotas.TokensAvailable("a"), 0.0);
  EXPECT_FALSE(quotas.AdmitStream("a", &inner).ok());
  clock.Advance(absl::Milliseconds(10));  // +1
  EXPECT_DOUBLE_EQ(*quotas.TokensAvailable("a"), 1.0);
  auto again = quotas.AdmitStream("a", &inner);
  EXPECT_TRUE(again.ok());

  clock.Advance(absl::Hours(1));  // the bucket holds at most one second's worth
  EXPECT_DOUBLE_EQ(*quotas.TokensAvailable("a"), 100.0);
  running->OnFinish(absl::OkStatus(), GenerateSummary{});
}

TEST(TenantQuotasTest, TenantsDoNotShareBuckets) {
  FakeClock clock;
  auto tenants =
      TenantsFrom(std::string(kHash) +
                  " tenant=a tokens_per_second=10\n"
                  "sha256:1111111111111111111111111111111111111111111111111111111111111111"
                  " tenant=b tokens_per_second=10\n");
  TenantQuotas quotas(tenants.get(), &clock, Metrics::Null());
  RecordingObserver inner;
  auto a = quotas.AdmitStream("a", &inner);
  ASSERT_TRUE(a.ok());
  GenerateObserver* running = a->release();
  running->OnChunk(ChunkOf(1000));
  EXPECT_FALSE(quotas.AdmitStream("a", &inner).ok());
  EXPECT_TRUE(quotas.AdmitStream("b", &inner).ok());
  running->OnFinish(absl::OkStatus(), GenerateSummary{});
}

TEST(TenantQuotasTest, MaxSessionsRefusesAtTheLimit) {
  FakeClock clock;
  auto tenants = TenantsFrom(std::string(kHash) + " tenant=a max_sessions=3\n");
  TenantQuotas quotas(tenants.get(), &clock, Metrics::Null());
  EXPECT_TRUE(quotas.CheckSessions("a", [] { return int64_t{2}; }).ok());
  absl::Status full = quotas.CheckSessions("a", [] { return int64_t{3}; });
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("max_sessions"), std::string::npos);
  // A tenant removed by a reload runs without quotas.
  EXPECT_TRUE(quotas.CheckSessions("gone", [] { return int64_t{1'000'000}; }).ok());
}

}  // namespace
}  // namespace fwserve
