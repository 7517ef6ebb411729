// The grid and the per-thread body of the row copies (row_copy.h): the CUDA kernel
// (row_copy.cu) and its CPU mirror (row_copy_host.h) run these same functions, so the
// mirror's test covers the kernel's indexing. Torch-free, header-only.
//
// The grid: one block of kRowCopyThreads threads per (tensor, batch row, chunk), a chunk
// being kRowCopyChunkFloats consecutive floats of the row (the row's last chunk may be
// shorter): tensor t's blocks are [first_block[t], first_block[t + 1]), row-major over
// (b, chunk). So a [768] row is one block and a [12, 64, 64] row (49,152 floats) 24,
// and a launch has Σ_t n · ⌈row_floats[t] / kRowCopyChunkFloats⌉ blocks: at n = 1 the
// 0.1B RWKV-7 state alone is ~300 blocks, at n = 512 ~160,000. Within a chunk, thread i
// copies elements i, i + kRowCopyThreads, ... (coalesced): 16-byte vectors (two per
// thread) where the tensor's row length is a multiple of 4 floats and both of its
// pointers are 16-byte aligned, else single floats (eight per thread). Every load of a
// thread is issued before its first store.
#pragma once

#include <climits>
#include <cstdint>

#include "models/gpu/host_device.h"
#include "models/gpu/row_copy.h"

