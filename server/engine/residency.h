// Which sessions have their state resident in the engine's StatePool, and which one
// gives its slot up when memory runs short. Torch-free (slots are pool row indices).
// Engine thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "server/api/session_record.h"

namespace fwserve {

// A session whose state is in the pool.
struct ResidentSession {
  int slot = -1;
  int64_t tokens = 0;
  absl::Time created;
  absl::Time last_used;
  bool in_use = false;      // a task or session operation is using the slot
  int64_t version = 0;      // shared store: the store's version this copy holds
  std::string tag = {};     // and that version's tag
  std::string tenant = {};  // the owner (SessionRecord::tenant)
  // What the last committed Generate produced; written through with the state (its
  // labels) and read by GetSessionOutput.
  LastOutput last_output = {};
};

using ResidentSessions = absl::flat_hash_map<std::string, ResidentSession>;

// The session to release when a slot is needed: the least recently used one that no
// request uses, of the tenant holding the most resident sessions (a tenant filling
// memory loses its own idle sessions first, not other tenants'; with one tenant this
// is plain LRU). `releasable` vetoes a candidate (busy in the registry, or not yet
// stored where the store must hold what leaves memory); it is asked only about a
// candidate that would beat the best so far. Empty: none can go.
std::string ChooseSessionToRelease(const ResidentSessions& resident,
                                   const std::function<bool(const std::string& id)>& releasable);

}  // namespace fwserve
