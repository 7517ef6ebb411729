// The grouped small-batch GEMV kernel (gemv.cu): up to kGemvMaxProducts independent
// matrix-vector products over M ≤ kGemvMaxRows rows in one launch, for the projections of
// a decode step (models/architectures/rwkv7.cc) where cuBLAS would take a launch (or three)
// per product. Product g:
//   y_g[m, o] = epilogue(Σ_i input(x_g[m, i]) · W_g[o, i] (+ bias_g[o]))   m < M, o < out_g
// with W_g row-major [out_g, in_g] in float32 or bf16 (the launch's weight type), x, y,
// bias and residual float32, the sum accumulated in float32. Inputs: as is, tanh or
// sigmoid (a LoRA's second product reading its first's raw output); epilogues: none,
// plus a residual (y = r + result) or relu(·)². The bodies are gemv_rule.h's; gemv_host.h
// runs the same grid on the CPU. Torch-free and CUDA-free: the launcher takes the stream
// as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The most products one launch computes, and the most rows (M) it takes.
constexpr int kGemvMaxProducts = 8;
constexpr int kGemvMaxRows = 16;
// The kernel's block: kGemvWarps warps, one output row of one product each.
constexpr int kGemvWarps = 8;

// The weights' element type, for all the products of a launch.
enum class GemvWeight : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,  // the high 16 bits of a float32 (uint16 storage; float = bits << 16)
};

// What the product reads of x: x itself, tanh(x) or sigmoid(x) (gemv_rule.h's bodies).
enum class GemvInput : int32_t { kNone = 0, kTanh = 1, kSigmoid = 2 };

// What is written: the sum (+ bias), residual + it, or relu(it)².
enum class GemvEpilogue : int32_t { kNone = 0, kResidual = 1, kSquaredRelu = 2 };

// One product. Device pointers; the element (m, i) of a [M, ·] operand is at m·stride + i.
struct GemvProduct {
  const void* w = nullptr;      // [out, in] row-major, contiguous, of the launch's weight type
  const float* x = nullptr;     // [M, in], row stride x_stride (≥ in)
  const float* bias = nullptr;  // [out], or null: none
  // [M, out], row stride residual_stride; kResidual only. May be y itself (same stride):
  // each element is read before the same thread writes it.
  const float* residual = nullptr;
  float* y = nullptr;  // [M, out], row stride y_stride (≥ out); must not overlap any x,
                       // w, bias or other product's y or residual of the launch
  int64_t in = 0;
  int64_t out = 0;
  int64_t x_stride = 0;
  int64_t y_stride = 0;
  int64_t residual_stride = 0;
  GemvInput input = GemvInput::kNone;
  GemvEpilogue epilogue = GemvEpilogue::kNone;
};

// One launch: `count` products over the same M rows. Passed by value to the kernel
// (kGemvMaxProducts products: well under the 4 KB parameter limit).
struct GroupedGemvArgs {
  int M = 0;      // rows, 0..kGemvMaxRows (0: nothing to do)
  int count = 0;  // products, 1..kGemvMaxProducts
  GemvWeight weight = GemvWeight::kFloat32;
  GemvProduct products[kGemvMaxProducts];
};

// Launches the grouped GEMV on `cuda_stream` (a cudaStream_t; null: the legacy default
// stream): blocks of kGemvWarps warps over (product, tile of kGemvWarps output rows), W
// read once for all M rows, with 16-byte loads where W's and x's rows allow them (the
// rest element by element). Returns 0 (cudaSuccess) or the cudaError_t of a bad argument
// (cudaErrorInvalidValue: GroupedGemvArgsValid false) or of the launch (cudaGetLastError).
// Asynchronous; no allocation, no synchronisation: safe during CUDA Graph capture.
int LaunchGroupedGemv(const GroupedGemvArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchGroupedGemv result.
const char* GemvErrorString(int error);

}  // namespace fwmodel::kernels
