// Both SessionDirectory implementations without a server or a model: claims (tenant,
// model, busy), reads and pages, the engine's policy, store I/O, indexing of a dir:
// store, and for the shared one the lease in the store: released before an error is
// answered, fenced writes, renewal, and a lost lease seen by the renewer. The shared
// directory runs over an in-memory fake of the shared store here; the real-Redis tests
// (redis_store_test, the shared-store integration tests) stay.
#include "server/sessions/session_directory.h"

#include <filesystem>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/sessions/store/session_store.h"
#include "tests/common/fake_shared_store.h"

namespace fwserve {
namespace {

const std::string kId1 = "00000000000000000000000000000001";
const std::string kId2 = "00000000000000000000000000000002";
const std::string kId3 = "00000000000000000000000000000003";

// Waits for one asynchronous answer.
template <typename T>
struct Answer {
  std::function<void(absl::StatusOr<T>)> callback() {
    return [this](absl::StatusOr<T> result) {
      value = std::move(result);
      done.Notify();
    };
  }
  absl::StatusOr<T>& Wait() {
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return value;
  }
  absl::Notification done;
  absl::StatusOr<T> value = absl::UnknownError("not answered");
};

SessionRecord Record(const std::string& id, const std::string& model, const std::string& tenant,
                     int created_seconds = 0) {
  SessionRecord record;
  record.id = id;
  record.model = model;
  record.tenant = tenant;
  record.created = record.last_used = absl::FromUnixSeconds(1'700'000'000 + created_seconds);
  record.resident = true;
  return record;
}

std::unique_ptr<SessionDirectory> Local(std::unique_ptr<SessionStore> store = nullptr) {
  SessionDirectoryOptions options;
  options.store = std::move(store);
  options.max_sessions = 100;
  return MakeSessionDirectory(std::move(options));
}

// --- Local (memory and dir:) ---

TEST(LocalSessionDirectoryTest, ClaimsCheckTenantModelAndBusyAtOnce) {
  auto directory = Local();
  ASSERT_TRUE(directory->registry().Insert(Record(kId1, "m", "acme")).ok());
  absl::StatusOr<SessionClaim> first = absl::UnknownError("");
  bool answered_at_once = false;
  directory->Claim("acme", kId1, "", [&](absl::StatusOr<SessionClaim> claim) {
    first = std::move(claim);
    answered_at_once = true;
  });
  ASSERT_TRUE(answered_at_once);  // a local claim never waits
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->model, "m");
  EXPECT_EQ(first->ticket, nullptr);
  EXPECT_TRUE(first->lease.held());

  const auto claim = [&](const std::string& tenant, const std::string& id,
                         const std::string& model) {
    absl::Status status = absl::UnknownError("not answered");
    directory->Claim(tenant, id, model,
                     [&](absl::StatusOr<SessionClaim> c) { status = c.status(); });
    return status;
  };
  EXPECT_EQ(claim("acme", kId1, "").code(), absl::StatusCode::kAborted);   // busy
  EXPECT_EQ(claim("beta", kId1, "").code(), absl::StatusCode::kNotFound);  // not beta's
  EXPECT_EQ(claim("acme", kId2, "").code(), absl::StatusCode::kNotFound);
  first->lease.Release();
  absl::Status wrong_model = claim("acme", kId1, "other");
  EXPECT_EQ(wrong_model.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_model.message().find("belongs to model 'm'"), std::string::npos);
  EXPECT_TRUE(claim("acme", kId1, "m").ok());

  bool ended = false;
  directory->EndClaimThen(nullptr, [&] { ended = true; });
  EXPECT_TRUE(ended);
}

TEST(LocalSessionDirectoryTest, GetAndListSeeOnlyTheTenantsSessionsInPages) {
  auto directory = Local();
  ASSERT_TRUE(directory->registry().Insert(Record(kId1, "m", "acme", 1)).ok());
  ASSERT_TRUE(directory->registry().Insert(Record(kId2, "m", "beta", 2)).ok());
  ASSERT_TRUE(directory->registry().Insert(Record(kId3, "n", "acme", 3)).ok());
  Answer<SessionRecord> theirs;
  directory->Get("acme", kId2, theirs.callback());
  EXPECT_EQ(theirs.Wait().status().code(), absl::StatusCode::kNotFound);

  Answer<SessionList> page1;
  directory->List("acme", "", 1, "", page1.callback());
  ASSERT_TRUE(page1.Wait().ok());
  ASSERT_EQ(page1.value->sessions.size(), 1u);
  EXPECT_EQ(page1.value->sessions[0].id, kId1);
  ASSERT_FALSE(page1.value->next_page_token.empty());
  Answer<SessionList> page2;
  directory->List("acme", "", 1, page1.value->next_page_token, page2.callback());
  ASSERT_TRUE(page2.Wait().ok());
  ASSERT_EQ(page2.value->sessions.size(), 1u);
  EXPECT_EQ(page2.value->sessions[0].id, kId3);
  Answer<SessionList> of_model;
  directory->List("acme", "n", 10, "", of_model.callback());
  ASSERT_TRUE(of_model.Wait().ok());
  ASSERT_EQ(of_model.value->sessions.size(), 1u);
  Answer<SessionList> bad;
  directory->List("acme", "", 10, "not-a-token", bad.callback());
  EXPECT_EQ(bad.Wait().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalSessionDirectoryTest, PoliciesOfMemoryAndDir) {
  const SessionPolicy memory = Local()->policy();
  EXPECT_FALSE(memory.durable);
  EXPECT_FALSE(memory.keeps_unstored);
  EXPECT_FALSE(memory.shared);
  const std::string dir = ::testing::TempDir() + "/fwserve-directory-policy";
  std::filesystem::create_directories(dir);
  auto store = OpenSessionStore("dir:" + dir, SessionStoreOptions{});
  ASSERT_TRUE(store.ok()) << store.status();
  auto directory = Local(std::move(*store));
  EXPECT_TRUE(directory->policy().durable);
  EXPECT_TRUE(directory->policy().keeps_unstored);
  EXPECT_TRUE(directory->policy().engine_expires_stored);
  EXPECT_FALSE(directory->policy().shared);
  EXPECT_EQ(directory->NewVersionTag(nullptr), "");
  std::filesystem::remove_all(dir);
}

TEST(LocalSessionDirectoryTest, DirStoreWritesReadsDeletesAndIndexesAtStart) {
  const std::string dir = ::testing::TempDir() + "/fwserve-directory-dir";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    auto store = OpenSessionStore("dir:" + dir, SessionStoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status();
    auto directory = Local(std::move(*store));
    SessionWrite write;
    write.id = kId1;
    write.blob = "state one";
    ASSERT_TRUE(directory->WriteState(write).ok());
    write.id = kId2;
    write.blob = "state two";
    ASSERT_TRUE(directory->WriteState(write).ok());
    auto read = directory->ReadState(kId1);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "state one");
    ASSERT_TRUE(directory->DeleteState(kId2, nullptr).ok());
    EXPECT_EQ(directory->ReadState(kId2).status().code(), absl::StatusCode::kNotFound);
    write.id = kId3;
    write.blob = "unreadable";
    ASSERT_TRUE(directory->WriteState(write).ok());
  }
  // A new run indexes what the store holds, through the core's describer.
  auto store = OpenSessionStore("dir:" + dir, SessionStoreOptions{});
  ASSERT_TRUE(store.ok());
  auto directory = Local(std::move(*store));
  directory->Start([](const std::string& id, std::string blob) -> absl::StatusOr<SessionRecord> {
    if (blob == "unreadable") return absl::InvalidArgumentError("labels are malformed");
    return Record(id, "m", "acme");
  });
  for (int i = 0; i < 500 && directory->registry().indexing(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(directory->registry().indexing());
  auto indexed = directory->registry().Get(kId1);
  ASSERT_TRUE(indexed.ok()) << indexed.status();
  EXPECT_EQ(indexed->tenant, "acme");
  EXPECT_FALSE(directory->registry().Get(kId3).ok());  // skipped, logged
  EXPECT_EQ(directory->registry().size(), 1);
  std::filesystem::remove_all(dir);
}

// --- Shared (redis:// semantics, over the fake) ---

class SharedSessionDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = std::make_unique<fwtest::FakeSharedStore>();
    store_ = store.get();
    SessionDirectoryOptions options;
    options.store = std::move(store);
    options.store_threads = 2;
    options.lease_ttl = absl::Milliseconds(300);
    options.store_timeout = absl::Milliseconds(50);
    options.state_bytes_of = [](const std::string&) { return int64_t{1152}; };
    options.is_served = [](const std::string& model) { return model == "m" || model == "n"; };
    directory_ = MakeSessionDirectory(std::move(options));
    directory_->Start(nullptr);
    for (const auto& [id, model] : {std::pair{kId1, "m"}, {kId2, "unserved"}, {kId3, "n"}}) {
      StoredSessionInfo info;
      info.id = id;
      info.model = model;
      info.tenant = "acme";
      info.tokens = 5;
      info.version = 1;
      info.tag = "t0";
      ASSERT_TRUE(store_->CreateSession(info, "blob of " + id).ok());
    }
  }
  void TearDown() override { directory_.reset(); }

  absl::StatusOr<SessionClaim> Claim(const std::string& tenant, const std::string& id,
                                     const std::string& model = "") {
    Answer<SessionClaim> answer;
    directory_->Claim(tenant, id, model, answer.callback());
    return std::move(answer.Wait());
  }

  fwtest::FakeSharedStore* store_ = nullptr;
  std::unique_ptr<SessionDirectory> directory_;
};

TEST_F(SharedSessionDirectoryTest, AClaimTakesTheStoreLeaseAndHandsTheStateOnAMiss) {
  EXPECT_TRUE(directory_->policy().shared);
  EXPECT_TRUE(directory_->policy().durable);
  EXPECT_FALSE(directory_->policy().keeps_unstored);
  auto claim = Claim("acme", kId1);
  ASSERT_TRUE(claim.ok()) << claim.status();
  ASSERT_NE(claim->ticket, nullptr);
  EXPECT_EQ(claim->ticket->version, 1);
  EXPECT_EQ(claim->model, "m");
  ASSERT_TRUE(claim->stored_state.has_value());  // nothing cached here yet
  EXPECT_EQ(*claim->stored_state, "blob of " + kId1);
  EXPECT_TRUE(store_->LeaseHeld(kId1));
  auto busy = Claim("acme", kId1);
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(busy.status().message().find("busy"), std::string::npos) << busy.status();
  EXPECT_EQ(Claim("beta", kId1).status().code(), absl::StatusCode::kNotFound);

  absl::Notification ended;
  directory_->EndClaimThen(claim->ticket, [&] { ended.Notify(); });
  ASSERT_TRUE(ended.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(store_->LeaseHeld(kId1));
  const int64_t releases = store_->releases();
  // Ending it again releases nothing more.
  bool again = false;
  directory_->EndClaimThen(claim->ticket, [&] { again = true; });
  EXPECT_TRUE(again);
  EXPECT_EQ(store_->releases(), releases);
}

TEST_F(SharedSessionDirectoryTest, ARefusedClaimReleasesTheStoreLeaseBeforeAnswering) {
  auto unserved = Claim("acme", kId2);
  EXPECT_EQ(unserved.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unserved.status().message().find("does not serve"), std::string::npos);
  EXPECT_FALSE(store_->LeaseHeld(kId2));  // released before the answer
  auto wrong_model = Claim("acme", kId1, "n");
  EXPECT_EQ(wrong_model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(store_->LeaseHeld(kId1));
  auto right_model = Claim("acme", kId1, "m");
  EXPECT_TRUE(right_model.ok()) << right_model.status();
}

TEST_F(SharedSessionDirectoryTest, WritesAreFencedByTheLease) {
  auto claim = Claim("acme", kId1);
  ASSERT_TRUE(claim.ok());
  SessionWrite write;
  write.id = kId1;
  write.blob = "after turn 1";
  write.ticket = claim->ticket.get();
  write.tag = directory_->NewVersionTag(claim->ticket.get());
  EXPECT_EQ(write.tag, claim->ticket->token);
  auto version = directory_->WriteState(write);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2);
  EXPECT_TRUE(claim->ticket->ended.load());
  EXPECT_EQ(*store_->BlobOf(kId1), "after turn 1");
  claim->lease.Release();  // this replica's lease, which the engine ends after the write

  // A request whose lease was lost (expired while paused) writes nothing.
  auto late = Claim("acme", kId1);
  ASSERT_TRUE(late.ok());
  store_->DropLease(kId1);
  late->lease.Release();  // the thief stands for another replica: only the store's lease counts
  auto thief = Claim("acme", kId1);
  ASSERT_TRUE(thief.ok());
  write.blob = "stale";
  write.ticket = late->ticket.get();
  auto refused = directory_->WriteState(write);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(*store_->BlobOf(kId1), "after turn 1");
  const absl::Status told = directory_->ClientError(StoreCall::kWrite, kId1, refused.status());
  EXPECT_EQ(told.code(), absl::StatusCode::kAborted);
  EXPECT_NE(told.message().find("lost its lease"), std::string::npos);

  // A new session is created at version 1 with a fresh tag.
  SessionWrite created;
  created.id = "0000000000000000000000000000000a";
  created.model = "m";
  created.tenant = "acme";
  created.blob = "new";
  created.tag = directory_->NewVersionTag(nullptr);
  EXPECT_EQ(created.tag.size(), 32u);
  auto first = directory_->WriteState(created);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 1);
}

TEST_F(SharedSessionDirectoryTest, RunningClaimsAreRenewedAndALostLeaseIsNoticed) {
  auto claim = Claim("acme", kId3);
  ASSERT_TRUE(claim.ok());
  // Renewed every third of the 300 ms lease.
  for (int i = 0; i < 100 && store_->renewals() < 2; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_GE(store_->renewals(), 2);
  EXPECT_FALSE(claim->ticket->lost.load());
  store_->DropLease(kId3);
  for (int i = 0; i < 100 && !claim->ticket->lost.load(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(claim->ticket->lost.load());
}

TEST_F(SharedSessionDirectoryTest, GetAndListReadTheStoreForTheTenantOnly) {
  Answer<SessionRecord> mine;
  directory_->Get("acme", kId1, mine.callback());
  ASSERT_TRUE(mine.Wait().ok()) << mine.value.status();
  EXPECT_EQ(mine.value->tokens, 5);
  EXPECT_EQ(mine.value->state_bytes, 1152);
  EXPECT_FALSE(mine.value->resident);
  Answer<SessionRecord> theirs;
  directory_->Get("beta", kId1, theirs.callback());
  EXPECT_EQ(theirs.Wait().status().code(), absl::StatusCode::kNotFound);
  Answer<SessionList> list;
  directory_->List("acme", "", 2, "", list.callback());
  ASSERT_TRUE(list.Wait().ok());
  EXPECT_EQ(list.value->sessions.size(), 2u);
  EXPECT_FALSE(list.value->next_page_token.empty());
  EXPECT_TRUE(directory_->WaitIdle(absl::Now() + absl::Seconds(5)));
}

}  // namespace
}  // namespace fwserve
