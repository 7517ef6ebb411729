// The fused `aft` recurrence (aft.h): one thread per (session b, channel c), item
// b·d + c of the B·d pairs, blocks of kAftThreads consecutive items. The thread keeps its
// channel's state (alpha, beta, p) in registers across the loop over the T tokens; a
// warp's loads and stores of the projections, y and the state are consecutive floats
// (coalesced). No shared memory, no barrier: the threads are independent, and each reads
// its own state before writing it, so in place is safe. The arithmetic is aft_rule.h's;
// aft_host.h runs this grid on the CPU. Torch-free: compiled by nvcc alone.
#include <cuda_runtime.h>

#include <cstdint>

#include "models/gpu/aft.h"
#include "models/gpu/aft_rule.h"

namespace fwmodel::kernels {
namespace {

__global__ void __launch_bounds__(kAftThreads) AftKernel(const AftArgs args) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kAftThreads + threadIdx.x;
  if (item >= args.B * args.d) return;
  AftRunItem(args, item);
}

}  // namespace

int LaunchAft(const AftArgs& args, void* cuda_stream) {
  if (!AftArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0) return cudaSuccess;
  const int64_t blocks = (args.B * args.d + kAftThreads - 1) / kAftThreads;
  AftKernel<<<dim3(static_cast<unsigned>(blocks)), dim3(kAftThreads), 0,
              static_cast<cudaStream_t>(cuda_stream)>>>(args);
  return cudaGetLastError();
}

const char* AftErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
