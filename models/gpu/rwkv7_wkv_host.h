// LaunchRwkv7Wkv's grid (rwkv7_wkv.cu) run on the CPU with host pointers: the CPU test of
// the launch's indexing, phases and reductions (tests/unit/gpu_bodies_test.cc), since
// the kernel itself only runs on a GPU machine. Blocks (session, head) one after
// another; in each, the kernel's phases between two barriers in order, every thread's
// work of a phase in turn (thread i: row i of the state and key channel i; threads past
// N add zeros to the sums), with the kernel's staging of the state through its tile
// (the same chunks and tile indices), its reductions in its order (HostBlockTreeSums:
// each thread's own result) and rwkv7_rule.h's bodies, so the arithmetic per element is
// the kernel's (up to the compilers' contraction into fused multiply-adds). Not a fast
// path. Torch-free, header-only.
#pragma once

#include <cstdint>
#include <vector>

#include "models/gpu/rwkv7_rule.h"
#include "models/gpu/rwkv7_wkv.h"

namespace fwmodel::kernels {

// The halving tree's Σ over buf's first n values (p = TreeWidth(n) floats, zeros past n
// filled here): buf[i] += buf[i + s] for s = p/2, ..., 1; returns buf[0].
inline float HostTreeSum(std::vector<float>& buf, int n) {
  const int p = TreeWidth(n);
  for (int i = n; i < p; ++i) buf[static_cast<size_t>(i)] = 0.0f;
  for (int s = p / 2; s > 0; s /= 2) {
    for (int i = 0; i < s; ++i) buf[static_cast<size_t>(i)] += buf[static_cast<size_t>(i + s)];
  }
  return buf[0];
}

// rwkv7_wkv.cu's TreeSum as the block's p = TreeWidth(n) threads run it, thread i's value
// values[i] (zeros past n): with p > 32, thread i (lane l = i % 32) first takes the tree's
// steps above 32 over buf[l + 32 c] (UpperTreeSteps); then the butterfly over its warp's
// min(p, 32) lanes, x += x of lane l ^ s for s = 16 (or p/2), ..., 1. Returns each
// thread's result, sums[i] (every one the tree's HostTreeSum, bit for bit:
// GpuBodiesTreeSumTest).
inline std::vector<float> HostBlockTreeSums(const std::vector<float>& values, int n) {
  const int p = TreeWidth(n);
  std::vector<float> lanes(static_cast<size_t>(p));
  for (int i = 0; i < p; ++i)
    lanes[static_cast<size_t>(i)] = i < n ? values[static_cast<size_t>(i)] : 0.0f;
  if (p > 32) {
    const int groups = p / 32;
    std::vector<float> upper(static_cast<size_t>(p)), acc(static_cast<size_t>(groups));
    for (int i = 0; i < p; ++i) {
      for (int c = 0; c < groups; ++c) {
        acc[static_cast<size_t>(c)] = lanes[static_cast<size_t>(i % 32 + 32 * c)];
      }
      for (int g = groups / 2; g >= 1; g /= 2) {
        for (int c = 0; c < g; ++c) acc[static_cast<size_t>(c)] += acc[static_cast<size_t>(c + g)];
      }
      upper[static_cast<size_t>(i)] = acc[0];
    }
    lanes = upper;
  }
  const int width = p < 32 ? p : 32;
  std::vector<float> next(static_cast<size_t>(p));
  for (int s = width / 2; s > 0; s /= 2) {
    for (int i = 0; i < p; ++i) {
      next[static_cast<size_t>(i)] =
          lanes[static_cast<size_t>(i)] + lanes[static_cast<size_t>(i ^ s)];
    }
    lanes.swap(next);
  }
  return lanes;
}

// LaunchRwkv7Wkv's computation on host pointers (the same Rwkv7WkvArgs contract, rows a
// host pointer too). Returns false, doing nothing, where the launcher would refuse the
// arguments (cudaErrorInvalidValue).
inline bool RunRwkv7WkvOnHost(const Rwkv7WkvArgs& args) {
  if (!Rwkv7WkvArgsValid(args)) return false;
  if (args.B == 0 || args.T == 0 || args.H == 0) return true;
  const int n = static_cast<int>(args.N);
  const int p = Rwkv7WkvThreads(n);
  const int64_t d = args.H * n;
  // The tile's layout is the same whether the kernel moves floats or float4s (whole
  // float4s of one row); the mirror moves floats.
  const int stride = Rwkv7WkvTileStride(n);
  const size_t width = static_cast<size_t>(p);
  // Shared memory, and each thread's registers (index: thread i).
  std::vector<float> tile(static_cast<size_t>(kRwkv7WkvStageRows) * static_cast<size_t>(stride));
  std::vector<float> s_w(width), s_neg_kk(width), s_kk_a(width), s_k(width), s_r(width);
  std::vector<float> rows(static_cast<size_t>(n) * n);
  std::vector<float> values(width), values1(width), y(width), v(width), r(width), bonus_term(width);
  std::vector<float> mean(width);
  std::vector<Rwkv7Channel> c(width);
  for (int64_t item = 0; item < args.B * args.H; ++item) {
    const int64_t b = item / args.H, head = item % args.H;
    const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t state_at = (state_row * args.H + head) * n * n;
    auto at = [&](int i) { return head * n + i; };
    // The state in, kRwkv7WkvStageRows rows at a time, through the tile.
    for (int r0 = 0; r0 < n; r0 += kRwkv7WkvStageRows) {
      const int count = (n - r0 < kRwkv7WkvStageRows ? n - r0 : kRwkv7WkvStageRows) * n;
      const float* src = args.state_in + state_at + static_cast<int64_t>(r0) * n;
      for (int e = 0; e < count; ++e) {
        tile[static_cast<size_t>(Rwkv7WkvTileIndex(e, n, stride))] = src[e];
      }
      for (int i = r0; i < n && i < r0 + kRwkv7WkvStageRows; ++i) {
        for (int j = 0; j < n; ++j) {
          rows[static_cast<size_t>(i) * n + j] = tile[static_cast<size_t>((i - r0) * stride + j)];
        }
      }
    }
    for (int64_t t = 0; t < args.T; ++t) {
      auto o = [&](int i) { return (b * args.T + t) * d + at(i); };
      for (int i = 0; i < n; ++i) {
        values[i] = Rwkv7KkRaw(args.k[o(i)], args.k_k[at(i)]);
        values1[i] = values[i] * values[i];
      }
      const std::vector<float> kk_sums = HostBlockTreeSums(values1, n);
      for (int i = 0; i < n; ++i) {  // values: kk_raw
        c[i] = Rwkv7PrepareChannel(args.w_raw[o(i)], args.a_raw[o(i)], values[i],
                                   Rwkv7KkNorm(kk_sums[i]), args.k[o(i)], args.k_a[at(i)]);
        r[i] = args.r[o(i)];
        s_w[i] = c[i].w;
        s_neg_kk[i] = c[i].neg_kk;
        s_kk_a[i] = c[i].kk_a;
        s_k[i] = c[i].k;
        s_r[i] = r[i];
        bonus_term[i] = Rwkv7BonusTerm(r[i], c[i].k, args.r_k[at(i)]);
        v[i] = args.v[o(i)];
        if (!args.first_layer) v[i] = Rwkv7ValueMix(v[i], args.v_first[o(i)], args.v_raw[o(i)]);
      }
      for (int i = 0; i < n; ++i) {
        y[i] = Rwkv7RowUpdate(n, rows.data() + static_cast<size_t>(i) * n, s_w.data(),
                              s_neg_kk.data(), s_kk_a.data(), s_k.data(), s_r.data(), v[i]);
      }
      const std::vector<float> y_sums = HostBlockTreeSums(y, n);
      const std::vector<float> bonus = HostBlockTreeSums(bonus_term, n);
      for (int i = 0; i < n; ++i) {
        mean[i] = Rwkv7GroupNormMean(y_sums[i], n);
        values[i] = (y[i] - mean[i]) * (y[i] - mean[i]);
      }
      const std::vector<float> centred_sums = HostBlockTreeSums(values, n);
      for (int i = 0; i < n; ++i) {
        const float inv = Rwkv7GroupNormInv(centred_sums[i], n, args.eps);
        args.y[o(i)] = Rwkv7Output(y[i], mean[i], inv, args.ln_w[at(i)], args.ln_b[at(i)], bonus[i],
                                   v[i], args.g[o(i)]);
      }
    }
    // The state out, the same way back.
    for (int r0 = 0; r0 < n; r0 += kRwkv7WkvStageRows) {
      const int count = (n - r0 < kRwkv7WkvStageRows ? n - r0 : kRwkv7WkvStageRows) * n;
      for (int i = r0; i < n && i < r0 + kRwkv7WkvStageRows; ++i) {
        for (int j = 0; j < n; ++j) {
          tile[static_cast<size_t>((i - r0) * stride + j)] = rows[static_cast<size_t>(i) * n + j];
        }
      }
      float* dst = args.state_out + state_at + static_cast<int64_t>(r0) * n;
      for (int e = 0; e < count; ++e) {
        dst[e] = tile[static_cast<size_t>(Rwkv7WkvTileIndex(e, n, stride))];
      }
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
