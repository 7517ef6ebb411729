// SessionKeeper without an engine or a server, on a small random model: the end of a
// claim before every answer (BindClaim), and a stream's session from admission
// (OpenStream) to its end (CommitStream, FailStream), with a memory directory and with
// a shared one over the in-memory fake of the shared store. The test thread stands in
// for the engine thread: it runs the keeper's continuations (FakeHost::Drain).
#include "server/engine/session_keeper.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/base/session_id.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_directory.h"
#include "tests/common/fake_shared_store.h"
#include "tests/unit/test_models.h"

namespace fwserve {
namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

// The engine's side of the keeper: store jobs are counted and their continuations
// queued for the test thread.
class FakeHost : public KeeperHost {
 public:
  void StoreJobStarted() override {
    absl::MutexLock lock(&mu_);
    ++running_;
  }
  void StoreJobDone(std::function<void()> then) override {
    absl::MutexLock lock(&mu_);
    if (then) continuations_.push_back(std::move(then));
    --running_;
  }
  void Readmit(std::unique_ptr<WorkItem> item) override { readmitted.push_back(std::move(item)); }

  // Runs continuations until no store job is left, as the engine's loop does.
  void Drain() {
    while (true) {
      std::vector<std::function<void()>> ready;
      {
        absl::MutexLock lock(&mu_);
        if (!mu_.AwaitWithTimeout(absl::Condition(this, &FakeHost::Ready), absl::Seconds(10))) {
          ADD_FAILURE() << "a store job did not end";
          return;
        }
        if (continuations_.empty()) return;
        ready.swap(continuations_);
      }
      for (auto& continuation : ready) continuation();
    }
  }

  std::vector<std::unique_ptr<WorkItem>> readmitted;

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ == 0 || !continuations_.empty();
  }

  absl::Mutex mu_;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::function<void()>> continuations_ ABSL_GUARDED_BY(mu_);
};

// A Generate's observer that records its end; `probe` runs when OnFinish does.
class Recorder : public GenerateObserver {
 public:
  void OnStart(std::shared_ptr<GenerateControl>) override {}
  void OnChunk(GenerateChunk) override { ++chunks; }
  void OnFinish(absl::Status status, GenerateSummary) override {
    finished_with = status;
    if (probe) probe();
    finished.Notify();
  }
  int chunks = 0;
  absl::Status finished_with = absl::UnknownError("not finished");
  std::function<void()> probe;
  absl::Notification finished;
};

