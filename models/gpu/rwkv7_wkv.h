// The fused CUDA kernel of RWKV-7's time-mix recurrence (rwkv7_wkv.cu): from the
// projections' raw outputs to the gated, GroupNormed output y, over T tokens of B
// sessions, the whole per-token part of models/architectures/rwkv7.cc's time mix in one
// launch (the bodies are rwkv7_rule.h's; rwkv7_wkv_host.h runs the same grid on the CPU).
// Torch-free and CUDA-free: the launcher takes the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

#include "models/gpu/rwkv7_rule.h"  // TreeWidth

namespace fwmodel::kernels {

// The widest head the kernel takes (one thread per row of the head's state).
constexpr int64_t kRwkv7WkvMaxN = 128;

// The state rows a block stages through shared memory at a time (rwkv7_wkv.cu): a head
// of N > 64 is loaded and stored in chunks of 64 rows, so the staging tile stays within
// the 48 KB of static shared memory.
constexpr int kRwkv7WkvStageRows = 64;

// The row stride, in floats, of the staging tile for a head of width n: n + 4 when n is a
// multiple of 8 (rows moved as float4; a stride of an odd number of float4s keeps the
// block's 128-bit accesses free of bank conflicts both ways), else n + 1 (scalar; an odd
// stride does the same for 32-bit accesses).
FW_HOST_DEVICE inline int Rwkv7WkvTileStride(int n) { return n % 8 == 0 ? n + 4 : n + 1; }

// Where float e of a staged chunk (whole rows of n floats in global memory, e = row·n +
// column) sits in the tile of row stride `stride`.
FW_HOST_DEVICE inline int Rwkv7WkvTileIndex(int e, int n, int stride) {
  const int row = e / n;
  return row * stride + (e - row * n);
}

// One layer's launch. Device pointers, float32, contiguous.
struct Rwkv7WkvArgs {
  int64_t B = 0;  // sessions (rows)
  int64_t T = 0;  // tokens per session, in order
  int64_t H = 0;  // heads
  int64_t N = 0;  // head width, 1..kRwkv7WkvMaxN; d = H·N
  // The projections, [B, T, d] each (token t of session b at (b·T + t)·d, head h's
  // channels at h·N): read only.
  const float* r = nullptr;      // receptance
  const float* w_raw = nullptr;  // w0 + tanh(x_w·w1ᵀ)·w2ᵀ, before sigmoid and exp
  const float* a_raw = nullptr;  // a0 + (x_a·a1ᵀ)·a2ᵀ, before sigmoid
  const float* k = nullptr;      // key, before k ⊙ (1 + (a − 1) ⊙ k_a)
  const float* v = nullptr;      // value, before the value residual's mix
  const float* v_raw = nullptr;  // v0 + (x_v·v1ᵀ)·v2ᵀ, before sigmoid; unread if first_layer
  const float* v_first = nullptr;  // block 0's v; unread if first_layer
  const float* g = nullptr;        // output gate
  // The layer's weights, [d] each (r_k [H, N]).
  const float* k_k = nullptr;
  const float* k_a = nullptr;
  const float* r_k = nullptr;
  const float* ln_w = nullptr;  // ln_x.weight
  const float* ln_b = nullptr;  // ln_x.bias
  // The state, [B, H, N (value channel i), N (key channel j)] (or, with rows, [any, H,
  // N, N]): read from state_in, the state after the T tokens written to state_out; the
  // two may be the same buffer (in place), and must not otherwise overlap.
  const float* state_in = nullptr;
  float* state_out = nullptr;
  // Optional, device, [B]: session b's state is row rows[b] of state_in and of state_out
  // (a row: H·N·N floats), so that the kernel runs on a state pool in place, without a
  // gather and a scatter. The caller guarantees every rows[b] is within both buffers and
  // the B rows are distinct (two sessions on one row would race); rows not named are
  // neither read nor written. Null: session b's state is row b.
  const int64_t* rows = nullptr;
  float* y = nullptr;        // out, [B, T, d]: (GroupNorm(S·r) + (r·(k ⊙ r_k)) v) ⊙ g
  float eps = 0;             // the GroupNorm's: d_head · norm_eps
  bool first_layer = false;  // block 0: no value residual mix
  // Optional, device, at least Rwkv7WkvScratchFloats(B, T, H, N) floats, not overlapping
  // any other buffer (16-byte aligned for the float4 path): with T > 1, the launch runs
  // the split-phase path (per-token vectors computed in parallel over tokens into the
  // scratch, the sequential recurrence, then the GroupNorm and output in parallel); its
  // contents before and after are unspecified. Null, or T = 1: the single kernel.
  float* scratch = nullptr;
};

// The split path's scratch, per (session b, head, token t): kRwkv7WkvScratchFields
// vectors of N floats (w, −kk, kk·a, the adjusted k, r, the mixed v: rwkv7_rule.h's
// Rwkv7PrepareChannel results, the receptance, Rwkv7ValueMix's), contiguous over the
// tokens of one (session, head): [B, H, T, 6, N]; then one bonus (r·(k ⊙ r_k)) per (b,
// head, t): [B, H, T] after the B·H·T·6·N vector floats.
constexpr int kRwkv7WkvScratchFields = 6;

// The floats the split path's scratch needs for (B, T, H, N) (0 if any is < 1).
FW_HOST_DEVICE inline int64_t Rwkv7WkvScratchFloats(int64_t B, int64_t T, int64_t H, int64_t N) {
  if (B < 1 || T < 1 || H < 1 || N < 1) return 0;
  return B * H * T * (kRwkv7WkvScratchFields * N + 1);
}

// Where token t of session b, head `head` starts in the scratch (its 6 vectors of n).
FW_HOST_DEVICE inline int64_t Rwkv7WkvScratchToken(int64_t b, int64_t head, int64_t t, int64_t H,
                                                   int64_t T, int64_t n) {
  return ((b * H + head) * T + t) * (kRwkv7WkvScratchFields * n);
}

// Where the bonus of token t of session b, head `head` sits in the scratch.
FW_HOST_DEVICE inline int64_t Rwkv7WkvScratchBonus(int64_t b, int64_t head, int64_t t, int64_t B,
                                                   int64_t H, int64_t T, int64_t n) {
  return B * H * T * (kRwkv7WkvScratchFields * n) + (b * H + head) * T + t;
}

// The tokens whose vectors the recurrence stages through shared memory between one pair of
// barriers, for a head of width n (the stage, ≤ 6,144 floats, shares the state's tile).
FW_HOST_DEVICE inline int Rwkv7WkvChunkTokens(int n) { return n > 64 ? 8 : 16; }

// Whether the launch takes the split-phase path.
FW_HOST_DEVICE inline bool Rwkv7WkvSplit(const Rwkv7WkvArgs& args) {
  return args.scratch != nullptr && args.T > 1;
}

// The threads of a block for a head of width n: the power of two ≥ n (the reductions'
// width); threads n.. only pad the reductions with zeros.
FW_HOST_DEVICE inline int Rwkv7WkvThreads(int n) { return TreeWidth(n); }

// The checks LaunchRwkv7Wkv makes before launching (shared with the CPU mirror): true when
// the arguments are acceptable. With B, T or H = 0 (nothing to do) no pointer is needed.
inline bool Rwkv7WkvArgsValid(const Rwkv7WkvArgs& args) {
  if (args.B < 0 || args.T < 0 || args.H < 0 || args.N < 1 || args.N > kRwkv7WkvMaxN) {
    return false;
  }
  if (args.B == 0 || args.T == 0 || args.H == 0) return true;
  if (args.B > INT32_MAX / args.H) return false;  // grid.x = B·H
  // The split path's per-token phases: grid.x = B·T·H.
  if (Rwkv7WkvSplit(args) &&
      (args.T > INT32_MAX / args.H || args.B > INT32_MAX / (args.T * args.H))) {
    return false;
  }
  const void* needed[] = {args.r,    args.w_raw,    args.a_raw,     args.k,   args.v,
                          args.g,    args.k_k,      args.k_a,       args.r_k, args.ln_w,
                          args.ln_b, args.state_in, args.state_out, args.y};
  for (const void* pointer : needed) {
    if (pointer == nullptr) return false;
  }
  return args.first_layer || (args.v_raw != nullptr && args.v_first != nullptr);
}

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per (session, head), Rwkv7WkvThreads(N) threads; nothing to do when B, T or H
// is 0. With a scratch and T > 1 (Rwkv7WkvSplit), three kernels in order on the stream
// instead: the per-token vectors (a block per (session, token, head)), the recurrence (a
// block per (session, head), writing the raw y_i = S_i·r to args.y), the GroupNorm and
// output in place in args.y (a block per (session, token, head)). Returns 0 (cudaSuccess)
// or the cudaError_t of a bad argument (cudaErrorInvalidValue: Rwkv7WkvArgsValid false) or
// of a launch (cudaGetLastError). Asynchronous: errors of the kernels' execution surface
// later. Safe to call during CUDA Graph capture (no allocation, no synchronisation, no
// attribute set: static shared memory only, at most 41 KB a block).
int LaunchRwkv7Wkv(const Rwkv7WkvArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchRwkv7Wkv result.
const char* Rwkv7WkvErrorString(int error);

}  // namespace fwmodel::kernels
