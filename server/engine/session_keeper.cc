// SessionKeeper: claims' ends, admission's loads, session operations (create is a
// stream task in engine.cc; fork, export, import, delete and reading the last output
// here), what a stream holds of its session, write-through and housekeeping.
#include "server/engine/session_keeper.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "server/base/session_id.h"
#include "server/sessions/session_labels.h"
#include "server/sessions/session_seal.h"

namespace fwserve {
namespace {

double SecondsFrom(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

// Wraps `done` so that it first ends the claim's store lease, then answers.
template <typename T>
Callback<T> EndClaimFirst(SessionDirectory* directory, std::shared_ptr<StoreTicket> ticket,
                          Callback<T> done) {
  return [directory, ticket = std::move(ticket), done = std::move(done)](absl::StatusOr<T> result) {
    auto held = std::make_shared<absl::StatusOr<T>>(std::move(result));
    directory->EndClaimThen(ticket, [done, held] { done(std::move(*held)); });
  };
}

// The Generate observer of a request holding a claim in a shared store: ends the claim
// before the final message. Deletes itself after OnFinish.
class ClaimObserver : public GenerateObserver {
 public:
  ClaimObserver(SessionDirectory* directory, std::shared_ptr<StoreTicket> ticket,
                GenerateObserver* inner)
      : directory_(directory), ticket_(std::move(ticket)), inner_(inner) {}
  void OnStart(std::shared_ptr<GenerateControl> stream) override { inner_->OnStart(stream); }
  void OnChunk(GenerateChunk chunk) override { inner_->OnChunk(std::move(chunk)); }
  void OnFinish(absl::Status status, GenerateSummary summary) override {
    GenerateObserver* inner = inner_;
    directory_->EndClaimThen(ticket_,
                             [inner, status, summary] { inner->OnFinish(status, summary); });
    delete this;
  }

 private:
  SessionDirectory* const directory_;
  const std::shared_ptr<StoreTicket> ticket_;
  GenerateObserver* const inner_;
};

}  // namespace

void AnswerWorkItem(WorkItem& w, absl::Status status) {
  // The lease first: a caller that retries at once must not find the session busy.
  w.lease.Release();
  std::visit(Overloaded{
                 [&](GenerateWork& g) { g.observer->OnFinish(status, GenerateSummary{}); },
                 [&](auto& work) { work.done(status); },
             },
             w.work);
}

SessionKeeper::SessionKeeper(KeeperContext context)
    : name_(std::move(context.name)),
      model_(*context.model),
      fingerprint_(std::move(context.fingerprint)),
      options_(*context.options),
      directory_(context.directory),
      registry_(&context.directory->registry()),
      policy_(context.directory->policy()),
      executor_(&context.directory->executor()),
      budget_(context.budget),
      clock_(context.clock),
      metrics_(context.metrics),
      pool_(*context.pool),
      host_(context.host),
      state_bytes_(model_.state_bytes_per_session()) {}

// ---------------------------------------------------------------------------------
// Claims.

void SessionKeeper::BindClaim(SessionDirectory& directory, SessionClaim& claim, WorkItem& w) {
  w.lease = std::move(claim.lease);
  w.ticket = claim.ticket;
  // Without a store lease (a local directory) a claim ends with its lease.
  if (claim.ticket == nullptr) return;
  const std::shared_ptr<StoreTicket>& ticket = claim.ticket;
  std::visit(
      Overloaded{
          [&](GenerateWork& g) { g.observer = new ClaimObserver(&directory, ticket, g.observer); },
          [&](ScoreWork& s) { s.done = EndClaimFirst(&directory, ticket, std::move(s.done)); },
          [&](ForkWork& f) { f.done = EndClaimFirst(&directory, ticket, std::move(f.done)); },
          [&](ExportWork& e) { e.done = EndClaimFirst(&directory, ticket, std::move(e.done)); },
          [&](DeleteWork& d) { d.done = EndClaimFirst(&directory, ticket, std::move(d.done)); },
          [&](ReadOutputWork& r) { r.done = EndClaimFirst(&directory, ticket, std::move(r.done)); },
          // New sessions: nothing is claimed.
          [](CreateWork&) {},
          [](ImportWork&) {},
      },
      w.work);
}

// ---------------------------------------------------------------------------------
// Writes and their ends.

absl::Status SessionKeeper::WriteFailure(const std::string& id, const absl::Status& written,
                                         const char* what) const {
  return directory_->ClientError(StoreCall::kWrite, id, written, what);
}

void SessionKeeper::EndLeaseAfterWrite(SessionLease& lease, const std::string& id, int64_t tokens,
                                       absl::Time now, const absl::Status& written) {
  if (written.ok()) return lease.Commit(tokens, now, policy_.durable);
  if (policy_.keeps_unstored) return lease.Commit(tokens, now, /*stored=*/false);
  lease.Forget();  // WriteThrough dropped the local copy
  registry_->Erase(id);
}

void SessionKeeper::DropStaleCopy(WorkItem& item) {
  auto it = resident_.find(item.session_id);
  if (it == resident_.end() || it->second.in_use) return;
  if (item.loaded == nullptr && it->second.version == item.ticket->version &&
      it->second.tag == item.ticket->tag) {
    return;
  }
  RemoveSession(item.session_id);
  registry_->SetResident(item.session_id, false);
}

bool SessionKeeper::NeedsLoad(WorkItem& item) {
  const bool needs_state =
      !item.session_id.empty() && !item.Is<DeleteWork>() && !item.Is<CreateWork>();
  if (needs_state && item.ticket != nullptr) DropStaleCopy(item);
  return (needs_state && !resident_.contains(item.session_id) && !item.loaded) ||
         (item.Is<ImportWork>() && !item.loaded);
}

// ---------------------------------------------------------------------------------
// Store jobs.

void SessionKeeper::RunStoreJob(std::function<std::function<void()>()> job) {
  host_->StoreJobStarted();
  executor_->Run([this, job = std::move(job)] {
    c10::NoGradGuard no_grad;
    std::function<void()> then = job();  // jobs catch their own exceptions
    host_->StoreJobDone(std::move(then));
  });
}

void SessionKeeper::StartLoad(std::unique_ptr<WorkItem> item) {
  if (!item->Is<ImportWork>() && !policy_.durable) {
    // Without a store every session is resident; this is a bug, not a client error.
    return FailItem(std::move(item),
                    absl::InternalError(
                        absl::StrCat("session_id '", item->session_id, "' has no resident state")));
  }
  auto holder = std::make_shared<std::unique_ptr<WorkItem>>(std::move(item));
  RunStoreJob([this, holder]() -> std::function<void()> {
    WorkItem& w = **holder;
    ImportWork* import = w.As<ImportWork>();
    absl::StatusOr<fwmodel::DecodedState> decoded = absl::InternalError("not loaded");
    absl::Status failure;
    try {
      if (import != nullptr) {
        // The signature first: nothing of an unauthenticated blob is parsed.
        if (options_.sealer != nullptr) {
          auto opened = options_.sealer->Open(std::move(import->blob));
          if (!opened.ok()) {
            failure = opened.status();
          } else {
            import->blob = std::move(*opened);
          }
        } else if (SessionSealer::LooksSealed(import->blob)) {
          failure = absl::InvalidArgumentError(
              "blob: it is signed by a deployment's key, and this server has no "
              "--session-key-file to check it");
        }
      }
      if (!failure.ok()) {
        // Refused before parsing.
      } else if (import != nullptr) {
        decoded = fwmodel::DecodeStateRow(model_, fingerprint_, std::move(import->blob));
        if (!decoded.ok()) {
          // A blob for another model is a bad argument to this call, like a corrupt one.
          failure = absl::InvalidArgumentError(absl::StrCat("blob: ", decoded.status().message()));
        }
      } else {
        auto blob = directory_->ReadState(w.session_id);
        if (!blob.ok()) {
          Log(LogLevel::kError, absl::StrCat("model ", name_, ": loading session ", w.session_id,
                                             " failed: ", blob.status().message()));
          metrics_->CountSessionStoreError("read");
          failure = directory_->ClientError(StoreCall::kLoad, w.session_id, blob.status(),
                                            "the session could not be read");
        } else {
          decoded = fwmodel::DecodeStateRow(model_, fingerprint_, std::move(*blob));
          if (!decoded.ok()) {
            Log(LogLevel::kError,
                absl::StrCat("model ", name_, ": session ", w.session_id,
                             ": stored state unreadable: ", decoded.status().message()));
            failure = absl::DataLossError(absl::StrCat("session_id '", w.session_id,
                                                       "': its saved state could not be restored"));
          }
        }
      }
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("model ", name_, ": load failed: ", e.what()));
      failure = absl::InternalError("loading the session failed");
    }
    if (failure.ok()) w.loaded = std::make_shared<fwmodel::DecodedState>(std::move(*decoded));
    return [this, holder, failure] {
      if (!failure.ok()) return FailItem(std::move(*holder), failure);
      host_->Readmit(std::move(*holder));
    };
  });
}

void SessionKeeper::WriteThrough(const std::string& id, int slot, int64_t tokens,
                                 absl::Time created, absl::Time last_used,
                                 std::shared_ptr<StoreTicket> ticket,
                                 std::function<void(absl::Status)> then) {
  if (!policy_.durable) return then(absl::OkStatus());
  // Copies taken now, on the engine thread: the slot may change once `then` has run.
  auto row = std::make_shared<fwmodel::State>(pool_.CopyRow(slot));
  torch::Tensor logits = tokens > 0 ? pool_.CopyLogits(slot) : torch::Tensor();
  // The tag of the version this write makes (a shared store tracks versions).
  const std::string new_tag = directory_->NewVersionTag(ticket.get());
  StoredSessionLabels labels{id, name_, "", created, last_used};
  if (auto resident = resident_.find(id); resident != resident_.end()) {
    labels.tenant = resident->second.tenant;
    labels.last_output = resident->second.last_output;
  }
  RunStoreJob([this, id, labels = std::move(labels), row, logits, tokens, ticket, new_tag,
               then = std::move(then)]() -> std::function<void()> {
    const absl::StatusOr<int64_t> version =
        StoreRow(labels, *row, logits, tokens, ticket.get(), new_tag);
    return [this, id, then, version, new_tag] {
      if (policy_.shared) {
        auto it = resident_.find(id);
        if (version.ok() && it != resident_.end()) {
          it->second.version = *version;
          it->second.tag = new_tag;
          registry_->SetResident(id, true, *version);
        } else if (!version.ok()) {
          // The store keeps the last committed state; this copy may be ahead of it.
          RemoveSession(id);
          registry_->SetResident(id, false);
        }
      }
      then(version.status());
    };
  });
}

absl::StatusOr<int64_t> SessionKeeper::StoreRow(const StoredSessionLabels& labels,
                                                const fwmodel::State& row,
                                                const torch::Tensor& logits, int64_t tokens,
                                                StoreTicket* ticket, const std::string& new_tag) {
  const std::string& id = labels.id;
  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> version = int64_t{0};
  try {
    auto blob = fwmodel::EncodeStateRow(model_, fingerprint_, row, 0, tokens, logits,
                                        ToStoredLabels(labels));
    if (!blob.ok()) {
      version = blob.status();
    } else {
      SessionWrite write;
      write.id = id;
      write.model = name_;
      write.tenant = labels.tenant;
      write.blob = std::move(*blob);
      write.tokens = tokens;
      write.created = labels.created;
      write.last_used = labels.last_used;
      write.ticket = ticket;
      write.tag = new_tag;
      version = directory_->WriteState(write);
    }
  } catch (const std::exception& e) {
    version = absl::InternalError(e.what());
  }
  if (version.ok()) {
    metrics_->ObserveSessionStoreWrite(SecondsFrom(start, absl::Now()));
  } else {
    metrics_->CountSessionStoreError("write");
  }
  if (!version.ok()) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": storing session ", id,
                                       " failed: ", version.status().message()));
  }
  return version;
}

