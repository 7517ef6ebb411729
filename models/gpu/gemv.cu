// The grouped GEMV kernel (gemv.h).
//
// One block of kGemvWarps warps per (product g, tile of kGemvWarps output rows), the
// products' tiles one after another (GemvLocate). Warp w takes output row o = tile ·
// kGemvWarps + w of its product (none past out_g: the warp returns; there are no
// barriers). Its lane l keeps kRows float accumulators (kRows the power of two ≥ M; rows
// ≥ M stay 0) and walks W's row o in 16-byte chunks c = l, l + 32, ... (4 float32 or 8
// bf16 each; consecutive lanes read consecutive 16 bytes, so a warp's load is 512
// contiguous bytes), reading each chunk once for all M rows and the matching x of each
// row (x is small and shared by every warp: L1/L2-resident), in groups of GemvUnroll(kRows)
// chunks whose loads are all issued before the group's multiply-adds (gemv_rule.h), then
// the tail elements one by one; gemv_rule.h's GemvMac per element, in order. A butterfly
// of shuffles (s = 16, ..., 1) gives every lane the row sums; lane m writes row m's
// GemvFinish. gemv_host.h runs this grid, warp by warp and lane by lane, on the CPU.
//
// Global memory is read-only except the y's, which no block of the launch reads (gemv.h:
// y overlaps no input, except a residual that is y itself, element by element).
#include <cuda_runtime.h>

#include "models/gpu/gemv.h"
#include "models/gpu/gemv_rule.h"

