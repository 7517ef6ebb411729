// The row copies of row_copy.h: one kernel, gather or scatter, over row_copy_rule.h's
// grid (one block per (tensor, batch row, chunk), kRowCopyThreads threads) and
// per-thread body. The arguments are __grid_constant__: the body indexes their arrays
// with the block's tensor, read in place from the parameter space (no copy to local
// memory). row_copy_host.h runs the same grid on the CPU. Torch-free: compiled by nvcc
// alone.
#include <cuda_runtime.h>

#include "models/gpu/row_copy.h"
#include "models/gpu/row_copy_rule.h"

namespace fwmodel::kernels {
namespace {

template <bool kGather>
__global__ void __launch_bounds__(kRowCopyThreads)
    RowCopyKernel(const __grid_constant__ RowCopyArgs args,
                  const __grid_constant__ RowCopyGrid grid) {
  RowCopyThread(args, grid, kGather, blockIdx.x, static_cast<int>(threadIdx.x));
}

template <bool kGather>
int Launch(const RowCopyArgs& args, void* cuda_stream) {
  RowCopyGrid grid;
  if (!PlanRowCopy(args, &grid)) return cudaErrorInvalidValue;
  if (grid.blocks == 0) return cudaSuccess;
  RowCopyKernel<kGather><<<static_cast<unsigned>(grid.blocks), kRowCopyThreads, 0,
                           static_cast<cudaStream_t>(cuda_stream)>>>(args, grid);
  return cudaGetLastError();
}

}  // namespace

int LaunchRowGather(const RowCopyArgs& args, void* cuda_stream) {
  return Launch<true>(args, cuda_stream);
}

int LaunchRowScatter(const RowCopyArgs& args, void* cuda_stream) {
  return Launch<false>(args, cuda_stream);
}

const char* RowCopyErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
