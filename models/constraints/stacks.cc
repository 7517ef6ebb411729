#include "models/constraints/stacks.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace fwserve::constraints::internal {
namespace {

void AppendUnique(const int32_t* frames, int depth, StackSet* out) {
  const int32_t* p = out->data();
  const int32_t* end = p + out->size();
  while (p < end) {
    const int32_t d = *p;
    if (d == depth && std::memcmp(p + 1, frames, sizeof(int32_t) * depth) == 0) return;
    p += d + 1;
  }
  out->push_back(depth);
  out->insert(out->end(), frames, frames + depth);
}

}  // namespace

void ExpandStack(const Grammar& g, int32_t* frames, int depth, bool local, StackSet* out,
                 StepInfo* info) {
  const int32_t top = frames[depth - 1];
  if (depth > info->max_depth) info->max_depth = depth;
  if (g.HasBytes(top)) AppendUnique(frames, depth, out);
  if (g.HasCalls(top)) {
    for (const GrammarCall* c = g.CallsBegin(top); c != g.CallsEnd(top); ++c) {
      if (depth + 1 > g.max_depth()) {
        if (depth + 1 > info->max_depth) info->max_depth = depth + 1;
        continue;
      }
      frames[depth - 1] = c->ret;
      frames[depth] = c->callee_start;
      ExpandStack(g, frames, depth + 1, local, out, info);
      frames[depth - 1] = top;
    }
  }
  if (g.IsFinal(top)) {
    if (depth > 1) {
      // The caller's return state is below: it continues.
      ExpandStack(g, frames, depth - 1, local, out, info);
      frames[depth - 1] = top;
    } else if (local) {
      info->context_pop = true;
    } else {
      info->complete = true;
    }
  }
}

bool StepStacks(const Grammar& g, const int32_t* begin, const int32_t* end, uint8_t byte,
                bool local, StackSet* out, StepInfo* info) {
  out->clear();
  int32_t frames[kMaxDepthLimit + 1];
  bool stepped = false;
  const bool was_complete = info->complete, was_context = info->context_pop;
  info->complete = false;
  info->context_pop = false;
  for (const int32_t* p = begin; p < end;) {
    const int32_t depth = *p;
    const int32_t next = g.Next(p[depth], byte);
    if (next != Grammar::kNoState) {
      stepped = true;
      std::memcpy(frames, p + 1, sizeof(int32_t) * depth);
      frames[depth - 1] = next;
      ExpandStack(g, frames, depth, local, out, info);
    }
    p += depth + 1;
  }
  const bool ok = stepped && (!out->empty() || info->complete || info->context_pop);
  if (!ok) {
    info->complete = was_complete;
    info->context_pop = was_context;
  }
  return ok;
}

void Canonicalize(StackSet* set) {
  // One stack is canonical already (the common case: no allocation).
  if (set->empty() || static_cast<size_t>((*set)[0]) + 1 == set->size()) return;
  std::vector<std::pair<const int32_t*, int32_t>> stacks;
  for (const int32_t* p = set->data(); p < set->data() + set->size(); p += *p + 1) {
    stacks.push_back({p + 1, *p});
  }
  if (stacks.size() <= 1) return;
  std::sort(stacks.begin(), stacks.end(), [](const auto& a, const auto& b) {
    return std::lexicographical_compare(a.first, a.first + a.second, b.first, b.first + b.second);
  });
  if (stacks.size() > static_cast<size_t>(kMaxStacks)) stacks.resize(kMaxStacks);
  StackSet sorted;
  for (const auto& [frames, depth] : stacks) {
    sorted.push_back(depth);
    sorted.insert(sorted.end(), frames, frames + depth);
  }
  *set = std::move(sorted);
}

}  // namespace fwserve::constraints::internal
