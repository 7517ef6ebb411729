// Sets of pushdown stacks over a Grammar, and one byte step of all of them (internal to
// models/constraints: the Matcher's position and the TokenMasker's walk). Torch-free.
//
// A stack set is flat: each stack is its depth followed by its states, bottom first; the
// top state is the one that reads the next byte. The sets kept are "ready": every stack's
// top has a byte transition (calls and rule ends have been followed).
#pragma once

#include <cstdint>

#include "absl/container/inlined_vector.h"
#include "models/constraints/grammar.h"

namespace fwserve::constraints::internal {

using StackSet = absl::InlinedVector<int32_t, 8>;

// The most stacks a set keeps (alternatives alive at once); more are dropped, the
// smallest kept (documented in docs/structured-output.md).
inline constexpr int kMaxStacks = 64;
// The deepest stack any grammar allows (Grammar::max_depth() is at most this).
inline constexpr int kMaxDepthLimit = 256;

struct StepInfo {
  // Some stack ended at depth 1 on a final state: the document is complete (global mode).
  bool complete = false;
  // Local mode: some stack ended on a final state at depth 1, the frame whose caller is
  // unknown; the bytes after depend on the context below.
  bool context_pop = false;
  // The deepest stack reached, counting pushes refused at the depth bound.
  int max_depth = 0;
};

// Follows calls and rule ends from the stack `frames[0 .. depth)` and appends the ready
// stacks it reaches to `out` (once each). `local`: the bottom frame's caller is unknown
// (its end sets info->context_pop instead of info->complete). `frames` must have room for
// Grammar::max_depth() + 1 entries; it is restored on return.
void ExpandStack(const Grammar& g, int32_t* frames, int depth, bool local, StackSet* out,
                 StepInfo* info);

// Steps every stack of the flat set [begin, end) by `byte` and expands the results into
// `out` (cleared first). Returns whether the byte can come next: some stack read it and
// what follows is ready, complete or (local) context-dependent.
bool StepStacks(const Grammar& g, const int32_t* begin, const int32_t* end, uint8_t byte,
                bool local, StackSet* out, StepInfo* info);

// Sorts the stacks of `set` (a canonical order for equality) and keeps at most kMaxStacks.
void Canonicalize(StackSet* set);

}  // namespace fwserve::constraints::internal
