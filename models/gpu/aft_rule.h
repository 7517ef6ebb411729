// The per-(session, channel) body of the `aft` mixer's recurrence
// (models/architectures/aft.cc has the math; ../shared/spec/models.md, "Mixer aft"): a
// plain function with no library calls, `__host__ __device__` under nvcc, so the CPU
// kernel (aft.cc's NativeAft, AftRow), the CUDA kernel (aft.cu) and its CPU mirror
// (aft_host.h) run the same arithmetic per element, and the CPU suite tests it on every
// run. Torch-free, header-only.
//
// Channel c of one session keeps (alpha, beta, p): the running sums Σ e^{k_s − (t−1−s) w}
// v_s and Σ e^{k_s − (t−1−s) w}, both scaled by e^{−p}. One token (r_raw, k, v), with
// u = time_first[c] and w = decay[c] = exp(time_decay[c]) > 0:
//   q  = max(p, u + k);   wkv = (e^{p−q} alpha + e^{u+k−q} v) / (e^{p−q} beta + e^{u+k−q})
//   q2 = max(p − w, k);   alpha ← e^{p−w−q2} alpha + e^{k−q2} v;
//                         beta  ← e^{p−w−q2} beta + e^{k−q2};   p ← q2
//   y  = sigmoid(r_raw) · wkv
// A fresh state is (0, 0, −1e30) (aft.cc's kAftInitialLogScale): finite, so p − w stays
// finite, and e^{p−q} is exactly 0.
#pragma once

#include "models/gpu/aft.h"
#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// One channel's state: the scaled sums and their log scale p.
struct AftChannelState {
  float alpha;
  float beta;
  float p;
};

// Channel c's token: advances *s past it and returns y = sigmoid(r_raw) · wkv. r_raw is
// the receptance before its sigmoid; u = time_first[c], w = decay[c] (exp(time_decay)).
// FastExpF / SigmoidF throughout (native_math.h's FastExp / Sigmoid arithmetic).
FW_HOST_DEVICE inline float AftChannelToken(float r_raw, float k, float v, float u, float w,
                                            AftChannelState* s) {
  const float r = SigmoidF(r_raw);
  const float p0 = s->p, a0 = s->alpha, b0 = s->beta;
  const float uk = u + k;
  const float q = p0 < uk ? uk : p0;  // std::max(p0, u + k)
  float e1 = FastExpF(p0 - q), e2 = FastExpF(uk - q);
  const float wkv = (e1 * a0 + e2 * v) / (e1 * b0 + e2);
  const float decayed = p0 - w;
  const float q2 = decayed < k ? k : decayed;  // std::max(p0 - w, k)
  e1 = FastExpF(decayed - q2);
  e2 = FastExpF(k - q2);
  s->alpha = e1 * a0 + e2 * v;
  s->beta = e1 * b0 + e2;
  s->p = q2;
  return r * wkv;
}

// LaunchAft's item `item` (of B·d: session b = item / d, channel c): the channel's state
// from its row, the T tokens in order (AftChannelToken), the state out. The kernel's
// thread body (aft.cu) and the mirror's loop body (aft_host.h).
FW_HOST_DEVICE inline void AftRunItem(const AftArgs& args, int64_t item) {
  const int64_t d = args.d;
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

}  // namespace fwmodel::kernels
