// LaunchFastWeight's grid (fast_weight.cu) run on the CPU with host pointers: the CPU test
// of the launch's indexing and phases (tests/unit/gpu_fast_weight_test.cc), since the
// kernel itself only runs on a GPU machine. Blocks (session, head) one after another; in
// each, the kernel's three phases per token in order, every thread's work of a phase in
// turn (thread t = c·N + i: chunk c of row i of W), over fast_weight_rule.h's bodies, and
// the warps' sums as the halving tree the kernel's butterflies compute, so the arithmetic
// per element is the kernel's (up to the compilers' contraction into fused multiply-adds).
// Not a fast path. Torch-free, header-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "models/gpu/fast_weight.h"
#include "models/gpu/fast_weight_rule.h"
#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// The halving tree over the 32 values of a warp, buf[l] += buf[l + s] for s = 16, ..., 1:
// the bits tree_sum.cuh's WarpTreeSum gives every lane. `buf` is overwritten.
inline float FastWeightHostWarpSum(float* buf) {
  for (int s = 16; s > 0; s /= 2) {
    for (int l = 0; l < s; ++l) buf[l] += buf[l + s];
  }
  return buf[0];
}

// LaunchFastWeight's computation on host pointers (the same FastWeightArgs contract, rows
// a host pointer too). Returns false, doing nothing, where the launcher would refuse the
// arguments (cudaErrorInvalidValue).
inline bool RunFastWeightOnHost(const FastWeightArgs& args) {
  if (!FastWeightArgsValid(args)) return false;
  if (args.B == 0 || args.H == 0) return true;
  const int n = static_cast<int>(args.N), chunks = 2 * static_cast<int>(args.nu);
  const int phi = chunks * n, threads = FastWeightThreads(args.N, args.nu), warps = threads / 32;
  const int64_t d = args.H * n;
  // Shared memory (one set: the phases run in order), and each thread's registers
  // (thread t's chunk at t·n).
  std::vector<float> s_fk(static_cast<size_t>(threads)), s_fq(s_fk.size()), s_dk(s_fk.size()),
      s_dq(s_fk.size()), s_warp(3 * static_cast<size_t>(warps));
  std::vector<float> chunk(static_cast<size_t>(phi) * static_cast<size_t>(n)), v(s_fk.size());
  float lanes[32];
  for (int64_t item = 0; item < args.B * args.H; ++item) {
    const int64_t b = item / args.H, head = item % args.H;
    const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t head_at = (state_row * args.H + head) * n * phi;
    auto W_at = [&](int tid) {
      return head_at + static_cast<int64_t>(tid % n) * phi + tid / n * n;
    };
    for (int tid = 0; tid < phi; ++tid) {
      for (int m = 0; m < n; ++m) chunk[tid * n + m] = args.W_in[W_at(tid) + m];
    }
    for (int64_t t = 0; t < args.T; ++t) {
      const int64_t token = b * args.T + t;
      const int64_t o = token * d + head * n;
      const float beta = SigmoidF(args.beta[token * args.H + head]);
      // Phase 1: the features (zeros past d_phi) and the warps' sums.
      for (int tid = 0; tid < threads; ++tid) {
        const bool active = tid < phi;
        s_fk[tid] = active ? FastWeightFeature(args.k + o, n, tid) : 0.0f;
        s_fq[tid] = active ? FastWeightFeature(args.q + o, n, tid) : 0.0f;
        if (active) v[tid] = args.v[o + tid % n];
      }
      for (int w = 0; w < warps; ++w) {
        for (int l = 0; l < 32; ++l) lanes[l] = s_fk[32 * w + l];
        s_warp[w] = FastWeightHostWarpSum(lanes);
        for (int l = 0; l < 32; ++l) lanes[l] = s_fq[32 * w + l];
        s_warp[warps + w] = FastWeightHostWarpSum(lanes);
        for (int l = 0; l < 32; ++l) lanes[l] = s_fk[32 * w + l] * s_fq[32 * w + l];
        s_warp[2 * warps + w] = FastWeightHostWarpSum(lanes);
      }
      // Phase 2 (after barrier 1): the normalisers, the chunks' dots.
      float sum_k = 0.0f, sum_q = 0.0f, sum_kq = 0.0f;
      for (int w = 0; w < warps; ++w) {
        sum_k += s_warp[w];
        sum_q += s_warp[warps + w];
        sum_kq += s_warp[2 * warps + w];
      }
      const float inv_k = FastWeightInverse(sum_k, args.eps);
      const float inv_q = FastWeightInverse(sum_q, args.eps);
      for (int tid = 0; tid < phi; ++tid) {
        const int c = tid / n;
        const FastWeightDots dots = FastWeightChunkDots(n, chunk.data() + tid * n,
                                                        s_fk.data() + c * n, s_fq.data() + c * n);
        s_dk[tid] = dots.k;
        s_dq[tid] = dots.q;
      }
      // Phase 3 (after barrier 2): the rows' sums, the writes, y.
      for (int tid = 0; tid < phi; ++tid) {
        const int c = tid / n, i = tid % n;
        const float retrieved = FastWeightRowSum(s_dk.data(), chunks, n, i, inv_k);
        const float delta = FastWeightDelta(beta, v[tid], retrieved);
        FastWeightChunkUpdate<const float*>(n, chunk.data() + tid * n, s_fk.data() + c * n,
                                            delta * inv_k);
        if (c == 0) {
          const float read = FastWeightRowSum(s_dq.data(), chunks, n, i, inv_q);
          args.y[o + i] = FastWeightOutput(read, delta, sum_kq * inv_k * inv_q);
        }
      }
    }
    for (int tid = 0; tid < phi; ++tid) {
      for (int m = 0; m < n; ++m) args.W_out[W_at(tid) + m] = chunk[tid * n + m];
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
