// A unit of work for an engine: a header every item has (its session, tenant, claim,
// text, arrival) and one typed work (Work, a std::variant) saying what to do and whom
// to answer. Torch-free: the core builds items; a loaded state is the engine's, behind a
// forward declaration.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/api/requests.h"
#include "server/sessions/session_directory.h"
#include "server/sessions/session_registry.h"

namespace fwmodel {
struct DecodedState;  // models/checkpoints/state_codec.h
}  // namespace fwmodel

namespace fwserve {

class LateStreamHandle;  // engine.cc

// A Generate: a stream task (engine.cc). The transport's observer gets OnStart before
// the item is queued, then chunks, then OnFinish exactly once.
struct GenerateWork {
  GenerateParams params;
  GenerateObserver* observer = nullptr;  // see server/api/requests.h for its lifetime
  uint64_t stream_id = 0;                // set by Engine::Submit
  // With GenerateParams::fork_from (or a kept conversation): the new session's id,
  // chosen by the core. The item's `session_id` (and its claim) are then the source's
  // until the engine forks it, and the new session's after.
  std::string fork_id;
  // The stream control handed to the observer before the session was claimed
  // (OpenStreamBeforeClaim); null: Engine::Submit hands the observer one.
  std::shared_ptr<LateStreamHandle> control;
};
// Score: a stream task that samples nothing; the session (if any) is not changed.
struct ScoreWork {
  Callback<ScoreResult> done;
};
// CreateSession: a stream task that absorbs the prefix and samples nothing; it ends
// when the prefix is absorbed (TaskKind::kCreate), whatever its other fields say.
struct CreateWork {
  Callback<SessionRecord> done;
};
// Session operations, run at admission (SessionKeeper::RunSessionOperation).
struct ForkWork {
  Callback<SessionRecord> done;
};
struct ExportWork {
  Callback<ExportResult> done;
};
struct ImportWork {
  std::string blob;  // the exported blob, decoded on a store thread
  Callback<SessionRecord> done;
};
struct DeleteWork {
  Callback<bool> done;
};
// The session's last output (Core::GetSessionOutput); like an export it holds the lease
// while it reads, and changes nothing.
struct ReadOutputWork {
  Callback<SessionOutput> done;
};

using Work = std::variant<GenerateWork, ScoreWork, CreateWork, ForkWork, ExportWork, ImportWork,
                          DeleteWork, ReadOutputWork>;

// Items that name an existing session hold its claim (lease, and with a shared store
// the store's ticket) from submission until the engine answers them (and, for a change,
// until the store holds it). Every answer ends the claim first (SessionKeeper::BindClaim).
struct WorkItem {
  std::string session_id;
  // The caller's tenant: owns the sessions this item creates (Caller::tenant).
  std::string tenant;
  SessionLease lease;
  // Shared store only: the lease in the store (null otherwise, and for new sessions).
  std::shared_ptr<StoreTicket> ticket;
  std::vector<int64_t> tokens;  // prompt, scored text or prefix
  // The prompt, scored text or prefix as the caller sent it: Engine::Submit encodes it
  // into `tokens` with the model's tokenizer (the core may not know the model yet), after
  // the tokenizer's begin_of_text when `fresh_prompt`.
  std::string text;
  // The text starts a fresh state (a Generate with neither session nor fork, a new
  // session's prefix): set by the core.
  bool fresh_prompt = false;
  // The session's state read from the store (or the decoded import blob), when the
  // session was not resident at admission; null otherwise. Set and read on the engine's
  // threads only (a shared_ptr so that the core, which cannot see the type, may destroy
  // an item).
  std::shared_ptr<fwmodel::DecodedState> loaded;
  // Generate, Score, Create: polled at admission and between prefill chunks; may be null.
  std::function<bool()> is_cancelled;
  absl::Time arrival;
  Work work;

  template <typename T>
  bool Is() const {
    return std::holds_alternative<T>(work);
  }
  template <typename T>
  T* As() {
    return std::get_if<T>(&work);
  }
  template <typename T>
  const T* As() const {
    return std::get_if<T>(&work);
  }
  // Generate, Score and CreateSession become stream tasks that count against
  // --max-active-streams; the other works run at admission.
  bool IsStream() const { return Is<GenerateWork>() || Is<ScoreWork>() || Is<CreateWork>(); }
};

// std::visit with one lambda per work: Visit(item.work, Overloaded{...}).
template <typename... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <typename... F>
Overloaded(F...) -> Overloaded<F...>;

// Answers `item` with `status` through its work's callback (its lease released first;
// a bound claim ends before the callback runs: SessionKeeper::BindClaim).
void AnswerWorkItem(WorkItem& item, absl::Status status);
inline void FailItem(std::unique_ptr<WorkItem> item, absl::Status status) {
  AnswerWorkItem(*item, std::move(status));
}

}  // namespace fwserve
