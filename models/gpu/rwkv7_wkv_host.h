// LaunchRwkv7Wkv's grid (rwkv7_wkv.cu) run on the CPU with host pointers: the CPU test of
// the launch's indexing, phases and reductions (tests/unit/gpu_bodies_test.cc), since
// the kernel itself only runs on a GPU machine. Blocks (session, head) one after
// another; in each, the kernel's phases between two barriers in order, every thread's
// work of a phase in turn (thread i: row i of the state and key channel i; threads past
// N add zeros to the sums), with the kernel's staging of the state through its tile
// (the same chunks and tile indices), its reductions in its order (HostBlockTreeSums:
// each thread's own result) and rwkv7_rule.h's bodies, so the arithmetic per element is
// the kernel's (up to the compilers' contraction into fused multiply-adds). With a
// scratch and T > 1, the split path's three kernels the same way (RunRwkv7WkvSplitOnHost).
// Not a fast path. Torch-free, header-only.
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

// rwkv7_wkv.cu's LoadRows: a head's state (n rows of n floats at src) into `rows` (thread
// i's registers: rows[i·n ..]), kRwkv7WkvStageRows rows at a time through `tile`.
inline void HostLoadRows(const float* src, int n, std::vector<float>& tile,
                         std::vector<float>& rows) {
  const int stride = Rwkv7WkvTileStride(n);
  for (int r0 = 0; r0 < n; r0 += kRwkv7WkvStageRows) {
    const int count = (n - r0 < kRwkv7WkvStageRows ? n - r0 : kRwkv7WkvStageRows) * n;
    const float* chunk = src + static_cast<int64_t>(r0) * n;
    for (int e = 0; e < count; ++e) {
      tile[static_cast<size_t>(Rwkv7WkvTileIndex(e, n, stride))] = chunk[e];
    }
    for (int i = r0; i < n && i < r0 + kRwkv7WkvStageRows; ++i) {
      for (int j = 0; j < n; ++j) {
        rows[static_cast<size_t>(i) * n + j] = tile[static_cast<size_t>((i - r0) * stride + j)];
      }
    }
  }
}

// rwkv7_wkv.cu's StoreRows: HostLoadRows' reverse, `rows` to dst.
inline void HostStoreRows(const std::vector<float>& rows, int n, std::vector<float>& tile,
                          float* dst) {
  const int stride = Rwkv7WkvTileStride(n);
  for (int r0 = 0; r0 < n; r0 += kRwkv7WkvStageRows) {
    const int count = (n - r0 < kRwkv7WkvStageRows ? n - r0 : kRwkv7WkvStageRows) * n;
    for (int i = r0; i < n && i < r0 + kRwkv7WkvStageRows; ++i) {
      for (int j = 0; j < n; ++j) {
        tile[static_cast<size_t>((i - r0) * stride + j)] = rows[static_cast<size_t>(i) * n + j];
      }
    }
    float* chunk = dst + static_cast<int64_t>(r0) * n;
    for (int e = 0; e < count; ++e) {
      chunk[e] = tile[static_cast<size_t>(Rwkv7WkvTileIndex(e, n, stride))];
    }
  }
}

