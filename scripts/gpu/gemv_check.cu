// A device check of the grouped GEMV kernel (models/gpu/gemv.cu) without LibTorch: random
// products at the RWKV-7 0.1B shapes (in → out: 768 → 768, 768 → 64, 64 → 768, 768 → 3072,
// 3072 → 768, 768 → 65536) and two off them (33 → 40: no 16-byte loads; 1000 → 24: a
// vector part that is not a multiple of the lanes), M = 1, 4 and 16 rows, float32 and bf16
// weights, each launch grouping the product with a second one (tanh input, bias, residual
// in place) and a third (sigmoid input, relu² epilogue), LaunchGroupedGemv on the GPU
// against RunGroupedGemvOnHost (the CPU mirror of its grid, which GpuGemvTest checks
// against LibTorch). Prints the worst relative difference per case and exits 1 on any above
// 1e-5 or any CUDA error. Then times one launch of each 0.1B shape at M = 1 (float32 and
// bf16), with the weights' traffic in GB/s.
//
//   nvcc -std=c++17 -O3 -arch=native -I . scripts/gpu/gemv_check.cu models/gpu/gemv.cu
//        -o /tmp/gemv_check && /tmp/gemv_check
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "models/gpu/gemv.h"
#include "models/gpu/gemv_host.h"

namespace {

using fwmodel::kernels::GemvEpilogue;
using fwmodel::kernels::GemvInput;
using fwmodel::kernels::GemvProduct;
using fwmodel::kernels::GemvWeight;
using fwmodel::kernels::GroupedGemvArgs;

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("CUDA error at %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

// A device copy of `bytes` bytes (null: uninitialised); the caller frees it.
void* Upload(const void* host, size_t bytes) {
  void* device = nullptr;
  if (!Check(cudaMalloc(&device, bytes + 64), "cudaMalloc")) return nullptr;
  if (host != nullptr) Check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "upload");
  return device;
}

// The bf16 bits of a float (round to nearest even).
uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// One product's host data.
struct HostProduct {
  int64_t in, out;
  GemvInput input;
  GemvEpilogue epilogue;
  bool bias;
  std::vector<float> w32, x, b, y;  // y: the residual's values before the launch
  std::vector<uint16_t> w16;
};

HostProduct MakeProduct(int64_t in, int64_t out, int M, GemvInput input, GemvEpilogue epilogue,
                        bool bias, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostProduct h{in, out, input, epilogue, bias, {}, {}, {}, {}, {}};
  const float scale = 1.0f / std::sqrt(static_cast<float>(in));
  h.w32.resize(static_cast<size_t>(in * out));
  h.w16.resize(h.w32.size());
  for (size_t i = 0; i < h.w32.size(); ++i) {
    h.w32[i] = normal(rng) * scale;
    h.w16[i] = ToBf16(h.w32[i]);
  }
  h.x.resize(static_cast<size_t>(M * in));
  for (float& e : h.x) e = normal(rng);
  h.b.resize(static_cast<size_t>(out));
  for (float& e : h.b) e = normal(rng) * 0.1f;
  h.y.resize(static_cast<size_t>(M * out));
  for (float& e : h.y) e = normal(rng);
  return h;
}

double MaxRel(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0, scale = 0;
  for (float v : want) scale = std::fmax(scale, std::fabs(v));
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::fmax(worst, std::fabs(got[i] - want[i]));
  }
  return worst / (1.0 + scale);
}

