// RWKV-7's block-input kernels (rwkv7_mix.h).
//
// The shift mix: one block per (session b, token t), p = Rwkv7MixThreads(d) threads (a
// power of two ≤ 256); thread i takes channels c = i, i + p, ... of the row. The block
// normalises its own token's row h[b, t] and, for t > 0, the previous token's row
// h[b, t − 1] too (the same arithmetic as block (b, t − 1) does for its own row), so no
// block waits for another; for t = 0 the previous x is the shift state's row b. Each
// thread sums its channels in order, then a halving reduction in shared memory over the
// p partial sums (buf[i] += buf[i + s], s = p/2, ..., 1) gives the row's Σ: first Σ h (the
// mean), then Σ (h − mean)² (two-pass, biased variance, as torch::layer_norm). The two
// rows' sums share each reduction's barriers. Then every thread writes its channels of
// the kCount interpolations and, in block (b, T − 1), of the new shift state.
// rwkv7_mix_host.h runs this grid, phase by phase, on the CPU.
//
// Barriers per block: the two BlockSum2 calls (each: one after the writes, one per
// halving step, one after every thread's read of the sum, so the second call may reuse
// the buffers). Global memory is read-only except the outputs, which no block reads.
//
// The squared relu: a grid-stride elementwise loop, 256 threads per block.
#include <cuda_runtime.h>

#include <climits>

#include "models/gpu/rwkv7_mix.h"
#include "models/gpu/rwkv7_mix_rule.h"

namespace fwmodel::kernels {
namespace {

static_assert((kRwkv7MixMaxThreads & (kRwkv7MixMaxThreads - 1)) == 0,
              "kRwkv7MixMaxThreads: a power of two (the reductions' width)");

// The Σ over the block's p threads (a power of two) of x0 and of x1, halving in shared
// memory; every thread gets both sums. buf0, buf1: p floats each, free on entry and again
// on return (the last barrier is after every thread's read).
__device__ __forceinline__ void MixBlockSum2(float x0, float x1, float* buf0, float* buf1, int p,
                                             int i, float* sum0, float* sum1) {
  buf0[i] = x0;
  buf1[i] = x1;
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

template <int kCount>
__global__ void __launch_bounds__(kRwkv7MixMaxThreads)
    Rwkv7ShiftMixKernel(const Rwkv7ShiftMixArgs args) {
  __shared__ float s_sum0[kRwkv7MixMaxThreads], s_sum1[kRwkv7MixMaxThreads];
  const int p = static_cast<int>(blockDim.x);
  const int i = static_cast<int>(threadIdx.x);
  const int64_t item = blockIdx.x;  // b·T + t
  const int64_t b = item / args.T, t = item % args.T;
  const int64_t d = args.d;
  const float* __restrict__ row = args.h + item * d;
  // The previous token's row: in this call for t > 0, else the shift state (already x).
  const bool previous_in_call = t > 0;
  const float* __restrict__ previous_row = previous_in_call ? row - d : args.shift_in + b * d;

  float sum = 0.0f, previous_sum = 0.0f;
  for (int64_t c = i; c < d; c += p) {
    sum += row[c];
    if (previous_in_call) previous_sum += previous_row[c];
  }
  MixBlockSum2(sum, previous_sum, s_sum0, s_sum1, p, i, &sum, &previous_sum);
  const float mean = LayerNormMean(sum, d), previous_mean = LayerNormMean(previous_sum, d);

  float squares = 0.0f, previous_squares = 0.0f;
  for (int64_t c = i; c < d; c += p) {
    const float centered = row[c] - mean;
    squares += centered * centered;
    if (previous_in_call) {
      const float previous_centered = previous_row[c] - previous_mean;
      previous_squares += previous_centered * previous_centered;
    }
  }
  MixBlockSum2(squares, previous_squares, s_sum0, s_sum1, p, i, &squares, &previous_squares);
  const float inv = LayerNormInv(squares, d, args.eps);
  const float previous_inv = LayerNormInv(previous_squares, d, args.eps);

  const int64_t plane = args.B * args.T * d;  // one interpolation's [B, T, d]
  float* __restrict__ out = args.out + item * d;
  const bool last = t == args.T - 1;
  float* __restrict__ shift_out = args.shift_out + b * d;
  for (int64_t c = i; c < d; c += p) {
    const float w = args.ln_w[c], bias = args.ln_b[c];
    const float x = LayerNormOut(row[c], mean, inv, w, bias);
    const float previous = previous_in_call
                               ? LayerNormOut(previous_row[c], previous_mean, previous_inv, w, bias)
                               : previous_row[c];
#pragma unroll
    for (int m = 0; m < kCount; ++m)
      out[m * plane + c] = Rwkv7ShiftMix(x, previous, args.mix[m][c]);
    if (last) shift_out[c] = x;
  }
}

__global__ void __launch_bounds__(256) SquaredReluKernel(const float* in, float* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += stride) {
    out[k] = SquaredRelu(in[k]);
  }
}

}  // namespace

int LaunchRwkv7ShiftMix(const Rwkv7ShiftMixArgs& args, void* cuda_stream) {
  if (args.B < 0 || args.T < 1 || args.d < 1 || args.d > INT_MAX ||
      (args.count != 1 && args.count != kRwkv7MixMaxCount)) {
    return cudaErrorInvalidValue;
  }
  if (args.B == 0) return cudaSuccess;
  if (args.B * args.T > INT_MAX) return cudaErrorInvalidValue;  // grid.x
  if (args.h == nullptr || args.ln_w == nullptr || args.ln_b == nullptr ||
      args.shift_in == nullptr || args.shift_out == nullptr || args.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  for (int m = 0; m < args.count; ++m) {
    if (args.mix[m] == nullptr) return cudaErrorInvalidValue;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const dim3 grid(static_cast<unsigned>(args.B * args.T));
  const dim3 block(static_cast<unsigned>(Rwkv7MixThreads(args.d)));
  if (args.count == 1) {
    Rwkv7ShiftMixKernel<1><<<grid, block, 0, stream>>>(args);
  } else {
    Rwkv7ShiftMixKernel<kRwkv7MixMaxCount><<<grid, block, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

int LaunchSquaredRelu(const float* in, float* out, int64_t n, void* cuda_stream) {
  if (n < 0 || (n > 0 && (in == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  constexpr int64_t kThreads = 256, kMaxBlocks = 65536;
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  SquaredReluKernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(kThreads), 0,
                      static_cast<cudaStream_t>(cuda_stream)>>>(in, out, n);
  return cudaGetLastError();
}

const char* Rwkv7MixErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