class SessionKeeperTest : public ::testing::Test {
 protected:
  SessionKeeperTest()
      : model_(fwtest::RandomModel(fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kRelu, 3),
                                   7, torch::kFloat32)),
        budget_(int64_t{1} << 30),
        pool_(model_, 64, &budget_) {}

  // A keeper over `store` (null: memory only; a fake shared store: redis:// semantics).
  void Open(std::unique_ptr<SessionStore> store) {
    SessionDirectoryOptions options;
    options.store = std::move(store);
    options.max_sessions = 100;
    options.lease_ttl = absl::Seconds(10);
    options.state_bytes_of = [this](const std::string&) {
      return model_.state_bytes_per_session();
    };
    options.is_served = [](const std::string& model) { return model == "m"; };
    directory_ = MakeSessionDirectory(std::move(options));
    directory_->Start(nullptr);
    keeper_ = std::make_unique<SessionKeeper>(KeeperContext{
        "m", &model_, "fingerprint", &options_, directory_.get(), &budget_, Clock::Real(),
        Metrics::Null()->AddModel(ModelInfoLabels{"m", "fast_weight", 0, 0}), &pool_, &host_});
  }
  void OpenShared() {
    auto store = std::make_unique<fwtest::FakeSharedStore>();
    store_ = store.get();
    Open(std::move(store));
  }
  void TearDown() override {
    host_.Drain();
    keeper_.reset();
    directory_.reset();
  }

  // A committed new session of `tenant`, made as a CreateSession stream makes it.
  std::string Create(const std::string& tenant = "acme") {
    auto item = std::make_shared<WorkItem>();
    item->tenant = tenant;
    item->work = CreateWork{[](absl::StatusOr<SessionRecord>) {}};
    auto opened = keeper_->OpenStream(*item);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return "";
    EXPECT_FALSE(opened->id.empty());
    EXPECT_FALSE(opened->forked);
    EXPECT_TRUE(directory_->registry().Get(opened->id)->busy);
    absl::Status answered = absl::UnknownError("not answered");
    StreamEnd end;
    end.id = opened->id;
    end.slot = opened->slot;
    keeper_->CommitStream(item, end, [&](absl::Status status) { answered = status; });
    host_.Drain();
    EXPECT_TRUE(answered.ok()) << answered;
    return opened->id;
  }

  SessionClaim Claim(const std::string& id, const std::string& tenant = "acme") {
    absl::StatusOr<SessionClaim> claim = absl::UnknownError("not answered");
    absl::Notification done;
    directory_->Claim(tenant, id, "", [&](absl::StatusOr<SessionClaim> result) {
      claim = std::move(result);
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(claim.ok()) << claim.status();
    return claim.ok() ? std::move(*claim) : SessionClaim{};
  }

  // A Generate on session `id` (or, with `fork_id`, on a new fork of it) holding `claim`.
  std::unique_ptr<WorkItem> GenerateOn(const std::string& id, SessionClaim claim,
                                       GenerateObserver* observer, const std::string& fork_id = "",
                                       bool store = true) {
    auto item = std::make_unique<WorkItem>();
    item->tenant = "acme";
    item->session_id = id;
    GenerateWork generate;
    generate.observer = observer;
    generate.fork_id = fork_id;
    generate.params.store = store;
    item->work = std::move(generate);
    SessionKeeper::BindClaim(*directory_, claim, *item);
    return item;
  }

  c10::NoGradGuard no_grad_;
  fwmodel::Model model_;
  StateMemoryBudget budget_;
  StatePool pool_;
  EngineOptions options_;
  FakeHost host_;
  fwtest::FakeSharedStore* store_ = nullptr;
  std::unique_ptr<SessionDirectory> directory_;
  std::unique_ptr<SessionKeeper> keeper_;
};

TEST_F(SessionKeeperTest, ALocalClaimEndsWithItsLeaseAndIsAnsweredAtOnce) {
  Open(nullptr);
  const std::string id = Create();
  auto item = std::make_unique<WorkItem>();
  item->session_id = id;
  bool answered = false;
  item->work = ExportWork{[&](absl::StatusOr<ExportResult> result) {
    answered = true;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
    // The lease is free before the caller hears: a retry at once finds it idle.
    EXPECT_FALSE(directory_->registry().Get(id)->busy);
  }};
  SessionClaim claim = Claim(id);
  EXPECT_TRUE(directory_->registry().Get(id)->busy);
  SessionKeeper::BindClaim(*directory_, claim, *item);
  FailItem(std::move(item), absl::UnavailableError("refused"));
  EXPECT_TRUE(answered);
}

TEST_F(SessionKeeperTest, EveryAnswerEndsTheStoreLeaseFirst) {
  OpenShared();
  const std::string id = Create();
  ASSERT_FALSE(id.empty());
  EXPECT_FALSE(store_->LeaseHeld(id));

  // A session operation's callback.
  {
    auto item = std::make_unique<WorkItem>();
    item->session_id = id;
    absl::Notification answered;
    bool held_at_answer = true;
    item->work = ExportWork{[&](absl::StatusOr<ExportResult> result) {
      EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
      held_at_answer = store_->LeaseHeld(id);
      answered.Notify();
    }};
    SessionClaim claim = Claim(id);
    ASSERT_NE(claim.ticket, nullptr);
    EXPECT_TRUE(store_->LeaseHeld(id));
    SessionKeeper::BindClaim(*directory_, claim, *item);
    FailItem(std::move(item), absl::UnavailableError("refused"));
    ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_FALSE(held_at_answer);
  }

  // A Generate's observer: chunks pass at once, the end waits for the release.
  Recorder recorder;
  bool held_at_finish = true;
  recorder.probe = [&] { held_at_finish = store_->LeaseHeld(id); };
  auto item = GenerateOn(id, Claim(id), &recorder);
  GenerateObserver* wrapped = item->As<GenerateWork>()->observer;
  ASSERT_NE(wrapped, &recorder);
  wrapped->OnChunk(GenerateChunk{});
  EXPECT_EQ(recorder.chunks, 1);
  const int64_t releases = store_->releases();
  FailItem(std::move(item), absl::CancelledError("cancelled by the client"));
  ASSERT_TRUE(recorder.finished.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(recorder.finished_with.code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(held_at_finish);
  EXPECT_EQ(store_->releases(), releases + 1);
}

TEST_F(SessionKeeperTest, ACommitIsInTheStoreBeforeTheAnswerAndEndsTheLeaseItself) {
  OpenShared();
  const std::string id = Create();
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(store_->GetInfo(id)->version, 1);

  Recorder recorder;
  int64_t version_at_finish = 0;
  recorder.probe = [&] { version_at_finish = store_->GetInfo(id)->version; };
  SessionClaim claim = Claim(id);
  ASSERT_NE(claim.ticket, nullptr);
  EXPECT_FALSE(claim.stored_state.has_value());  // this copy is current: a cache hit
  std::shared_ptr<StoreTicket> ticket = claim.ticket;
  std::shared_ptr<WorkItem> item = GenerateOn(id, std::move(claim), &recorder);
  EXPECT_FALSE(keeper_->NeedsLoad(*item));
  auto opened = keeper_->OpenStream(*item);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->id, id);
  EXPECT_FALSE(opened->forked);

  const int64_t releases = store_->releases();
  StreamEnd end;
  end.id = id;
  end.slot = opened->slot;
  end.tokens = 3;
  end.delivered = 3;
  keeper_->CommitStream(item, end, [item](absl::Status status) {
    item->As<GenerateWork>()->observer->OnFinish(status, GenerateSummary{});
  });
  EXPECT_FALSE(recorder.finished.HasBeenNotified());  // the write runs on a store thread
  host_.Drain();
  ASSERT_TRUE(recorder.finished.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(recorder.finished_with.ok()) << recorder.finished_with;
  EXPECT_EQ(version_at_finish, 2);  // committed before the client heard
  EXPECT_TRUE(ticket->ended.load());
  EXPECT_EQ(store_->releases(), releases);  // the fenced commit ended the lease
  EXPECT_FALSE(store_->LeaseHeld(id));
  auto record = directory_->registry().Get(id);
  ASSERT_TRUE(record.ok());
  EXPECT_FALSE(record->busy);
  EXPECT_EQ(record->tokens, 3);
  EXPECT_EQ(record->version, 2);
}

TEST_F(SessionKeeperTest, AForkThatKeepsNothingLeavesTheSourceAndNoNewSession) {
  Open(nullptr);
  const std::string source = Create();
  const std::string fork = NewSessionId();
  Recorder recorder;
  std::shared_ptr<WorkItem> item =
      GenerateOn(source, Claim(source), &recorder, fork, /*store=*/false);
  auto opened = keeper_->OpenStream(*item);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->id, fork);
  EXPECT_TRUE(opened->forked);
  EXPECT_EQ(item->session_id, fork);
  // The source is released unchanged at once; the fork is leased by the stream.
  EXPECT_FALSE(directory_->registry().Get(source)->busy);
  EXPECT_TRUE(directory_->registry().Get(fork)->busy);

  absl::Status answered = absl::UnknownError("not answered");
  StreamEnd end;
  end.id = fork;
  end.slot = opened->slot;
  end.tokens = 2;
  end.forked = true;
  end.delivered = 2;
  keeper_->CommitStream(item, end, [&](absl::Status status) { answered = status; });
  EXPECT_TRUE(answered.ok()) << answered;
  EXPECT_EQ(directory_->registry().Get(fork).status().code(), absl::StatusCode::kNotFound);
  auto kept = directory_->registry().Get(source);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->tokens, 0);
  EXPECT_FALSE(kept->busy);
}

TEST_F(SessionKeeperTest, AFailedStreamKeepsExactlyWhatTheClientReceived) {
  Open(nullptr);
  const std::string id = Create();
  for (const int64_t delivered : {0, 2}) {
    Recorder recorder;
    auto item = GenerateOn(id, Claim(id), &recorder);
    auto opened = keeper_->OpenStream(*item);
    ASSERT_TRUE(opened.ok()) << opened.status();
    StreamEnd end;
    end.id = id;
    end.slot = opened->slot;
    end.tokens = opened->tokens + delivered;
    end.delivered = delivered;
    keeper_->FailStream(std::move(item), end, absl::CancelledError("cancelled by the client"));
    host_.Drain();
    ASSERT_TRUE(recorder.finished.HasBeenNotified()) << delivered;
    EXPECT_EQ(recorder.finished_with.code(), absl::StatusCode::kCancelled);
    auto record = directory_->registry().Get(id);
    ASSERT_TRUE(record.ok());
    EXPECT_FALSE(record->busy);
    // Nothing received: the session is as it was (0 tokens); then it keeps the 2.
    EXPECT_EQ(record->tokens, delivered) << delivered;
  }
}

}  // namespace
}  // namespace fwserve
