// A device check of the fused RWKV-7 time-mix kernel (models/gpu/rwkv7_wkv.cu) without
// LibTorch: random inputs, LaunchRwkv7Wkv on the GPU against RunRwkv7WkvOnHost (the CPU
// mirror of its grid, which GpuBodiesTest checks against the LibTorch block), for the
// compiled widths (N = 8, 16, 32, 64, 128) and widths off them (1, 12, 24, 40, 100: the
// run-time kernel, with threads past N, float4 and scalar tiles), T = 1 and T > 1, block 0
// and later blocks, in place or not, on a state pool through `rows` (unnamed pool rows
// must stay untouched), and a state pointer off 16-byte alignment (the scalar global
// path). Prints the worst relative difference per case and exits 1 on any above 1e-4 or
// any CUDA error; the same for the split-phase path (a scratch, T > 1: several staging
// chunks, the last partial). Then times the launch at the 0.1B shape (H = 12, N = 64):
// T = 1 for B = 1, 64 and 512, with the state's traffic in GB/s; and prefill, B = 1 with
// T = 1,024 and B = 16 with T = 256, the single kernel against the split path, in µs per
// launch and tokens per second.
//
//   nvcc -std=c++17 -O3 -arch=native -I . scripts/gpu/rwkv7_wkv_check.cu \
//        models/gpu/rwkv7_wkv.cu -o /tmp/rwkv7_wkv_check && /tmp/rwkv7_wkv_check
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "models/gpu/rwkv7_wkv.h"
#include "models/gpu/rwkv7_wkv_host.h"

namespace {

struct Case {
  int64_t B, T, H, N;
  bool first_layer, in_place;
  int64_t extra_rows;  // > 0: the state in a pool of B + extra_rows rows, through `rows`
  bool misaligned;     // the state buffers (and the scratch) one float off 16-byte alignment
  bool split = false;  // with a scratch: the split-phase path when T > 1
};

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("CUDA error at %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

template <typename T>
T* Upload(const std::vector<T>& host, size_t offset = 0) {
  T* device = nullptr;
  if (!Check(cudaMalloc(&device, (host.size() + offset + 4) * sizeof(T)), "cudaMalloc")) {
    return nullptr;
  }
  Check(cudaMemcpy(device + offset, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
        "upload");
  return device;
}

double MaxRel(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (float x : b) scale = std::fmax(scale, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) && std::isfinite(b[i])) return INFINITY;
    if (std::isfinite(b[i])) worst = std::fmax(worst, std::fabs(a[i] - b[i]));
  }
  return worst / (1.0 + scale);
}

bool Run(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t d = c.H * c.N, tokens = c.B * c.T, head_size = c.H * c.N * c.N;
  auto randoms = [&](int64_t n, float scale, float offset = 0.0f) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = normal(rng) * scale + offset;
    return x;
  };
  std::vector<std::vector<float>> per_token;  // r, w_raw, a_raw, k, v, v_raw, v_first, g
  for (int m = 0; m < 8; ++m) per_token.push_back(randoms(tokens * d, 1.0f));
  std::vector<std::vector<float>> weights;  // k_k, k_a, r_k, ln_w, ln_b
  for (int m = 0; m < 5; ++m) weights.push_back(randoms(d, 0.5f, m == 3 ? 1.0f : 0.0f));
  const int64_t pool_rows = c.B + c.extra_rows;
  const std::vector<float> state = randoms(pool_rows * head_size, 0.3f);
  std::vector<int64_t> rows(static_cast<size_t>(pool_rows));
  std::iota(rows.begin(), rows.end(), int64_t{0});
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(static_cast<size_t>(c.B));
  const bool use_rows = c.extra_rows > 0;

  fwmodel::kernels::Rwkv7WkvArgs host;
  host.B = c.B;
  host.T = c.T;
  host.H = c.H;
  host.N = c.N;
  const float** token_fields[] = {&host.r, &host.w_raw, &host.a_raw,   &host.k,
                                  &host.v, &host.v_raw, &host.v_first, &host.g};
  for (int m = 0; m < 8; ++m) *token_fields[m] = per_token[static_cast<size_t>(m)].data();
  const float** weight_fields[] = {&host.k_k, &host.k_a, &host.r_k, &host.ln_w, &host.ln_b};
  for (int m = 0; m < 5; ++m) *weight_fields[m] = weights[static_cast<size_t>(m)].data();
  host.eps = static_cast<float>(c.N) * 1e-5f;
  host.first_layer = c.first_layer;
  host.rows = use_rows ? rows.data() : nullptr;
  const int64_t scratch_floats = fwmodel::kernels::Rwkv7WkvScratchFloats(c.B, c.T, c.H, c.N);
  std::vector<float> h_scratch(c.split ? static_cast<size_t>(scratch_floats) : 0);
  host.scratch = c.split ? h_scratch.data() : nullptr;
  std::vector<float> s_ref = state, y_ref(static_cast<size_t>(tokens * d));
  host.state_in = state.data();
  host.state_out = s_ref.data();  // the pool's unnamed rows keep their values
  host.y = y_ref.data();
  if (!fwmodel::kernels::RunRwkv7WkvOnHost(host)) {
    std::printf("host mirror refused the case\n");
    return false;
  }

