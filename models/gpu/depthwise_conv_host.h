// LaunchDepthwiseConv's grid (depthwise_conv.cu) run on the CPU with host pointers: item by
// item, the kernel's body (depthwise_conv_rule.h). The CPU test of the launch's layout and
// the stand-in for the launch in model.cc's test path (SetModelHostKernelsForTesting).
// Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/depthwise_conv.h"
#include "models/gpu/depthwise_conv_rule.h"

namespace fwmodel::kernels {

// LaunchDepthwiseConv's computation on host pointers. Returns false, doing nothing, where
// the launcher would refuse the arguments.
inline bool RunDepthwiseConvOnHost(const DepthwiseConvArgs& args) {
  if (!DepthwiseConvArgsValid(args)) return false;
  for (int64_t item = 0; item < args.B * 3 * args.d; ++item) DepthwiseConvRun<0>(args, item);
  return true;
}

}  // namespace fwmodel::kernels
