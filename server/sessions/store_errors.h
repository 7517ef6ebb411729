// What a client hears when the session store failed: the one mapping from a store's
// status to the client's status, for every mode and call. The details (the store's own
// message) go to the server log, never to the client. Torch-free.
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace fwserve {

// Which store call failed, as the client's request sees it.
enum class StoreCall {
  // Taking a session's lease or reading its record in a shared store (redis://).
  kLookup,
  // Reading a session's saved state to make it resident.
  kLoad,
  // Writing a session through (a commit, a delete).
  kWrite,
  // Writing a new session (create, fork, import): on failure it is not created.
  kCreate,
};

struct StoreErrorContext {
  // Whether the store is shared by several replicas (redis://): leases, fenced writes.
  bool shared = false;
  // --session-store-timeout, quoted by kLookup's UNAVAILABLE.
  absl::Duration timeout = absl::Seconds(1);
  // The request field that named the session, in kLookup's errors (a fork-and-generate
  // names it fork_from).
  std::string field = "session_id";
};

// The client's error for `store_status` (not OK) of `call` on session `id` (may be
// empty: a call about no one session, e.g. a listing). `what` says what was lost or kept,
// for dir: writes and loads ("the session could not be read", ...); it may be empty.
//
//   call     store code             shared store                    dir: store
//   kLookup  NOT_FOUND              NOT_FOUND "not found"           (not used)
//            ABORTED                ABORTED "busy"
//            UNAVAILABLE/DEADLINE   UNAVAILABLE, quotes the timeout
//            other                  INTERNAL
//   kLoad    NOT_FOUND              DATA_LOSS "saved state is missing"
//            other                  UNAVAILABLE "unchanged"         UNAVAILABLE + `what`
//   kWrite   ABORTED                ABORTED "lost its lease"        UNAVAILABLE + `what`
//            UNAVAILABLE/DEADLINE   UNAVAILABLE "may not have been saved"
//            other                  INTERNAL
//   kCreate  UNAVAILABLE/DEADLINE   UNAVAILABLE "was not created"   UNAVAILABLE + `what`
//            other                  INTERNAL
absl::Status ClientStoreError(StoreCall call, const StoreErrorContext& context,
                              absl::string_view id, const absl::Status& store_status,
                              absl::string_view what = "");

// The outcome label of a store operation for fwserve_session_store_* metrics: "ok",
// "not_found", "conflict", "unavailable" or "error".
const char* StoreOutcome(const absl::Status& status);

}  // namespace fwserve
