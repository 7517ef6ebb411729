#include "server/sessions/session_directory.h"

#include <algorithm>
#include <limits>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/base/log.h"
#include "server/base/session_id.h"
#include "server/sessions/store/shared_session_store.h"

namespace fwserve {
namespace {

absl::Status ModelMismatch(const std::string& id, const std::string& has, const std::string& asked,
                           absl::string_view field = "session_id") {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " '", id, "' belongs to model '", has, "', not '", asked, "'"));
}

// What both directories share: the registry, the store, the store threads and the
// count of the directory's own jobs on them (for WaitIdle and Stop).
class DirectoryBase : public SessionDirectory {
 public:
  explicit DirectoryBase(SessionDirectoryOptions options)
      : store_(std::move(options.store)),
        options_(std::move(options)),
        registry_(options_.max_sessions),
        executor_(store_ != nullptr ? options_.store_threads : 1) {}

  SessionRegistry& registry() override { return registry_; }
  StoreExecutor& executor() override { return executor_; }

  bool WaitIdle(absl::Time deadline) override {
    absl::MutexLock lock(&jobs_mu_);
    return jobs_mu_.AwaitWithDeadline(absl::Condition(this, &DirectoryBase::NoJobs), deadline);
  }
  void AwaitJobs() override {
    absl::MutexLock lock(&jobs_mu_);
    jobs_mu_.Await(absl::Condition(this, &DirectoryBase::NoJobs));
  }

  absl::StatusOr<std::string> ReadState(const std::string& id) override {
    if (store_ == nullptr) return absl::NotFoundError("no session store");
    return store_->Get(id);
  }

  absl::Status ClientError(StoreCall call, const std::string& id, const absl::Status& store_status,
                           const char* what) const override {
    StoreErrorContext context;
    context.shared = policy().shared;
    context.timeout = options_.store_timeout;
    return ClientStoreError(call, context, id, store_status, what);
  }

 protected:
  bool NoJobs() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(jobs_mu_) { return jobs_ == 0; }

  // Runs `job` on a store thread, counted for WaitIdle/AwaitJobs.
  void RunJob(std::function<void()> job) {
    {
      absl::MutexLock lock(&jobs_mu_);
      ++jobs_;
    }
    executor_.Run([this, job = std::move(job)] {
      job();
      absl::MutexLock lock(&jobs_mu_);
      --jobs_;
    });
  }

  // Destroyed in reverse order: the executor (which joins its threads, and may still
  // run jobs that count in jobs_ and use the registry and the store) first.
  std::unique_ptr<SessionStore> store_;
  const SessionDirectoryOptions options_;  // its store moved to store_
  SessionRegistry registry_;
  absl::Mutex jobs_mu_;
  int64_t jobs_ ABSL_GUARDED_BY(jobs_mu_) = 0;
  StoreExecutor executor_;
};

// --session-store=memory and dir:PATH: this replica's registry is the index.
class LocalSessionDirectory final : public DirectoryBase {
 public:
  explicit LocalSessionDirectory(SessionDirectoryOptions options)
      : DirectoryBase(std::move(options)) {
    policy_.durable = store_ != nullptr;
    policy_.keeps_unstored = store_ != nullptr;
    policy_.shared = false;
    policy_.engine_expires_stored = store_ != nullptr;
  }
  ~LocalSessionDirectory() override { StopBackground(); }

  void Start(DescribeStoredSession describe) override {
    if (store_ == nullptr) return;
    registry_.SetIndexing(true);
    indexer_ = std::thread([this, describe = std::move(describe)] { IndexStore(describe); });
  }

  void ClaimNamed(const std::string& tenant, const std::string& id, const std::string& model,
                  const std::string& field,
                  std::function<void(absl::StatusOr<SessionClaim>)> done) override {
    auto record = registry_.Get(id);
    // Unknown, and another tenant's session, which does not exist for this caller.
    if (!record.ok() || record->tenant != tenant) return done(registry_.NotFoundError(id, field));
    if (!model.empty() && record->model != model)
      return done(ModelMismatch(id, record->model, model, field));
    auto acquired = registry_.Acquire(id, field);
    if (!acquired.ok()) return done(acquired.status());
    SessionClaim claim;
    claim.lease = std::move(*acquired);
    claim.model = record->model;
    done(std::move(claim));
  }

  void EndClaimThen(const std::shared_ptr<StoreTicket>&, std::function<void()> answer) override {
    answer();
  }

  void Get(const std::string& tenant, const std::string& id,
           Callback<SessionRecord> done) override {
    auto record = registry_.Get(id);
    if (record.ok() && record->tenant != tenant) return done(registry_.NotFoundError(id));
    done(std::move(record));
  }