// One launch of the (in, out) product with two companions; false on a difference > 1e-5.
bool Run(int64_t in, int64_t out, int M, GemvWeight weight, std::mt19937& rng) {
  std::vector<HostProduct> hosts;
  hosts.push_back(MakeProduct(in, out, M, GemvInput::kNone, GemvEpilogue::kNone, false, rng));
  hosts.push_back(MakeProduct(in, 64, M, GemvInput::kTanh, GemvEpilogue::kResidual, true, rng));
  hosts.push_back(
      MakeProduct(64, in, M, GemvInput::kSigmoid, GemvEpilogue::kSquaredRelu, true, rng));
  GroupedGemvArgs host, dev;
  host.M = dev.M = M;
  host.count = dev.count = static_cast<int>(hosts.size());
  host.weight = dev.weight = weight;
  std::vector<std::vector<float>> want(hosts.size());
  std::vector<void*> owned;
  std::vector<float*> dev_y(hosts.size());
  bool ok = true;
  for (size_t g = 0; g < hosts.size(); ++g) {
    HostProduct& h = hosts[g];
    want[g] = h.y;
    GemvProduct p;
    p.w = weight == GemvWeight::kBFloat16 ? static_cast<const void*>(h.w16.data())
                                          : static_cast<const void*>(h.w32.data());
    p.x = h.x.data();
    p.bias = h.bias ? h.b.data() : nullptr;
    p.y = want[g].data();
    p.residual = h.epilogue == GemvEpilogue::kResidual ? want[g].data() : nullptr;
    p.in = p.x_stride = h.in;
    p.out = p.y_stride = p.residual_stride = h.out;
    p.input = h.input;
    p.epilogue = h.epilogue;
    host.products[g] = p;

    const size_t w_bytes = h.w32.size() * (weight == GemvWeight::kBFloat16 ? 2 : 4);
    void* dw = Upload(p.w, w_bytes);
    void* dx = Upload(h.x.data(), h.x.size() * 4);
    void* db = Upload(h.b.data(), h.b.size() * 4);
    void* dy = Upload(h.y.data(), h.y.size() * 4);
    owned.insert(owned.end(), {dw, dx, db, dy});
    ok = ok && dw != nullptr && dx != nullptr && db != nullptr && dy != nullptr;
    p.w = dw;
    p.x = static_cast<const float*>(dx);
    p.bias = h.bias ? static_cast<const float*>(db) : nullptr;
    p.y = dev_y[g] = static_cast<float*>(dy);
    p.residual = h.epilogue == GemvEpilogue::kResidual ? p.y : nullptr;
    dev.products[g] = p;
  }
  if (!fwmodel::kernels::RunGroupedGemvOnHost(host)) {
    std::printf("host mirror refused the case\n");
    ok = false;
  }
  ok = ok &&
       Check(static_cast<cudaError_t>(fwmodel::kernels::LaunchGroupedGemv(dev, nullptr)),
             "launch") &&
       Check(cudaDeviceSynchronize(), "kernel");
  double worst = 0;
  for (size_t g = 0; ok && g < hosts.size(); ++g) {
    std::vector<float> got(want[g].size());
    ok =
        Check(cudaMemcpy(got.data(), dev_y[g], got.size() * 4, cudaMemcpyDeviceToHost), "download");
    if (ok) worst = std::fmax(worst, MaxRel(got, want[g]));
  }
  if (!ok) worst = INFINITY;
  ok = ok && worst <= 1e-5;
  std::printf("%s %lld -> %lld M=%d %s (+ tanh/residual, sigmoid/relu2): %.2e\n",
              ok ? "ok  " : "FAIL", (long long)in, (long long)out, M,
              weight == GemvWeight::kBFloat16 ? "bf16" : "f32 ", worst);
  for (void* p : owned) cudaFree(p);
  return ok;
}

// Microseconds per launch of one (in, out) product at M = 1, from 200 launches; the
// weights' bytes per launch over that time.
void Time(int64_t in, int64_t out, GemvWeight weight) {
  const size_t element = weight == GemvWeight::kBFloat16 ? 2 : 4;
  const size_t w_bytes = static_cast<size_t>(in * out) * element;
  void* w = Upload(nullptr, w_bytes);
  void* x = Upload(nullptr, static_cast<size_t>(in) * 4);
  void* y = Upload(nullptr, static_cast<size_t>(out) * 4);
  if (w == nullptr || x == nullptr || y == nullptr) return;
  cudaMemset(w, 0, w_bytes);
  cudaMemset(x, 0, static_cast<size_t>(in) * 4);
  GroupedGemvArgs args;
  args.M = 1;
  args.count = 1;
  args.weight = weight;
  GemvProduct& p = args.products[0];
  p.w = w;
  p.x = static_cast<const float*>(x);
  p.y = static_cast<float*>(y);
  p.in = p.x_stride = in;
  p.out = p.y_stride = out;
  for (int i = 0; i < 5; ++i) fwmodel::kernels::LaunchGroupedGemv(args, nullptr);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kLaunches = 200;
  cudaEventRecord(start);
  for (int i = 0; i < kLaunches; ++i) fwmodel::kernels::LaunchGroupedGemv(args, nullptr);
  cudaEventRecord(stop);
  Check(cudaEventSynchronize(stop), "timing");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  const double us = 1000.0 * ms / kLaunches;
  std::printf("time %lld -> %lld M=1 %s: %.2f us per launch, weights %.0f GB/s\n", (long long)in,
              (long long)out, weight == GemvWeight::kBFloat16 ? "bf16" : "f32 ", us,
              static_cast<double>(w_bytes) / (us * 1e3));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
}

}  // namespace

int main() {
  std::mt19937 rng(20261128);
  const int64_t shapes[][2] = {{768, 768},  {768, 64},    {64, 768}, {768, 3072},
                               {3072, 768}, {768, 65536}, {33, 40},  {1000, 24}};
  bool ok = true;
  for (GemvWeight weight : {GemvWeight::kFloat32, GemvWeight::kBFloat16}) {
    for (int M : {1, 4, 16}) {
      for (const auto& shape : shapes) ok = Run(shape[0], shape[1], M, weight, rng) && ok;
    }
  }
  if (!ok) {
    std::printf("gemv_check: FAILED\n");
    return 1;
  }
  for (GemvWeight weight : {GemvWeight::kFloat32, GemvWeight::kBFloat16}) {
    for (int s = 0; s < 6; ++s) Time(shapes[s][0], shapes[s][1], weight);
  }
  std::printf("gemv_check: ok\n");
  return 0;
}
