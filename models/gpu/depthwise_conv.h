// The fused causal depthwise convolution (depthwise_conv.cu) of the contract's mixer
// inputs (Primer-EZ, ../shared/spec/models.md "Causal depthwise convolution"; in LibTorch
// model.cc's CausalDepthwiseConv, one cat, K multiplies and K adds per projection): the
// three projections q|r, k, v of B sessions over T tokens, each through its own kernel of
// K taps, with the conv state (the last K − 1 inputs) read and advanced, in one launch.
// Per (session b, projection p, channel c) and token t, with x' the K − 1 inputs before
// x_t (the state's, then the tokens'):
//   y_t = bias_c + w_c,0 · x'_0 + ... + w_c,K−2 · x'_{K−2} + w_c,K−1 · x_t
// summed in that order (DepthwiseConvToken); afterwards the state holds the last K − 1
// inputs. The body is depthwise_conv_rule.h's; depthwise_conv_host.h runs the same grid on
// the CPU. Torch-free and CUDA-free: the launcher takes the stream as a `cudaStream_t` in a
// void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The block's threads, and the widest kernel (taps) a launch takes.
constexpr int kDepthwiseConvThreads = 256;
constexpr int kDepthwiseConvMaxTaps = 8;

// One launch. Device pointers, float32.
struct DepthwiseConvArgs {
  int64_t B = 0;  // sessions
  int64_t T = 0;  // tokens per session, in order
  int64_t d = 0;  // channels, ≥ 1
  int K = 0;      // taps, 2..kDepthwiseConvMaxTaps
  // Projection p's input [B, T, d] (token t of session b at (b·T + t)·d + c) and output,
  // which may be the input itself (in place: a thread reads x_t before writing y_t, and
  // later tokens' inputs are its own); three pointers each, p = 0, 1, 2.
  const float* x[3] = {nullptr, nullptr, nullptr};
  float* y[3] = {nullptr, nullptr, nullptr};
  const float* weight[3] = {nullptr, nullptr, nullptr};  // [d, K] each, row-major
  const float* bias[3] = {nullptr, nullptr, nullptr};    // [d] each
  // The conv state [B, 3, K − 1, d] (input j of projection p of session b, channel c at
  // ((b·3 + p)·(K − 1) + j)·d + c; j = K − 2 the latest): read from state_in, written to
  // state_out after the T tokens; the two may be the same buffer (in place), and must not
  // otherwise overlap.
  const float* state_in = nullptr;
  float* state_out = nullptr;
};

// The checks LaunchDepthwiseConv makes (shared with the CPU mirror): true when acceptable.
inline bool DepthwiseConvArgsValid(const DepthwiseConvArgs& args) {
  if (args.B < 0 || args.T < 0 || args.d < 1 || args.K < 2 || args.K > kDepthwiseConvMaxTaps) {
    return false;
  }
  if (args.B == 0) return true;
  if (args.B > INT32_MAX / (3 * args.d) * int64_t{kDepthwiseConvThreads}) return false;
  if (args.state_in == nullptr || args.state_out == nullptr) return false;
  for (int p = 0; p < 3; ++p) {
    if (args.weight[p] == nullptr || args.bias[p] == nullptr) return false;
    if (args.T > 0 && (args.x[p] == nullptr || args.y[p] == nullptr)) return false;
  }
  return true;
}

// Launches on `cuda_stream` (a cudaStream_t; null: the legacy default stream): one thread
// per (session, projection, channel), blocks of kDepthwiseConvThreads. Returns 0
// (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue:
// DepthwiseConvArgsValid false) or of the launch. Asynchronous; no allocation, no
// synchronisation: safe during CUDA Graph capture.
int LaunchDepthwiseConv(const DepthwiseConvArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchDepthwiseConv result.
const char* DepthwiseConvErrorString(int error);

}  // namespace fwmodel::kernels
