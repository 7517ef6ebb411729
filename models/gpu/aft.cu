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
  const int64_t d = args.d;
  if (item >= args.B * d) return;
  const int64_t b = item / d, c = item - b * d;
  const int64_t row = args.rows != nullptr ? args.rows[b] : b;
  const int64_t state_at = row * 3 * d + c;
  const float* in = args.state_in + state_at;
  AftChannelState s{in[0], in[d], in[2 * d]};
  const float u = args.time_first[c], w = args.decay[c];
  const float* __restrict__ r = args.r;
  const float* __restrict__ k = args.k;
  const float* __restrict__ v = args.v;
  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t o = (b * args.T + t) * d + c;
    args.y[o] = AftChannelToken(r[o], k[o], v[o], u, w, &s);
  }
  float* out = args.state_out + state_at;
  out[0] = s.alpha;
  out[d] = s.beta;
  out[2 * d] = s.p;
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
