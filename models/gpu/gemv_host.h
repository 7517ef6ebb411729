// LaunchGroupedGemv's grid (gemv.cu) run on the CPU with host pointers: the CPU test of
// the launch's layout, indexing, vector/tail split and warp reductions
// (tests/unit/gpu_gemv_test.cc), since the kernel itself only runs on a GPU machine; and
// the stand-in for the launch in rwkv7.cc's test of its grouped-GEMV path on CPU tensors.
// Blocks one after another; in each, warp by warp (output rows tile·kGemvWarps + w), lane
// by lane the kernel's per-lane sums in its order over gemv_rule.h's bodies, then the
// shuffle butterfly, then lane m's write of row m. So the arithmetic per element is the
// kernel's (up to the compilers' contraction into fused multiply-adds). Not a fast path.
// Torch-free, header-only.
#pragma once

#include <cstdint>

#include "models/gpu/gemv.h"
#include "models/gpu/gemv_rule.h"

namespace fwmodel::kernels {

// W[o, i] of product p as a float (float32, or a bf16 widened).
inline float HostGemvWeight(const GemvProduct& p, GemvWeight weight, int64_t o, int64_t i) {
  if (weight == GemvWeight::kBFloat16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(p.w)[o * p.in + i]);
  }
  return static_cast<const float*>(p.w)[o * p.in + i];
}

// LaunchGroupedGemv's computation on host pointers (the same GroupedGemvArgs contract).
// Returns false, doing nothing, where the launcher would refuse the arguments
// (cudaErrorInvalidValue).
inline bool RunGroupedGemvOnHost(const GroupedGemvArgs& args) {
  if (!GroupedGemvArgsValid(args)) return false;
  if (args.M == 0) return true;
  const int M = args.M;
  const int vector = GemvVector(args.weight);
  const int64_t blocks = GemvBlocks(args);
  for (int64_t block = 0; block < blocks; ++block) {
    int g;
    int64_t tile;
    GemvLocate(args, block, &g, &tile);
    const GemvProduct& p = args.products[g];
    const int64_t chunks = GemvVectorChunks(p, args.weight);
    for (int warp = 0; warp < kGemvWarps; ++warp) {
      const int64_t o = tile * kGemvWarps + warp;
      if (o >= p.out) continue;
      // acc[lane][m], the lanes' accumulators.
      float acc[kGemvWarpSize][kGemvMaxRows] = {};
      for (int lane = 0; lane < kGemvWarpSize; ++lane) {
        for (int64_t c = lane; c < chunks; c += kGemvWarpSize) {
          for (int m = 0; m < M; ++m) {
            float a = acc[lane][m];
            for (int j = 0; j < vector; ++j) {
              const int64_t i = c * vector + j;
              a = GemvMac(a, p.x[m * p.x_stride + i], HostGemvWeight(p, args.weight, o, i),
                          p.input);
            }
            acc[lane][m] = a;
          }
        }
        for (int64_t i = chunks * vector + lane; i < p.in; i += kGemvWarpSize) {
          const float wi = HostGemvWeight(p, args.weight, o, i);
          for (int m = 0; m < M; ++m) {
            acc[lane][m] = GemvMac(acc[lane][m], p.x[m * p.x_stride + i], wi, p.input);
          }
        }
      }
      // The butterfly: every lane adds lane l ^ s's value, all lanes at once.
      for (int s = kGemvWarpSize / 2; s > 0; s /= 2) {
        float next[kGemvWarpSize][kGemvMaxRows];
        for (int lane = 0; lane < kGemvWarpSize; ++lane) {
          for (int m = 0; m < M; ++m) next[lane][m] = acc[lane][m] + acc[lane ^ s][m];
        }
        for (int lane = 0; lane < kGemvWarpSize; ++lane) {
          for (int m = 0; m < M; ++m) acc[lane][m] = next[lane][m];
        }
      }
      for (int m = 0; m < M; ++m) {
        const float residual =
            p.epilogue == GemvEpilogue::kResidual ? p.residual[m * p.residual_stride + o] : 0.0f;
        p.y[m * p.y_stride + o] = GemvFinish(acc[m][m], p.bias, o, p.epilogue, residual);
      }
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