namespace fwmodel::kernels {
namespace {

static_assert(sizeof(GroupedGemvArgs) <= 4096, "GroupedGemvArgs: over the parameter limit");

template <int kRows, GemvWeight kWeight>
__global__ void __launch_bounds__(kGemvThreads) GroupedGemvKernel(const GroupedGemvArgs args) {
  const int warp = static_cast<int>(threadIdx.x) / kGemvWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kGemvWarpSize;
  int g;
  int64_t tile;
  GemvLocate(args, blockIdx.x, &g, &tile);
  const GemvProduct& p = args.products[g];
  const int64_t o = tile * kGemvWarps + warp;
  if (o >= p.out) return;
  const int M = args.M;
  const int64_t in = p.in, x_stride = p.x_stride;
  const GemvInput input = p.input;
  const float* __restrict__ x = p.x;

  float acc[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) acc[m] = 0.0f;

  const int64_t chunks = GemvVectorChunks(p, kWeight);
  // The vector part in groups of kUnroll chunks per lane (c, c + 32, ..., c + 32·(kUnroll
  // − 1)): all of a group's W loads (and, for kPreloadX, its x loads) are issued before its
  // first multiply-add, so a lane keeps kUnroll 16-byte loads of W in flight; a short row
  // (in ≤ 32·kUnroll·GemvVector) is one group. Chunks past `chunks` are neither loaded nor
  // added. The multiply-adds run in the chunks' order, as gemv_rule.h states.
  constexpr int kUnroll = GemvUnroll(kRows);
  constexpr bool kPreloadX = GemvPreloadX(kRows, kWeight);
  if constexpr (kWeight == GemvWeight::kFloat32) {
    const float4* __restrict__ w_row = reinterpret_cast<const float4*>(p.w) + o * chunks;
    for (int64_t c0 = lane; c0 < chunks; c0 += kGemvWarpSize * kUnroll) {
      float4 wv[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t c = c0 + k * kGemvWarpSize;
        wv[k] = c < chunks ? __ldg(w_row + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float4 xv[kPreloadX ? kUnroll * kRows : 1];
      if constexpr (kPreloadX) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int64_t c = c0 + k * kGemvWarpSize;
#pragma unroll
          for (int m = 0; m < kRows; ++m) {
            xv[k * kRows + m] = c < chunks && m < M
                                    ? __ldg(reinterpret_cast<const float4*>(x + m * x_stride) + c)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t c = c0 + k * kGemvWarpSize;
        if (c < chunks) {
#pragma unroll
          for (int m = 0; m < kRows; ++m) {
            if (m < M) {
              float4 xm;
              if constexpr (kPreloadX) {
                xm = xv[k * kRows + m];
              } else {
                xm = __ldg(reinterpret_cast<const float4*>(x + m * x_stride) + c);
              }
              float a = acc[m];
              a = GemvMac(a, xm.x, wv[k].x, input);
              a = GemvMac(a, xm.y, wv[k].y, input);
              a = GemvMac(a, xm.z, wv[k].z, input);
              a = GemvMac(a, xm.w, wv[k].w, input);
              acc[m] = a;
            }
          }
        }
      }
    }
    const float* __restrict__ w_scalar = static_cast<const float*>(p.w) + o * in;
    for (int64_t i = chunks * 4 + lane; i < in; i += kGemvWarpSize) {
      const float wi = __ldg(w_scalar + i);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) acc[m] = GemvMac(acc[m], __ldg(x + m * x_stride + i), wi, input);
      }
    }
  } else {
    const uint4* __restrict__ w_row = reinterpret_cast<const uint4*>(p.w) + o * chunks;
    for (int64_t c0 = lane; c0 < chunks; c0 += kGemvWarpSize * kUnroll) {
      uint4 wv[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t c = c0 + k * kGemvWarpSize;
        wv[k] = c < chunks ? __ldg(w_row + c) : make_uint4(0u, 0u, 0u, 0u);
      }
      float4 xv[kPreloadX ? 2 * kUnroll * kRows : 1];
      if constexpr (kPreloadX) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int64_t c = c0 + k * kGemvWarpSize;
#pragma unroll
          for (int m = 0; m < kRows; ++m) {
            const float4* x_row = reinterpret_cast<const float4*>(x + m * x_stride) + 2 * c;
            const bool live = c < chunks && m < M;
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            xv[2 * (k * kRows + m)] = live ? __ldg(x_row) : zero;
            xv[2 * (k * kRows + m) + 1] = live ? __ldg(x_row + 1) : zero;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t c = c0 + k * kGemvWarpSize;
        if (c < chunks) {
#pragma unroll
          for (int m = 0; m < kRows; ++m) {
            if (m < M) {
              float4 x0, x1;
              if constexpr (kPreloadX) {
                x0 = xv[2 * (k * kRows + m)];
                x1 = xv[2 * (k * kRows + m) + 1];
              } else {
                const float4* x_row = reinterpret_cast<const float4*>(x + m * x_stride) + 2 * c;
                x0 = __ldg(x_row);
                x1 = __ldg(x_row + 1);
              }
              float a = acc[m];
              a = GemvMac(a, x0.x, Bf16LowOf(wv[k].x), input);
              a = GemvMac(a, x0.y, Bf16HighOf(wv[k].x), input);
              a = GemvMac(a, x0.z, Bf16LowOf(wv[k].y), input);
              a = GemvMac(a, x0.w, Bf16HighOf(wv[k].y), input);
              a = GemvMac(a, x1.x, Bf16LowOf(wv[k].z), input);
              a = GemvMac(a, x1.y, Bf16HighOf(wv[k].z), input);
              a = GemvMac(a, x1.z, Bf16LowOf(wv[k].w), input);
              a = GemvMac(a, x1.w, Bf16HighOf(wv[k].w), input);
              acc[m] = a;
            }
          }
        }
      }
    }
    const unsigned short* __restrict__ w_scalar = static_cast<const unsigned short*>(p.w) + o * in;
    for (int64_t i = chunks * 8 + lane; i < in; i += kGemvWarpSize) {
      const float wi = Bf16ToFloat(__ldg(w_scalar + i));
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) acc[m] = GemvMac(acc[m], __ldg(x + m * x_stride + i), wi, input);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kRows; ++m) {
#pragma unroll
    for (int s = kGemvWarpSize / 2; s > 0; s /= 2) {
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], s);
    }
  }
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m < M && lane == m) {
      const float residual =
          p.epilogue == GemvEpilogue::kResidual ? p.residual[m * p.residual_stride + o] : 0.0f;
      p.y[m * p.y_stride + o] = GemvFinish(acc[m], p.bias, o, p.epilogue, residual);
    }
  }
}

template <int kRows>
void LaunchRows(const GroupedGemvArgs& args, dim3 grid, cudaStream_t stream) {
  if (args.weight == GemvWeight::kBFloat16) {
    GroupedGemvKernel<kRows, GemvWeight::kBFloat16><<<grid, kGemvThreads, 0, stream>>>(args);
  } else {
    GroupedGemvKernel<kRows, GemvWeight::kFloat32><<<grid, kGemvThreads, 0, stream>>>(args);
  }
}

}  // namespace

int LaunchGroupedGemv(const GroupedGemvArgs& args, void* cuda_stream) {
  if (!GroupedGemvArgsValid(args)) return cudaErrorInvalidValue;
  if (args.M == 0) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const dim3 grid(static_cast<unsigned>(GemvBlocks(args)));
  switch (GemvRowBucket(args.M)) {
    case 1:
      LaunchRows<1>(args, grid, stream);
      break;
    case 2:
      LaunchRows<2>(args, grid, stream);
      break;
    case 4:
      LaunchRows<4>(args, grid, stream);
      break;
    case 8:
      LaunchRows<8>(args, grid, stream);
      break;
    default:
      LaunchRows<kGemvMaxRows>(args, grid, stream);
      break;
  }
  return cudaGetLastError();
}

const char* GemvErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
