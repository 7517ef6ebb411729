// The session store backends, the registry and its leases, and the store executor.
// Torch-free; time comes from a FakeClock, so nothing here sleeps.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/base/clock.h"
#include "server/sessions/store/dir_session_store.h"
#include "server/base/session_id.h"
#include "server/sessions/session_registry.h"
#include "server/sessions/store_executor.h"

namespace fwserve {
namespace {

std::string TempDir(const std::string& tag) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("fwserve-store-" + tag + "-XXXXXX")).string();
  char* made = mkdtemp(pattern.data());
  EXPECT_NE(made, nullptr);
  return pattern;
}

int Mode(const std::string& path) {
  struct stat st;
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(SessionIdTest, IdsAreWellFormedAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = NewSessionId();
    EXPECT_TRUE(IsWellFormedSessionId(id)) << id;
    EXPECT_TRUE(seen.insert(id).second);
  }
  EXPECT_FALSE(IsWellFormedSessionId("../../etc/passwd"));
  EXPECT_FALSE(IsWellFormedSessionId(std::string(32, 'A')));
  EXPECT_FALSE(IsWellFormedSessionId(std::string(31, 'a')));
}

TEST(OpenSessionStoreTest, ParsesTheFlag) {
  auto memory = OpenSessionStore("memory");
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ(*memory, nullptr);
  auto dir = OpenSessionStore("dir:" + TempDir("flag") + "/sub/dir");
  ASSERT_TRUE(dir.ok()) << dir.status();
  ASSERT_NE(*dir, nullptr);
  EXPECT_EQ((*dir)->Describe().rfind("dir:", 0), 0u);
  for (const char* bad : {"", "disk", "dir:", "redis"}) {
    auto store = OpenSessionStore(bad);
    ASSERT_FALSE(store.ok()) << bad;
    EXPECT_NE(store.status().message().find("--session-store"), std::string::npos)
        << store.status();
  }
}

TEST(DirectorySessionStoreTest, PutGetDeleteList) {
  const std::string dir = TempDir("basic");
  auto store = DirectorySessionStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string a = NewSessionId(), b = NewSessionId();
  EXPECT_EQ((*store)->Get(a).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*store)->Put(a, "first").ok());
  ASSERT_TRUE((*store)->Put(b, std::string(100000, 'x')).ok());
  ASSERT_TRUE((*store)->Put(a, "second").ok());  // replaces
  EXPECT_EQ(*(*store)->Get(a), "second");
  EXPECT_EQ((*store)->Get(b)->size(), 100000u);
  std::set<std::string> ids;
  ASSERT_TRUE((*store)
                  ->ForEachId([&](const std::string& id) {
                    ids.insert(id);
                    return true;
                  })
                  .ok());
  EXPECT_EQ(ids, (std::set<std::string>{a, b}));
  ASSERT_TRUE((*store)->Delete(a).ok());
  EXPECT_TRUE((*store)->Delete(a).ok());  // already gone: fine
  EXPECT_EQ((*store)->Get(a).status().code(), absl::StatusCode::kNotFound);
  // Only the lock and b's file remain: no temporaries.
  EXPECT_EQ(Files(dir), (std::vector<std::string>{".lock", b + ".fwstate"}));
  // Private: the directory 0700, files 0600.
  EXPECT_EQ(Mode(dir), 0700);
  EXPECT_EQ(Mode((*store)->FilePath(b)), 0600);
}