absl::Status SessionKeeper::DeleteFromStore(const std::string& id, StoreTicket* ticket) {
  absl::Status deleted;
  try {
    deleted = directory_->DeleteState(id, ticket);
  } catch (const std::exception& e) {
    deleted = absl::InternalError(e.what());
  }
  if (!deleted.ok()) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": deleting session ", id,
                                       " from the store failed: ", deleted.message()));
    metrics_->CountSessionStoreError("delete");
  }
  return deleted;
}

void SessionKeeper::CommitNewSession(std::unique_ptr<WorkItem> item, Callback<SessionRecord> done,
                                     int slot, int64_t tokens, LastOutput last_output,
                                     const char* operation) {
  const absl::Time now = clock_->Now();
  SessionRecord record;
  record.id = NewSessionId();
  record.model = name_;
  record.tokens = tokens;
  record.state_bytes = state_bytes_;
  record.created = record.last_used = now;
  record.tenant = item->tenant;
  auto lease = registry_->InsertLeased(record);
  if (!lease.ok()) {
    FreeSlot(slot);
    return FailItem(std::move(item), lease.status());
  }
  resident_[record.id] = ResidentSession{slot, tokens, now, now, false};
  resident_[record.id].tenant = record.tenant;
  resident_[record.id].last_output = std::move(last_output);
  auto new_lease = std::make_shared<SessionLease>(std::move(*lease));
  std::shared_ptr<WorkItem> shared(std::move(item));
  WriteThrough(record.id, slot, tokens, now, now, /*ticket=*/nullptr,
               [this, shared, done = std::move(done), new_lease, record,
                operation](absl::Status written) mutable {
                 if (!written.ok()) {
                   EraseSession(record.id, *new_lease);
                   return done(directory_->ClientError(StoreCall::kCreate, record.id, written,
                                                       "the new session could not be saved"));
                 }
                 new_lease->Commit(record.tokens, record.last_used, policy_.durable);
                 metrics_->CountSessionOperation(operation);
                 record.stored = policy_.durable;
                 done(record);
               });
}

