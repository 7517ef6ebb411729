// LaunchLinearAttention's grid (linear_attention.cu) run on the CPU with host pointers: the
// CPU test of the launch's indexing and phases (tests/unit/gpu_linear_attention_test.cc),
// since the kernel itself only runs on a GPU machine. Blocks (session, head) one after
// another; in each, the kernel's two phases per token in order, every thread's work of a
// phase in turn (thread j: value channel j, column j of the state, z_j), over
// linear_attention_rule.h's bodies, so the arithmetic per element is the kernel's (up to
// the compilers' contraction into fused multiply-adds and their order of the dots' sums).
// Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>
#include <vector>

#include "models/gpu/linear_attention.h"
#include "models/gpu/linear_attention_rule.h"

namespace fwmodel::kernels {

// LaunchLinearAttention's computation on host pointers (the same LinearAttentionArgs
// contract, rows a host pointer too). Returns false, doing nothing, where the launcher
// would refuse the arguments (cudaErrorInvalidValue).
inline bool RunLinearAttentionOnHost(const LinearAttentionArgs& args) {
  if (!LinearAttentionArgsValid(args)) return false;
  if (args.B == 0 || args.H == 0) return true;
  const int64_t n = args.N, d = args.H * n;
  const size_t width = static_cast<size_t>(n);
  // Shared memory (one set: the phases run in order), and each thread's registers
  // (index: thread j; thread j's column at j·n).
  std::vector<float> s_fq(width), s_fk(width), s_z(width);
  std::vector<float> columns(width * width), z(width), v(width);
  for (int64_t item = 0; item < args.B * args.H; ++item) {
    const int64_t b = item / args.H, head = item % args.H;
    const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t S_at = (state_row * args.H + head) * n * n;
    const int64_t z_at = (state_row * args.H + head) * n;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < n; ++i) columns[j * width + i] = args.S_in[S_at + i * n + j];
      z[j] = args.z_in[z_at + j];
    }
    for (int64_t t = 0; t < args.T; ++t) {
      const int64_t o = (b * args.T + t) * d + head * n;
      for (int64_t j = 0; j < n; ++j) {
        const float fq = LinearAttentionFeature(args.q[o + j]);
        const float fk = LinearAttentionFeature(args.k[o + j]);
        z[j] += fk;
        s_fq[j] = fq;
        s_fk[j] = fk;
        s_z[j] = z[j];
        v[j] = args.v[o + j];
      }
      for (int64_t j = 0; j < n; ++j) {  // after the barrier
        const float num =
            LinearAttentionColumn(n, columns.data() + j * width, s_fq.data(), s_fk.data(), v[j]);
        const float den = LinearAttentionDen(n, s_fq.data(), s_z.data(), args.eps);
        args.y[o + j] = num / den;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < n; ++i) args.S_out[S_at + i * n + j] = columns[j * width + i];
      args.z_out[z_at + j] = z[j];
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
