// The fused DeltaNet / Gated DeltaNet delta rule (delta_rule_cuda.h): one block per
// (session, value head), one thread per value channel j, which keeps column j of the
// head's state S [K, V] (K floats) in its registers across the loop over the T tokens.
// Per token the block stages the token's q and k [K] in shared memory (each thread loads
// channels j, j + V, ...), every thread runs DeltaRuleColumn on its column (its own q·k
// too, so no reduction there), and the output RMSNorm's Σ o² is a halving reduction in
// shared memory. The arithmetic per column is delta_rule_column.h's;
// delta_rule_cuda_host.h runs this grid, phase by phase, on the CPU. Torch-free:
// compiled by nvcc alone.
//
// Barriers per token: (1) after staging q and k, before any thread reads them; (2) the
// norm's BlockSum, whose first barrier comes after every thread's last read of s_q and
// s_k for this token, so the next token's staging cannot overwrite them early, and whose
// last barrier comes after every thread's read of the sum, so the next token's sum may
// reuse s_sum.
#include <cuda_runtime.h>

#include "models/gpu/delta_rule_column.h"
#include "models/gpu/delta_rule_cuda.h"
#include "models/gpu/rwkv7_rule.h"  // TreeWidth

namespace fwmodel::kernels {
namespace {

static_assert((kDeltaRuleMaxV & (kDeltaRuleMaxV - 1)) == 0, "kDeltaRuleMaxV: a power of two");

// Σ of the n threads' x (thread i's), halving over p (the power of two ≥ n, zeros past n):
// buf[i] += buf[i + s] for s = p/2, ..., 1. Every thread gets the sum. buf: p floats of
// shared memory, free on entry and again on return (the last barrier is after the read).
// (rwkv7_wkv.cu's BlockSum.)
__device__ __forceinline__ float DeltaBlockSum(float x, float* buf, int n, int p, int i) {
  buf[i] = x;
  if (i + n < p) buf[i + n] = 0.0f;
  __syncthreads();
  for (int s = p / 2; s > 0; s /= 2) {
    if (i < s) buf[i] += buf[i + s];
    __syncthreads();
  }
  const float sum = buf[0];
  __syncthreads();
  return sum;
}

// kK: the q/k head width, known at compile time (the column's loops unroll and the column
// stays in registers); 0: args.K at run time (the column in local memory).
// blockDim.x == V.
template <int kK>
__global__ void __launch_bounds__(kDeltaRuleMaxV) DeltaRuleKernel(const DeltaRuleArgs args) {
  constexpr int kCap = kK > 0 ? kK : static_cast<int>(kDeltaRuleMaxK);
  const int K = kK > 0 ? kK : static_cast<int>(args.K);  // ≤ kCap
  const int V = static_cast<int>(args.V);
  const int p = TreeWidth(V);  // ≤ kDeltaRuleMaxV
  const int j = static_cast<int>(threadIdx.x);
  const int64_t item = blockIdx.x;  // b·HV + hv
  const int64_t b = item / args.HV, hv = item % args.HV;
  const int64_t qk_head = hv / (args.HV / args.H);

  __shared__ float s_q[kCap], s_k[kCap];
  __shared__ float s_sum[kDeltaRuleMaxV];

  // Column j of S: S[i][j] at (item·K + i)·V + j (coalesced across the block's threads).
  float column[kCap];
  const float* in = args.state_in + item * K * V + j;
#pragma unroll
  for (int i = 0; i < (kK > 0 ? kK : K); ++i) column[i] = in[static_cast<int64_t>(i) * V];
  const float weight = args.norm_weight[j];
  const bool gated = args.gate != nullptr;

  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t token = b * args.T + t;
    const int64_t qk_at = (token * args.H + qk_head) * K;  // q/k head's first channel
    for (int i = j; i < K; i += V) {
      s_q[i] = args.q[qk_at + i];
      s_k[i] = args.k[qk_at + i];
    }
    const int64_t head_at = token * args.HV + hv;  // [B, T, HV] index
    const int64_t at = head_at * V + j;            // [B, T, HV, V] index
    const float v = args.v[at];
    const float beta = args.beta[head_at];
    const float decay = args.decay != nullptr ? args.decay[head_at] : 1.0f;
    const float g = gated ? args.gate[at] : 0.0f;
    __syncthreads();  // q and k are staged
    // DeltaRuleColumn's bodies; the update reads k through a volatile pointer, so that
    // each k_i is loaded where it is used (else K = 128 spills; delta_rule_column.h).
    const DeltaRuleSums sums = DeltaRuleColumnSums(kK > 0 ? kK : K, column, s_q, s_k);
    const float u = DeltaRuleDelta(v, beta, decay, sums.read);
    DeltaRuleColumnUpdate<const volatile float*>(kK > 0 ? kK : K, column, s_k, decay, u);
    const float o = DeltaRuleColumnOutput(sums, decay, u);
    const float inv = DeltaNetNormInv(DeltaBlockSum(o * o, s_sum, V, p, j), V, args.eps);
    args.o[at] = DeltaNetOutputColumn(o, inv, weight, gated, g);
  }

  float* out = args.state_out + item * K * V + j;
#pragma unroll
  for (int i = 0; i < (kK > 0 ? kK : K); ++i) out[static_cast<int64_t>(i) * V] = column[i];
}

template <int kK>
cudaError_t LaunchDeltaRuleWidth(const DeltaRuleArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.HV)), block(static_cast<unsigned>(args.V));
  DeltaRuleKernel<kK><<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchDeltaRule(const DeltaRuleArgs& args, void* cuda_stream) {
  if (!DeltaRuleArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0 || args.HV == 0) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (args.K) {
    case 8:
      return LaunchDeltaRuleWidth<8>(args, stream);
    case 16:
      return LaunchDeltaRuleWidth<16>(args, stream);
    case 32:
      return LaunchDeltaRuleWidth<32>(args, stream);
    case 64:
      return LaunchDeltaRuleWidth<64>(args, stream);
    case 128:
      return LaunchDeltaRuleWidth<128>(args, stream);
    default:
      return LaunchDeltaRuleWidth<0>(args, stream);
  }
}

const char* DeltaRuleErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