  fwmodel::kernels::Rwkv7WkvArgs dev = host;
  std::vector<float*> owned;
  for (int m = 0; m < 8; ++m) owned.push_back(Upload(per_token[static_cast<size_t>(m)]));
  const float** dev_token_fields[] = {&dev.r, &dev.w_raw, &dev.a_raw,   &dev.k,
                                      &dev.v, &dev.v_raw, &dev.v_first, &dev.g};
  for (int m = 0; m < 8; ++m) *dev_token_fields[m] = owned[static_cast<size_t>(m)];
  const float** dev_weight_fields[] = {&dev.k_k, &dev.k_a, &dev.r_k, &dev.ln_w, &dev.ln_b};
  for (int m = 0; m < 5; ++m) {
    owned.push_back(Upload(weights[static_cast<size_t>(m)]));
    *dev_weight_fields[m] = owned.back();
  }
  const size_t offset = c.misaligned ? 1 : 0;
  float* ds_in = Upload(state, offset);
  float* ds_out = Upload(state, offset);  // out of place: unnamed rows as they were
  float* dy = Upload(std::vector<float>(y_ref.size(), NAN));
  int64_t* drows = use_rows ? Upload(rows) : nullptr;
  float* dscratch = c.split ? Upload(std::vector<float>(h_scratch.size(), NAN), offset) : nullptr;
  dev.scratch = c.split ? dscratch + offset : nullptr;
  dev.state_in = ds_in + offset;
  dev.state_out = (c.in_place ? ds_in : ds_out) + offset;
  dev.y = dy;
  dev.rows = drows;
  bool ok =
      Check(static_cast<cudaError_t>(fwmodel::kernels::LaunchRwkv7Wkv(dev, nullptr)), "launch") &&
      Check(cudaDeviceSynchronize(), "kernel");
  std::vector<float> s_got(state.size()), y_got(y_ref.size()), s_in_after(state.size());
  ok = ok && Check(cudaMemcpy(s_got.data(), dev.state_out, s_got.size() * sizeof(float),
                              cudaMemcpyDeviceToHost),
                   "download state");
  ok = ok && Check(cudaMemcpy(s_in_after.data(), ds_in + offset, state.size() * sizeof(float),
                              cudaMemcpyDeviceToHost),
                   "download state_in");
  ok = ok &&
       Check(cudaMemcpy(y_got.data(), dy, y_got.size() * sizeof(float), cudaMemcpyDeviceToHost),
             "download y");
  const double ds = ok ? MaxRel(s_got, s_ref) : INFINITY,
               dy_rel = ok ? MaxRel(y_got, y_ref) : INFINITY;
  // Unnamed pool rows: the same bits as before (in place or not).
  bool untouched = true;
  if (ok && use_rows) {
    for (int64_t row = 0; row < pool_rows; ++row) {
      if (std::find(rows.begin(), rows.end(), row) != rows.end()) continue;
      for (int64_t e = row * head_size; e < (row + 1) * head_size; ++e) {
        untouched = untouched && s_got[static_cast<size_t>(e)] == state[static_cast<size_t>(e)];
      }
    }
  }
  const bool in_kept = c.in_place || s_in_after == state;
  ok = ok && ds <= 1e-4 && dy_rel <= 1e-4 && untouched && in_kept;
  std::printf(
      "%s B=%lld T=%lld H=%lld N=%lld first=%d in_place=%d pool+%lld misaligned=%d split=%d: "
      "state %.2e, y %.2e%s%s\n",
      ok ? "ok  " : "FAIL", (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.N,
      c.first_layer, c.in_place, (long long)c.extra_rows, c.misaligned, c.split, ds, dy_rel,
      untouched ? "" : ", an unnamed row was written", in_kept ? "" : ", state_in was written");
  for (float* p : owned) cudaFree(p);
  cudaFree(ds_in);
  cudaFree(ds_out);
  cudaFree(dy);
  if (drows != nullptr) cudaFree(drows);
  if (dscratch != nullptr) cudaFree(dscratch);
  return ok;
}

// Microseconds per launch at (B, H = 12, N = 64, T), in place, from `launches` launches
// after 3 warm-ups; split: with a scratch (the split-phase path when T > 1). Prints the
// tokens per second (B·T per launch) and the state's traffic in GB/s.
void Time(int64_t B, int64_t T, bool split, int launches) {
  const int64_t H = 12, N = 64, d = H * N, state_floats = B * H * N * N;
  std::vector<float> ones(static_cast<size_t>(B * T * d), 0.5f);
  std::vector<float> state(static_cast<size_t>(state_floats), 0.01f);
  float* inputs = Upload(ones);
  float* weights = Upload(std::vector<float>(static_cast<size_t>(d), 0.5f));
  float* s = Upload(state);
  float* y = Upload(ones);
  float* scratch = nullptr;
  if (split) {
    Check(cudaMalloc(&scratch,
                     static_cast<size_t>(fwmodel::kernels::Rwkv7WkvScratchFloats(B, T, H, N)) *
                         sizeof(float)),
          "cudaMalloc scratch");
  }
  fwmodel::kernels::Rwkv7WkvArgs args;
  args.B = B;
  args.T = T;
  args.H = H;
  args.N = N;
  args.r = args.w_raw = args.a_raw = args.k = args.v = args.v_raw = args.v_first = args.g = inputs;
  args.k_k = args.k_a = args.r_k = args.ln_w = args.ln_b = weights;
  args.state_in = s;
  args.state_out = s;
  args.y = y;
  args.eps = 64e-5f;
  args.scratch = scratch;
  for (int i = 0; i < 3; ++i) fwmodel::kernels::LaunchRwkv7Wkv(args, nullptr);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  for (int i = 0; i < launches; ++i) fwmodel::kernels::LaunchRwkv7Wkv(args, nullptr);
  cudaEventRecord(stop);
  Check(cudaEventSynchronize(stop), "timing");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  const double us = 1000.0 * ms / launches;
  std::printf(
      "time %s B=%lld H=12 N=64 T=%lld: %.2f us per launch, %.0f tokens/s, state %.0f GB/s\n",
      split && T > 1 ? "split " : "single", (long long)B, (long long)T, us,
      static_cast<double>(B * T) / (us * 1e-6), 2.0 * state_floats * sizeof(float) / (us * 1e3));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (float* p : {inputs, weights, s, y}) cudaFree(p);
  if (scratch != nullptr) cudaFree(scratch);
}

}  // namespace

