// The bodies of the grouped GEMV kernel (gemv.h): the argument check, the grid's layout
// (which product and output rows a block takes), how much of a row the 16-byte loads
// cover, and the per-element arithmetic (the input activation, the bf16 widening, the
// multiply-add, the epilogue). Plain functions with no library calls, `__host__
// __device__` under nvcc, so the CUDA kernel (gemv.cu) and its CPU mirror (gemv_host.h)
// run the same arithmetic per element. Torch-free, header-only.
//
// Product g, row m, output o (gemv.h): lane l of the warp of output o sums, in order,
//   the elements of W's 16-byte chunks c = l, l + 32, ... (GemvVectorChunks of them;
//   kGemvVector elements each, in order), then the tail elements i = chunks·kGemvVector
//   + l, + 32, ...: acc ← acc + input(x[m, i]) · W[o, i]                       GemvMac
// then the warp's butterfly (acc ← acc + the acc of lane l ^ s, s = 16, ..., 1) gives
// every lane the row's sum; lane m writes GemvFinish(sum) to y[m, o].
#pragma once

#include <climits>
#include <cstdint>

#include "models/gpu/gemv.h"
#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// The threads of a block, and of a warp.
constexpr int kGemvWarpSize = 32;
constexpr int kGemvThreads = kGemvWarps * kGemvWarpSize;

// The float of a bf16's bits (its high 16 bits).
FW_HOST_DEVICE inline float Bf16ToFloat(uint16_t bits) {
  return FloatFromBits(static_cast<int32_t>(static_cast<uint32_t>(bits) << 16));
}

// The floats of the two bf16 in a little-endian 32-bit word: element 2j (low half) and
// element 2j + 1 (high half); each equals Bf16ToFloat of its half.
FW_HOST_DEVICE inline float Bf16LowOf(uint32_t word) {
  return FloatFromBits(static_cast<int32_t>(word << 16));
}
FW_HOST_DEVICE inline float Bf16HighOf(uint32_t word) {
  return FloatFromBits(static_cast<int32_t>(word & 0xffff0000u));
}

// tanh(z) = s·(1 − e)/(1 + e), e = e^{−2|z|}, s the sign of z (FastExpF: within a few
// ulp of 1 in absolute terms, ±1 for large |z|).
FW_HOST_DEVICE inline float GemvTanh(float z) {
  const float magnitude = z < 0.0f ? -z : z;
  const float e = FastExpF(-2.0f * magnitude);
  const float t = (1.0f - e) / (1.0f + e);
  return z < 0.0f ? -t : t;
}

// What a product reads of x's element.
FW_HOST_DEVICE inline float GemvApplyInput(float x, GemvInput input) {
  switch (input) {
    case GemvInput::kTanh:
      return GemvTanh(x);
    case GemvInput::kSigmoid:
      return SigmoidF(x);
    default:
      return x;
  }
}

// One step of a lane's sum: acc + input(x) · w.
FW_HOST_DEVICE inline float GemvMac(float acc, float x, float w, GemvInput input) {
  return acc + GemvApplyInput(x, input) * w;
}

// y[m, o] from the row's sum: (sum + bias), then + residual or relu(·)².
FW_HOST_DEVICE inline float GemvFinish(float sum, const float* bias, int64_t o,
                                       GemvEpilogue epilogue, float residual) {
  const float z = bias != nullptr ? sum + bias[o] : sum;
  switch (epilogue) {
    case GemvEpilogue::kResidual:
      return residual + z;
    case GemvEpilogue::kSquaredRelu: {
      const float r = z < 0.0f ? 0.0f : z;
      return r * r;
    }
    default:
      return z;
  }
}

// The elements of one 16-byte load of W: 4 float32 or 8 bf16.
FW_HOST_DEVICE inline int GemvVector(GemvWeight weight) {
  return weight == GemvWeight::kBFloat16 ? 8 : 4;
}

// How many 16-byte chunks of each W row (and x row) the lanes load as vectors: in /
// GemvVector where every row of W and of x starts 16-byte aligned (W's and x's pointers
// aligned, in·(element size) and x_stride·4 multiples of 16), else 0 (all elements one by
// one). Elements past the chunks are the tail.
FW_HOST_DEVICE inline int64_t GemvVectorChunks(const GemvProduct& p, GemvWeight weight) {
  const int64_t element = weight == GemvWeight::kBFloat16 ? 2 : 4;
  const bool aligned = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.in * element) % 16 == 0 &&
                       (p.x_stride * 4) % 16 == 0;
  return aligned ? p.in / GemvVector(weight) : 0;
}

