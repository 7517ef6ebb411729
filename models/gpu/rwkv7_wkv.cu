// The fused RWKV-7 time-mix recurrence (rwkv7_wkv.h): one block per (session, head),
// p = TreeWidth(N) threads, thread i < N owning row i of the head's state S (value channel
// i), which stays in the thread's registers across the loop over the T tokens (threads
// N.. exist only when N is not a power of two, and add zeros to the reductions).
//
// The state moves between global memory and the registers through a shared tile
// (kRwkv7WkvStageRows rows at a time, row stride Rwkv7WkvTileStride(N)): the block's
// threads load and store consecutive floats (float4 when N % 8 == 0 and the state's
// pointers are 16-byte aligned), so a warp's accesses are coalesced, and each thread moves
// its row between the tile and its registers. The row stride keeps both sides free of
// bank conflicts.
//
// Per token, thread i also does key channel i's per-channel work; the channels' vectors
// go through shared memory, and the head's sums (‖kk‖², Σ y with the bonus,
// Σ (y − mean)²) are the halving tree's (rwkv7_wkv_host.h's HostTreeSum) computed by
// tree_sum.cuh's TreeSum: a butterfly of warp shuffles, after the tree's steps above 32
// lanes through shared memory. Four barriers per token with more than 32 threads (each
// sum's, the vectors'); with 32 or fewer, the vectors' alone, the vectors alternating
// between two sets by token so that a token's writes cannot race the last token's reads.
// The arithmetic per element is rwkv7_rule.h's; rwkv7_wkv_host.h runs this grid, phase
// by phase, on the CPU. Torch-free: compiled by nvcc alone.
//
// With a scratch and T > 1 (prefill; rwkv7_wkv.h's Rwkv7WkvSplit), the launch is split so
// that only the state update is sequential over tokens: Rwkv7WkvPrepareKernel (a block
// per (session, token, head): the channels' vectors, the mixed v and the bonus into the
// scratch), Rwkv7WkvRecurrenceKernel (a block per (session, head), row i in thread i's
// registers as above, Rwkv7RowUpdate alone per token, the vectors staged a chunk of tokens
// per barrier pair; the raw y_i into args.y), Rwkv7WkvOutputKernel (a block per (session,
// token, head): the GroupNorm and output in place). The same bodies and tree sums, so
// the results are the single kernel's (up to contraction into fused multiply-adds).
#include <cuda_runtime.h>

#include <cstdint>

#include "models/gpu/rwkv7_rule.h"
#include "models/gpu/rwkv7_wkv.h"
#include "models/gpu/tree_sum.cuh"

