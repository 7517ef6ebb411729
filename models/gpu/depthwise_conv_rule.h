// The per-(session, projection, channel) body of the fused causal depthwise convolution
// (depthwise_conv.h has the math): a plain function, `__host__ __device__` under nvcc, so
// the CUDA kernel (depthwise_conv.cu) and its CPU mirror (depthwise_conv_host.h) compute
// the same values. Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/depthwise_conv.h"
#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// One channel's token: y = bias + Σ_j w[j] · window[j] (j < K − 1, the K − 1 inputs
// before x, oldest first) + w[K − 1] · x, summed in that order as CausalDepthwiseConv's
// `y = y + w_j · x_j`; then the window shifts by one (x becomes its newest input).
FW_HOST_DEVICE inline float DepthwiseConvToken(float* window, float x, const float* w, float bias,
                                               int K) {
  // (Inlined into DepthwiseConvRun<kK>: with K known there the loops unroll.)
  float y = bias;
  for (int j = 0; j < K - 1; ++j) y = y + w[j] * window[j];
  y = y + w[K - 1] * x;
  for (int j = 0; j + 1 < K - 1; ++j) window[j] = window[j + 1];
  window[K - 2] = x;
  return y;
}

// The grid's item `item` (of B·3·d): session b, projection p, channel c.
FW_HOST_DEVICE inline void DepthwiseConvItem(int64_t item, int64_t d, int64_t* b, int* p,
                                             int64_t* c) {
  const int64_t bp = item / d;
  *c = item - bp * d;
  *b = bp / 3;
  *p = static_cast<int>(bp - *b * 3);
}

// a[p] for p in 0..2 without indexing the array by a run-time value (a kernel's
// by-value argument array indexed so would be copied to local memory).
template <typename Pointer>
FW_HOST_DEVICE inline Pointer DepthwiseConvPick(Pointer const (&a)[3], int p) {
  return p == 0 ? a[0] : (p == 1 ? a[1] : a[2]);
}

// The work of item `item` over the T tokens: the thread's channel, its taps and its
// K − 1 window from the state, the tokens in order, the state out. kK: the taps, known
// at compile time (the loops unroll and the window stays in registers), or 0: args.K.
template <int kK>
FW_HOST_DEVICE inline void DepthwiseConvRun(const DepthwiseConvArgs& args, int64_t item) {
  int64_t b, c;
  int p;
  DepthwiseConvItem(item, args.d, &b, &p, &c);
  const int K = kK > 0 ? kK : args.K;
  constexpr int kCap = kK > 0 ? kK : kDepthwiseConvMaxTaps;
  const int64_t d = args.d;
  const float* x = DepthwiseConvPick(args.x, p);
  float* y = DepthwiseConvPick(args.y, p);
  const float* weight = DepthwiseConvPick(args.weight, p);
  float w[kCap];
  float window[kCap - 1];
  for (int j = 0; j < K; ++j) w[j] = weight[c * K + j];
  const int64_t state_at = (b * 3 + p) * (K - 1) * d + c;
  for (int j = 0; j < K - 1; ++j) window[j] = args.state_in[state_at + j * d];
  const float bias = DepthwiseConvPick(args.bias, p)[c];
  for (int64_t t = 0; t < args.T; ++t) {
    const int64_t o = (b * args.T + t) * d + c;
    y[o] = DepthwiseConvToken(window, x[o], w, bias, K);
  }
  for (int j = 0; j < K - 1; ++j) args.state_out[state_at + j * d] = window[j];
}

}  // namespace fwmodel::kernels
