// The state pool's row copies in one launch each (row_copy.cu): the rows of a step's
// batch gathered from every state tensor of the pool, and scattered back, for up to
// kRowCopyMaxTensors tensors at once (State::Gather / State::Scatter in
// models/architectures/model.cc; before, one index_select or index_copy_ per tensor).
// The grid and the per-thread body are row_copy_rule.h's; row_copy_host.h runs the same
// grid on the CPU. Torch-free and CUDA-free: the launchers take the stream as a
// `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The most tensors one launch copies (the argument struct, by value, stays within the
// 4 KB kernel parameter limit); a caller with more launches once per group.
constexpr int kRowCopyMaxTensors = 64;

// One launch. Device pointers, float32, contiguous. Tensor t (t < count) is a pool
// [pool_rows, row_floats[t]] at pool[t] and a batch [n, row_floats[t]] at batch[t]; a
// pool and a batch must not overlap (any tensor's with any other's).
struct RowCopyArgs {
  int count = 0;                  // tensors, 0..kRowCopyMaxTensors
  int64_t n = 0;                  // batch rows
  int64_t pool_rows = 0;          // the pools' rows (their first dimension)
  const int64_t* rows = nullptr;  // [n]: batch row b is pool row rows[b]
  float* pool[kRowCopyMaxTensors] = {};
  float* batch[kRowCopyMaxTensors] = {};
  int64_t row_floats[kRowCopyMaxTensors] = {};  // floats per row, ≥ 1
};

// batch[t][b] = pool[t][rows[b]] for every t < count and b < n, on `cuda_stream` (a
// cudaStream_t; null: the legacy default stream). A row outside [0, pool_rows) gives a
// zero batch row (index_select would fail a device assertion). Rows may repeat.
// Returns 0 (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue:
// count outside 0..kRowCopyMaxTensors, a negative n or pool_rows, a row_floats[t] < 1, a
// null pointer the launch needs, or more than 2³¹ − 1 blocks) or of the launch
// (cudaGetLastError); nothing to do when count or n is 0. Asynchronous; no allocation,
// no synchronisation: safe during CUDA Graph capture.
int LaunchRowGather(const RowCopyArgs& args, void* cuda_stream);

// pool[t][rows[b]] = batch[t][b] for every t < count and b < n: the inverse of
// LaunchRowGather, returning as it does. A row outside [0, pool_rows) is skipped. Rows
// should be distinct: a row that repeats gets, float by float, one of its batch rows'
// values, unspecified which (as index_copy_ on CUDA; the decode step's pad rows do).
int LaunchRowScatter(const RowCopyArgs& args, void* cuda_stream);

// Tensors [0, count) (pool[i], batch[i], row_floats[i] each) in launches of at most
// kRowCopyMaxTensors: `launch(args)` (a LaunchRowGather or LaunchRowScatter on a stream,
// or a CPU mirror, returning an int: 0 for success) once per group, in order. Returns the
// first non-zero result (the later groups are not launched), else 0. No launch when
// count ≤ 0.
template <typename Launch>
int LaunchRowCopyGroups(int64_t count, int64_t n, int64_t pool_rows, const int64_t* rows,
                        float* const* pool, float* const* batch, const int64_t* row_floats,
                        Launch&& launch) {
  for (int64_t first = 0; first < count; first += kRowCopyMaxTensors) {
    RowCopyArgs args;
    args.count =
        static_cast<int>(count - first < kRowCopyMaxTensors ? count - first : kRowCopyMaxTensors);
    args.n = n;
    args.pool_rows = pool_rows;
    args.rows = rows;
    for (int t = 0; t < args.count; ++t) {
      args.pool[t] = pool[first + t];
      args.batch[t] = batch[first + t];
      args.row_floats[t] = row_floats[first + t];
    }
    if (const int error = launch(static_cast<const RowCopyArgs&>(args)); error != 0) return error;
  }
  return 0;
}

// cudaGetErrorString of a LaunchRowGather or LaunchRowScatter result.
const char* RowCopyErrorString(int error);

}  // namespace fwmodel::kernels