// ---------------------------------------------------------------------------------
// Session operations (they hold the session's lease from submission).

void SessionKeeper::RunSessionOperation(std::unique_ptr<WorkItem>& item) {
  const absl::Time now = clock_->Now();
  const std::string id = item->session_id;
  if (ForkWork* fork = item->As<ForkWork>()) {
    auto source = EnsureResident(*item);
    if (!source.ok()) return FailItem(std::move(item), source.status());
    if (absl::Status room = registry_->CheckCapacity(); !room.ok()) {
      return FailItem(std::move(item), room);
    }
    resident_[id].in_use = true;  // keep the source out of eviction
    auto slot = AllocateSlot();
    resident_[id].in_use = false;
    if (!slot.ok()) return FailItem(std::move(item), slot.status());
    ResidentSession& src = resident_[id];
    pool_.CopySlot(src.slot, *slot);
    src.last_used = now;  // a use: restarts the idle clock
    const int64_t tokens = src.tokens;
    LastOutput last_output = src.last_output;
    item->lease.ReleaseUsed(now);
    Callback<SessionRecord> done = fork->done;
    return CommitNewSession(std::move(item), std::move(done), *slot, tokens, std::move(last_output),
                            "forked");
  }
  if (ExportWork* export_work = item->As<ExportWork>()) {
    auto slot = EnsureResident(*item);
    if (!slot.ok()) return FailItem(std::move(item), slot.status());
    ResidentSession& r = resident_[id];
    r.last_used = now;  // a use: restarts the idle clock
    const int64_t tokens = r.tokens;
    auto row = std::make_shared<fwmodel::State>(pool_.CopyRow(*slot));
    torch::Tensor logits = tokens > 0 ? pool_.CopyLogits(*slot) : torch::Tensor();
    // The owner goes into the blob as information only: an import never trusts it.
    // The last output goes along (an import of the blob takes it).
    std::map<std::string, std::string> labels = {{"x-model", name_}, {"x-tenant", r.tenant}};
    AddLastOutputLabels(r.last_output, &labels);
    item->lease.ReleaseUsed(now);
    Callback<ExportResult> done = export_work->done;
    item.reset();
    // Encoding (a checksum over the state) and sealing run off the engine thread.
    return RunStoreJob([this, done = std::move(done), row, logits, tokens,
                        labels = std::move(labels)]() -> std::function<void()> {
      absl::StatusOr<std::string> blob = absl::InternalError("export failed");
      try {
        blob = fwmodel::EncodeStateRow(model_, fingerprint_, *row, 0, tokens, logits, labels);
        if (blob.ok() && options_.sealer != nullptr) {
          blob = options_.sealer->Seal(std::move(*blob));
        }
      } catch (const std::exception& e) {
        Log(LogLevel::kError, absl::StrCat("model ", name_, ": export failed: ", e.what()));
      }
      return [this, done, blob = std::move(blob), tokens]() mutable {
        if (!blob.ok()) return done(blob.status());
        metrics_->CountSessionOperation("exported");
        done(ExportResult{std::move(*blob), name_, tokens});
      };
    });
  }
  if (ImportWork* import = item->As<ImportWork>()) {
    if (absl::Status room = registry_->CheckCapacity(); !room.ok()) {
      return FailItem(std::move(item), room);
    }
    auto last_output = LoadedLastOutput(*item);
    if (!last_output.ok()) return FailItem(std::move(item), last_output.status());
    auto slot = AllocateSlot();
    if (!slot.ok()) return FailItem(std::move(item), slot.status());
    const fwmodel::DecodedState& decoded = *item->loaded;
    pool_.SetRow(*slot, decoded.state, decoded.tokens > 0 ? decoded.next_logits : torch::Tensor());
    const int64_t tokens = decoded.tokens;
    item->loaded.reset();
    Callback<SessionRecord> done = import->done;
    return CommitNewSession(std::move(item), std::move(done), *slot, tokens,
                            std::move(*last_output), "imported");
  }
  if (ReadOutputWork* read = item->As<ReadOutputWork>()) {
    // A session that is not resident is read from its loaded copy, which is then
    // dropped: reading takes no slot (and so never fails for want of memory).
    SessionOutput answer;
    if (auto it = resident_.find(id); it != resident_.end()) {
      answer.output = it->second.last_output;
    } else {
      auto last_output = LoadedLastOutput(*item);
      if (!last_output.ok()) return FailItem(std::move(item), last_output.status());
      answer.output = std::move(*last_output);
      item->loaded.reset();
    }
    item->lease.Release();  // read only: not a use of the session
    auto record = registry_->Get(id);
    if (!record.ok()) return FailItem(std::move(item), record.status());
    answer.session = std::move(*record);
    return read->done(std::move(answer));
  }
  if (item->Is<DeleteWork>()) {
    auto finish = [this, id](std::unique_ptr<WorkItem> w) {
      EraseSession(id, w->lease);
      metrics_->CountSessionOperation("deleted");
      w->As<DeleteWork>()->done(true);
    };
    if (!policy_.durable) return finish(std::move(item));
    auto holder = std::make_shared<std::unique_ptr<WorkItem>>(std::move(item));
    // Removed from the store first: a crash in between leaves the session, whole.
    return RunStoreJob([this, holder, id, finish]() -> std::function<void()> {
      const absl::Status deleted = DeleteFromStore(id, (*holder)->ticket.get());
      return [this, holder, id, deleted, finish]() mutable {
        if (!deleted.ok()) {
          if (policy_.shared) {
            RemoveSession(id);  // the store's copy is the truth; reload it next time
            registry_->SetResident(id, false);
          }
          return FailItem(
              std::move(*holder),
              WriteFailure(id, deleted, "the session could not be deleted; it is kept"));
        }
        finish(std::move(*holder));
      };
    });
  }
}

