// The fused RWKV-7 time-mix recurrence (rwkv7_wkv.h): one block per (session, head), one
// thread per row i of the head's state S (value channel i), which stays in the thread's
// registers across the loop over the T tokens. Per token, thread i also does key channel
// i's per-channel work; the channels' vectors go through shared memory, and the head's
// sums (‖kk‖², Σ y with the bonus, Σ (y − mean)²) are halving reductions in shared
// memory. The arithmetic per element is rwkv7_rule.h's; rwkv7_wkv_host.h runs this
// grid, phase by phase, on the CPU. Torch-free: compiled by nvcc alone.
#include <cuda_runtime.h>

#include <climits>

#include "models/gpu/rwkv7_rule.h"
#include "models/gpu/rwkv7_wkv.h"

namespace fwmodel::kernels {
namespace {

// Σ of the n threads' x (thread i's), halving over p (the power of two ≥ n, zeros past n):
// buf[i] += buf[i + s] for s = p/2, ..., 1. Every thread gets the sum. buf: p floats of
// shared memory, free on entry and again on return (the last barrier is after the read).
__device__ __forceinline__ float BlockSum(float x, float* buf, int n, int p, int i) {
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

// BlockSum of two values with one set of barriers.
__device__ __forceinline__ void BlockSum2(float x0, float x1, float* buf0, float* buf1, int n,
                                          int p, int i, float* sum0, float* sum1) {
  buf0[i] = x0;
  buf1[i] = x1;
  if (i + n < p) {
    buf0[i + n] = 0.0f;
    buf1[i + n] = 0.0f;
  }
  __syncthreads();
  for (int s = p / 2; s > 0; s /= 2) {
    if (i < s) {
      buf0[i] += buf0[i + s];
      buf1[i] += buf1[i + s];
    }
    __syncthreads();
  }
  *sum0 = buf0[0];
  *sum1 = buf1[0];
  __syncthreads();
}

// kN: the head width, known at compile time (the row's loops unroll and the row stays
// in registers); 0: args.N at run time (the row in local memory). blockDim.x == N.
template <int kN>
__global__ void __launch_bounds__(kRwkv7WkvMaxN) Rwkv7WkvKernel(const Rwkv7WkvArgs args) {
  constexpr int kCap = kN > 0 ? kN : static_cast<int>(kRwkv7WkvMaxN);
  static_assert((kCap & (kCap - 1)) == 0, "kCap must be a power of two (the reductions' width)");
  const int n = kN > 0 ? kN : static_cast<int>(args.N);
  const int p = TreeWidth(n);  // ≤ kCap
  const int i = static_cast<int>(threadIdx.x);
  const int64_t item = blockIdx.x;  // b·H + head
  const int64_t b = item / args.H, head = item % args.H;
  const int64_t d = args.H * n;
  const int64_t at = head * n + i;  // channel (and row) i of this head in a [d] vector

  __shared__ float s_w[kCap], s_neg_kk[kCap], s_kk_a[kCap], s_k[kCap], s_r[kCap];
  __shared__ float s_sum0[kCap], s_sum1[kCap];

  const float k_k = args.k_k[at], k_a = args.k_a[at], r_k = args.r_k[at];
  const float ln_w = args.ln_w[at], ln_b = args.ln_b[at];
  float row[kCap];
  const float* in = args.state_in + (item * n + i) * n;
#pragma unroll
  for (int j = 0; j < (kN > 0 ? kN : n); ++j) row[j] = in[j];

  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t o = (b * args.T + t) * d + at;
    // Key channel i: kk, the head's norm, then its contributions to the update.
    const float k = args.k[o];
    const float kk_raw = Rwkv7KkRaw(k, k_k);
    const float norm = Rwkv7KkNorm(BlockSum(kk_raw * kk_raw, s_sum0, n, p, i));
    const Rwkv7Channel c = Rwkv7PrepareChannel(args.w_raw[o], args.a_raw[o], kk_raw, norm, k, k_a);
    const float r = args.r[o];
    s_w[i] = c.w;
    s_neg_kk[i] = c.neg_kk;
    s_kk_a[i] = c.kk_a;
    s_k[i] = c.k;
    s_r[i] = r;
    // Value row i.
    float v = args.v[o];
    if (!args.first_layer) v = Rwkv7ValueMix(v, args.v_first[o], args.v_raw[o]);
    __syncthreads();  // the channels' vectors are written
    const float y = Rwkv7RowUpdate(kN > 0 ? kN : n, row, s_w, s_neg_kk, s_kk_a, s_k, s_r, v);
    // BlockSum2's first barrier also ends every thread's reads of s_w .. s_r, so the next
    // token may overwrite them.
    float sum, bonus;
    BlockSum2(y, Rwkv7BonusTerm(r, c.k, r_k), s_sum0, s_sum1, n, p, i, &sum, &bonus);
    const float mean = Rwkv7GroupNormMean(sum, n);
    const float inv =
        Rwkv7GroupNormInv(BlockSum((y - mean) * (y - mean), s_sum0, n, p, i), n, args.eps);
    args.y[o] = Rwkv7Output(y, mean, inv, ln_w, ln_b, bonus, v, args.g[o]);
  }

  float* out = args.state_out + (item * n + i) * n;
#pragma unroll
  for (int j = 0; j < (kN > 0 ? kN : n); ++j) out[j] = row[j];
}

template <int kN>
cudaError_t LaunchWidth(const Rwkv7WkvArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.H)), block(static_cast<unsigned>(args.N));
  Rwkv7WkvKernel<kN><<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchRwkv7Wkv(const Rwkv7WkvArgs& args, void* cuda_stream) {
  if (args.B < 0 || args.T < 0 || args.H < 0 || args.N < 1 || args.N > kRwkv7WkvMaxN) {
    return cudaErrorInvalidValue;
  }
  if (args.B == 0 || args.T == 0 || args.H == 0) return cudaSuccess;
  if (args.B * args.H > INT_MAX) return cudaErrorInvalidValue;  // grid.x
  const void* needed[] = {args.r,    args.w_raw,    args.a_raw,     args.k,   args.v,
                          args.g,    args.k_k,      args.k_a,       args.r_k, args.ln_w,
                          args.ln_b, args.state_in, args.state_out, args.y};
  for (const void* pointer : needed) {
    if (pointer == nullptr) return cudaErrorInvalidValue;
  }
  if (!args.first_layer && (args.v_raw == nullptr || args.v_first == nullptr)) {
    return cudaErrorInvalidValue;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (args.N) {
    case 8:
      return LaunchWidth<8>(args, stream);
    case 16:
      return LaunchWidth<16>(args, stream);
    case 32:
      return LaunchWidth<32>(args, stream);
    case 64:
      return LaunchWidth<64>(args, stream);
    case 128:
      return LaunchWidth<128>(args, stream);
    default:
      return LaunchWidth<0>(args, stream);
  }
}

const char* Rwkv7WkvErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
