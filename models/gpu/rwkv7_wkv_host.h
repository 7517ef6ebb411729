// LaunchRwkv7Wkv's grid (rwkv7_wkv.cu) run on the CPU with host pointers: the CPU test of
// the launch's indexing, phases and reductions (tests/unit/gpu_bodies_test.cc), since
// the kernel itself only runs on a GPU machine. Blocks (session, head) one after
// another; in each, the kernel's phases between two barriers in order, every thread's
// work of a phase in turn (thread i: row i of the state and key channel i), with the
// kernel's halving reductions in its order and rwkv7_rule.h's bodies, so the arithmetic
// per element is the kernel's (up to the compilers' contraction into fused multiply-adds).
// Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>
#include <vector>

#include "models/gpu/rwkv7_rule.h"
#include "models/gpu/rwkv7_wkv.h"

namespace fwmodel::kernels {

// The kernel's BlockSum over buf's first n values (p = TreeWidth(n) floats, zeros past n
// filled here): buf[i] += buf[i + s] for s = p/2, ..., 1; returns buf[0].
inline float HostTreeSum(std::vector<float>& buf, int n) {
  const int p = TreeWidth(n);
  for (int i = n; i < p; ++i) buf[static_cast<size_t>(i)] = 0.0f;
  for (int s = p / 2; s > 0; s /= 2) {
    for (int i = 0; i < s; ++i) buf[static_cast<size_t>(i)] += buf[static_cast<size_t>(i + s)];
  }
  return buf[0];
}

// LaunchRwkv7Wkv's computation on host pointers (the same Rwkv7WkvArgs contract; N may be
// any positive width). Returns false, doing nothing, where the launcher would refuse the
// arguments (cudaErrorInvalidValue).
inline bool RunRwkv7WkvOnHost(const Rwkv7WkvArgs& args) {
  if (args.B < 0 || args.T < 0 || args.H < 0 || args.N < 1 || args.N > kRwkv7WkvMaxN) {
    return false;
  }
  if (!args.first_layer && (args.v_raw == nullptr || args.v_first == nullptr)) return false;
  const int n = static_cast<int>(args.N);
  const int64_t d = args.H * n;
  const size_t width = static_cast<size_t>(TreeWidth(n));
  // Shared memory, and each thread's registers (index: thread i).
  std::vector<float> s_w(width), s_neg_kk(width), s_kk_a(width), s_k(width), s_r(width);
  std::vector<float> s_sum0(width), s_sum1(width);
  std::vector<float> rows(static_cast<size_t>(n) * n);
  std::vector<float> kk_raw(width), y(width), v(width), r(width);
  std::vector<Rwkv7Channel> c(width);
  for (int64_t item = 0; item < args.B * args.H; ++item) {
    const int64_t b = item / args.H, head = item % args.H;
    auto at = [&](int i) { return head * n + i; };
    for (int i = 0; i < n; ++i) {
      const float* in = args.state_in + (item * n + i) * n;
      for (int j = 0; j < n; ++j) rows[static_cast<size_t>(i) * n + j] = in[j];
    }
    for (int64_t t = 0; t < args.T; ++t) {
      auto o = [&](int i) { return (b * args.T + t) * d + at(i); };
      for (int i = 0; i < n; ++i) {
        kk_raw[i] = Rwkv7KkRaw(args.k[o(i)], args.k_k[at(i)]);
        s_sum0[i] = kk_raw[i] * kk_raw[i];
      }
      const float norm = Rwkv7KkNorm(HostTreeSum(s_sum0, n));
      for (int i = 0; i < n; ++i) {
        c[i] = Rwkv7PrepareChannel(args.w_raw[o(i)], args.a_raw[o(i)], kk_raw[i], norm,
                                   args.k[o(i)], args.k_a[at(i)]);
        r[i] = args.r[o(i)];
        s_w[i] = c[i].w;
        s_neg_kk[i] = c[i].neg_kk;
        s_kk_a[i] = c[i].kk_a;
        s_k[i] = c[i].k;
        s_r[i] = r[i];
        v[i] = args.v[o(i)];
        if (!args.first_layer) v[i] = Rwkv7ValueMix(v[i], args.v_first[o(i)], args.v_raw[o(i)]);
      }
      for (int i = 0; i < n; ++i) {
        y[i] = Rwkv7RowUpdate(n, rows.data() + static_cast<size_t>(i) * n, s_w.data(),
                              s_neg_kk.data(), s_kk_a.data(), s_k.data(), s_r.data(), v[i]);
        s_sum0[i] = y[i];
        s_sum1[i] = Rwkv7BonusTerm(r[i], c[i].k, args.r_k[at(i)]);
      }
      const float sum = HostTreeSum(s_sum0, n);
      const float bonus = HostTreeSum(s_sum1, n);
      const float mean = Rwkv7GroupNormMean(sum, n);
      for (int i = 0; i < n; ++i) s_sum0[i] = (y[i] - mean) * (y[i] - mean);
      const float inv = Rwkv7GroupNormInv(HostTreeSum(s_sum0, n), n, args.eps);
      for (int i = 0; i < n; ++i) {
        args.y[o(i)] = Rwkv7Output(y[i], mean, inv, args.ln_w[at(i)], args.ln_b[at(i)], bonus, v[i],
                                   args.g[o(i)]);
      }
    }
    for (int i = 0; i < n; ++i) {
      float* out = args.state_out + (item * n + i) * n;
      for (int j = 0; j < n; ++j) out[j] = rows[static_cast<size_t>(i) * n + j];
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