// ---------------------------------------------------------------------------------
// Stream tasks.

absl::StatusOr<StreamSession> SessionKeeper::OpenStream(WorkItem& w) {
  const absl::Time now = clock_->Now();
  GenerateWork* generate = w.As<GenerateWork>();
  if (w.Is<CreateWork>()) {
    auto slot = AllocateSlot();
    if (!slot.ok()) return slot.status();
    pool_.Reset(*slot);
    const std::string id = NewSessionId();
    auto lease = LeaseNewSession(id, w.tenant, 0, *slot, now);
    if (!lease.ok()) return lease.status();
    w.lease = std::move(*lease);
    resident_[id] = ResidentSession{*slot, 0, now, now, /*in_use=*/true};
    resident_[id].tenant = w.tenant;
    metrics_->CountSessionOperation("created");
    return StreamSession{id, *slot, 0, /*forked=*/false};
  }
  if (generate != nullptr && !generate->fork_id.empty()) {
    // A new session for this stream, under the id the core chose: a fork of
    // w.session_id (GenerateParams::fork_from: the source's state goes into the new
    // row, and the source is released unchanged), or, with no source, a fresh row (a
    // stateless request kept as a session: GenerateParams::prefix_reuse).
    const bool from_source = !w.session_id.empty();
    if (from_source) {
      auto source = EnsureResident(w);
      if (!source.ok()) return source.status();
    }
    if (absl::Status room = registry_->CheckCapacity(); !room.ok()) return room;
    if (from_source) resident_[w.session_id].in_use = true;  // keep it out of eviction
    auto slot = AllocateSlot();
    if (from_source) resident_[w.session_id].in_use = false;
    if (!slot.ok()) return slot.status();
    int64_t tokens = 0;
    if (from_source) {
      ResidentSession& source_session = resident_[w.session_id];
      pool_.CopySlot(source_session.slot, *slot);
      source_session.last_used = now;  // a use: restarts the idle clock
      tokens = source_session.tokens;
    } else {
      pool_.Reset(*slot);
    }
    const std::string id = generate->fork_id;
    auto lease = LeaseNewSession(id, w.tenant, tokens, *slot, now);
    if (!lease.ok()) return lease.status();
    // The source's lease (and its claim in a shared store) ends now; the new session is
    // created in the store by its first write (no ticket: version 1).
    if (from_source) {
      w.lease.ReleaseUsed(now);
      if (w.ticket != nullptr) {
        directory_->EndClaimThen(w.ticket, [] {});
        w.ticket = nullptr;
      }
    }
    w.lease = std::move(*lease);
    w.session_id = id;
    resident_[id] = ResidentSession{*slot, tokens, now, now, /*in_use=*/true};
    resident_[id].tenant = w.tenant;
    metrics_->CountSessionOperation(from_source ? "forked" : "created");
    // New: nothing to roll back to, removed if it keeps nothing.
    return StreamSession{id, *slot, tokens, /*forked=*/true};
  }
  if (!w.session_id.empty()) {
    auto slot = EnsureResident(w);
    if (!slot.ok()) return slot.status();
    ResidentSession& r = resident_[w.session_id];
    // A Score copies the row at once (a private context): it does not hold the slot.
    if (generate != nullptr) r.in_use = true;
    return StreamSession{w.session_id, *slot, r.tokens, /*forked=*/false};
  }
  if (generate != nullptr) {
    auto slot = AllocateSlot();
    if (!slot.ok()) return slot.status();
    pool_.Reset(*slot);
    return StreamSession{"", *slot, 0, /*forked=*/false};
  }
  return StreamSession{};  // a throwaway Score runs on a fresh private row
}

