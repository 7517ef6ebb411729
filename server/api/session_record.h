// A session's metadata as callers see it (GetSession, ListSessions, the answers of
// Create/Fork/Import). Header-only and torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace fwserve {

struct SessionRecord {
  std::string id;
  std::string model;
  // The tenant that owns the session (docs/security.md); empty on an open server. Only
  // its owner sees it: to anyone else it does not exist.
  std::string tenant;
  // Tokens the state has absorbed (== the history's length in tokens).
  int64_t tokens = 0;
  int64_t state_bytes = 0;
  absl::Time created;
  absl::Time last_used;
  // True while one request holds the session's lease.
  bool busy = false;
  // True while the state is in the model's pool (else only in the session store).
  bool resident = true;
  // True when the session store holds the state as of the last committed request.
  // False without a durable store, and after a failed write (retried until it works;
  // such a session is never dropped from memory).
  bool stored = false;
  // Shared store (redis://) only: the store's version of the session that the resident
  // copy holds (0 = none). Bumped by each committed request.
  int64_t version = 0;
};

}  // namespace fwserve
