// The fused CUDA kernels of RWKV-7's block inputs (rwkv7_mix.cu), around the time-mix
// recurrence (rwkv7_wkv.h) in models/architectures/rwkv7.cc:
// - LaunchRwkv7ShiftMix: x = LayerNorm(h), the token shift (x' = the previous token's x,
//   the shift state's for the call's first token), the new shift state (the last token's
//   x) and `count` interpolations x + (x' − x) ⊙ mix_p into one [count, B, T, d] buffer.
//   The time mix runs it with its 6 mixes (r, w, k, v, a, g) and ln1, the channel mix
//   with its one (x_k) and ln2.
// - LaunchSquaredRelu: relu(z)² elementwise (the channel mix's key activation).
// The bodies are rwkv7_mix_rule.h's; rwkv7_mix_host.h runs the same grids on the CPU.
// Torch-free and CUDA-free: the launchers take the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The most interpolations one launch writes.
constexpr int kRwkv7MixMaxCount = 6;
// The widest block (threads) of the shift-mix kernel; wider rows loop.
constexpr int kRwkv7MixMaxThreads = 256;

// One launch of the shift-mix kernel. Device pointers, float32, contiguous.
struct Rwkv7ShiftMixArgs {
  int64_t B = 0;                // sessions (rows)
  int64_t T = 0;                // tokens per session, in order
  int64_t d = 0;                // channels
  const float* h = nullptr;     // in, [B, T, d] (token t of session b at (b·T + t)·d)
  const float* ln_w = nullptr;  // the LayerNorm's weight, [d]
  const float* ln_b = nullptr;  // the LayerNorm's bias, [d]
  float eps = 0;                // the LayerNorm's
  // The shift state, [B, d]: x of the token before the call's first, read from
  // shift_in; the call's last token's x written to shift_out. Must not overlap (block
  // (b, T − 1) writes what block (b, 0) reads).
  const float* shift_in = nullptr;
  float* shift_out = nullptr;
  int count = 0;                             // 1 or 6: the interpolations
  const float* mix[kRwkv7MixMaxCount] = {};  // mix_p, [d] each, p < count
  float* out = nullptr;  // [count, B, T, d]: x + (x' − x) ⊙ mix_p at p·B·T·d
};

// Launches the shift-mix kernel on `cuda_stream` (a cudaStream_t; null: the legacy default
// stream): one block per (session, token), Rwkv7MixThreads(d) threads; nothing to do
// when B is 0 (T must be ≥ 1: the new shift state is the last token's). Returns 0
// (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue: count not 1
// or 6, T < 1, d < 1, a negative B, a null pointer the launch needs) or of the launch
// (cudaGetLastError). Asynchronous; no allocation, no synchronisation: safe during CUDA
// Graph capture.
int LaunchRwkv7ShiftMix(const Rwkv7ShiftMixArgs& args, void* cuda_stream);

// out[i] = relu(in[i])² for i < n, on `cuda_stream`; in and out may be the same buffer
// (in place), and must not otherwise overlap. Returns as LaunchRwkv7ShiftMix (n < 0 or a
// null pointer with n > 0: cudaErrorInvalidValue; n = 0: nothing to do).
int LaunchSquaredRelu(const float* in, float* out, int64_t n, void* cuda_stream);

// cudaGetErrorString of a LaunchRwkv7ShiftMix or LaunchSquaredRelu result.
const char* Rwkv7MixErrorString(int error);

}  // namespace fwmodel::kernels