  void List(const std::string& tenant, const std::string& model, int page_size,
            const std::string& token, Callback<SessionList> done) override {
    // A local page token is "<created unix nanos>:<id>" of the last session returned
    // (the registry's order: creation time at full precision, then id).
    int64_t after_nanos = std::numeric_limits<int64_t>::min();
    std::string after_id;
    if (!token.empty()) {
      const size_t colon = token.find(':');
      if (colon == std::string::npos || !absl::SimpleAtoi(token.substr(0, colon), &after_nanos) ||
          !IsWellFormedSessionId(token.substr(colon + 1))) {
        return done(absl::InvalidArgumentError("page_token is malformed"));
      }
      after_id = token.substr(colon + 1);
    }
    SessionList list;
    for (SessionRecord& record : registry_.List(model)) {
      if (record.tenant != tenant) continue;
      const int64_t nanos = absl::ToUnixNanos(record.created);
      if (!token.empty() &&
          (nanos < after_nanos || (nanos == after_nanos && record.id <= after_id))) {
        continue;
      }
      if (static_cast<int>(list.sessions.size()) == page_size) {
        const SessionRecord& last = list.sessions.back();
        list.next_page_token = absl::StrCat(absl::ToUnixNanos(last.created), ":", last.id);
        break;
      }
      list.sessions.push_back(std::move(record));
    }
    done(std::move(list));
  }

  void StopBackground() override {
    stop_indexing_.store(true);
    if (indexer_.joinable()) indexer_.join();
    AwaitJobs();
  }

  const SessionPolicy& policy() const override { return policy_; }
  std::string NewVersionTag(const StoreTicket*) const override { return ""; }

  absl::StatusOr<int64_t> WriteState(const SessionWrite& write) override {
    if (store_ == nullptr) return int64_t{0};
    if (absl::Status put = store_->Put(write.id, write.blob); !put.ok()) return put;
    return int64_t{0};
  }

  absl::Status DeleteState(const std::string& id, StoreTicket*) override {
    if (store_ == nullptr) return absl::OkStatus();
    return store_->Delete(id);
  }

 private:
  // Registers the sessions an earlier run stored (not resident; loaded on first use).
  // Runs on its own thread while the server serves; reads each blob once.
  void IndexStore(const DescribeStoredSession& describe) {
    const absl::Time start = absl::Now();
    int64_t indexed = 0, skipped = 0;
    std::vector<std::string> ids;
    absl::Status listed = store_->ForEachId([&](const std::string& id) {
      ids.push_back(id);
      return !stop_indexing_.load();
    });
    for (const std::string& id : ids) {
      if (stop_indexing_.load()) break;
      if (registry_.Get(id).ok()) continue;  // already known (created since the start)
      auto blob = store_->Get(id);
      auto record =
          blob.ok() ? describe(id, std::move(*blob)) : absl::StatusOr<SessionRecord>(blob.status());
      absl::Status inserted = record.ok() ? registry_.Insert(*record) : record.status();
      if (!inserted.ok()) {
        Log(LogLevel::kWarning,
            absl::StrCat("session store: skipped session ", id, ": ", inserted.message()));
        ++skipped;
        continue;
      }
      ++indexed;
    }
    registry_.SetIndexing(false);
    if (!listed.ok()) {
      Log(LogLevel::kError, absl::StrCat("session store: listing failed: ", listed.message()));
    }
    Log(LogLevel::kInfo,
        absl::StrCat(
            "session store ", store_->Describe(), ": found ", indexed, " sessions",
            skipped > 0 ? absl::StrCat(" (", skipped, " skipped)") : "", " in ",
            absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))));
  }

  SessionPolicy policy_;
  std::thread indexer_;
  std::atomic<bool> stop_indexing_{false};
};

// redis://: the store is the truth and the index; leases in the store, renewed here,
// fenced at the write.
class SharedSessionDirectory final : public DirectoryBase {
 public:
  explicit SharedSessionDirectory(SessionDirectoryOptions options)
      : DirectoryBase(std::move(options)), shared_(static_cast<SharedSessionStore*>(store_.get())) {
    policy_.durable = true;
    policy_.keeps_unstored = false;
    policy_.shared = true;
    policy_.engine_expires_stored = false;
  }
  ~SharedSessionDirectory() override {
    StopBackground();
    AwaitJobs();
  }

  void Start(DescribeStoredSession) override {
    // A shared store is its own index: sessions are looked up there on demand.
    renewer_ = std::thread([this] { RenewLeases(); });
  }