// The 16-byte chunks per lane of one group of the kernel's loads (gemv.cu): a lane issues
// the W loads of a group's chunks c, c + 32, ..., c + 32·(GemvUnroll − 1) before the
// group's multiply-adds, so that many loads of W are in flight per lane (the kernel is
// bound by their latency: a product of out ≤ 1,024 rows has fewer blocks than an H200 has
// SMs). 6 for M ≤ 2: the 0.1B's float32 768-wide rows (6 chunks a lane; bf16: 3) in one
// group; 4 for M ≤ 4; 2 above (the accumulators' registers). No instantiation spills
// (scripts/gpu/compile-check.sh). The order of the multiply-adds does not depend on it:
// gemv_host.h does not use it.
FW_HOST_DEVICE constexpr int GemvUnroll(int rows) { return rows <= 2 ? 6 : rows <= 4 ? 4 : 2; }

// Whether the kernel also loads a group's x (all rows) before its multiply-adds: where
// that is at most 6 float4 per lane (float32 at M = 1), which keeps that kernel at ≤ 72
// registers (3 blocks of kGemvThreads per SM). Else x is read beside each multiply-add
// (x is small and L1/L2-resident; ptxas schedules those loads).
FW_HOST_DEVICE constexpr bool GemvPreloadX(int rows, GemvWeight weight) {
  return GemvUnroll(rows) * rows * (weight == GemvWeight::kBFloat16 ? 2 : 1) <= 6;
}

// The blocks of a product of `out` output rows: one per kGemvWarps rows.
FW_HOST_DEVICE inline int64_t GemvTiles(int64_t out) { return (out + kGemvWarps - 1) / kGemvWarps; }

// Block `block`'s product (*product) and tile of it (*tile; output rows tile·kGemvWarps +
// warp): the products' tiles laid out one product after another, in order.
FW_HOST_DEVICE inline void GemvLocate(const GroupedGemvArgs& args, int64_t block, int* product,
                                      int64_t* tile) {
  int g = 0;
  while (g < args.count - 1) {
    const int64_t tiles = GemvTiles(args.products[g].out);
    if (block < tiles) break;
    block -= tiles;
    ++g;
  }
  *product = g;
  *tile = block;
}

// The launch's blocks: Σ over the products of GemvTiles(out).
inline int64_t GemvBlocks(const GroupedGemvArgs& args) {
  int64_t blocks = 0;
  for (int g = 0; g < args.count; ++g) blocks += GemvTiles(args.products[g].out);
  return blocks;
}

// The rows the kernel is compiled for (its accumulators per lane): the power of two ≥ M.
inline int GemvRowBucket(int M) {
  int rows = 1;
  while (rows < M) rows *= 2;
  return rows;
}

// Whether LaunchGroupedGemv takes `args`: M in 0..kGemvMaxRows, count in
// 1..kGemvMaxProducts, a known weight type; per product non-null w, x and y, in and out
// in 1..INT_MAX, x_stride ≥ in, y_stride ≥ out, a known input and epilogue, and for
// kResidual a non-null residual with residual_stride ≥ out; the grid's blocks ≤ INT_MAX.
inline bool GroupedGemvArgsValid(const GroupedGemvArgs& args) {
  if (args.M < 0 || args.M > kGemvMaxRows || args.count < 1 || args.count > kGemvMaxProducts ||
      (args.weight != GemvWeight::kFloat32 && args.weight != GemvWeight::kBFloat16)) {
    return false;
  }
  for (int g = 0; g < args.count; ++g) {
    const GemvProduct& p = args.products[g];
    if (p.w == nullptr || p.x == nullptr || p.y == nullptr || p.in < 1 || p.out < 1 ||
        p.in > INT_MAX || p.out > INT_MAX || p.x_stride < p.in || p.y_stride < p.out) {
      return false;
    }
    if (p.input != GemvInput::kNone && p.input != GemvInput::kTanh &&
        p.input != GemvInput::kSigmoid) {
      return false;
    }
    if (p.epilogue == GemvEpilogue::kResidual) {
      if (p.residual == nullptr || p.residual_stride < p.out) return false;
    } else if (p.epilogue != GemvEpilogue::kNone && p.epilogue != GemvEpilogue::kSquaredRelu) {
      return false;
    }
  }
  return GemvBlocks(args) <= INT_MAX;
}

}  // namespace fwmodel::kernels
