// The fused CUDA kernel of DeltaNet's and Gated DeltaNet's delta rule (delta_rule_cuda.cu):
// from the activated, normalised q and k, v, β and the decay to the output RMSNorm's
// (gated) result, over T tokens of B sessions: the loop over T of
// models/architectures/delta_net.cc and its o_norm and gate, in one launch (the bodies are
// delta_rule_column.h's; delta_rule_cuda_host.h runs the same grid on the CPU).
// Torch-free and CUDA-free: the launcher takes the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The widest q/k head (K, the length of each thread's column of the state, kept in
// registers) and value head (V, one thread per value channel) the kernel takes.
constexpr int64_t kDeltaRuleMaxK = 128;
constexpr int64_t kDeltaRuleMaxV = 256;  // a power of two (the norm's reduction width)

// One layer's launch. Device pointers, float32, contiguous.
struct DeltaRuleArgs {
  int64_t B = 0;   // sessions (rows)
  int64_t T = 0;   // tokens per session, in order (0: the state is copied, nothing else)
  int64_t H = 0;   // q/k heads, ≥ 1 and dividing HV
  int64_t HV = 0;  // value heads; value head hv reads q/k head hv / (HV / H)
  int64_t K = 0;   // q/k head width, 1..kDeltaRuleMaxK
  int64_t V = 0;   // value head width, 1..kDeltaRuleMaxV
  // Read only. Token t of session b is row b·T + t.
  const float* q = nullptr;      // [B, T, H, K]: activated, normalised, scaled by K^(−1/2)
  const float* k = nullptr;      // [B, T, H, K]: activated, normalised
  const float* v = nullptr;      // [B, T, HV, V]: silu(conv_v(x·Wvᵀ))
  const float* beta = nullptr;   // [B, T, HV]: β (×2 with allow_neg_eigval; ones without b_proj)
  const float* decay = nullptr;  // [B, T, HV]: exp(g) (gated_deltanet); null: 1
  const float* gate = nullptr;   // [B, T, HV, V]: g_proj's output before silu; null: no gate
  const float* norm_weight = nullptr;  // [V]: attn.o_norm.weight
  // The state, [B, HV, K (key channel i), V (value channel j)] (or, with rows, [any, HV,
  // K, V]): read from state_in, the state after the T tokens written to state_out; the
  // two may be the same buffer (in place), and must not otherwise overlap.
  const float* state_in = nullptr;
  float* state_out = nullptr;
  // Optional, device, [B]: session b's state is row rows[b] of state_in and of state_out
  // (a row: HV·K·V floats), so that the kernel runs on a state pool in place. The caller
  // guarantees every rows[b] is within both buffers and the B rows are distinct; rows
  // not named are neither read nor written. Null: session b's state is row b.
  const int64_t* rows = nullptr;
  float* o = nullptr;  // out, [B, T, HV, V]: RMSNorm(Sᵀq; o_norm) [⊙ silu(gate)]
  float eps = 0;       // the output RMSNorm's (norm_eps)
};

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per (session, value head), TreeWidth(V) threads (the power of two ≥ V);
// nothing to do when B or HV is 0.
// Returns 0 (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue: K
// or V out of range, a negative size, H not dividing HV, or a null pointer the launch
// needs) or of the launch (cudaGetLastError). Asynchronous: errors of the kernel's
// execution surface later. Safe to call during CUDA Graph capture (no allocation, no
// synchronisation).
int LaunchDeltaRule(const DeltaRuleArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchDeltaRule result.
const char* DeltaRuleErrorString(int error);

// The checks LaunchDeltaRule makes before launching (shared with the CPU mirror): true
// when the arguments are acceptable. With T = 0 only the state's pointers (and the norm
// weight) are needed; with B = 0 or HV = 0, none.
inline bool DeltaRuleArgsValid(const DeltaRuleArgs& args) {
  if (args.B < 0 || args.T < 0 || args.H < 1 || args.HV < 0 || args.HV % args.H != 0) {
    return false;
  }
  if (args.K < 1 || args.K > kDeltaRuleMaxK || args.V < 1 || args.V > kDeltaRuleMaxV) {
    return false;
  }
  if (args.B * args.HV > INT32_MAX) return false;  // grid.x
  if (args.B == 0 || args.HV == 0) return true;    // nothing to launch
  if (args.norm_weight == nullptr || args.state_in == nullptr || args.state_out == nullptr) {
    return false;
  }
  if (args.T == 0) return true;  // the tokens' pointers are not read
  const void* per_token[] = {args.q, args.k, args.v, args.beta, args.o};
  for (const void* pointer : per_token) {
    if (pointer == nullptr) return false;
  }
  return true;
}

}  // namespace fwmodel::kernels
