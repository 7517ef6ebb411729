// The fused DeltaNet / Gated DeltaNet delta rule (delta_rule_cuda.h): one block per
// (session, value head), p = TreeWidth(V) threads, thread j < V owning value channel j and
// keeping column j of the head's state S [K, V] (K floats) in its registers across the
// loop over the T tokens (threads V.. exist only when V is not a power of two, and add
// zeros to the norm's sum). The state's loads and stores are coalesced as they are
// (thread j reads S[i][j], consecutive j consecutive floats). Per token the block stages
// the token's q and k [K] in shared memory (each thread loads channels j, j + p, ...),
// every thread runs DeltaRuleColumn on its column (its own q·k too, so no reduction
// there), and the output RMSNorm's Σ o² is the halving tree's, computed by
// tree_sum.cuh's TreeSum (warp-shuffle butterflies; above 32 threads after the tree's
// upper steps through shared memory). The arithmetic per column is delta_rule_column.h's;
// delta_rule_cuda_host.h runs this grid, phase by phase, on the CPU. Torch-free:
// compiled by nvcc alone.
//
// Barriers per token: (1) after staging q and k, before any thread reads them; (2) with
// p > 32, TreeSum's, after every thread's writes of o² and (so) after its last read of
// s_q and s_k for this token, so that the next token's staging cannot overwrite them
// early; the next token's write of o² comes after the next (1), when every thread has
// read this token's sum. With p ≤ 32 (one warp) the sum is shuffles alone, and (2) is a
// barrier of its own at the token's end.
#include <cuda_runtime.h>

#include "models/gpu/delta_rule_column.h"
#include "models/gpu/delta_rule_cuda.h"
#include "models/gpu/rwkv7_rule.h"  // TreeWidth
#include "models/gpu/tree_sum.cuh"

namespace fwmodel::kernels {
namespace {

static_assert((kDeltaRuleMaxV & (kDeltaRuleMaxV - 1)) == 0, "kDeltaRuleMaxV: a power of two");

using tree_sum::TreeSum;

// kK: the q/k head width, known at compile time (the column's loops unroll and the column
// stays in registers); 0: args.K at run time (the column in local memory).
// blockDim.x == TreeWidth(V).
template <int kK>
__global__ void __launch_bounds__(kDeltaRuleMaxV) DeltaRuleKernel(const DeltaRuleArgs args) {
  constexpr int kCap = kK > 0 ? kK : static_cast<int>(kDeltaRuleMaxK);
  const int K = kK > 0 ? kK : static_cast<int>(args.K);  // ≤ kCap
  const int V = static_cast<int>(args.V);
  const int p = TreeWidth(V);  // == blockDim.x, ≤ kDeltaRuleMaxV
  const int j = static_cast<int>(threadIdx.x);
  const bool active = j < V;        // thread j has a column
  const int64_t item = blockIdx.x;  // b·HV + hv
  const int64_t b = item / args.HV, hv = item % args.HV;
  const int64_t qk_head = hv / (args.HV / args.H);
  // The head's state: row `state_row` of the buffers, then value head hv.
  const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
  const int64_t state_at = (state_row * args.HV + hv) * K * V;

  __shared__ float s_q[kCap], s_k[kCap];
  __shared__ float s_sum[kDeltaRuleMaxV];

  // Column j of S: S[i][j] at state_at + i·V + j (coalesced across the block's threads).
  float column[kCap];
  float weight = 0.0f;
  if (active) {
    const float* in = args.state_in + state_at + j;
#pragma unroll
    for (int i = 0; i < (kK > 0 ? kK : K); ++i) column[i] = in[static_cast<int64_t>(i) * V];
    weight = args.norm_weight[j];
  }
  const bool gated = args.gate != nullptr;

  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t token = b * args.T + t;
    const int64_t qk_at = (token * args.H + qk_head) * K;  // q/k head's first channel
    for (int i = j; i < K; i += p) {
      s_q[i] = args.q[qk_at + i];
      s_k[i] = args.k[qk_at + i];
    }
    const int64_t head_at = token * args.HV + hv;  // [B, T, HV] index
    const int64_t at = head_at * V + j;            // [B, T, HV, V] index
    float v = 0.0f, g = 0.0f;
    if (active) {
      v = args.v[at];
      if (gated) g = args.gate[at];
    }
    const float beta = args.beta[head_at];
    const float decay = args.decay != nullptr ? args.decay[head_at] : 1.0f;
    __syncthreads();  // q and k are staged
    float o = 0.0f;
    if (active) {
      // DeltaRuleColumn's bodies; the update reads k through a volatile pointer, so that
      // each k_i is loaded where it is used (else K = 128 spills; delta_rule_column.h).
      const DeltaRuleSums sums = DeltaRuleColumnSums(kK > 0 ? kK : K, column, s_q, s_k);
      const float u = DeltaRuleDelta(v, beta, decay, sums.read);
      DeltaRuleColumnUpdate<const volatile float*>(kK > 0 ? kK : K, column, s_k, decay, u);
      o = DeltaRuleColumnOutput(sums, decay, u);
    }
    const float inv =
        DeltaNetNormInv(TreeSum<static_cast<int>(kDeltaRuleMaxV)>(o * o, s_sum, p, j), V, args.eps);
    if (active) args.o[at] = DeltaNetOutputColumn(o, inv, weight, gated, g);
    // With p ≤ 32 the sum had no barrier: one here, after every thread's last read of
    // s_q and s_k, before the next token's staging.
    if (p <= 32) __syncthreads();
  }

  if (active) {
    float* out = args.state_out + state_at + j;
#pragma unroll
    for (int i = 0; i < (kK > 0 ? kK : K); ++i) out[static_cast<int64_t>(i) * V] = column[i];
  }
}

template <int kK>
cudaError_t LaunchDeltaRuleWidth(const DeltaRuleArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.HV));
  const dim3 block(static_cast<unsigned>(TreeWidth(static_cast<int>(args.V))));
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
