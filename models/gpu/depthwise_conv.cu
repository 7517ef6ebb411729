// The fused causal depthwise convolution (depthwise_conv.h): one thread per (session b,
// projection p, channel c), item (b·3 + p)·d + c, blocks of kDepthwiseConvThreads
// consecutive items, so a warp's loads and stores are consecutive floats of one row
// (coalesced). The thread keeps its taps and its K − 1 window in registers across the T
// tokens; threads are independent (no shared memory, no barrier), and each reads its own
// inputs and state before writing them, so in place is safe. The body is
// depthwise_conv_rule.h's; depthwise_conv_host.h runs this grid on the CPU. Torch-free:
// compiled by nvcc alone.
#include <cuda_runtime.h>

#include <cstdint>

#include "models/gpu/depthwise_conv.h"
#include "models/gpu/depthwise_conv_rule.h"

namespace fwmodel::kernels {
namespace {

// kK: the taps, compiled for 2, 3 and 4 (the window in registers); 0: args.K at run time.
template <int kK>
__global__ void __launch_bounds__(kDepthwiseConvThreads)
    DepthwiseConvKernel(const DepthwiseConvArgs args) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kDepthwiseConvThreads + threadIdx.x;
  if (item >= args.B * 3 * args.d) return;
  DepthwiseConvRun<kK>(args, item);
}

template <int kK>
cudaError_t LaunchTaps(const DepthwiseConvArgs& args, cudaStream_t stream) {
  const int64_t blocks = (args.B * 3 * args.d + kDepthwiseConvThreads - 1) / kDepthwiseConvThreads;
  DepthwiseConvKernel<kK>
      <<<dim3(static_cast<unsigned>(blocks)), dim3(kDepthwiseConvThreads), 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchDepthwiseConv(const DepthwiseConvArgs& args, void* cuda_stream) {
  if (!DepthwiseConvArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (args.K) {
    case 2:
      return LaunchTaps<2>(args, stream);
    case 3:
      return LaunchTaps<3>(args, stream);
    case 4:
      return LaunchTaps<4>(args, stream);
    default:
      return LaunchTaps<0>(args, stream);
  }
}

const char* DepthwiseConvErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