void SessionKeeper::CommitStream(std::shared_ptr<WorkItem> item, StreamEnd end,
                                 std::function<void(absl::Status)> answer) {
  const std::string& id = end.id;
  const GenerateWork* generate = item->As<GenerateWork>();
  if (id.empty() || item->Is<ScoreWork>()) {
    // A throwaway stream or a Score: nothing of a session changes.
    if (id.empty() && end.slot >= 0) FreeSlot(end.slot);
    item->lease.Release();
    return answer(absl::OkStatus());
  }
  if (end.forked && (!generate->params.store || (end.delivered == 0 && end.cut))) {
    // A fork that keeps nothing: store false, or cut before the client got a token. It
    // was never stored, so it is removed from memory alone.
    EraseSession(id, item->lease);
    return answer(absl::OkStatus());
  }
  const absl::Time now = clock_->Now();
  ResidentSession& r = resident_[id];
  r.in_use = false;
  r.tokens = end.tokens;
  if (end.rolled_back) {
    item->lease.Release();
    if (item->ticket != nullptr && item->ticket->lost.load()) {
      return answer(WriteFailure(id, absl::AbortedError("lease lost"), ""));
    }
    return answer(absl::OkStatus());
  }
  r.last_used = now;
  if (generate != nullptr) r.last_output = std::move(end.output);
  item->session_id = id;
  const int64_t tokens = end.tokens;
  const bool forked = end.forked;
  // Write-through: the caller hears of the change only once the store holds it.
  WriteThrough(id, end.slot, tokens, r.created, now, item->ticket,
               [this, item, id, tokens, now, answer, forked](absl::Status written) mutable {
                 if (written.ok()) {
                   item->lease.Commit(tokens, now, policy_.durable);
                   return answer(absl::OkStatus());
                 }
                 if (item->Is<CreateWork>() || forked) {
                   EraseSession(id, item->lease);
                   return answer(directory_->ClientError(StoreCall::kCreate, id, written,
                                                         "the new session could not be saved"));
                 }
                 // dir: the session keeps what was streamed, in memory, and the write is
                 // retried. Shared store: the session keeps its last committed state.
                 EndLeaseAfterWrite(item->lease, id, tokens, now, written);
                 answer(WriteFailure(id, written,
                                     "the generated tokens are kept in memory but could not "
                                     "be saved yet (the server retries)"));
               });
}