namespace fwmodel::kernels {
namespace {

using tree_sum::TreeSum;
using tree_sum::TreeSum2;

// Copies `count` floats (whole rows of n) from global `src` into the tile (row stride
// `stride`), the block's `threads` threads on consecutive floats: float4s when `vec`
// (n % 8 == 0, src 16-byte aligned), else one float each. kMaxCount: the most floats a
// call moves (the loops' trip counts, fully unrolled when it and `threads` are known).
template <int kMaxCount>
__device__ __forceinline__ void TileLoad(const float* __restrict__ src, float* tile, int count,
                                         int n, int stride, bool vec, int i, int threads) {
  if (vec) {
    const float4* src4 = reinterpret_cast<const float4*>(src);
    const int count4 = count / 4;
#pragma unroll 16
    for (int q0 = 0; q0 < kMaxCount / 4; q0 += threads) {
      const int q = q0 + i;
      if (q < count4) {
        *reinterpret_cast<float4*>(tile + Rwkv7WkvTileIndex(4 * q, n, stride)) = src4[q];
      }
    }
  } else {
    for (int e = i; e < count; e += threads) tile[Rwkv7WkvTileIndex(e, n, stride)] = src[e];
  }
}

// TileLoad's reverse: the tile's `count` floats to global `dst`.
template <int kMaxCount>
__device__ __forceinline__ void TileStore(float* __restrict__ dst, const float* tile, int count,
                                          int n, int stride, bool vec, int i, int threads) {
  if (vec) {
    float4* dst4 = reinterpret_cast<float4*>(dst);
    const int count4 = count / 4;
#pragma unroll 16
    for (int q0 = 0; q0 < kMaxCount / 4; q0 += threads) {
      const int q = q0 + i;
      if (q < count4) {
        dst4[q] = *reinterpret_cast<const float4*>(tile + Rwkv7WkvTileIndex(4 * q, n, stride));
      }
    }
  } else {
    for (int e = i; e < count; e += threads) dst[e] = tile[Rwkv7WkvTileIndex(e, n, stride)];
  }
}

// The rows of one head's state (n rows of n floats at global `src`) into the threads'
// registers, kStage rows at a time through the tile (kStage·stride floats of shared
// memory; the state's rows r0.. in tile rows 0..): thread i < n (active) gets row i. Starts
// without a barrier (the tile must be free), ends after the last chunk's reads of the
// tile are issued (a barrier must precede its next write).
template <int kN, int kCap>
__device__ __forceinline__ void LoadRows(const float* __restrict__ src, float* s_tile,
                                         float (&row)[kCap], int n, int stride, bool vec,
                                         bool vec_tile, bool active, int i, int p) {
  constexpr int kStage = kCap < kRwkv7WkvStageRows ? kCap : kRwkv7WkvStageRows;
#pragma unroll
  for (int r0 = 0; r0 < (kN > 0 ? kN : n); r0 += kStage) {
    const int rows_here = n - r0 < kStage ? n - r0 : kStage;
    if (r0 > 0) __syncthreads();  // every thread has taken its row from the last chunk
    TileLoad<kStage * kCap>(src + static_cast<int64_t>(r0) * n, s_tile, rows_here * n, n, stride,
                            vec, i, p);
    __syncthreads();  // the chunk is staged
    if (active && i >= r0 && i < r0 + rows_here) {
      const float* mine = s_tile + (i - r0) * stride;
      if (vec_tile) {
#pragma unroll
        for (int j = 0; j < (kN > 0 ? kN : n); j += 4) {
          const float4 x = *reinterpret_cast<const float4*>(mine + j);
          row[j] = x.x;
          row[j + 1] = x.y;
          row[j + 2] = x.z;
          row[j + 3] = x.w;
        }
      } else {
        for (int j = 0; j < n; ++j) row[j] = mine[j];
      }
    }
  }
}

// LoadRows' reverse: the threads' rows to global `dst`, through the tile (starts with a
// barrier, so the tile may still be being read when it is called).
template <int kN, int kCap>
__device__ __forceinline__ void StoreRows(float* __restrict__ dst, float* s_tile,
                                          const float (&row)[kCap], int n, int stride, bool vec,
                                          bool vec_tile, bool active, int i, int p) {
  constexpr int kStage = kCap < kRwkv7WkvStageRows ? kCap : kRwkv7WkvStageRows;
#pragma unroll
  for (int r0 = 0; r0 < (kN > 0 ? kN : n); r0 += kStage) {
    const int rows_here = n - r0 < kStage ? n - r0 : kStage;
    __syncthreads();  // the tile is free (the last chunk stored, or the load's reads done)
    if (active && i >= r0 && i < r0 + rows_here) {
      float* mine = s_tile + (i - r0) * stride;
      if (vec_tile) {
#pragma unroll
        for (int j = 0; j < (kN > 0 ? kN : n); j += 4) {
          *reinterpret_cast<float4*>(mine + j) =
              make_float4(row[j], row[j + 1], row[j + 2], row[j + 3]);
        }
      } else {
        for (int j = 0; j < n; ++j) mine[j] = row[j];
      }
    }
    __syncthreads();  // the chunk is in the tile
    TileStore<kStage * kCap>(dst + static_cast<int64_t>(r0) * n, s_tile, rows_here * n, n, stride,
                             vec, i, p);
  }
}

// The blocks per SM each width's registers must allow: 64 warps' worth for N ≤ 32 (the
// SM's limit is 32 blocks anyway), 16 warps (128 registers a thread) for N = 64 and 8 for
// N = 128 (ptxas would otherwise take more, to hold more shared-memory loads in flight,
// and fewer warps would hide the per-token chains' latency). No local memory at these
// bounds (compile-check.sh).
template <int kN>
constexpr int kMinBlocks = kN == 128  ? 2
                           : kN == 64 ? 8
                           : kN == 0  ? 2
                                      : 16;

// kN: the head width, known at compile time (a multiple of 8 and a power of two: the
// row's loops unroll and the row stays in registers); 0: args.N at run time (the row in
// local memory). blockDim.x == TreeWidth(N). vec: the state's global accesses may be
// float4s (N % 8 == 0, state_in and state_out 16-byte aligned).
template <int kN>
__global__ void __launch_bounds__(kN > 0 ? kN : kRwkv7WkvMaxN, kMinBlocks<kN>)
    Rwkv7WkvKernel(const Rwkv7WkvArgs args, bool vec) {
  constexpr int kCap = kN > 0 ? kN : static_cast<int>(kRwkv7WkvMaxN);
  static_assert((kCap & (kCap - 1)) == 0, "kCap must be a power of two (the reductions' width)");
  static_assert(kN % 8 == 0, "compiled widths move their rows as float4s");
  constexpr int kStage = kCap < kRwkv7WkvStageRows ? kCap : kRwkv7WkvStageRows;
  constexpr int kStride = kCap + 4;  // ≥ Rwkv7WkvTileStride(n) for every n ≤ kCap
  const int n = kN > 0 ? kN : static_cast<int>(args.N);
  const int p = kN > 0 ? kN : TreeWidth(n);  // == blockDim.x, ≤ kCap
  const int stride = kN > 0 ? kN + 4 : Rwkv7WkvTileStride(n);
  const bool vec_tile = kN > 0 || n % 8 == 0;  // the tile's rows as float4s
  const int i = static_cast<int>(threadIdx.x);
  const bool active = kN > 0 || i < n;  // thread i has a row and a channel
  const int64_t item = blockIdx.x;      // b·H + head
  const int64_t b = item / args.H, head = item % args.H;
  const int64_t d = args.H * n;
  const int64_t at = head * n + i;  // channel (and row) i of this head in a [d] vector
  // The head's state: row `state_row` of the buffers, then head `head`.
  const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
  const int64_t state_at = (state_row * args.H + head) * n * n;

  __shared__ __align__(16) float s_tile[kStage * kStride];
  // The channels' vectors, two sets (token t uses set t % 2 when p ≤ 32, else set 0).
  __shared__ float s_w[2][kCap], s_neg_kk[2][kCap], s_kk_a[2][kCap], s_k[2][kCap], s_r[2][kCap];
  // The sums' buffers (p > 32 only): ‖kk‖², Σ y, the bonus, Σ (y − mean)². Each is
  // written once per token and read after its own barrier; the next token's write comes
  // at least two barriers after every read.
  __shared__ float s_kk[kCap], s_y[kCap], s_bonus[kCap], s_centred[kCap];

  float k_k = 0.0f, k_a = 0.0f, r_k = 0.0f, ln_w = 0.0f, ln_b = 0.0f;
  if (active) {
    k_k = args.k_k[at];
    k_a = args.k_a[at];
    r_k = args.r_k[at];
    ln_w = args.ln_w[at];
    ln_b = args.ln_b[at];
  }

  // The state in: coalesced into the tile, then row i into thread i's registers.
  float row[kCap];
  LoadRows<kN, kCap>(args.state_in + state_at, s_tile, row, n, stride, vec, vec_tile, active, i, p);

  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t o = (b * args.T + t) * d + at;
    // The vectors' set: alternating when the sums have no barrier (p ≤ 32); with p > 32
    // the Σ y barrier already comes after every thread's last read of this token's.
    const int set = p > 32 ? 0 : static_cast<int>(t & 1);
    // Key channel i: kk, the head's norm, then its contributions to the update.
    float k = 0.0f, kk_raw = 0.0f;
    if (active) {
      k = args.k[o];
      kk_raw = Rwkv7KkRaw(k, k_k);
    }
    const float norm = Rwkv7KkNorm(TreeSum<kCap>(kk_raw * kk_raw, s_kk, p, i));
    float r = 0.0f, v = 0.0f, bonus_term = 0.0f;
    if (active) {
      const Rwkv7Channel c =
          Rwkv7PrepareChannel(args.w_raw[o], args.a_raw[o], kk_raw, norm, k, k_a);
      r = args.r[o];
      s_w[set][i] = c.w;
      s_neg_kk[set][i] = c.neg_kk;
      s_kk_a[set][i] = c.kk_a;
      s_k[set][i] = c.k;
      s_r[set][i] = r;
      bonus_term = Rwkv7BonusTerm(r, c.k, r_k);
      // Value row i.
      v = args.v[o];
      if (!args.first_layer) v = Rwkv7ValueMix(v, args.v_first[o], args.v_raw[o]);
    }
    __syncthreads();  // the channels' vectors are written
    float y = 0.0f;
    if (active) {
      y = Rwkv7RowUpdate(kN > 0 ? kN : n, row, s_w[set], s_neg_kk[set], s_kk_a[set], s_k[set],
                         s_r[set], v);
    }
    float sum, bonus;
    TreeSum2<kCap>(y, bonus_term, s_y, s_bonus, p, i, &sum, &bonus);
    const float mean = Rwkv7GroupNormMean(sum, n);
    const float centred = active ? (y - mean) * (y - mean) : 0.0f;
    const float inv = Rwkv7GroupNormInv(TreeSum<kCap>(centred, s_centred, p, i), n, args.eps);
    if (active) args.y[o] = Rwkv7Output(y, mean, inv, ln_w, ln_b, bonus, v, args.g[o]);
  }

