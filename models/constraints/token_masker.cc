#include "models/constraints/token_masker.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace fwserve::constraints {
namespace {

using internal::StackSet;
using internal::StepInfo;

// kSpread[b]: the 8 bytes 0/1 of the bits of b, little-endian (bit k -> byte k).
struct SpreadTable {
  uint64_t v[256];
  SpreadTable() {
    for (int b = 0; b < 256; ++b) {
      uint64_t x = 0;
      for (int k = 0; k < 8; ++k) {
        if (b & (1 << k)) x |= uint64_t{1} << (8 * k);
      }
      v[b] = x;
    }
  }
};
const SpreadTable kSpread;

// More grammars than this verified against one cache entry: the oldest is forgotten.
constexpr size_t kMaxVerifiedIds = 256;

}  // namespace

TokenMasker::TokenMasker(std::vector<std::string> token_bytes, int64_t end_token,
                         size_t cache_bytes)
    : token_bytes_(std::move(token_bytes)),
      end_token_(end_token >= 0 && end_token < static_cast<int64_t>(token_bytes_.size()) ? end_token
                                                                                         : -1),
      cache_budget_(cache_bytes) {
  words_ = (token_bytes_.size() + 63) / 64;
  std::vector<int32_t> order;
  for (size_t id = 0; id < token_bytes_.size(); ++id) {
    if (!token_bytes_[id].empty() && static_cast<int64_t>(id) != end_token_) {
      order.push_back(static_cast<int32_t>(id));
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [this](int32_t a, int32_t b) { return token_bytes_[a] < token_bytes_[b]; });
  // Preorder trie: each token adds the nodes of its bytes past the common prefix with the
  // previous token (sorted order visits the trie depth first).
  std::vector<int32_t> path;  // node index at each depth of the previous token
  const std::string* previous = nullptr;
  for (int32_t id : order) {
    const std::string& bytes = token_bytes_[id];
    size_t common = 0;
    if (previous != nullptr) {
      while (common < bytes.size() && common < previous->size() &&
             bytes[common] == (*previous)[common]) {
        ++common;
      }
    }
    path.resize(common);
    for (size_t k = common; k < bytes.size(); ++k) {
      byte_.push_back(static_cast<uint8_t>(bytes[k]));
      depth_.push_back(static_cast<int32_t>(k + 1));
      token_.push_back(-1);
      more_.push_back(-1);
      path.push_back(static_cast<int32_t>(byte_.size()) - 1);
    }
    const int32_t node = path.back();
    if (token_[node] < 0) {
      token_[node] = id;
    } else {
      if (more_[node] < 0) {
        more_[node] = static_cast<int32_t>(more_tokens_.size());
        more_tokens_.emplace_back();
      }
      more_tokens_[more_[node]].push_back(id);
    }
    max_token_length_ = std::max(max_token_length_, static_cast<int>(bytes.size()));
    previous = &bytes;
  }
  // skip_[i]: the first later node no deeper than i.
  const auto n = static_cast<int32_t>(byte_.size());
  skip_.assign(n, n);
  std::vector<int32_t> open;
  for (int32_t i = 0; i < n; ++i) {
    while (!open.empty() && depth_[open.back()] >= depth_[i]) {
      skip_[open.back()] = i;
      open.pop_back();
    }
    open.push_back(i);
  }
}

void TokenMasker::Walk(const Grammar& g, const StackSet& start, bool local,
                       WalkResult* result) const {
  // Per depth of the trie: the stacks after the node's bytes, either one single-frame
  // stack in a plain state (plain[d] >= 0: the common case, stepped by a table lookup) or
  // the general set levels[d] (valid when plain[d] == kGeneral); and whether a context
  // pop happened on the way (context[d]).
  constexpr int32_t kGeneral = -1, kDead = -2;
  std::vector<StackSet> levels(max_token_length_ + 1);
  std::vector<int32_t> plain(max_token_length_ + 1, kDead);
  std::vector<uint8_t> context(max_token_length_ + 1, 0);
  if (start.size() == 2 && g.IsPlain(start[1])) {
    plain[0] = start[1];
  } else if (!start.empty()) {
    levels[0] = start;
    plain[0] = kGeneral;
  }
  const auto n = static_cast<int32_t>(byte_.size());
  result->accepted.assign(words_, 0);
  uint64_t* accepted = result->accepted.data();
  auto accept = [&](int32_t node) {
    const int32_t id = token_[node];
    accepted[id >> 6] |= uint64_t{1} << (id & 63);
    ++result->accepted_count;
    if (more_[node] >= 0) {
      for (int32_t more : more_tokens_[more_[node]]) {
        accepted[more >> 6] |= uint64_t{1} << (more & 63);
        ++result->accepted_count;
      }
    }
  };
  auto uncertain = [&](int32_t node) {
    result->uncertain.push_back(token_[node]);
    if (more_[node] >= 0) {
      const std::vector<int32_t>& more = more_tokens_[more_[node]];
      result->uncertain.insert(result->uncertain.end(), more.begin(), more.end());
    }
  };
  int max_depth = start.empty() ? 0 : 1;
  for (int32_t i = 0; i < n;) {
    const int32_t d = depth_[i];
    const int32_t parent_state = plain[d - 1];
    int32_t here = kDead;
    bool context_pop = false;
    if (parent_state >= 0) {
      const int32_t next = g.Next(parent_state, byte_[i]);
      if (next != Grammar::kNoState) {
        if (g.IsPlain(next)) {
          here = next;
        } else {
          StepInfo info;
          const int32_t parent[2] = {1, parent_state};
          if (internal::StepStacks(g, parent, parent + 2, byte_[i], local, &levels[d], &info)) {
            here = kGeneral;
            context_pop = info.context_pop;
          }
          max_depth = std::max(max_depth, info.max_depth);
        }
      }
    } else if (parent_state == kGeneral) {
      const StackSet& parent = levels[d - 1];
      StepInfo info;
      if (internal::StepStacks(g, parent.data(), parent.data() + parent.size(), byte_[i], local,
                               &levels[d], &info)) {
        here = kGeneral;
        context_pop = info.context_pop;
      }
      max_depth = std::max(max_depth, info.max_depth);
    }
    if (here == kGeneral && levels[d].size() == 2 && g.IsPlain(levels[d][1])) {
      here = levels[d][1];
    }
    const bool ok = here != kDead;
    const bool parent_context = context[d - 1] != 0;
    context[d] = parent_context || context_pop;
    // A general set that is empty (only a context pop, or a finished document) has no
    // continuation of its own.
    if (here == kGeneral && levels[d].empty())
      plain[d] = kDead;
    else
      plain[d] = here;
    if (token_[i] >= 0) {
      if (ok) {
        accept(i);
      } else if (parent_context) {
        uncertain(i);
      }
    }
    const bool live = plain[d] != kDead || context[d];
    i = live ? i + 1 : skip_[i];
  }
  result->max_depth = std::max(result->max_depth, max_depth);
}

std::shared_ptr<const TokenMasker::StateMask> TokenMasker::ComputeStateMask(const Grammar& g,
                                                                            int32_t state) const {
  WalkResult walk;
  StackSet start = {1, state};
  Walk(g, start, /*local=*/true, &walk);
  auto mask = std::make_shared<StateMask>();
  if (walk.accepted_count * 32 > static_cast<int64_t>(token_bytes_.size())) {
    mask->bits = std::move(walk.accepted);
  } else {
    mask->ids.reserve(walk.accepted_count);
    for (size_t w = 0; w < words_; ++w) {
      for (uint64_t word = walk.accepted[w]; word != 0; word &= word - 1) {
        mask->ids.push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(word)));
      }
    }
  }
  mask->uncertain = std::move(walk.uncertain);
  mask->max_depth = walk.max_depth;
  return mask;
}