void SessionKeeper::FailStream(std::unique_ptr<WorkItem> item, StreamEnd end, absl::Status status) {
  const std::string& id = end.id;
  const bool keep_streamed = end.delivered > 0;
  const GenerateWork* generate = item->As<GenerateWork>();
  // A new session that keeps nothing is removed: a CreateSession's, or a fork's that
  // streamed nothing or is not to be stored.
  if (item->Is<CreateWork>() || (end.forked && (!keep_streamed || !generate->params.store))) {
    if (!id.empty()) {
      EraseSession(id, item->lease);
    } else if (end.slot >= 0) {
      FreeSlot(end.slot);
    }
    return FailItem(std::move(item), status);
  }
  if (id.empty()) {
    if (end.slot >= 0) FreeSlot(end.slot);
    return FailItem(std::move(item), status);
  }
  auto it = resident_.find(id);
  if (it != resident_.end()) it->second.in_use = false;
  if (!keep_streamed || it == resident_.end()) return FailItem(std::move(item), status);
  const absl::Time now = clock_->Now();
  const int64_t tokens = end.tokens;
  it->second.tokens = tokens;
  it->second.last_used = now;
  it->second.last_output = std::move(end.output);
  std::shared_ptr<WorkItem> shared(std::move(item));
  WriteThrough(id, it->second.slot, tokens, it->second.created, now, shared->ticket,
               [this, shared, id, tokens, now, status](absl::Status written) {
                 EndLeaseAfterWrite(shared->lease, id, tokens, now, written);
                 AnswerWorkItem(*shared, written.ok() || policy_.keeps_unstored
                                             ? status
                                             : WriteFailure(id, written, ""));
               });
}

absl::StatusOr<SessionRecord> SessionKeeper::Record(const std::string& id) const {
  return registry_->Get(id);
}

// ---------------------------------------------------------------------------------
// Residency.

