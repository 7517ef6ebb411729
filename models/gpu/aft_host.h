// LaunchAft's grid (aft.cu) run on the CPU with host pointers: the CPU test of the
// launch's indexing (tests/unit/gpu_aft_test.cc), since the kernel itself only runs on a
// GPU machine. The threads (session b, channel c), item b·d + c, one after another, each
// as the kernel's: its state in, the T tokens through aft_rule.h's body, its state out;
// so the arithmetic per element is the kernel's (up to the compilers' contraction into
// fused multiply-adds). Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/aft.h"
#include "models/gpu/aft_rule.h"

namespace fwmodel::kernels {

// LaunchAft's computation on host pointers (the same AftArgs contract, rows a host
// pointer too). Returns false, doing nothing, where the launcher would refuse the
// arguments (cudaErrorInvalidValue).
inline bool RunAftOnHost(const AftArgs& args) {
  if (!AftArgsValid(args)) return false;
  for (int64_t item = 0; item < args.B * args.d; ++item) AftRunItem(args, item);
  return true;
}

}  // namespace fwmodel::kernels
