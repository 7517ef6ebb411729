// Test helpers for models/constraints: the shortest completion of a document, from the
// grammar's public tables (Grammar, Matcher::stacks()).
#pragma once

#include <algorithm>
#include <bitset>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/constraints/grammar.h"
#include "models/constraints/matcher.h"

namespace fwserve::constraints::testing_util {

// dist[s]: the fewest bytes from state s to the end of its rule's value (calls cost their
// callee's shortest value). Bellman-Ford sweeps over the grammar until nothing improves.
inline std::vector<int64_t> RuleDistances(const Grammar& g) {
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  const int32_t n = g.num_states();
  std::vector<std::vector<int32_t>> successors(n);
  for (int32_t s = 0; s < n; ++s) {
    for (int b = 0; b < 256; ++b) {
      const int32_t t = g.Next(s, static_cast<uint8_t>(b));
      if (t >= 0) successors[s].push_back(t);
    }
    std::sort(successors[s].begin(), successors[s].end());
    successors[s].erase(std::unique(successors[s].begin(), successors[s].end()),
                        successors[s].end());
  }
  std::vector<int64_t> dist(n, kInf);
  for (int32_t s = 0; s < n; ++s) {
    if (g.IsFinal(s)) dist[s] = 0;
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t s = n - 1; s >= 0; --s) {
      int64_t best = dist[s];
      for (int32_t t : successors[s]) best = std::min(best, 1 + dist[t]);
      for (const GrammarCall* c = g.CallsBegin(s); c != g.CallsEnd(s); ++c) {
        best = std::min(best, dist[c->callee_start] + dist[c->ret]);
      }
      if (best < dist[s]) {
        dist[s] = best;
        changed = true;
      }
    }
  }
  return dist;
}

// The fewest bytes that complete the document from `m`'s position.
inline int64_t PositionDistance(const Matcher& m, const std::vector<int64_t>& dist) {
  if (m.IsComplete()) return 0;
  int64_t best = std::numeric_limits<int64_t>::max();
  const auto stacks = m.stacks();
  for (size_t i = 0; i < stacks.size(); i += stacks[i] + 1) {
    int64_t cost = 0;
    for (int32_t k = 1; k <= stacks[i]; ++k) cost += dist[stacks[i + k]];
    best = std::min(best, cost);
  }
  return best;
}

// The shortest bytes that complete the document from `m` (the smallest byte on ties).
inline std::string ShortestCompletion(Matcher m, const std::vector<int64_t>& dist) {
  std::string out;
  while (!m.IsComplete()) {
    const std::bitset<256> next = m.NextBytes();
    int best_byte = -1;
    int64_t best = std::numeric_limits<int64_t>::max();
    for (int b = 0; b < 256; ++b) {
      if (!next[b]) continue;
      Matcher copy = m;
      EXPECT_TRUE(copy.Advance(static_cast<uint8_t>(b)));
      const int64_t d = PositionDistance(copy, dist);
      if (d < best) {
        best = d;
        best_byte = b;
      }
    }
    if (best_byte < 0 || out.size() > 100000) {
      ADD_FAILURE() << "no completion after " << out.size() << " bytes";
      return out;
    }
    EXPECT_TRUE(m.Advance(static_cast<uint8_t>(best_byte)));
    out.push_back(static_cast<char>(best_byte));
  }
  return out;
}

}  // namespace fwserve::constraints::testing_util