absl::StatusOr<int> SessionKeeper::EnsureResident(WorkItem& item) {
  const std::string& id = item.session_id;
  if (auto it = resident_.find(id); it != resident_.end()) {
    if (item.ticket != nullptr) metrics_->CountSessionCacheLookup(true);
    return it->second.slot;
  }
  if (item.loaded == nullptr) {
    return absl::InternalError(absl::StrCat("session_id '", id, "' has no resident state"));
  }
  auto record = registry_->Get(id);
  if (!record.ok()) return record.status();
  auto last_output = LoadedLastOutput(item);
  if (!last_output.ok()) return last_output.status();
  auto slot = AllocateSlot();
  if (!slot.ok()) return slot.status();
  const fwmodel::DecodedState& decoded = *item.loaded;
  pool_.SetRow(*slot, decoded.state, decoded.tokens > 0 ? decoded.next_logits : torch::Tensor());
  const int64_t version = item.ticket != nullptr ? item.ticket->version : 0;
  resident_[id] = ResidentSession{*slot,
                                  decoded.tokens,
                                  record->created,
                                  record->last_used,
                                  false,
                                  version,
                                  item.ticket != nullptr ? item.ticket->tag : std::string(),
                                  record->tenant,
                                  std::move(*last_output)};
  item.loaded.reset();
  registry_->SetResident(id, true, version);
  if (item.ticket != nullptr) metrics_->CountSessionCacheLookup(false);
  metrics_->CountSessionOperation("restored");
  return *slot;
}

absl::StatusOr<LastOutput> SessionKeeper::LoadedLastOutput(const WorkItem& item) const {
  auto last_output = ParseLastOutputLabels(item.loaded->labels);
  if (last_output.ok()) return last_output;
  if (item.Is<ImportWork>()) {
    return absl::InvalidArgumentError(absl::StrCat("blob: ", last_output.status().message()));
  }
  Log(LogLevel::kError,
      absl::StrCat("model ", name_, ": session ", item.session_id,
                   ": stored state unreadable: ", last_output.status().message()));
  return absl::DataLossError(
      absl::StrCat("session_id '", item.session_id, "': its saved state could not be restored"));
}

absl::StatusOr<SessionLease> SessionKeeper::LeaseNewSession(const std::string& id,
                                                            const std::string& tenant,
                                                            int64_t tokens, int slot,
                                                            absl::Time now) {
  SessionRecord record;
  record.id = id;
  record.model = name_;
  record.tokens = tokens;
  record.state_bytes = state_bytes_;
  record.created = record.last_used = now;
  record.tenant = tenant;
  auto lease = registry_->InsertLeased(record);
  if (!lease.ok()) FreeSlot(slot);
  return lease;
}

absl::StatusOr<int> SessionKeeper::AllocateSlot() {
  while (true) {
    StatePool::Shortage shortage;
    if (std::optional<int> slot = pool_.TryAllocate(&shortage)) return *slot;
    if (ReleaseOneIdle()) continue;
    if (shortage == StatePool::Shortage::kBudget) {
      // The budget is held by other models' sessions: ask them to give up idle ones.
      budget_->RequestReclaim(state_bytes_);
      return absl::ResourceExhaustedError(
          absl::StrCat("no room for another session state of model '", name_,
                       "' within --max-state-memory-bytes=", options_.max_state_memory_bytes,
                       "; idle sessions of other models are being released, retry shortly"));
    }
    std::string unsaved;
    if (policy_.keeps_unstored) {
      if (const size_t n = registry_->Unstored(name_).size(); n > 0) {
        unsaved = absl::StrCat("; ", n,
                               " idle sessions must stay in memory because the session store "
                               "failed to save them (see the server log)");
      }
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "no room for another session state of model '", name_, "' within --max-state-memory-bytes=",
        options_.max_state_memory_bytes, " (every resident session is in use", unsaved, ")"));
  }
}

void SessionKeeper::FreeSlot(int slot) { pool_.Free(slot); }

bool SessionKeeper::ReleaseOneIdle() {
  // The least recently used resident session that no request holds and that the store
  // holds (with a store, a session is only ever dropped from memory, never lost), of
  // the tenant holding the most resident sessions: a tenant filling memory loses its
  // own idle sessions first, not other tenants'. With one tenant: plain LRU.
  const std::string victim = ChooseSessionToRelease(resident_, [this](const std::string& id) {
    auto record = registry_->Get(id);
    if (!record.ok() || record->busy) return false;
    // With a store, a session is only ever dropped from memory, never lost.
    return !policy_.durable || record->stored;
  });
  if (victim.empty()) return false;
  if (policy_.durable) {
    auto it = resident_.find(victim);
    FreeSlot(it->second.slot);
    resident_.erase(it);
    // A shared store is the index of its sessions: forget this one here.
    if (policy_.shared) {
      registry_->EraseIfIdle(victim);
    } else {
      registry_->SetResident(victim, false);
    }
    metrics_->CountSessionOperation("spilled");
    return true;
  }
  if (!registry_->EraseIfIdle(victim)) return true;  // leased meanwhile: try again
  RemoveSession(victim);
  metrics_->CountSessionRemoval("evicted");
  Log(LogLevel::kInfo, absl::StrCat("model ", name_, ": evicted session ", victim,
                                    " (state memory budget; --session-store=memory)"));
  return true;
}

