// The fused `fast_weight` recurrence (fast_weight.h): one block per (session, head),
// FastWeightThreads(N, ν) threads, thread t = c·N + i < d_phi owning chunk c of row i of
// the head's fast weight W [N, d_phi] (features c·N .. c·N + N − 1, N floats), which stays
// in its registers across the loop over the T tokens.
//
// Per token, phase 1: thread t computes feature t of DPFP_ν(k) and of DPFP_ν(q),
// unnormalised, into shared memory, and the warps' sums of fk, fq and fk·fq (warp-shuffle
// butterflies: the halving tree's bits) into shared memory. Barrier (1). Phase 2: every
// thread adds the warps' sums in order (the normalisers and φ(k)·φ(q)) and writes its
// chunk's dots with fk and fq to shared memory. Barrier (2). Phase 3: thread (c, i) adds
// row i's chunk dots in order (v̄_i, read_i, the same bits in each of the row's threads),
// writes its chunk and, for c = 0, y_i. The features alternate between two sets by token
// (phase 3 of a token reads them after barrier (2), which the next token's phase 1 passes
// only after); the warp sums and the chunk dots need one set (each read before the
// barrier that precedes their next write). The arithmetic is fast_weight_rule.h's;
// fast_weight_host.h runs this grid, phase by phase, on the CPU. Torch-free: compiled by
// nvcc alone.
#include <cuda_runtime.h>

#include <cstdint>

#include "models/gpu/fast_weight.h"
#include "models/gpu/fast_weight_rule.h"
#include "models/gpu/tree_sum.cuh"

namespace fwmodel::kernels {
namespace {

using tree_sum::WarpTreeSum;

// kN: the head width, known at compile time (the chunk's loops unroll and the chunk stays
// in registers), with ν ≤ kMaxNu; kN = 0: args.N at run time (the chunk in local memory),
// any valid ν. blockDim.x == FastWeightThreads(N, ν) ≤ kThreads.
template <int kN, int kMaxNu>
__global__ void __launch_bounds__(kN > 0 ? 2 * kMaxNu * kN : kFastWeightMaxPhi)
    FastWeightKernel(const FastWeightArgs args) {
  constexpr int kCap = kN > 0 ? kN : static_cast<int>(kFastWeightMaxN);
  constexpr int kThreads = kN > 0 ? 2 * kMaxNu * kN : static_cast<int>(kFastWeightMaxPhi);
  const int n = kN > 0 ? kN : static_cast<int>(args.N);  // ≤ kCap
  const int chunks = 2 * static_cast<int>(args.nu);
  const int phi = chunks * n;  // ≤ kThreads
  const int tid = static_cast<int>(threadIdx.x);
  const bool active = tid < phi;
  const int c = tid / n, i = tid % n;
  const int lane = tid & 31, warp = tid >> 5, warps = static_cast<int>(blockDim.x) >> 5;
  const int64_t item = blockIdx.x;  // b·H + head
  const int64_t b = item / args.H, head = item % args.H;
  const int64_t d = args.H * n;
  const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
  // Chunk c of row i: W[i][c·n + m] at W_at + m.
  const int64_t W_at = ((state_row * args.H + head) * n + i) * phi + c * n;

  __shared__ float s_fk[2][kThreads], s_fq[2][kThreads];
  __shared__ float s_dk[kThreads], s_dq[kThreads];  // chunk c's dots of row i at c·n + i
  __shared__ float s_warp[3][kThreads / 32];

  float chunk[kCap];
  if (active) {
    const float* in = args.W_in + W_at;
#pragma unroll
    for (int m = 0; m < (kN > 0 ? kN : n); ++m) chunk[m] = in[m];
  }

  for (int64_t t = 0; t < args.T; ++t) {
    const int set = static_cast<int>(t & 1);
    const int64_t token = b * args.T + t;
    const int64_t o = token * d + head * n;
    float fk = 0.0f, fq = 0.0f, v = 0.0f;
    if (active) {
      fk = FastWeightFeature(args.k + o, n, tid);
      fq = FastWeightFeature(args.q + o, n, tid);
      s_fk[set][tid] = fk;
      s_fq[set][tid] = fq;
      v = args.v[o + i];
    }
    const float beta = SigmoidF(args.beta[token * args.H + head]);
    const float warp_k = WarpTreeSum(fk, 32), warp_q = WarpTreeSum(fq, 32),
                warp_kq = WarpTreeSum(fk * fq, 32);
    if (lane == 0) {
      s_warp[0][warp] = warp_k;
      s_warp[1][warp] = warp_q;
      s_warp[2][warp] = warp_kq;
    }
    __syncthreads();  // (1) the token's features and warp sums are written
    float sum_k = 0.0f, sum_q = 0.0f, sum_kq = 0.0f;
    for (int w = 0; w < warps; ++w) {
      sum_k += s_warp[0][w];
      sum_q += s_warp[1][w];
      sum_kq += s_warp[2][w];
    }
    const float inv_k = FastWeightInverse(sum_k, args.eps);
    const float inv_q = FastWeightInverse(sum_q, args.eps);
    if (active) {
      const FastWeightDots dots =
          FastWeightChunkDots(kN > 0 ? kN : n, chunk, s_fk[set] + c * n, s_fq[set] + c * n);
      s_dk[tid] = dots.k;
      s_dq[tid] = dots.q;
    }
    __syncthreads();  // (2) the chunks' dots are written
    if (active) {
      const float retrieved = FastWeightRowSum(s_dk, chunks, n, i, inv_k);
      const float delta = FastWeightDelta(beta, v, retrieved);
      FastWeightChunkUpdate<const volatile float*>(kN > 0 ? kN : n, chunk, s_fk[set] + c * n,
                                                   delta * inv_k);
      if (c == 0) {
        const float read = FastWeightRowSum(s_dq, chunks, n, i, inv_q);
        args.y[o + i] = FastWeightOutput(read, delta, sum_kq * inv_k * inv_q);
      }
    }
  }

  if (active) {
    float* out = args.W_out + W_at;
#pragma unroll
    for (int m = 0; m < (kN > 0 ? kN : n); ++m) out[m] = chunk[m];
  }
}

template <int kN, int kMaxNu>
cudaError_t LaunchFastWeightWidth(const FastWeightArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.H));
  const dim3 block(static_cast<unsigned>(FastWeightThreads(args.N, args.nu)));
  FastWeightKernel<kN, kMaxNu><<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchFastWeight(const FastWeightArgs& args, void* cuda_stream) {
  if (!FastWeightArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0 || args.H == 0) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  // The compiled widths, each for ν up to its block's register budget; anything else at
  // run time (the chunk in local memory).
  switch (args.N) {
    case 8:
      if (args.nu <= 4) return LaunchFastWeightWidth<8, 4>(args, stream);
      break;
    case 16:
      if (args.nu <= 4) return LaunchFastWeightWidth<16, 4>(args, stream);
      break;
    case 32:
      if (args.nu <= 4) return LaunchFastWeightWidth<32, 4>(args, stream);
      break;
    case 64:
      if (args.nu <= 2) return LaunchFastWeightWidth<64, 2>(args, stream);
      if (args.nu <= 3) return LaunchFastWeightWidth<64, 3>(args, stream);
      break;
    case 128:
      if (args.nu <= 1) return LaunchFastWeightWidth<128, 1>(args, stream);
      break;
    default:
      break;
  }
  return LaunchFastWeightWidth<0, 0>(args, stream);
}

const char* FastWeightErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