std::shared_ptr<const TokenMasker::StateMask> TokenMasker::StateMaskFor(
    const std::shared_ptr<const Grammar>& g, int32_t state) const {
  const std::pair<uint64_t, uint64_t> key = {g->fingerprint()[0], g->fingerprint()[1]};
  std::shared_ptr<const Grammar> representative;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = cache_.try_emplace(key);
    GrammarEntry& entry = it->second;
    if (inserted) {
      entry.representative = g;
      entry.bytes = g->MemoryBytes();
      cache_total_ += entry.bytes;
    }
    entry.last_use = ++clock_;
    const bool verified = entry.representative.get() == g.get() ||
                          std::find(entry.verified_ids.begin(), entry.verified_ids.end(),
                                    g->id()) != entry.verified_ids.end();
    if (verified) {
      auto found = entry.masks.find(state);
      if (found != entry.masks.end()) {
        ++stats_.state_mask_hits;
        return found->second;
      }
    } else {
      representative = entry.representative;
    }
  }
  // A grammar met for the first time under a known fingerprint: confirm the tables match
  // (outside the lock: it reads both grammars whole).
  bool cacheable = true;
  if (representative != nullptr) {
    cacheable = representative->SameAutomaton(*g);
    if (cacheable) {
      absl::MutexLock lock(&mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        auto& ids = it->second.verified_ids;
        if (ids.size() >= kMaxVerifiedIds) ids.erase(ids.begin());
        ids.push_back(g->id());
        auto found = it->second.masks.find(state);
        if (found != it->second.masks.end()) {
          ++stats_.state_mask_hits;
          return found->second;
        }
      }
    }
  }
  std::shared_ptr<const StateMask> mask = ComputeStateMask(*g, state);
  absl::MutexLock lock(&mu_);
  ++stats_.state_masks_computed;
  if (!cacheable) return mask;  // a fingerprint collision: never mix two automata
  auto it = cache_.find(key);
  if (it == cache_.end()) {  // evicted meanwhile
    it = cache_.try_emplace(key).first;
    it->second.representative = g;
    it->second.bytes = g->MemoryBytes();
    cache_total_ += it->second.bytes;
  }
  it->second.last_use = ++clock_;
  if (it->second.masks.emplace(state, mask).second) {
    it->second.bytes += mask->MemoryBytes();
    cache_total_ += mask->MemoryBytes();
  }
  // Over budget: drop the least recently used grammars, then this grammar's other masks.
  while (cache_total_ > cache_budget_ && cache_.size() > 1) {
    auto oldest = cache_.end();
    for (auto c = cache_.begin(); c != cache_.end(); ++c) {
      if (c->first != key &&
          (oldest == cache_.end() || c->second.last_use < oldest->second.last_use)) {
        oldest = c;
      }
    }
    cache_total_ -= oldest->second.bytes;
    cache_.erase(oldest);
  }
  if (cache_total_ > cache_budget_) {
    GrammarEntry& entry = cache_.find(key)->second;
    cache_total_ -= entry.bytes;
    entry.masks.clear();
    entry.masks.emplace(state, mask);
    entry.bytes = g->MemoryBytes() + mask->MemoryBytes();
    cache_total_ += entry.bytes;
  }
  return mask;
}

