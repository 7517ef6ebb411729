// The fused CUDA kernel of RWKV-7's time-mix recurrence (rwkv7_wkv.cu): from the
// projections' raw outputs to the gated, GroupNormed output y, over T tokens of B
// sessions, the whole per-token part of models/architectures/rwkv7.cc's time mix in one
// launch (the bodies are rwkv7_rule.h's; rwkv7_wkv_host.h runs the same grid on the CPU).
// Torch-free and CUDA-free: the launcher takes the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The widest head the kernel takes (one thread per row of the head's state).
constexpr int64_t kRwkv7WkvMaxN = 128;

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
  // The state, [B, H, N (value channel i), N (key channel j)]: read from state_in,
  // the state after the T tokens written to state_out; the two may be the same buffer
  // (in place), and must not otherwise overlap.
  const float* state_in = nullptr;
  float* state_out = nullptr;
  float* y = nullptr;        // out, [B, T, d]: (GroupNorm(S·r) + (r·(k ⊙ r_k)) v) ⊙ g
  float eps = 0;             // the GroupNorm's: d_head · norm_eps
  bool first_layer = false;  // block 0: no value residual mix
};

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per (session, head), N threads; nothing to do when B, T or H is 0. Returns
// 0 (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue: N outside
// 1..kRwkv7WkvMaxN, a negative size, or a null pointer the launch needs) or of the launch
// (cudaGetLastError). Asynchronous: errors of the kernel's execution surface later. Safe
// to call during CUDA Graph capture (no allocation, no synchronisation).
int LaunchRwkv7Wkv(const Rwkv7WkvArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchRwkv7Wkv result.
const char* Rwkv7WkvErrorString(int error);

}  // namespace fwmodel::kernels
