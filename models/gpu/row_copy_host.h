// LaunchRowGather's and LaunchRowScatter's grid (row_copy.cu) run on the CPU with host
// pointers: the CPU test of the launches' planning, block-to-(tensor, row, chunk)
// mapping, vector/scalar choice and per-thread body (tests/unit/gpu_row_copy_test.cc),
// since the kernel itself only runs on a GPU machine. The blocks one after another,
// every thread of a block in turn, each through row_copy_rule.h's RowCopyThread, as the
// kernel. Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/row_copy.h"
#include "models/gpu/row_copy_rule.h"

namespace fwmodel::kernels {

// The launch's computation on host pointers (the same RowCopyArgs contract). Returns
// false, doing nothing, where the launcher would refuse the arguments
// (cudaErrorInvalidValue).
inline bool RunRowCopyOnHost(const RowCopyArgs& args, bool gather) {
  RowCopyGrid grid;
  if (!PlanRowCopy(args, &grid)) return false;
  for (int64_t block = 0; block < grid.blocks; ++block) {
    for (int thread = 0; thread < kRowCopyThreads; ++thread) {
      RowCopyThread(args, grid, gather, block, thread);
    }
  }
  return true;
}

// LaunchRowGather's computation on host pointers.
inline bool RunRowGatherOnHost(const RowCopyArgs& args) { return RunRowCopyOnHost(args, true); }

// LaunchRowScatter's computation on host pointers.
inline bool RunRowScatterOnHost(const RowCopyArgs& args) { return RunRowCopyOnHost(args, false); }

}  // namespace fwmodel::kernels