  // The state out, the same way back.
  StoreRows<kN, kCap>(args.state_out + state_at, s_tile, row, n, stride, vec, vec_tile, active, i,
                      p);
}

// The split path's phase 1 (T > 1, a scratch): block (b·T + t)·H + head, p = TreeWidth(N)
// threads, thread i < N doing key channel i and value row i of the token: the channel's
// Rwkv7PrepareChannel results, r and the mixed v into the scratch's vectors, and the
// head's bonus (thread 0) into its bonus, the sums TreeSum's as in Rwkv7WkvKernel.
__global__ void __launch_bounds__(kRwkv7WkvMaxN) Rwkv7WkvPrepareKernel(const Rwkv7WkvArgs args) {
  constexpr int kCap = static_cast<int>(kRwkv7WkvMaxN);
  const int n = static_cast<int>(args.N);
  const int p = TreeWidth(n);
  const int i = static_cast<int>(threadIdx.x);
  const bool active = i < n;
  const int64_t item = blockIdx.x;  // (b·T + t)·H + head
  const int64_t head = item % args.H, bt = item / args.H;
  const int64_t b = bt / args.T, t = bt % args.T;
  const int64_t at = head * n + i;
  const int64_t o = bt * (args.H * n) + at;
  __shared__ float s_kk[kCap], s_bonus[kCap];
  float k = 0.0f, kk_raw = 0.0f;
  if (active) {
    k = args.k[o];
    kk_raw = Rwkv7KkRaw(k, args.k_k[at]);
  }
  const float norm = Rwkv7KkNorm(TreeSum<kCap>(kk_raw * kk_raw, s_kk, p, i));
  float bonus_term = 0.0f;
  if (active) {
    const Rwkv7Channel c =
        Rwkv7PrepareChannel(args.w_raw[o], args.a_raw[o], kk_raw, norm, k, args.k_a[at]);
    const float r = args.r[o];
    float v = args.v[o];
    if (!args.first_layer) v = Rwkv7ValueMix(v, args.v_first[o], args.v_raw[o]);
    float* out = args.scratch + Rwkv7WkvScratchToken(b, head, t, args.H, args.T, n) + i;
    out[0] = c.w;
    out[n] = c.neg_kk;
    out[2 * n] = c.kk_a;
    out[3 * n] = c.k;
    out[4 * n] = r;
    out[5 * n] = v;
    bonus_term = Rwkv7BonusTerm(r, c.k, args.r_k[at]);
  }
  const float bonus = TreeSum<kCap>(bonus_term, s_bonus, p, i);
  if (i == 0) args.scratch[Rwkv7WkvScratchBonus(b, head, t, args.B, args.H, args.T, n)] = bonus;
}

// The recurrence kernel's blocks per SM: as kMinBlocks, but 4 for N = 64 (up to 255
// registers a thread; 128 spill): the split path has few (session, head) blocks (B·H),
// so the per-token chain's registers matter more than occupancy.
template <int kN>
constexpr int kRecurrenceMinBlocks = kN == 64 ? 4 : kMinBlocks<kN>;

// The split path's phase 2: Rwkv7WkvKernel's grid and state handling (block b·H + head,
// row i in thread i's registers, the same tile), the loop over the T tokens doing only
// Rwkv7RowUpdate: the tokens' vectors come from the scratch Rwkv7WkvChunkTokens(N) tokens
// at a time (coalesced into shared memory, the chunk's stage sharing the tile's memory;
// every thread then reads the same element: a broadcast), and the raw y_i = S_i·r of
// each token goes to args.y. vec: the state's global accesses may be float4s (as for
// Rwkv7WkvKernel); vec_scratch: the scratch's (N % 8 == 0, scratch 16-byte aligned).
template <int kN>
__global__ void __launch_bounds__(kN > 0 ? kN : kRwkv7WkvMaxN, kRecurrenceMinBlocks<kN>)
    Rwkv7WkvRecurrenceKernel(const Rwkv7WkvArgs args, bool vec, bool vec_scratch) {
  constexpr int kCap = kN > 0 ? kN : static_cast<int>(kRwkv7WkvMaxN);
  static_assert((kCap & (kCap - 1)) == 0, "kCap must be a power of two");
  static_assert(kN % 8 == 0, "compiled widths move their rows as float4s");
  constexpr int kStage = kCap < kRwkv7WkvStageRows ? kCap : kRwkv7WkvStageRows;
  constexpr int kStride = kCap + 4;  // ≥ Rwkv7WkvTileStride(n) for every n ≤ kCap
  // The most floats a chunk of tokens' vectors takes, over the widths n ≤ kCap.
  constexpr int kChunkFloats = kRwkv7WkvScratchFields * (kCap <= 64 ? 16 * kCap : 8 * kCap);
  constexpr int kBuffer = kStage * kStride > kChunkFloats ? kStage * kStride : kChunkFloats;
  const int n = kN > 0 ? kN : static_cast<int>(args.N);
  const int p = kN > 0 ? kN : TreeWidth(n);  // == blockDim.x
  const int stride = kN > 0 ? kN + 4 : Rwkv7WkvTileStride(n);
  const bool vec_tile = kN > 0 || n % 8 == 0;
  const int i = static_cast<int>(threadIdx.x);
  const bool active = kN > 0 || i < n;
  const int64_t item = blockIdx.x;  // b·H + head
  const int64_t b = item / args.H, head = item % args.H;
  const int64_t d = args.H * n;
  const int64_t at = head * n + i;
  const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
  const int64_t state_at = (state_row * args.H + head) * n * n;
  // The state's tile, then (between the state's load and store) the chunks' vectors.
  __shared__ __align__(16) float s_buffer[kBuffer];

  float row[kCap];
  LoadRows<kN, kCap>(args.state_in + state_at, s_buffer, row, n, stride, vec, vec_tile, active, i,
                     p);

  const int chunk = Rwkv7WkvChunkTokens(n);
  const int per_token = kRwkv7WkvScratchFields * n;  // floats
  const float* vectors = args.scratch + Rwkv7WkvScratchToken(b, head, 0, args.H, args.T, n);
  for (int64_t t0 = 0; t0 < args.T; t0 += chunk) {
    const int count = static_cast<int>(args.T - t0 < chunk ? args.T - t0 : chunk);
    const float* src = vectors + t0 * per_token;
    const int floats = count * per_token;
    __syncthreads();  // every thread is done with the tile, or with the last chunk
    if (vec_scratch) {
      const float4* src4 = reinterpret_cast<const float4*>(src);
      float4* dst4 = reinterpret_cast<float4*>(s_buffer);
#pragma unroll 4
      for (int q = i; q < floats / 4; q += p) dst4[q] = src4[q];
    } else {
      for (int e = i; e < floats; e += p) s_buffer[e] = src[e];
    }
    __syncthreads();  // the chunk is staged
    if (active) {
      float* y = args.y + (b * args.T + t0) * d + at;
      for (int tt = 0; tt < count; ++tt) {
        const float* s = s_buffer + tt * per_token;
        y[tt * d] = Rwkv7RowUpdate(kN > 0 ? kN : n, row, s, s + n, s + 2 * n, s + 3 * n, s + 4 * n,
                                   s[5 * n + i]);
      }
    }
  }

  StoreRows<kN, kCap>(args.state_out + state_at, s_buffer, row, n, stride, vec, vec_tile, active, i,
                      p);
}

// The split path's phase 3: block (b·T + t)·H + head, thread i < N: the GroupNorm of the
// head's raw y (args.y, from phase 2) and Rwkv7Output, in place in args.y, the sums
// TreeSum's as in Rwkv7WkvKernel; the bonus and the mixed v from the scratch.
__global__ void __launch_bounds__(kRwkv7WkvMaxN) Rwkv7WkvOutputKernel(const Rwkv7WkvArgs args) {
  constexpr int kCap = static_cast<int>(kRwkv7WkvMaxN);
  const int n = static_cast<int>(args.N);
  const int p = TreeWidth(n);
  const int i = static_cast<int>(threadIdx.x);
  const bool active = i < n;
  const int64_t item = blockIdx.x;  // (b·T + t)·H + head
  const int64_t head = item % args.H, bt = item / args.H;
  const int64_t b = bt / args.T, t = bt % args.T;
  const int64_t at = head * n + i;
  const int64_t o = bt * (args.H * n) + at;
  __shared__ float s_y[kCap], s_centred[kCap];
  const float y = active ? args.y[o] : 0.0f;
  const float mean = Rwkv7GroupNormMean(TreeSum<kCap>(y, s_y, p, i), n);
  const float centred = active ? (y - mean) * (y - mean) : 0.0f;
  const float inv = Rwkv7GroupNormInv(TreeSum<kCap>(centred, s_centred, p, i), n, args.eps);
  if (active) {
    const float bonus = args.scratch[Rwkv7WkvScratchBonus(b, head, t, args.B, args.H, args.T, n)];
    const float v = args.scratch[Rwkv7WkvScratchToken(b, head, t, args.H, args.T, n) + 5 * n + i];
    args.y[o] = Rwkv7Output(y, mean, inv, args.ln_w[at], args.ln_b[at], bonus, v, args.g[o]);
  }
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

template <int kN>
cudaError_t LaunchWidth(const Rwkv7WkvArgs& args, bool vec, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.H));
  const dim3 block(static_cast<unsigned>(Rwkv7WkvThreads(static_cast<int>(args.N))));
  if (!Rwkv7WkvSplit(args)) {
    Rwkv7WkvKernel<kN><<<grid, block, 0, stream>>>(args, vec);
    return cudaGetLastError();
  }
  const dim3 token_grid(static_cast<unsigned>(args.B * args.T * args.H));
  const bool vec_scratch = args.N % 8 == 0 && Aligned16(args.scratch);
  Rwkv7WkvPrepareKernel<<<token_grid, block, 0, stream>>>(args);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  Rwkv7WkvRecurrenceKernel<kN><<<grid, block, 0, stream>>>(args, vec, vec_scratch);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  Rwkv7WkvOutputKernel<<<token_grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchRwkv7Wkv(const Rwkv7WkvArgs& args, void* cuda_stream) {
  if (!Rwkv7WkvArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0 || args.T == 0 || args.H == 0) return cudaSuccess;
  const bool vec = args.N % 8 == 0 && Aligned16(args.state_in) && Aligned16(args.state_out);
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (args.N) {
    case 8:
      return LaunchWidth<8>(args, vec, stream);
    case 16:
      return LaunchWidth<16>(args, vec, stream);
    case 32:
      return LaunchWidth<32>(args, vec, stream);
    case 64:
      return LaunchWidth<64>(args, vec, stream);
    case 128:
      return LaunchWidth<128>(args, vec, stream);
    default:
      return LaunchWidth<0>(args, vec, stream);
  }
}

const char* Rwkv7WkvErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