// The split path (Rwkv7WkvSplit: a scratch, here a host pointer, and T > 1) as
// rwkv7_wkv.cu's three kernels run it, one after another: Rwkv7WkvPrepareKernel's blocks
// (session, token, head), Rwkv7WkvRecurrenceKernel's (session, head: the state through
// the tile, the tokens' vectors staged Rwkv7WkvChunkTokens(N) at a time, the raw y to
// args.y), Rwkv7WkvOutputKernel's (session, token, head: the GroupNorm and output in
// place). Arguments already valid.
inline void RunRwkv7WkvSplitOnHost(const Rwkv7WkvArgs& args) {
  const int n = static_cast<int>(args.N);
  const size_t width = static_cast<size_t>(Rwkv7WkvThreads(n));
  const int64_t d = args.H * n;
  const int per_token = kRwkv7WkvScratchFields * n;
  std::vector<float> values(width), squares(width), bonus_terms(width), centred(width);
  // Phase 1: the tokens' vectors and bonuses.
  for (int64_t item = 0; item < args.B * args.T * args.H; ++item) {
    const int64_t head = item % args.H, bt = item / args.H;
    const int64_t b = bt / args.T, t = bt % args.T;
    auto at = [&](int i) { return head * n + i; };
    auto o = [&](int i) { return bt * d + at(i); };
    for (int i = 0; i < n; ++i) {
      values[i] = Rwkv7KkRaw(args.k[o(i)], args.k_k[at(i)]);  // kk_raw
      squares[i] = values[i] * values[i];
    }
    const std::vector<float> kk_sums = HostBlockTreeSums(squares, n);
    float* out = args.scratch + Rwkv7WkvScratchToken(b, head, t, args.H, args.T, n);
    for (int i = 0; i < n; ++i) {
      const Rwkv7Channel c =
          Rwkv7PrepareChannel(args.w_raw[o(i)], args.a_raw[o(i)], values[i],
                              Rwkv7KkNorm(kk_sums[i]), args.k[o(i)], args.k_a[at(i)]);
      const float r = args.r[o(i)];
      float v = args.v[o(i)];
      if (!args.first_layer) v = Rwkv7ValueMix(v, args.v_first[o(i)], args.v_raw[o(i)]);
      out[i] = c.w;
      out[n + i] = c.neg_kk;
      out[2 * n + i] = c.kk_a;
      out[3 * n + i] = c.k;
      out[4 * n + i] = r;
      out[5 * n + i] = v;
      bonus_terms[i] = Rwkv7BonusTerm(r, c.k, args.r_k[at(i)]);
    }
    args.scratch[Rwkv7WkvScratchBonus(b, head, t, args.B, args.H, args.T, n)] =
        HostBlockTreeSums(bonus_terms, n)[0];
  }
  // Phase 2: the recurrence, the raw y to args.y.
  const int chunk = Rwkv7WkvChunkTokens(n);
  std::vector<float> tile(static_cast<size_t>(kRwkv7WkvStageRows) *
                          static_cast<size_t>(Rwkv7WkvTileStride(n)));
  std::vector<float> stage(static_cast<size_t>(chunk) * static_cast<size_t>(per_token));
  std::vector<float> rows(static_cast<size_t>(n) * n);
  for (int64_t item = 0; item < args.B * args.H; ++item) {
    const int64_t b = item / args.H, head = item % args.H;
    const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t state_at = (state_row * args.H + head) * n * n;
    HostLoadRows(args.state_in + state_at, n, tile, rows);
    const float* vectors = args.scratch + Rwkv7WkvScratchToken(b, head, 0, args.H, args.T, n);
    for (int64_t t0 = 0; t0 < args.T; t0 += chunk) {
      const int count = static_cast<int>(args.T - t0 < chunk ? args.T - t0 : chunk);
      for (int e = 0; e < count * per_token; ++e) {
        stage[static_cast<size_t>(e)] = vectors[t0 * per_token + e];
      }
      for (int tt = 0; tt < count; ++tt) {
        const float* s = stage.data() + static_cast<size_t>(tt) * per_token;
        for (int i = 0; i < n; ++i) {
          args.y[(b * args.T + t0 + tt) * d + head * n + i] =
              Rwkv7RowUpdate(n, rows.data() + static_cast<size_t>(i) * n, s, s + n, s + 2 * n,
                             s + 3 * n, s + 4 * n, s[5 * n + i]);
        }
      }
    }
    HostStoreRows(rows, n, tile, args.state_out + state_at);
  }
  // Phase 3: the GroupNorm and the output, in place in args.y.
  for (int64_t item = 0; item < args.B * args.T * args.H; ++item) {
    const int64_t head = item % args.H, bt = item / args.H;
    const int64_t b = bt / args.T, t = bt % args.T;
    auto at = [&](int i) { return head * n + i; };
    auto o = [&](int i) { return bt * d + at(i); };
    for (int i = 0; i < n; ++i) values[i] = args.y[o(i)];
    const std::vector<float> y_sums = HostBlockTreeSums(values, n);
    std::vector<float> mean(width);
    for (int i = 0; i < n; ++i) {
      mean[i] = Rwkv7GroupNormMean(y_sums[i], n);
      centred[i] = (values[i] - mean[i]) * (values[i] - mean[i]);
    }
    const std::vector<float> centred_sums = HostBlockTreeSums(centred, n);
    const float bonus = args.scratch[Rwkv7WkvScratchBonus(b, head, t, args.B, args.H, args.T, n)];
    const float* v = args.scratch + Rwkv7WkvScratchToken(b, head, t, args.H, args.T, n) + 5 * n;
    for (int i = 0; i < n; ++i) {
      const float inv = Rwkv7GroupNormInv(centred_sums[i], n, args.eps);
      args.y[o(i)] = Rwkv7Output(values[i], mean[i], inv, args.ln_w[at(i)], args.ln_b[at(i)], bonus,
                                 v[i], args.g[o(i)]);
    }
  }
}

// LaunchRwkv7Wkv's computation on host pointers (the same Rwkv7WkvArgs contract, rows and
// scratch host pointers too; with a scratch and T > 1, RunRwkv7WkvSplitOnHost). Returns false,
// doing nothing, where the launcher would refuse the arguments (cudaErrorInvalidValue).
inline bool RunRwkv7WkvOnHost(const Rwkv7WkvArgs& args) {
  if (!Rwkv7WkvArgsValid(args)) return false;
  if (args.B == 0 || args.T == 0 || args.H == 0) return true;
  if (Rwkv7WkvSplit(args)) {
    RunRwkv7WkvSplitOnHost(args);
    return true;
  }
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
    HostLoadRows(args.state_in + state_at, n, tile, rows);
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
    HostStoreRows(rows, n, tile, args.state_out + state_at);
  }
  return true;
}

}  // namespace fwmodel::kernels
