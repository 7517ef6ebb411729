// The fused CUDA kernel of the `linear_attention` mixer's recurrence
// (linear_attention.cu): from the raw projections q, k, v to y = (φ(q)ᵀ S) / (φ(q)ᵀ z +
// attn_eps) and the new state (S, z), over T tokens of B sessions in one launch:
// models/architectures/linear_attention.cc's Step (T = 1, decode) and Forward (T > 1,
// prefill) on CUDA (the bodies are linear_attention_rule.h's; linear_attention_host.h
// runs the same grid on the CPU). Torch-free and CUDA-free: the launcher takes the stream
// as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The widest head the kernel takes (one thread per value channel j, keeping column j of
// the head's state, N floats, in registers).
constexpr int64_t kLinearAttentionMaxN = 128;

// One layer's launch. Device pointers, float32, contiguous.
struct LinearAttentionArgs {
  int64_t B = 0;  // sessions (rows)
  int64_t T = 0;  // tokens per session, in order (0: the state is copied, nothing else)
  int64_t H = 0;  // heads
  int64_t N = 0;  // head width d_head, 1..kLinearAttentionMaxN; d = H·N
  // The projections, [B, T, d] each, before φ (token t of session b, head h's channel i
  // at (b·T + t)·d + h·N + i): read only.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  // The state: S [B, H, N (key channel i), N (value channel j)] and z [B, H, N] (or,
  // with rows, [any, H, N, N] and [any, H, N]): read from *_in, the state after the T
  // tokens written to *_out; each pair may be the same buffer (in place), and must not
  // otherwise overlap.
  const float* S_in = nullptr;
  float* S_out = nullptr;
  const float* z_in = nullptr;
  float* z_out = nullptr;
  // Optional, device, [B]: session b's state is row rows[b] of the S and z buffers (a row:
  // H·N·N and H·N floats), so that the kernel runs on a state pool in place, without a
  // gather and a scatter. The caller guarantees every rows[b] is within the buffers and
  // the B rows are distinct (two sessions on one row would race); rows not named are
  // neither read nor written. Null: session b's state is row b.
  const int64_t* rows = nullptr;
  float* y = nullptr;  // out, [B, T, d]: (φ(q)ᵀ S) / (φ(q)ᵀ z + eps) per head
  float eps = 0;       // attn_eps
};

// The threads of a block for a head of width n: n rounded up to whole warps (threads
// n.. idle).
inline int LinearAttentionThreads(int64_t n) { return static_cast<int>((n + 31) / 32 * 32); }

// The checks LaunchLinearAttention makes before launching (shared with the CPU mirror):
// true when the arguments are acceptable. With B = 0 or H = 0 no pointer is needed; with
// T = 0 only the state's.
inline bool LinearAttentionArgsValid(const LinearAttentionArgs& args) {
  if (args.B < 0 || args.T < 0 || args.H < 0 || args.N < 1 || args.N > kLinearAttentionMaxN) {
    return false;
  }
  if (args.B == 0 || args.H == 0) return true;    // nothing to launch
  if (args.B > INT32_MAX / args.H) return false;  // grid.x = B·H
  const void* state[] = {args.S_in, args.S_out, args.z_in, args.z_out};
  for (const void* pointer : state) {
    if (pointer == nullptr) return false;
  }
  if (args.T == 0) return true;  // the tokens' pointers are not read
  const void* per_token[] = {args.q, args.k, args.v, args.y};
  for (const void* pointer : per_token) {
    if (pointer == nullptr) return false;
  }
  return true;
}

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per (session, head), LinearAttentionThreads(N) threads; nothing to do when B
// or H is 0. Returns 0 (cudaSuccess) or the cudaError_t of a bad argument
// (cudaErrorInvalidValue: LinearAttentionArgsValid false) or of the launch
// (cudaGetLastError). Asynchronous: errors of the kernel's execution surface later. Safe
// to call during CUDA Graph capture (no allocation, no synchronisation, static shared
// memory only: 3 KB a block).
int LaunchLinearAttention(const LinearAttentionArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchLinearAttention result.
const char* LinearAttentionErrorString(int error);

}  // namespace fwmodel::kernels