int main() {
  std::mt19937 rng(23);
  const Case cases[] = {
      {3, 1, 4, 8, true, false, 0, false},
      {3, 3, 2, 16, false, false, 0, false},
      {2, 1, 2, 32, false, true, 0, false},
      {4, 1, 12, 64, true, false, 0, false},
      {4, 1, 12, 64, false, true, 0, false},
      {2, 5, 2, 64, false, false, 3, false},
      {3, 1, 2, 64, false, true, 2, false},
      {2, 3, 1, 128, true, false, 0, false},
      {3, 2, 2, 128, false, true, 2, false},
      {2, 3, 2, 24, false, false, 0, false},
      {2, 2, 2, 40, false, true, 1, false},
      {2, 3, 2, 100, false, false, 0, false},
      {2, 1, 2, 12, true, false, 0, false},
      {2, 2, 3, 1, false, false, 0, false},
      {2, 1, 2, 64, false, false, 0, true},
      {2, 2, 1, 128, false, true, 0, true},
      {64, 1, 12, 64, false, true, 0, false},
      {512, 1, 12, 64, false, true, 64, false},
      // The split path (a scratch, T > 1): several staging chunks with a partial last one
      // (16 tokens a chunk for N ≤ 64, 8 above), the run-time kernel (N = 24: scalar
      // scratch; N = 40: float4), rows, in place, misaligned state and scratch; T = 1 with
      // a scratch takes the single kernel.
      {3, 40, 2, 8, true, false, 0, false, true},
      {2, 37, 4, 16, false, true, 0, false, true},
      {2, 33, 2, 32, false, false, 2, false, true},
      {4, 40, 12, 64, true, false, 0, false, true},
      {4, 41, 12, 64, false, true, 3, false, true},
      {1, 300, 12, 64, false, true, 0, false, true},
      {2, 20, 2, 128, true, false, 0, false, true},
      {3, 19, 2, 128, false, true, 2, false, true},
      {2, 21, 2, 24, false, false, 1, false, true},
      {2, 18, 2, 40, false, true, 0, false, true},
      {2, 17, 2, 100, false, false, 0, false, true},
      {2, 5, 3, 1, false, false, 0, false, true},
      {2, 23, 2, 64, false, false, 0, true, true},
      {2, 9, 1, 128, false, true, 0, true, true},
      {3, 1, 12, 64, false, true, 2, false, true},
      {2, 2, 12, 64, false, false, 0, false, true},
  };
  bool all = true;
  for (const Case& c : cases) all = Run(c, rng) && all;
  for (const int64_t B : {1, 64, 512}) Time(B, 1, false, 200);
  // Prefill at the 0.1B shape: the single kernel against the split path.
  for (const bool split : {false, true}) {
    Time(1, 1024, split, 20);
    Time(16, 256, split, 20);
  }
  std::printf(all ? "rwkv7_wkv_check: ok\n" : "rwkv7_wkv_check: FAILED\n");
  return all ? 0 : 1;
}
