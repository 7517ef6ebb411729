// The fused CUDA kernel of the `fast_weight` mixer's recurrence (fast_weight.cu): from the
// raw projections q, k, v and the write strength's logit to y and the new fast weight W,
// over T tokens of B sessions in one launch: models/architectures/fast_weight.cc's Step
// (T = 1, decode) and Forward (T > 1, prefill) on CUDA (the bodies are
// fast_weight_rule.h's; fast_weight_host.h runs the same grid on the CPU). Per head of
// width n, d_phi = 2·ν·n, and per token:
//   φ(z) = DPFP_ν(z) / (Σ DPFP_ν(z) + attn_eps)        (../shared/spec/models.md)
//   v̄ = W φ(k);  δ = β (v − v̄);  W ← W + δ φ(k)ᵀ;  y = W φ(q) = (W_old φ(q)) + δ (φ(k)·φ(q))
// with β = sigmoid(beta_logit). Torch-free and CUDA-free: the launcher takes the stream
// as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The widest head the kernel takes, and the most features a head may have (d_phi = 2·ν·n:
// one thread per feature, a block of at most 1024 threads).
constexpr int64_t kFastWeightMaxN = 128;
constexpr int64_t kFastWeightMaxPhi = 1024;

// One layer's launch. Device pointers, float32, contiguous.
struct FastWeightArgs {
  int64_t B = 0;   // sessions (rows)
  int64_t T = 0;   // tokens per session, in order (0: the state is copied, nothing else)
  int64_t H = 0;   // heads
  int64_t N = 0;   // head width d_head, 1..kFastWeightMaxN; d = H·N
  int64_t nu = 0;  // ν of DPFP, ≥ 1, with 2·ν·N ≤ kFastWeightMaxPhi
  // The projections, [B, T, d] each (token t of session b, head h's channel i at
  // (b·T + t)·d + h·N + i), before DPFP: read only.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  // The write strength's logit a·betaᵀ, [B, T, H], before the sigmoid: read only.
  const float* beta = nullptr;
  // The fast weights W [B, H, N (value channel i), d_phi (feature j)] (or, with rows,
  // [any, H, N, d_phi]): read from W_in, the state after the T tokens written to W_out;
  // the two may be the same buffer (in place), and must not otherwise overlap.
  const float* W_in = nullptr;
  float* W_out = nullptr;
  // Optional, device, [B]: session b's state is row rows[b] of the W buffers (a row:
  // H·N·d_phi floats), so that the kernel runs on a state pool in place, without a gather
  // and a scatter. The caller guarantees every rows[b] is within the buffers and the B
  // rows are distinct (two sessions on one row would race); rows not named are neither
  // read nor written. Null: session b's state is row b.
  const int64_t* rows = nullptr;
  float* y = nullptr;  // out, [B, T, d]: W_t φ(q_t) per head
  float eps = 0;       // attn_eps
};

// The features of a head: d_phi = 2·ν·N.
inline int64_t FastWeightPhi(int64_t n, int64_t nu) { return 2 * nu * n; }

// The threads of a block: one per feature (thread t = c·N + i owns row i's features
// c·N .. c·N + N − 1 of W), rounded up to whole warps (threads d_phi.. idle).
inline int FastWeightThreads(int64_t n, int64_t nu) {
  return static_cast<int>((FastWeightPhi(n, nu) + 31) / 32 * 32);
}

// The checks LaunchFastWeight makes before launching (shared with the CPU mirror): true
// when the arguments are acceptable. With B = 0 or H = 0 no pointer is needed; with T = 0
// only the state's.
inline bool FastWeightArgsValid(const FastWeightArgs& args) {
  if (args.B < 0 || args.T < 0 || args.H < 0 || args.N < 1 || args.N > kFastWeightMaxN ||
      args.nu < 1 || args.nu > kFastWeightMaxPhi / (2 * args.N)) {
    return false;
  }
  if (args.B == 0 || args.H == 0) return true;    // nothing to launch
  if (args.B > INT32_MAX / args.H) return false;  // grid.x = B·H
  if (args.W_in == nullptr || args.W_out == nullptr) return false;
  if (args.T == 0) return true;  // the tokens' pointers are not read
  const void* per_token[] = {args.q, args.k, args.v, args.beta, args.y};
  for (const void* pointer : per_token) {
    if (pointer == nullptr) return false;
  }
  return true;
}

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per (session, head), FastWeightThreads(N, nu) threads; nothing to do when B
// or H is 0. Returns 0 (cudaSuccess) or the cudaError_t of a bad argument
// (cudaErrorInvalidValue: FastWeightArgsValid false) or of the launch (cudaGetLastError).
// Asynchronous: errors of the kernel's execution surface later. Safe to call during CUDA
// Graph capture (no allocation, no synchronisation, static shared memory only: about
// 25 KB a block).
int LaunchFastWeight(const FastWeightArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchFastWeight result.
const char* FastWeightErrorString(int error);

}  // namespace fwmodel::kernels
