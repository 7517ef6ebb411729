// Kept conversations of stateless clients (docs/http.md "Replayed histories"): for each
// tenant and model, the sessions whose state is a whole conversation (prompt and reply),
// found by that conversation's token ids. A chat or response whose history begins with
// one continues from its state and prefills only the rest.
//
// A conversation is kept as the token ids its session absorbed, and a prompt continues
// it only when the prompt's token ids (the model's tokenizer's encoding of the whole
// prompt) start with all of them, compared whole: the state is then exactly what a full
// prefill of the prompt builds, whatever the tokenizer's merges do at the boundary, and
// no hash collision can continue another conversation. Entries never cross tenants or
// models.
//
// Bounded: at most `entries_per_owner` conversations per (tenant, model), least
// recently used evicted first; the caller deletes the evicted sessions.
//
// Thread-safety: thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/types/span.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace fwserve {

class PrefixIndex {
 public:
  // entries_per_owner: conversations kept per (tenant, model); 0 keeps none.
  explicit PrefixIndex(size_t entries_per_owner) : capacity_(entries_per_owner) {}

  using Tokens = std::vector<int64_t>;
  struct Match {
    std::string session_id;
    size_t length = 0;  // tokens of the prompt the session's state already holds
  };
  // The longest kept conversation of (tenant, model) that `prompt` (token ids) begins
  // with, made the most recently used; nullopt when none.
  std::optional<Match> Find(const std::string& tenant, const std::string& model,
                            absl::Span<const int64_t> prompt);
  // Keeps `conversation` as the state of `session_id`. `owned`: the session is the
  // index's (a stateless chat's), deleted when its entry goes; else the caller's (a
  // stored response), only forgotten. Returns the owned sessions evicted to stay within
  // the bound (or replaced by this entry of the same conversation), which the caller
  // deletes. With capacity 0, nothing is kept: returns `session_id` when owned.
  std::vector<std::string> Insert(const std::string& tenant, const std::string& model,
                                  Tokens conversation, std::string session_id,
                                  bool owned = true);
  // Forgets the entry of `session_id` (its session is gone); false when there was none.
  bool Erase(const std::string& tenant, const std::string& model, const std::string& session_id);
  // Conversations kept, over all owners.
  size_t size() const;
  // Owned conversations kept for `tenant`, over its models (they do not count against
  // its session quota).
  size_t CountOfTenant(const std::string& tenant) const;

 private:
  struct Entry {
    Tokens conversation;
    std::string session_id;
    bool owned = true;
  };
  using Owner = std::pair<std::string, std::string>;  // tenant, model

  const size_t capacity_;
  mutable absl::Mutex mu_;
  // Most recently used first.
  absl::flat_hash_map<Owner, std::list<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  size_t size_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fwserve