namespace fwmodel::kernels {

constexpr int kRowCopyThreads = 256;         // threads per block
constexpr int kRowCopyVectorsPerThread = 2;  // 16-byte vectors per thread and chunk
constexpr int kRowCopyFloatsPerThread = 4 * kRowCopyVectorsPerThread;
constexpr int64_t kRowCopyChunkFloats = int64_t{kRowCopyThreads} * kRowCopyFloatsPerThread;

// A launch's grid, from PlanRowCopy.
struct RowCopyGrid {
  int64_t blocks = 0;  // all tensors' blocks; ≤ INT_MAX (grid.x)
  int64_t first_block[kRowCopyMaxTensors + 1] =
      {};                // tensor t: [first_block[t], first_block[t + 1])
  uint64_t vectors = 0;  // bit t: tensor t is copied by 16-byte vectors
};

// Chunks (blocks) per row of `row_floats` floats.
FW_HOST_DEVICE inline int64_t RowCopyChunks(int64_t row_floats) {
  return row_floats / kRowCopyChunkFloats + (row_floats % kRowCopyChunkFloats != 0 ? 1 : 0);
}

// The grid of a launch of `args`, in *grid. False where the launchers refuse the
// arguments (row_copy.h: cudaErrorInvalidValue); true with grid->blocks 0 when there is
// nothing to do (count or n 0: then the pointers are not checked). Host only.
inline bool PlanRowCopy(const RowCopyArgs& args, RowCopyGrid* grid) {
  *grid = RowCopyGrid{};
  if (args.count < 0 || args.count > kRowCopyMaxTensors || args.n < 0 || args.pool_rows < 0) {
    return false;
  }
  for (int t = 0; t < args.count; ++t) {
    if (args.row_floats[t] < 1) return false;
  }
  if (args.count == 0 || args.n == 0) return true;
  if (args.rows == nullptr || args.n > INT_MAX) return false;
  int64_t blocks = 0;
  for (int t = 0; t < args.count; ++t) {
    if (args.pool[t] == nullptr || args.batch[t] == nullptr) return false;
    const int64_t chunks = RowCopyChunks(args.row_floats[t]);
    if (chunks > INT_MAX) return false;
    grid->first_block[t] = blocks;
    blocks += args.n * chunks;  // < 2⁶², both factors ≤ INT_MAX
    if (blocks > INT_MAX) return false;
    const uint64_t address =
        reinterpret_cast<uintptr_t>(args.pool[t]) | reinterpret_cast<uintptr_t>(args.batch[t]);
    if (args.row_floats[t] % 4 == 0 && address % 16 == 0) grid->vectors |= uint64_t{1} << t;
  }
  grid->first_block[args.count] = blocks;
  grid->blocks = blocks;
  return true;
}

// 4 floats moved as one 16-byte access on the GPU.
#if defined(__CUDACC__)
using RowCopyVec = float4;
#else
struct alignas(16) RowCopyVec {
  float x, y, z, w;
};
#endif

// The i-th 16-byte vector at p (16-byte aligned), read and written.
FW_HOST_DEVICE inline RowCopyVec RowCopyLoad(const float* p, int64_t i) {
#if defined(__CUDA_ARCH__)
  return reinterpret_cast<const float4*>(p)[i];
#else
  RowCopyVec v;
  __builtin_memcpy(&v, p + 4 * i, sizeof(v));
  return v;
#endif
}
FW_HOST_DEVICE inline void RowCopyStore(float* p, int64_t i, const RowCopyVec& v) {
#if defined(__CUDA_ARCH__)
  reinterpret_cast<float4*>(p)[i] = v;
#else
  __builtin_memcpy(p + 4 * i, &v, sizeof(v));
#endif
}

// Thread `thread`'s part of one chunk: floats [0, count) (count ≤ kRowCopyChunkFloats)
// of src into dst; zeros where src is null. vectors: count is a multiple of 4 and both
// pointers are 16-byte aligned.
FW_HOST_DEVICE inline void RowCopyChunkThread(const float* src, float* dst, int64_t count,
                                              bool vectors, int thread) {
  if (vectors) {
    const int64_t quads = count / 4;
    RowCopyVec v[kRowCopyVectorsPerThread] = {};
    for (int k = 0; k < kRowCopyVectorsPerThread; ++k) {
      const int64_t i = thread + int64_t{k} * kRowCopyThreads;
      if (i < quads && src != nullptr) v[k] = RowCopyLoad(src, i);
    }
    for (int k = 0; k < kRowCopyVectorsPerThread; ++k) {
      const int64_t i = thread + int64_t{k} * kRowCopyThreads;
      if (i < quads) RowCopyStore(dst, i, v[k]);
    }
    return;
  }
  float v[kRowCopyFloatsPerThread] = {};
  for (int k = 0; k < kRowCopyFloatsPerThread; ++k) {
    const int64_t i = thread + int64_t{k} * kRowCopyThreads;
    if (i < count && src != nullptr) v[k] = src[i];
  }
  for (int k = 0; k < kRowCopyFloatsPerThread; ++k) {
    const int64_t i = thread + int64_t{k} * kRowCopyThreads;
    if (i < count) dst[i] = v[k];
  }
}

// Thread `thread` of block `block` (< grid.blocks) of a launch of `args` planned as
// `grid`: gather (pool row rows[b] into batch row b; zeros for a row outside the pool)
// or scatter (batch row b into pool row rows[b]; nothing for a row outside the pool).
FW_HOST_DEVICE inline void RowCopyThread(const RowCopyArgs& args, const RowCopyGrid& grid,
                                         bool gather, int64_t block, int thread) {
  // The tensor: the last t with first_block[t] ≤ block (n ≥ 1 and row_floats ≥ 1, so
  // every tensor has blocks and first_block increases strictly).
  int lo = 0, hi = args.count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (grid.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int t = lo;
  const int64_t row_floats = args.row_floats[t];
  const int64_t chunks = RowCopyChunks(row_floats);
  const int64_t local = block - grid.first_block[t];
  const int64_t b = local / chunks, chunk = local % chunks;
  const int64_t begin = chunk * kRowCopyChunkFloats;
  const int64_t count =
      row_floats - begin < kRowCopyChunkFloats ? row_floats - begin : kRowCopyChunkFloats;
  const int64_t row = args.rows[b];
  const bool in_pool = row >= 0 && row < args.pool_rows;
  const bool vectors = ((grid.vectors >> t) & 1) != 0;
  float* pool = in_pool ? args.pool[t] + row * row_floats + begin : nullptr;
  float* batch = args.batch[t] + b * row_floats + begin;
  if (gather) {
    RowCopyChunkThread(pool, batch, count, vectors, thread);
  } else if (in_pool) {
    RowCopyChunkThread(batch, pool, count, vectors, thread);
  }
}

}  // namespace fwmodel::kernels
