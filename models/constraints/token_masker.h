// Which token ids of a vocabulary may come next from a Matcher's position: the mask a
// constrained stream applies to its logits before each draw. Torch-free.
//
// Cost model (docs/structured-output.md): the vocabulary is a byte trie. For each grammar
// state that tops a matcher stack, one walk of the trie, pruned by the grammar (a subtree
// is skipped as soon as its prefix is refused), computes once which tokens the state
// accepts whatever lies below it on the stack, and which few ("uncertain": tokens that
// finish a called rule's value and go on) depend on the stack below. Allowed() then ORs the
// cached per-state results of the position's stacks and checks the uncertain tokens
// against the real stack. Results are cached per (grammar fingerprint, state), so equal
// schemas compiled for different requests share them.
//
// Thread-safety: immutable after construction but for the mask cache, which a mutex
// guards; Allowed may run on any number of threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "models/constraints/grammar.h"
#include "models/constraints/matcher.h"
#include "models/constraints/stacks.h"

namespace fwserve::constraints {

class TokenMasker {
 public:
  // The default budget of the per-state mask cache.
  static constexpr size_t kDefaultCacheBytes = size_t{256} << 20;

  // token_bytes[id]: the exact bytes token `id` decodes to (empty: never allowed).
  // end_token: the model's end-of-text id, allowed exactly when the matcher IsComplete()
  // (its bytes are ignored), or -1 when the vocabulary has none. cache_bytes: the mask
  // cache's budget; least recently used grammars are dropped beyond it.
  TokenMasker(std::vector<std::string> token_bytes, int64_t end_token,
              size_t cache_bytes = kDefaultCacheBytes);

  // allowed->assign(vocab(), 0), then allowed[id] = 1 iff every byte of token id, in order,
  // may come next from `matcher`'s position (and the end token iff the matcher is
  // complete). Returns the number of allowed ids; 0 means the stream must end (a finished
  // document in a vocabulary without an end token).
  int64_t Allowed(const Matcher& matcher, std::vector<uint8_t>* allowed) const;

  int64_t vocab() const { return static_cast<int64_t>(token_bytes_.size()); }
  int64_t end_token() const { return end_token_; }
  const std::string& token_bytes(int64_t id) const { return token_bytes_[id]; }

  struct Stats {
    int64_t state_masks_computed = 0;  // trie walks for a grammar state
    int64_t state_mask_hits = 0;       // per-state results found in the cache
    int64_t full_walks = 0;            // walks from a real stack (near the depth bound)
    int64_t uncertain_checked = 0;     // tokens checked against a real stack
    size_t cache_bytes = 0;            // the cache's size now
    int64_t grammars_cached = 0;       // distinct automata in the cache now
  };
  Stats stats() const;

 private:
  // What a grammar state accepts, whatever is below it on the stack.
  struct StateMask {
    std::vector<uint64_t> bits;      // dense form (vocab bits), or empty
    std::vector<int32_t> ids;        // sparse form, when `bits` is empty
    std::vector<int32_t> uncertain;  // accepted or not depending on the stack below
    int max_depth = 0;               // deepest local stack the walk reached
    size_t MemoryBytes() const {
      return sizeof(StateMask) + bits.size() * 8 + (ids.size() + uncertain.size()) * 4;
    }
  };
  struct WalkResult {
    std::vector<uint64_t> accepted;  // a vocab bitset
    int64_t accepted_count = 0;
    std::vector<int32_t> uncertain;
    int max_depth = 0;
  };
  struct GrammarEntry {
    std::shared_ptr<const Grammar> representative;
    std::vector<uint64_t> verified_ids;  // grammars found equal to the representative
    absl::flat_hash_map<int32_t, std::shared_ptr<const StateMask>> masks;
    size_t bytes = 0;
    uint64_t last_use = 0;
  };

  // Walks the trie from the stack set `start` (local: its bottom frame's caller unknown).
  void Walk(const Grammar& g, const internal::StackSet& start, bool local,
            WalkResult* result) const;
  std::shared_ptr<const StateMask> ComputeStateMask(const Grammar& g, int32_t state) const;
  std::shared_ptr<const StateMask> StateMaskFor(const std::shared_ptr<const Grammar>& g,
                                                int32_t state) const;
  // Whether the single stack `stack` (flat: its depth, then its states) accepts all of
  // `bytes`.
  bool StackAccepts(const Grammar& g, const int32_t* stack, const std::string& bytes) const;

  const std::vector<std::string> token_bytes_;
  const int64_t end_token_;
  const size_t cache_budget_;
  size_t words_ = 0;  // 64-bit words of a vocab bitset

  // The vocabulary's byte trie in depth-first preorder: node i reads byte_[i] at depth
  // depth_[i] (1 = a token's first byte); its subtree ends before skip_[i]; token_[i] is
  // the first id whose bytes end there (-1: none); more_[i] >= 0 indexes more_tokens_,
  // the other ids with the same bytes.
  std::vector<uint8_t> byte_;
  std::vector<int32_t> depth_;
  std::vector<int32_t> skip_;
  std::vector<int32_t> token_;
  std::vector<int32_t> more_;
  std::vector<std::vector<int32_t>> more_tokens_;
  int max_token_length_ = 0;

  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::pair<uint64_t, uint64_t>, GrammarEntry> cache_
      ABSL_GUARDED_BY(mu_);
  mutable size_t cache_total_ ABSL_GUARDED_BY(mu_) = 0;
  mutable uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  mutable Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fwserve::constraints