bool TokenMasker::StackAccepts(const Grammar& g, const int32_t* stack,
                               const std::string& bytes) const {
  StackSet a(stack, stack + *stack + 1), b;
  for (char c : bytes) {
    StepInfo info;
    if (!internal::StepStacks(g, a.data(), a.data() + a.size(), static_cast<uint8_t>(c),
                              /*local=*/false, &b, &info)) {
      return false;
    }
    std::swap(a, b);
  }
  return true;
}

int64_t TokenMasker::Allowed(const Matcher& matcher, std::vector<uint8_t>* allowed) const {
  allowed->assign(token_bytes_.size(), 0);
  const std::shared_ptr<const Grammar>& g = matcher.grammar();
  const absl::Span<const int32_t> stacks = matcher.stacks();
  std::vector<uint64_t> acc(words_, 0);
  int64_t full_walks = 0, uncertain_checked = 0;
  auto set_bit = [&acc](int32_t id) { acc[id >> 6] |= uint64_t{1} << (id & 63); };
  for (const int32_t* p = stacks.data(); p < stacks.data() + stacks.size(); p += *p + 1) {
    const int32_t depth = *p;
    const int32_t* frames = p + 1;
    std::shared_ptr<const StateMask> mask = StateMaskFor(g, frames[depth - 1]);
    if (depth - 1 + mask->max_depth > g->max_depth()) {
      // Deep enough that the state's own walk may have pushed past the bound: walk from
      // the real stack.
      ++full_walks;
      WalkResult walk;
      StackSet start(p, p + depth + 1);
      Walk(*g, start, /*local=*/false, &walk);
      for (size_t w = 0; w < words_; ++w) acc[w] |= walk.accepted[w];
      continue;
    }
    if (!mask->bits.empty()) {
      for (size_t w = 0; w < words_; ++w) acc[w] |= mask->bits[w];
    } else {
      for (int32_t id : mask->ids) set_bit(id);
    }
    if (depth == 1) continue;  // nothing below to return to: the uncertain ones fail
    for (int32_t id : mask->uncertain) {
      if ((acc[id >> 6] >> (id & 63)) & 1) continue;
      ++uncertain_checked;
      if (StackAccepts(*g, p, token_bytes_[id])) set_bit(id);
    }
  }
  if (full_walks > 0 || uncertain_checked > 0) {
    absl::MutexLock lock(&mu_);
    stats_.full_walks += full_walks;
    stats_.uncertain_checked += uncertain_checked;
  }
  int64_t count = 0;
  uint8_t* out = allowed->data();
  const size_t vocab = token_bytes_.size();
  for (size_t w = 0; w < words_; ++w) {
    const uint64_t word = acc[w];
    if (word == 0) continue;
    count += __builtin_popcountll(word);
    const size_t base = w * 64;
    if (base + 64 <= vocab) {
      for (int k = 0; k < 8; ++k) {
        const uint64_t spread = kSpread.v[(word >> (8 * k)) & 0xFF];
        std::memcpy(out + base + 8 * k, &spread, 8);
      }
    } else {
      for (size_t k = 0; base + k < vocab; ++k) out[base + k] = (word >> k) & 1;
    }
  }
  if (end_token_ >= 0 && matcher.IsComplete()) {
    out[end_token_] = 1;
    ++count;
  }
  return count;
}

TokenMasker::Stats TokenMasker::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.cache_bytes = cache_total_;
  s.grammars_cached = static_cast<int64_t>(cache_.size());
  return s;
}

}  // namespace fwserve::constraints