void SessionKeeper::RemoveSession(const std::string& id) {
  if (auto it = resident_.find(id); it != resident_.end()) {
    FreeSlot(it->second.slot);
    resident_.erase(it);
  }
}

void SessionKeeper::EraseSession(const std::string& id, SessionLease& lease) {
  RemoveSession(id);
  registry_->Erase(id);
  lease.Forget();
}

// ---------------------------------------------------------------------------------
// Housekeeping.

void SessionKeeper::Housekeeping(bool ending) {
  // Runs outside the iteration's try: nothing here may end the process.
  try {
    while (budget_->reclaim_wanted() > 0 && ReleaseOneIdle()) budget_->Reclaimed(state_bytes_);
    for (const std::string& id :
         registry_->TakeExpired(name_, clock_->Now() - options_.session_ttl)) {
      RemoveSession(id);
      metrics_->CountSessionRemoval("expired");
      // A shared store expires sessions itself (other replicas may still use them).
      if (!policy_.engine_expires_stored) continue;
      // On failure the file stays; the next start indexes it and expires it again.
      RunStoreJob([this, id]() -> std::function<void()> {
        (void)DeleteFromStore(id, nullptr);
        return nullptr;
      });
    }
    // Not while shutting down: the exit makes one last attempt (StoreUnstoredAtExit).
    // (A shared store never holds unstored sessions: a failed write drops the copy.)
    if (policy_.keeps_unstored && !ending) RetryUnstored();
    PublishGauges();
  } catch (const std::exception& e) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": housekeeping failed: ", e.what()));
  }
}

void SessionKeeper::RetryUnstored() {
  for (const std::string& id : registry_->Unstored(name_)) {
    auto it = resident_.find(id);
    if (it == resident_.end() || it->second.in_use) continue;
    auto lease = registry_->Acquire(id);
    if (!lease.ok()) continue;  // a request holds it; it writes through when it ends
    auto held = std::make_shared<SessionLease>(std::move(*lease));
    const ResidentSession& r = it->second;
    const int64_t tokens = r.tokens;
    const absl::Time last_used = r.last_used;
    WriteThrough(id, r.slot, tokens, r.created, last_used, /*ticket=*/nullptr,
                 [this, held, tokens, last_used, id](absl::Status written) {
                   if (written.ok()) {
                     Log(LogLevel::kInfo, absl::StrCat("model ", name_, ": session ", id,
                                                       " is saved to the session store again"));
                   }
                   held->Commit(tokens, last_used, written.ok());
                 });
  }
}

void SessionKeeper::StoreUnstoredAtExit() {
  // A shared store never has unstored sessions: a failed write drops the local copy.
  if (!policy_.keeps_unstored) return;
  int64_t saved = 0, failed = 0;
  for (const std::string& id : registry_->Unstored(name_)) {
    auto it = resident_.find(id);
    if (it == resident_.end()) continue;
    const ResidentSession& r = it->second;
    try {
      const absl::Status status =
          StoreRow({id, name_, r.tenant, r.created, r.last_used, r.last_output},
                   pool_.CopyRow(r.slot), r.tokens > 0 ? pool_.CopyLogits(r.slot) : torch::Tensor(),
                   r.tokens, /*ticket=*/nullptr)
              .status();
      status.ok() ? ++saved : ++failed;
    } catch (const std::exception&) {  // from the row copies
      ++failed;
    }
  }
  if (saved + failed > 0) {
    Log(failed > 0 ? LogLevel::kError : LogLevel::kInfo,
        absl::StrCat("model ", name_, ": at exit, stored ", saved,
                     " sessions whose earlier writes had failed; ", failed, " still failed"));
  }
}

void SessionKeeper::PublishGauges() {
  metrics_->SetSessions(static_cast<int64_t>(resident_.size()), registry_->CountNotResident(name_),
                        pool_.slots_in_use() * state_bytes_);
  metrics_->SetStateMemoryUsage(budget_->used(), budget_->limit());
}

}  // namespace fwserve
