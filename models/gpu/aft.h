// The fused CUDA kernel of the `aft` mixer's recurrence (aft.cu): from the projections
// r (raw), k, v to y = sigmoid(r) ⊙ wkv and the new state, over T tokens of B sessions in
// one launch: models/architectures/aft.cc's Step (T = 1, decode) and Forward (T > 1,
// prefill) on CUDA (the body is aft_rule.h's; aft_host.h runs the same grid on the CPU).
// Torch-free and CUDA-free: the launcher takes the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The threads of a block (aft.cu): one thread per (session, channel), blocks over the
// B·d pairs in order.
constexpr int kAftThreads = 256;

// One layer's launch. Device pointers, float32, contiguous.
struct AftArgs {
  int64_t B = 0;  // sessions (rows)
  int64_t T = 0;  // tokens per session, in order (0: the state is copied, nothing else)
  int64_t d = 0;  // channels (d_model), ≥ 1
  // The projections, [B, T, d] each (token t of session b, channel c at (b·T + t)·d + c):
  // read only.
  const float* r = nullptr;  // receptance, before its sigmoid
  const float* k = nullptr;
  const float* v = nullptr;
  // The layer's weights, [d] each.
  const float* decay = nullptr;       // w = exp(mixer.time_decay) > 0
  const float* time_first = nullptr;  // u = mixer.time_first
  // The state, [B, 3, d] (alpha, beta, p of channel c at (row·3 + {0, 1, 2})·d + c; or,
  // with rows, [any, 3, d]): read from state_in, the state after the T tokens written to
  // state_out; the two may be the same buffer (in place), and must not otherwise overlap.
  const float* state_in = nullptr;
  float* state_out = nullptr;
  // Optional, device, [B]: session b's state is row rows[b] of state_in and of state_out
  // (a row: 3·d floats), so that the kernel runs on a state pool in place, without a
  // gather and a scatter. The caller guarantees every rows[b] is within both buffers and
  // the B rows are distinct (two sessions on one row would race); rows not named are
  // neither read nor written. Null: session b's state is row b.
  const int64_t* rows = nullptr;
  float* y = nullptr;  // out, [B, T, d]: sigmoid(r) ⊙ wkv
};

// The checks LaunchAft makes before launching (shared with the CPU mirror): true when the
// arguments are acceptable. With B = 0 no pointer is needed; with T = 0 only the state's
// and the weights'.
inline bool AftArgsValid(const AftArgs& args) {
  if (args.B < 0 || args.T < 0 || args.d < 1) return false;
  if (args.B == 0) return true;  // nothing to launch
  // grid.x = ⌈B·d / kAftThreads⌉ ≤ 2^31 − 1 blocks (so B·d does not overflow either).
  if (args.B > INT32_MAX / args.d * int64_t{kAftThreads}) return false;
  const void* needed[] = {args.decay, args.time_first, args.state_in, args.state_out};
  for (const void* pointer : needed) {
    if (pointer == nullptr) return false;
  }
  if (args.T == 0) return true;  // the tokens' pointers are not read
  const void* per_token[] = {args.r, args.k, args.v, args.y};
  for (const void* pointer : per_token) {
    if (pointer == nullptr) return false;
  }
  return true;
}

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// ⌈B·d / kAftThreads⌉ blocks of kAftThreads threads; nothing to do when B is 0. Returns 0
// (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue: AftArgsValid
// false) or of the launch (cudaGetLastError). Asynchronous: errors of the kernel's
// execution surface later. Safe to call during CUDA Graph capture (no allocation, no
// synchronisation, no shared memory).
int LaunchAft(const AftArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchAft result.
const char* AftErrorString(int error);

}  // namespace fwmodel::kernels