  void ClaimNamed(const std::string& tenant, const std::string& id, const std::string& model,
                  const std::string& field,
                  std::function<void(absl::StatusOr<SessionClaim>)> done) override {
    RunJob([this, tenant, id, model, field, done = std::move(done)] {
      try {
        ClaimNow(tenant, id, model, field, done);
      } catch (const std::exception& e) {
        Log(LogLevel::kError, absl::StrCat("taking a session's lease failed: ", e.what()));
        done(absl::InternalError("the server failed"));
      }
    });
  }

  void EndClaimThen(const std::shared_ptr<StoreTicket>& ticket,
                    std::function<void()> answer) override {
    if (ticket == nullptr || ticket->ended.exchange(true)) return answer();
    RunJob([this, ticket, answer = std::move(answer)] {
      if (absl::Status released = shared_->ReleaseLease(ticket->id, ticket->token);
          !released.ok()) {
        // It expires by itself after --session-lease-ttl.
        Log(LogLevel::kWarning, absl::StrCat("session ", ticket->id,
                                             ": releasing its lease failed: ", released.message()));
      }
      answer();
    });
  }

  void Get(const std::string& tenant, const std::string& id,
           Callback<SessionRecord> done) override {
    RunJob([this, tenant, id, done] {
      auto info = shared_->GetInfo(id);
      if (info.ok() && info->tenant != tenant) info = absl::NotFoundError("another tenant's");
      if (!info.ok()) return done(ClientError(StoreCall::kLookup, id, info.status(), ""));
      done(RecordFromStore(*info));
    });
  }

  void List(const std::string& tenant, const std::string& model, int page_size,
            const std::string& token, Callback<SessionList> done) override {
    RunJob([this, tenant, model, page_size, token, done] {
      auto page = shared_->List(model, tenant, page_size, token);
      if (!page.ok()) {
        return done(absl::IsInvalidArgument(page.status())
                        ? page.status()
                        : ClientError(StoreCall::kLookup, "", page.status(), ""));
      }
      SessionList list;
      list.next_page_token = std::move(page->next_page_token);
      for (const StoredSessionInfo& info : page->sessions) {
        list.sessions.push_back(RecordFromStore(info));
      }
      done(std::move(list));
    });
  }

  void StopBackground() override {
    {
      // Claims submit to the engines: let them finish first (each store call is
      // bounded by --session-store-timeout; draining engines refuse the work).
      absl::MutexLock lock(&jobs_mu_);
      stop_renewing_ = true;
      jobs_mu_.Await(absl::Condition(this, &SharedSessionDirectory::NoJobs));
    }
    if (renewer_.joinable()) renewer_.join();
  }

  const SessionPolicy& policy() const override { return policy_; }

  std::string NewVersionTag(const StoreTicket* ticket) const override {
    // A commit's tag is its lease token; a new session's a fresh random one.
    return ticket != nullptr ? ticket->token : NewSessionId();
  }

  absl::StatusOr<int64_t> WriteState(const SessionWrite& write) override {
    if (write.ticket != nullptr) {
      StoreTicket& ticket = *write.ticket;
      ticket.ending.store(true);
      absl::StatusOr<int64_t> version = shared_->CommitLeased(
          write.id, ticket.token, ticket.version, write.blob, write.tokens, write.last_used);
      // Committed (the lease ended with it) or refused (the lease is someone else's).
      if (version.ok() || absl::IsAborted(version.status())) ticket.ended.store(true);
      return version;
    }
    StoredSessionInfo info;
    info.id = write.id;
    info.model = write.model;
    info.tenant = write.tenant;
    info.tokens = write.tokens;
    info.created = write.created;
    info.last_used = write.last_used;
    info.version = 1;
    info.tag = write.tag;
    if (absl::Status created = shared_->CreateSession(info, write.blob); !created.ok()) {
      return created;
    }
    return int64_t{1};
  }

  absl::Status DeleteState(const std::string& id, StoreTicket* ticket) override {
    if (ticket == nullptr) return shared_->Delete(id);
    ticket->ending.store(true);
    absl::Status deleted = shared_->DeleteLeased(id, ticket->token);
    if (deleted.ok() || absl::IsAborted(deleted)) ticket->ended.store(true);
    return deleted;
  }

