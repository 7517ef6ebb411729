// A session's metadata as callers see it (GetSession, ListSessions, the answers of
// Create/Fork/Import), and the text its last Generate produced (GetSessionOutput).
// Header-only and torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

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

// The text the last committed Generate on a session produced, exactly as its client
// received it: the chunks' text, then the trailing text (an incomplete final character
// as U+FFFD), so valid UTF-8; a stop string the session absorbed is part of it. Empty
// for a session no Generate has committed to. A Score, a failed write-through or a
// cancelled Generate that streamed nothing leave it unchanged; a Fork copies it; an
// Import takes it from the blob. It is kept with the session's state (in memory and in
// the stored blob's labels, docs/sessions.md) and travels with it across restarts and
// replicas.
struct LastOutput {
  // At most this many bytes are kept: the first ones, cut at a character boundary.
  static constexpr size_t kMaxBytes = size_t{64} << 10;

  std::string text;
  // True when the text was longer than kMaxBytes: `text` holds its beginning only.
  bool truncated = false;

  // Appends `more`, keeping at most kMaxBytes (never splitting a UTF-8 character of
  // valid input) and setting `truncated` once anything is left out.
  void Append(std::string_view more) {
    if (truncated || more.empty()) return;
    const size_t room = kMaxBytes - text.size();
    if (more.size() <= room) {
      text.append(more);
      return;
    }
    size_t cut = room;
    // Back off to the first byte of the character that would be split.
    while (cut > 0 && (static_cast<unsigned char>(more[cut]) & 0xC0) == 0x80) --cut;
    text.append(more.substr(0, cut));
    truncated = true;
  }
};

// A session and its last output (Core::GetSessionOutput).
struct SessionOutput {
  SessionRecord session;
  LastOutput output;
};

}  // namespace fwserve
