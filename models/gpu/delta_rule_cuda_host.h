// LaunchDeltaRule's grid (delta_rule_cuda.cu) run on the CPU with host pointers: the CPU
// test of the launch's indexing, phases and reduction (tests/unit/gpu_bodies_test.cc),
// since the kernel itself only runs on a GPU machine. Blocks (session, value head) one
// after another; in each, the kernel's phases between two barriers in order, every
// thread's work of a phase in turn (thread j: column j of the state, value channel j;
// threads past V add zeros to the sum), with the kernel's reduction (HostBlockTreeSums:
// each thread's own result) and delta_rule_column.h's bodies, so
// the arithmetic per element is the kernel's (up to the compilers' contraction into
// fused multiply-adds). Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>
#include <vector>

#include "models/gpu/delta_rule_column.h"
#include "models/gpu/delta_rule_cuda.h"
#include "models/gpu/rwkv7_wkv_host.h"  // HostBlockTreeSums

namespace fwmodel::kernels {

// LaunchDeltaRule's computation on host pointers (the same DeltaRuleArgs contract, rows a
// host pointer too).
// Returns false, doing nothing, where the launcher would refuse the arguments
// (cudaErrorInvalidValue).
inline bool RunDeltaRuleOnHost(const DeltaRuleArgs& args) {
  if (!DeltaRuleArgsValid(args)) return false;
  const int K = static_cast<int>(args.K), V = static_cast<int>(args.V);
  const int p = TreeWidth(V);  // the block's threads
  // Shared memory, and each thread's registers (index: thread j).
  std::vector<float> s_q(static_cast<size_t>(K)), s_k(static_cast<size_t>(K));
  std::vector<float> squares(static_cast<size_t>(V));
  std::vector<float> columns(static_cast<size_t>(K) * V);  // thread j's at j·K
  std::vector<float> o(static_cast<size_t>(V));
  for (int64_t item = 0; item < args.B * args.HV; ++item) {
    const int64_t b = item / args.HV, hv = item % args.HV;
    const int64_t qk_head = hv / (args.HV / args.H);
    const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t state_at = (state_row * args.HV + hv) * K * V;
    for (int j = 0; j < V; ++j) {
      const float* in = args.state_in + state_at + j;
      for (int i = 0; i < K; ++i) {
        columns[static_cast<size_t>(j) * K + i] = in[static_cast<int64_t>(i) * V];
      }
    }
    for (int64_t t = 0; t < args.T; ++t) {
      const int64_t token = b * args.T + t;
      const int64_t qk_at = (token * args.H + qk_head) * K;
      for (int j = 0; j < p; ++j) {  // staging (thread j: channels j, j + p, ...)
        for (int i = j; i < K; i += p) {
          s_q[static_cast<size_t>(i)] = args.q[qk_at + i];
          s_k[static_cast<size_t>(i)] = args.k[qk_at + i];
        }
      }
      const int64_t head_at = token * args.HV + hv;
      const float beta = args.beta[head_at];
      const float decay = args.decay != nullptr ? args.decay[head_at] : 1.0f;
      for (int j = 0; j < V; ++j) {  // after the barrier: each thread's column
        const float v = args.v[head_at * V + j];
        o[static_cast<size_t>(j)] = DeltaRuleColumn(K, columns.data() + static_cast<size_t>(j) * K,
                                                    s_q.data(), s_k.data(), v, beta, decay);
        squares[static_cast<size_t>(j)] = o[static_cast<size_t>(j)] * o[static_cast<size_t>(j)];
      }
      const std::vector<float> sums = HostBlockTreeSums(squares, V);
      const bool gated = args.gate != nullptr;
      for (int j = 0; j < V; ++j) {
        const float inv = DeltaNetNormInv(sums[static_cast<size_t>(j)], V, args.eps);
        const int64_t at = head_at * V + j;
        args.o[at] = DeltaNetOutputColumn(o[static_cast<size_t>(j)], inv, args.norm_weight[j],
                                          gated, gated ? args.gate[at] : 0.0f);
      }
    }
    for (int j = 0; j < V; ++j) {
      float* out = args.state_out + state_at + j;
      for (int i = 0; i < K; ++i) {
        out[static_cast<int64_t>(i) * V] = columns[static_cast<size_t>(j) * K + i];
      }
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
