// The grouped GEMV kernel (gemv.h).
//
// One block of kGemvWarps warps per (product g, tile of kGemvWarps output rows), the
// products' tiles one after another (GemvLocate). Warp w takes output row o = tile ·
// kGemvWarps + w of its product (none past out_g: the warp returns; there are no
// barriers). Its lane l keeps kRows float accumulators (kRows the power of two ≥ M; rows
// ≥ M stay 0) and walks W's row o in 16-byte chunks c = l, l + 32, ... (4 float32 or 8
// bf16 each; consecutive lanes read consecutive 16 bytes, so a warp's load is 512
// contiguous bytes), reading each chunk once for all M rows and the matching x of each
// row (x is small and shared by every warp: L1/L2-resident), then the tail elements one
// by one; gemv_rule.h's GemvMac per element, in order. A butterfly of shuffles (s = 16,
// ..., 1) gives every lane the row sums; lane m writes row m's GemvFinish. gemv_host.h
// runs this grid, warp by warp and lane by lane, on the CPU.
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
  if constexpr (kWeight == GemvWeight::kFloat32) {
    const float4* __restrict__ w_row = reinterpret_cast<const float4*>(p.w) + o * chunks;
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += kGemvWarpSize) {
      const float4 wv = __ldg(w_row + c);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) {
          const float4 xv = __ldg(reinterpret_cast<const float4*>(x + m * x_stride) + c);
          float a = acc[m];
          a = GemvMac(a, xv.x, wv.x, input);
          a = GemvMac(a, xv.y, wv.y, input);
          a = GemvMac(a, xv.z, wv.z, input);
          a = GemvMac(a, xv.w, wv.w, input);
          acc[m] = a;
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
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += kGemvWarpSize) {
      const uint4 wv = __ldg(w_row + c);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) {
          const float4* x_row = reinterpret_cast<const float4*>(x + m * x_stride) + 2 * c;
          const float4 x0 = __ldg(x_row), x1 = __ldg(x_row + 1);
          float a = acc[m];
          a = GemvMac(a, x0.x, Bf16LowOf(wv.x), input);
          a = GemvMac(a, x0.y, Bf16HighOf(wv.x), input);
          a = GemvMac(a, x0.z, Bf16LowOf(wv.y), input);
          a = GemvMac(a, x0.w, Bf16HighOf(wv.y), input);
          a = GemvMac(a, x1.x, Bf16LowOf(wv.z), input);
          a = GemvMac(a, x1.y, Bf16HighOf(wv.z), input);
          a = GemvMac(a, x1.z, Bf16LowOf(wv.w), input);
          a = GemvMac(a, x1.w, Bf16HighOf(wv.w), input);
          acc[m] = a;
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