 private:
  void ClaimNow(const std::string& tenant, const std::string& id, const std::string& model,
                const std::string& field,
                const std::function<void(absl::StatusOr<SessionClaim>)>& done) {
    int64_t cached_version = 0;
    if (auto local = registry_.Get(id); local.ok() && local->resident) {
      cached_version = local->version;
    }
    auto grant = shared_->AcquireLease(id, options_.lease_ttl, cached_version, tenant);
    if (!grant.ok()) {
      StoreErrorContext context;
      context.shared = true;
      context.timeout = options_.store_timeout;
      context.field = field;
      return done(ClientStoreError(StoreCall::kLookup, context, id, grant.status(), ""));
    }
    auto ticket =
        std::make_shared<StoreTicket>(id, grant->token, grant->info.version, grant->info.tag);
    // From here every answer ends the store lease first.
    const auto refuse = [this, ticket, done](absl::Status status) {
      EndClaimThen(ticket, [done, status] { done(status); });
    };
    if (options_.is_served && !options_.is_served(grant->info.model)) {
      return refuse(absl::FailedPreconditionError(
          absl::StrCat(field, " '", id, "' belongs to model '", grant->info.model,
                       "', which this server does not serve")));
    }
    if (!model.empty() && model != grant->info.model) {
      return refuse(ModelMismatch(id, grant->info.model, model, field));
    }
    auto local_lease = registry_.AcquireFromStore(RecordFromStore(grant->info), field);
    if (!local_lease.ok()) return refuse(local_lease.status());
    {
      absl::MutexLock lock(&jobs_mu_);
      renewing_.push_back(ticket);
    }
    SessionClaim claim;
    claim.lease = std::move(*local_lease);
    claim.model = grant->info.model;
    claim.ticket = std::move(ticket);
    claim.stored_state = std::move(grant->blob);
    done(std::move(claim));
  }

  SessionRecord RecordFromStore(const StoredSessionInfo& info) const {
    SessionRecord record;
    record.id = info.id;
    record.model = info.model;
    record.tenant = info.tenant;
    record.tokens = info.tokens;
    record.created = info.created;
    record.last_used = info.last_used;
    record.stored = true;
    record.resident = false;
    if (options_.state_bytes_of) record.state_bytes = options_.state_bytes_of(info.model);
    record.busy = info.busy;
    if (auto local = registry_.Get(info.id); local.ok()) {
      record.busy = record.busy || local->busy;
      record.resident = local->resident && local->version == info.version;
    }
    record.version = info.version;
    return record;
  }

  // Renews the leases of running requests every third of --session-lease-ttl.
  void RenewLeases() {
    const absl::Duration period = options_.lease_ttl / 3;
    while (true) {
      std::vector<std::shared_ptr<StoreTicket>> live;
      {
        absl::MutexLock lock(&jobs_mu_);
        const auto stop = [this]()
                              ABSL_EXCLUSIVE_LOCKS_REQUIRED(jobs_mu_) { return stop_renewing_; };
        jobs_mu_.AwaitWithTimeout(absl::Condition(&stop), period);
        if (stop_renewing_) return;
        renewing_.erase(std::remove_if(renewing_.begin(), renewing_.end(),
                                       [&live](const std::weak_ptr<StoreTicket>& weak) {
                                         std::shared_ptr<StoreTicket> t = weak.lock();
                                         if (t == nullptr || t->ended.load() || t->lost.load()) {
                                           return true;
                                         }
                                         live.push_back(std::move(t));
                                         return false;
                                       }),
                        renewing_.end());
      }
      for (const auto& ticket : live) {
        if (ticket->ended.load()) continue;
        absl::Status renewed = shared_->RenewLease(ticket->id, ticket->token, options_.lease_ttl);
        if (absl::IsAborted(renewed) && !ticket->ended.load() && !ticket->ending.load()) {
          ticket->lost.store(true);
          Log(LogLevel::kWarning,
              absl::StrCat("session ", ticket->id,
                           ": this request's lease expired and was lost; its write will be "
                           "refused"));
        }
      }
    }
  }

  SharedSessionStore* const shared_;  // store_
  SessionPolicy policy_;
  // Leases of running requests, renewed by renewer_. Weak: a request dropped without an
  // answer (a bug path) stops being renewed, and its lease expires by itself.
  std::vector<std::weak_ptr<StoreTicket>> renewing_ ABSL_GUARDED_BY(jobs_mu_);
  bool stop_renewing_ ABSL_GUARDED_BY(jobs_mu_) = false;
  std::thread renewer_;
};

}  // namespace

std::unique_ptr<SessionDirectory> MakeSessionDirectory(SessionDirectoryOptions options) {
  if (dynamic_cast<SharedSessionStore*>(options.store.get()) != nullptr) {
    return std::make_unique<SharedSessionDirectory>(std::move(options));
  }
  return std::make_unique<LocalSessionDirectory>(std::move(options));
}

}  // namespace fwserve
