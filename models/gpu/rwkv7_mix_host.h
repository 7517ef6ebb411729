// LaunchRwkv7ShiftMix's and LaunchSquaredRelu's grids (rwkv7_mix.cu) run on the CPU with
// host pointers: the CPU test of the launches' indexing, phases and reductions
// (tests/unit/gpu_bodies_test.cc, GpuBodiesShiftMixTest), since the kernels themselves
// only run on a GPU machine. Blocks (session, token) one after another; in each, the
// kernel's phases between two barriers in order, every thread's work of a phase in turn
// (thread i: channels i, i + p, ...), with the kernel's per-thread partial sums and
// halving reductions in its order and rwkv7_mix_rule.h's bodies, so the arithmetic per
// element is the kernel's (up to the compilers' contraction into fused multiply-adds).
// Not a fast path. Torch-free, header-only.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

#include "models/gpu/rwkv7_mix.h"
#include "models/gpu/rwkv7_mix_rule.h"

namespace fwmodel::kernels {

// rwkv7_mix.cu's MixBlockSum2 for one buffer: buf[i] += buf[i + s] for s = p/2, ..., 1
// over the p partial sums (p a power of two); returns buf[0].
inline float HostMixHalvingSum(std::vector<float>& buf, int p) {
  for (int s = p / 2; s > 0; s /= 2) {
    for (int i = 0; i < s; ++i) buf[static_cast<size_t>(i)] += buf[static_cast<size_t>(i + s)];
  }
  return buf[0];
}

// LaunchRwkv7ShiftMix's computation on host pointers (the same Rwkv7ShiftMixArgs
// contract). Returns false, doing nothing, where the launcher would refuse the arguments
// (cudaErrorInvalidValue).
inline bool RunRwkv7ShiftMixOnHost(const Rwkv7ShiftMixArgs& args) {
  if (args.B < 0 || args.T < 1 || args.d < 1 || args.d > INT_MAX ||
      (args.count != 1 && args.count != kRwkv7MixMaxCount)) {
    return false;
  }
  if (args.B == 0) return true;
  if (args.B * args.T > INT_MAX) return false;
  if (args.h == nullptr || args.ln_w == nullptr || args.ln_b == nullptr ||
      args.shift_in == nullptr || args.shift_out == nullptr || args.out == nullptr) {
    return false;
  }
  for (int m = 0; m < args.count; ++m) {
    if (args.mix[m] == nullptr) return false;
  }
  const int64_t d = args.d;
  const int p = Rwkv7MixThreads(d);
  const int64_t plane = args.B * args.T * d;
  // Shared memory; each thread's partial sums are written straight into it.
  std::vector<float> s_sum0(static_cast<size_t>(p)), s_sum1(static_cast<size_t>(p));
  for (int64_t item = 0; item < args.B * args.T; ++item) {
    const int64_t b = item / args.T, t = item % args.T;
    const float* row = args.h + item * d;
    const bool previous_in_call = t > 0;
    const float* previous_row = previous_in_call ? row - d : args.shift_in + b * d;
    for (int i = 0; i < p; ++i) {
      float sum = 0.0f, previous_sum = 0.0f;
      for (int64_t c = i; c < d; c += p) {
        sum += row[c];
        if (previous_in_call) previous_sum += previous_row[c];
      }
      s_sum0[static_cast<size_t>(i)] = sum;
      s_sum1[static_cast<size_t>(i)] = previous_sum;
    }
    const float mean = LayerNormMean(HostMixHalvingSum(s_sum0, p), d);
    const float previous_mean = LayerNormMean(HostMixHalvingSum(s_sum1, p), d);
    for (int i = 0; i < p; ++i) {
      float squares = 0.0f, previous_squares = 0.0f;
      for (int64_t c = i; c < d; c += p) {
        const float centered = row[c] - mean;
        squares += centered * centered;
        if (previous_in_call) {
          const float previous_centered = previous_row[c] - previous_mean;
          previous_squares += previous_centered * previous_centered;
        }
      }
      s_sum0[static_cast<size_t>(i)] = squares;
      s_sum1[static_cast<size_t>(i)] = previous_squares;
    }
    const float inv = LayerNormInv(HostMixHalvingSum(s_sum0, p), d, args.eps);
    const float previous_inv = LayerNormInv(HostMixHalvingSum(s_sum1, p), d, args.eps);
    float* out = args.out + item * d;
    const bool last = t == args.T - 1;
    float* shift_out = args.shift_out + b * d;
    for (int i = 0; i < p; ++i) {
      for (int64_t c = i; c < d; c += p) {
        const float w = args.ln_w[c], bias = args.ln_b[c];
        const float x = LayerNormOut(row[c], mean, inv, w, bias);
        const float previous =
            previous_in_call ? LayerNormOut(previous_row[c], previous_mean, previous_inv, w, bias)
                             : previous_row[c];
        for (int m = 0; m < args.count; ++m) {
          out[m * plane + c] = Rwkv7ShiftMix(x, previous, args.mix[m][c]);
        }
        if (last) shift_out[c] = x;
      }
    }
  }
  return true;
}

// LaunchSquaredRelu's computation on host pointers (in == out allowed). Returns false
// where the launcher would refuse the arguments.
inline bool RunSquaredReluOnHost(const float* in, float* out, int64_t n) {
  if (n < 0 || (n > 0 && (in == nullptr || out == nullptr))) return false;
  for (int64_t k = 0; k < n; ++k) out[k] = SquaredRelu(in[k]);
  return true;
}

}  // namespace fwmodel::kernels
