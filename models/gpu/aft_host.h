// LaunchAft's grid (aft.cu) run on the CPU with host pointers: the CPU test of the
// launch's indexing (tests/unit/gpu_aft_test.cc), since the kernel itself only runs on a
// GPU machine. The threads (session b, channel c), item b·d + c, one after another, each
// as the kernel's: its state in, the T tokens through aft_rule.h's body, its state out;
// so the arithmetic per element is the kernel's (up to the compilers' contraction into
// fused multiply-adds). Not a fast path. Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/aft.h"
#include "models/gpu/aft_rule.h"

namespace fwmodel::kernels {

// LaunchAft's computation on host pointers (the same AftArgs contract, rows a host
// pointer too). Returns false, doing nothing, where the launcher would refuse the
// arguments (cudaErrorInvalidValue).
inline bool RunAftOnHost(const AftArgs& args) {
  if (!AftArgsValid(args)) return false;
  const int64_t d = args.d;
  for (int64_t item = 0; item < args.B * d; ++item) {
    const int64_t b = item / d, c = item - b * d;
    const int64_t row = args.rows != nullptr ? args.rows[b] : b;
    const int64_t state_at = row * 3 * d + c;
    const float* in = args.state_in + state_at;
    AftChannelState s{in[0], in[d], in[2 * d]};
    const float u = args.time_first[c], w = args.decay[c];
    for (int64_t t = 0; t < args.T; ++t) {
      const int64_t o = (b * args.T + t) * d + c;
      args.y[o] = AftChannelToken(args.r[o], args.k[o], args.v[o], u, w, &s);
    }
    float* out = args.state_out + state_at;
    out[0] = s.alpha;
    out[d] = s.beta;
    out[2 * d] = s.p;
  }
  return true;
}

}  // namespace fwmodel::kernels