TEST(DirectorySessionStoreTest, RefusesIdsThatAreNotSessionIds) {
  auto store = DirectorySessionStore::Open(TempDir("ids"));
  ASSERT_TRUE(store.ok());
  for (const std::string& bad :
       std::vector<std::string>{"../escape", "", "a/b", std::string(32, 'Z')}) {
    EXPECT_EQ((*store)->Put(bad, "x").code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ((*store)->Get(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ((*store)->Delete(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(DirectorySessionStoreTest, TheDirectoryIsLockedAgainstASecondServer) {
  const std::string dir = TempDir("lock");
  auto first = DirectorySessionStore::Open(dir);
  ASSERT_TRUE(first.ok());
  auto second = DirectorySessionStore::Open(dir);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("another fwserve process is using it"),
            std::string::npos);
  first->reset();
  EXPECT_TRUE(DirectorySessionStore::Open(dir).ok());  // released with the store
}

TEST(DirectorySessionStoreTest, OpenRemovesTemporariesOfACrashedWriterAndKeepsSessions) {
  const std::string dir = TempDir("stale");
  const std::string id = NewSessionId();
  {
    auto store = DirectorySessionStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(id, "committed").ok());
  }
  // What a writer killed between create and rename leaves behind.
  std::ofstream(dir + "/.tmp-" + id + "-0123456789abcdef") << "half a blob";
  auto store = DirectorySessionStore::Open(dir);
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->stale_temporaries_removed(), 1);
  EXPECT_EQ(*(*store)->Get(id), "committed");
  EXPECT_EQ(Files(dir), (std::vector<std::string>{".lock", id + ".fwstate"}));
}

// A write that fails (here EFBIG under a file-size limit, as ENOSPC would) reports an
// error naming the cause, leaves the previous blob intact and no temporary behind, and
// works again once the limit is lifted.
TEST(DirectorySessionStoreTest, AFailedWriteKeepsTheOldBlob) {
  const std::string dir = TempDir("efbig");
  auto store = DirectorySessionStore::Open(dir);
  ASSERT_TRUE(store.ok());
  const std::string id = NewSessionId();
  ASSERT_TRUE((*store)->Put(id, "old").ok());
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  struct sigaction ignore = {}, previous = {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &previous), 0);
  struct rlimit small = saved;
  small.rlim_cur = 1000;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::Status failed = (*store)->Put(id, std::string(5000, 'n'));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
  sigaction(SIGXFSZ, &previous, nullptr);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(failed.message().find("File too large"), std::string::npos) << failed;
  EXPECT_EQ(*(*store)->Get(id), "old");
  EXPECT_EQ(Files(dir), (std::vector<std::string>{".lock", id + ".fwstate"}));
  ASSERT_TRUE((*store)->Put(id, std::string(5000, 'n')).ok());
  EXPECT_EQ((*store)->Get(id)->size(), 5000u);
}

SessionRecord Record(const std::string& id, absl::Time at, const std::string& model = "m") {
  SessionRecord r;
  r.id = id;
  r.model = model;
  r.created = r.last_used = at;
  return r;
}

TEST(SessionRegistryTest, OneLeaseAtATimeReleasedByScope) {
  FakeClock clock;
  SessionRegistry registry(10);
  ASSERT_TRUE(registry.Insert(Record("a", clock.Now())).ok());
  {
    auto lease = registry.Acquire("a");
    ASSERT_TRUE(lease.ok());
    EXPECT_TRUE(registry.Get("a")->busy);
    EXPECT_EQ(registry.Acquire("a").status().code(), absl::StatusCode::kAborted);
    SessionLease moved = std::move(*lease);
    EXPECT_FALSE(lease->held());
    EXPECT_TRUE(moved.held());
  }  // dropped without Commit: released unchanged
  EXPECT_FALSE(registry.Get("a")->busy);
  EXPECT_EQ(registry.Get("a")->tokens, 0);
  auto lease = registry.Acquire("a");
  ASSERT_TRUE(lease.ok());
  clock.Advance(absl::Seconds(5));
  lease->Commit(42, clock.Now(), /*stored=*/true);
  EXPECT_FALSE(lease->held());
  const SessionRecord after = *registry.Get("a");
  EXPECT_FALSE(after.busy);
  EXPECT_EQ(after.tokens, 42);
  EXPECT_TRUE(after.stored);
  EXPECT_EQ(after.last_used, clock.Now());
  EXPECT_EQ(registry.Acquire("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionRegistryTest, ANewSessionStaysBusyUntilItsLeaseEnds) {
  SessionRegistry registry(1);
  auto lease = registry.InsertLeased(Record("new", absl::Now()));
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(registry.Acquire("new").status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(registry.Insert(Record("more", absl::Now())).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_NE(registry.CheckCapacity().message().find("--max-sessions=1"), std::string::npos);
  lease->Forget();  // as when the session is removed instead
  registry.Erase("new");
  EXPECT_TRUE(registry.CheckCapacity().ok());
}

TEST(SessionRegistryTest, ExpiryTakesOnlyIdleSessionsOfTheModelPastTheirTtl) {
  FakeClock clock;
  SessionRegistry registry(10);
  const absl::Time start = clock.Now();
  ASSERT_TRUE(registry.Insert(Record("old", start)).ok());
  ASSERT_TRUE(registry.Insert(Record("busy", start)).ok());
  ASSERT_TRUE(registry.Insert(Record("other", start, "m2")).ok());
  clock.Advance(absl::Hours(2));
  ASSERT_TRUE(registry.Insert(Record("young", clock.Now())).ok());
  auto held = registry.Acquire("busy");
  ASSERT_TRUE(held.ok());
  const auto expired = registry.TakeExpired("m", clock.Now() - absl::Hours(1));
  EXPECT_EQ(expired, std::vector<std::string>{"old"});
  EXPECT_EQ(registry.Get("old").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Get("busy").ok());
  EXPECT_TRUE(registry.Get("other").ok());
  EXPECT_TRUE(registry.Get("young").ok());
}

TEST(SessionRegistryTest, UnknownIdsAreUnavailableWhileIndexing) {
  SessionRegistry registry(10);
  registry.SetIndexing(true);
  EXPECT_EQ(registry.Get("x").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(registry.Acquire("x").status().code(), absl::StatusCode::kUnavailable);
  registry.SetIndexing(false);
  EXPECT_EQ(registry.Get("x").status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionRegistryTest, UnstoredListsResidentIdleSessionsTheStoreLacks) {
  SessionRegistry registry(10);
  for (const char* id : {"saved", "failed", "held", "gone"}) {
    ASSERT_TRUE(registry.Insert(Record(id, absl::Now())).ok());
  }
  for (const char* id : {"saved", "held", "gone"}) {
    auto lease = registry.Acquire(id);
    ASSERT_TRUE(lease.ok());
    lease->Commit(1, absl::Now(), std::string(id) == "saved");
  }
  registry.SetResident("gone", false);
  auto held = registry.Acquire("held");
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(registry.Unstored("m"), std::vector<std::string>{"failed"});
  EXPECT_EQ(registry.CountNotResident("m"), 1);
}

TEST(StoreExecutorTest, RunsEveryJobAndDrainsOnDestruction) {
  std::atomic<int> ran{0};
  {
    StoreExecutor executor(2);
    EXPECT_EQ(executor.pending(), 0);
    // Both threads held by a gated job each, so that the jobs after them stay queued.
    absl::Notification gate;
    absl::Mutex mu;
    int started = 0;
    for (int i = 0; i < 2; ++i) {
      executor.Run([&] {
        {
          absl::MutexLock lock(&mu);
          ++started;
        }
        gate.WaitForNotification();
        ++ran;
      });
    }
    bool both_started;
    {
      absl::MutexLock lock(&mu);
      both_started = mu.AwaitWithTimeout(
          absl::Condition(+[](int* n) { return *n == 2; }, &started), absl::Seconds(30));
    }
    if (!both_started) {
      gate.Notify();  // let the destructor drain
      FAIL() << "the two gated jobs never both ran";
    }
    EXPECT_EQ(executor.pending(), 2);  // running
    for (int i = 0; i < 100; ++i) executor.Run([&] { ++ran; });
    executor.Run([] { throw std::runtime_error("a job that throws is logged, not fatal"); });
    EXPECT_EQ(executor.pending(), 103);  // 2 running, 101 queued: none could run
    EXPECT_EQ(ran.load(), 0);
    gate.Notify();
  }
  EXPECT_EQ(ran.load(), 102);
}

}  // namespace
}  // namespace fwserve
