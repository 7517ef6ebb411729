// A device check of the fused delta-rule kernel (models/gpu/delta_rule_cuda.cu) without
// LibTorch: random inputs, LaunchDeltaRule on the GPU against RunDeltaRuleOnHost (the CPU
// mirror of its grid, which GpuBodiesDeltaRuleTest checks against the LibTorch block), for
// the shapes the models use (K = V = 8, 16, 64, 128; HV = 2H; V ≠ K; a K off the compiled
// widths), T = 1 and T > 1, gated or not, in place or not. Prints the worst relative
// difference per case and exits 1 on any above 1e-4 or any CUDA error.
//
//   nvcc -std=c++17 -O3 -arch=native -I . scripts/gpu/delta_rule_check.cu \
//        models/gpu/delta_rule_cuda.cu -o /tmp/delta_rule_check && /tmp/delta_rule_check
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "models/gpu/delta_rule_cuda.h"
#include "models/gpu/delta_rule_cuda_host.h"

namespace {

struct Case {
  int64_t B, T, H, HV, K, V;
  bool gated, gate, in_place;
};

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("CUDA error at %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

float* Upload(const std::vector<float>& host) {
  float* device = nullptr;
  if (!Check(cudaMalloc(&device, host.size() * sizeof(float) + 4), "cudaMalloc")) return nullptr;
  Check(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload");
  return device;
}

double MaxRel(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (float x : b) scale = std::fmax(scale, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    worst = std::fmax(worst, std::fabs(a[i] - b[i]));
  }
  return worst / (1.0 + scale);
}

bool Run(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int64_t tokens = c.B * c.T;
  auto randoms = [&](int64_t n, float scale) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = normal(rng) * scale;
    return x;
  };
  std::vector<float> q = randoms(tokens * c.H * c.K, 1.0f), k = randoms(tokens * c.H * c.K, 1.0f);
  for (int64_t r = 0; r < tokens * c.H; ++r) {  // l2-normalised, q scaled by K^(-1/2)
    float sq = 0, sk = 0;
    for (int64_t i = 0; i < c.K; ++i) {
      sq += q[r * c.K + i] * q[r * c.K + i];
      sk += k[r * c.K + i] * k[r * c.K + i];
    }
    for (int64_t i = 0; i < c.K; ++i) {
      q[r * c.K + i] /= std::sqrt(sq + 1e-6f) * std::sqrt(static_cast<float>(c.K));
      k[r * c.K + i] /= std::sqrt(sk + 1e-6f);
    }
  }
  std::vector<float> v = randoms(tokens * c.HV * c.V, 1.0f),
                     gate = randoms(tokens * c.HV * c.V, 1.0f);
  std::vector<float> beta(static_cast<size_t>(tokens * c.HV)), decay(beta.size());
  for (float& e : beta) e = unit(rng);
  for (float& e : decay) e = 0.5f + 0.5f * unit(rng);
  std::vector<float> weight(static_cast<size_t>(c.V));
  for (float& e : weight) e = 0.5f + unit(rng);
  const std::vector<float> state = randoms(c.B * c.HV * c.K * c.V, 0.3f);

  fwmodel::kernels::DeltaRuleArgs host;
  host.B = c.B;
  host.T = c.T;
  host.H = c.H;
  host.HV = c.HV;
  host.K = c.K;
  host.V = c.V;
  host.q = q.data();
  host.k = k.data();
  host.v = v.data();
  host.beta = beta.data();
  host.decay = c.gated ? decay.data() : nullptr;
  host.gate = c.gate ? gate.data() : nullptr;
  host.norm_weight = weight.data();
  host.eps = 1e-5f;
  std::vector<float> s_ref(state.size()), o_ref(static_cast<size_t>(tokens * c.HV * c.V));
  host.state_in = state.data();
  host.state_out = s_ref.data();
  host.o = o_ref.data();
  if (!fwmodel::kernels::RunDeltaRuleOnHost(host)) {
    std::printf("host mirror refused the case\n");
    return false;
  }

  fwmodel::kernels::DeltaRuleArgs dev = host;
  float *dq = Upload(q), *dk = Upload(k), *dv = Upload(v), *db = Upload(beta), *dd = Upload(decay),
        *dg = Upload(gate), *dw = Upload(weight), *ds_in = Upload(state),
        *ds_out = Upload(std::vector<float>(state.size(), NAN)),
        *d_o = Upload(std::vector<float>(o_ref.size(), NAN));
  dev.q = dq;
  dev.k = dk;
  dev.v = dv;
  dev.beta = db;
  dev.decay = c.gated ? dd : nullptr;
  dev.gate = c.gate ? dg : nullptr;
  dev.norm_weight = dw;
  dev.state_in = ds_in;
  dev.state_out = c.in_place ? ds_in : ds_out;
  dev.o = d_o;
  bool ok =
      Check(static_cast<cudaError_t>(fwmodel::kernels::LaunchDeltaRule(dev, nullptr)), "launch") &&
      Check(cudaDeviceSynchronize(), "kernel");
  std::vector<float> s_got(state.size()), o_got(o_ref.size());
  ok = ok && Check(cudaMemcpy(s_got.data(), c.in_place ? ds_in : ds_out,
                              s_got.size() * sizeof(float), cudaMemcpyDeviceToHost),
                   "download state");
  ok = ok &&
       Check(cudaMemcpy(o_got.data(), d_o, o_got.size() * sizeof(float), cudaMemcpyDeviceToHost),
             "download o");
  const double ds = ok ? MaxRel(s_got, s_ref) : INFINITY,
               dov = ok ? MaxRel(o_got, o_ref) : INFINITY;
  ok = ok && ds <= 1e-4 && dov <= 1e-4;
  std::printf(
      "%s B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld gated=%d gate=%d in_place=%d: "
      "state %.2e, o %.2e\n",
      ok ? "ok  " : "FAIL", (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.HV,
      (long long)c.K, (long long)c.V, c.gated, c.gate, c.in_place, ds, dov);
  for (float* p : {dq, dk, dv, db, dd, dg, dw, ds_in, ds_out, d_o}) cudaFree(p);
  return ok;
}

}  // namespace

int main() {
  std::mt19937 rng(17);
  const Case cases[] = {
      {3, 1, 2, 2, 8, 8, false, true, false},    {3, 5, 2, 4, 8, 8, true, true, true},
      {2, 5, 2, 2, 16, 16, true, false, false},  {2, 1, 2, 2, 32, 32, true, true, false},
      {4, 1, 2, 2, 64, 64, false, false, true},  {2, 7, 2, 4, 64, 64, true, true, false},
      {8, 1, 4, 4, 128, 128, true, true, false}, {2, 9, 4, 8, 128, 128, true, true, true},
      {2, 3, 2, 4, 128, 256, true, true, false}, {2, 3, 2, 2, 64, 16, true, true, false},
      {2, 3, 2, 2, 24, 24, false, true, false},  {2, 3, 1, 3, 40, 100, true, true, true},
      {1, 0, 2, 2, 64, 64, true, true, false},   {64, 1, 16, 16, 128, 128, true, true, true},
  };
  bool all = true;
  for (const Case& c : cases) all = Run(c, rng) && all;
  std::printf(all ? "delta_rule_check: ok\n" : "delta_rule_check: FAILED\n");
  return all ? 0 : 1;
}
