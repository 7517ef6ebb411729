// The halving tree's sum over a block's threads, for CUDA kernels (nvcc only): the order
// of rwkv7_wkv_host.h's HostTreeSum (buf[i] += buf[i + s] for s = p/2, ..., 1 over p
// values, a power of two, zeros past the threads that have one), which the CPU mirrors of
// rwkv7_wkv.cu and delta_rule_cuda.cu run, computed as warp-shuffle butterflies that give
// every thread the tree's bits (HostBlockTreeSums mirrors them thread by thread;
// GpuBodiesTreeSumTest checks them against the tree). Torch-free, header-only.
#pragma once

#include <cuda_runtime.h>

namespace fwmodel::kernels {
namespace tree_sum {

constexpr unsigned kFullMask = 0xffffffffu;

// Σ of x over a group of `width` lanes (a power of two ≤ 32; the block's lanes 0..width−1
// when width < 32), every lane getting the halving tree's result: x += (x of lane l ^ s)
// for s = width/2, ..., 1. Lane l < s adds lane l + s's value, as the tree's
// buf[l] += buf[l + s]; lane l ≥ s adds lane l − s's, the same two operands swapped (the
// same bits), so after each step lanes l and l ^ s agree and every lane ends with buf[0].
__device__ __forceinline__ float WarpTreeSum(float x, int width) {
  const unsigned mask = width >= 32 ? kFullMask : (1u << width) - 1u;
  for (int s = width / 2; s > 0; s /= 2) x += __shfl_xor_sync(mask, x, s);
  return x;
}

// The tree's steps s = p/2, ..., 32 for index `lane` of buf (p floats, p/32 ≤ kGroups
// groups of 32): the value the tree leaves at buf[lane] before its steps below 32, that
// is the tree over the p/32 values buf[lane + 32 c] (index c ↔ buf index lane + 32 c).
template <int kGroups>
__device__ __forceinline__ float UpperTreeSteps(const float* buf, int p, int lane) {
  const int groups = p / 32;
  float acc[kGroups];
#pragma unroll
  for (int c = 0; c < kGroups; ++c) acc[c] = c < groups ? buf[lane + 32 * c] : 0.0f;
#pragma unroll
  for (int g = kGroups / 2; g >= 1; g /= 2) {
    if (2 * g <= groups) {
#pragma unroll
      for (int c = 0; c < g; ++c) acc[c] += acc[c + g];
    }
  }
  return acc[0];
}

// The halving tree's Σ over the block's p threads' x (p = blockDim.x, a power of two ≤
// kCap; threads without a value pass 0), for every thread. p ≤ 32: shuffles alone. Else each
// thread writes x to buf (p floats of shared memory), one barrier, then every warp takes
// the tree's upper steps for its lanes and the butterfly: buf is read after the barrier,
// so the caller must not write it again before another barrier.
template <int kCap>
__device__ __forceinline__ float TreeSum(float x, float* buf, int p, int i) {
  if (p <= 32) return WarpTreeSum(x, p);
  buf[i] = x;
  __syncthreads();
  return WarpTreeSum(UpperTreeSteps<(kCap > 32 ? kCap / 32 : 1)>(buf, p, i & 31), 32);
}

// Two TreeSums with one barrier.
template <int kCap>
__device__ __forceinline__ void TreeSum2(float x0, float x1, float* buf0, float* buf1, int p, int i,
                                         float* sum0, float* sum1) {
  if (p <= 32) {
    *sum0 = WarpTreeSum(x0, p);
    *sum1 = WarpTreeSum(x1, p);
    return;
  }
  buf0[i] = x0;
  buf1[i] = x1;
  __syncthreads();
  constexpr int kGroups = kCap > 32 ? kCap / 32 : 1;
  *sum0 = WarpTreeSum(UpperTreeSteps<kGroups>(buf0, p, i & 31), 32);
  *sum1 = WarpTreeSum(UpperTreeSteps<kGroups>(buf1, p, i & 31), 32);
}

}  // namespace tree_sum
}  // namespace fwmodel::kernels
