// The sampling kernel (sample.h): plain (SampleKernel<pass, false>) and filtered
// (SampleKernel<0, true>, one block per row only). A mask (SampleArgs::allowed; one block
// per row) makes a disallowed id's adjusted logit −inf everywhere below, and phase 1 also
// finds the row's first allowed id (a min), the token where no allowed logit is finite.
//
// One block per row, kSampleThreads threads (16 warps); thread t owns the contiguous ids
// [t · chunk, (t + 1) · chunk) of the row (chunk = ceil(V / threads) rounded up to a
// multiple of 4: SampleChunk), so every running sum below goes in id order; a thread
// reads its ids four at a time (float4) where the row is 16-byte aligned. Phases, each
// ending in a barrier:
//  0. (only with penalty or bias entries) The row's n entries become keys (id << 32 |
//     entry), ranked by comparison with all others (n²/threads per thread; n is the
//     penalty width, 64 in the graphed step) into sorted order in shared memory; the
//     first entry of each id's run resolves that id's adjusted logit: raw, penalised
//     once if any penalty entry names it, plus its bias entries in entry order. Then the
//     sorted (id, adjusted logit) pairs, over the keys' memory. Each thread finds the
//     first pair at or after its chunk by binary search and walks the pairs along its ids.
//  1. Each thread: the argmax (first of equals) of the adjusted logits (non-finite =
//     −inf) and the max of the finite raw logits over its ids; the block's by a warp
//     butterfly (__shfl_xor 16, 8, 4, 2, 1) and then the warps' results combined in
//     warp order by every thread.
//  F. (the filters, SampleKernel<0, true>; not greedy) The row's cuts (sample_rule.h's
//     SampleFilter): top_k's value, the largest float32 bits b with count(bits(p) ≥ b) ≥
//     keep, by binary search over [0, kSampleMaxBits] (31 candidates, each a pass over
//     the thread's ids and a block count), then its last tie id: the ties counted per
//     thread, scanned in thread (= id) order, the thread holding the wanted one walks to
//     it. top_p (< 1): T = Σ p over A (the tokens top_k and min_p keep), then the largest
//     bits whose share Σ p/T over A at or above them reaches top_p (a binary search,
//     each candidate a float64 block sum in the fixed order below), the share above and
//     the ties, SampleNucleusTies for how many ties the cut keeps, and its last tie id as
//     for top_k. Phases 2 and 3 then take p through SampleFiltered. About 65 passes over
//     the row at most; no sort, no scratch.
//  2. Each thread over its ids, in order: Σ exp(ℓ − max ℓ) (the log-softmax's
//     normaliser), and, unless the row is greedy, its chunk's probability mass Σ p and
//     its last id with p > 0. The normaliser: warp butterfly then warps in order; the
//     last positive: the max; the chunk masses: an exclusive scan (Hillis–Steele
//     __shfl_up 1, 2, 4, 8, 16 in the warp, then the warps' totals summed in warp order)
//     that gives each thread the mass before its chunk and every thread the row's mass.
//  3. (not greedy) Each thread walks its ids again from its offset, summing p in order,
//     and stops at the first id with p > 0 whose running sum exceeds u · mass; the
//     block's lowest such id by a butterfly min then warps in order.
// Then thread 0 writes (token, log-probability). Every float64 sum is a sequential sum
// inside a thread, a fixed butterfly or scan inside a warp and a sequential sum over the
// warps: sample_host.h repeats exactly these operations, so the mirror's results are
// the kernel's up to expf/exp/log (CUDA's against glibc's). Against a sequential sum over
// the whole row (SampleToken) only the rounding of the running sums differs: the token is
// the same unless u · mass falls within a few ulps of a boundary between two tokens.
//
// Chunked (SampleChunksPerRow = C > 1, fewer than kSampleChunkedRowsBelow rows): the row's
// grid is C blocks of kSampleThreads, thread c · kSampleThreads + t of it owning the ids
// as above with chunk = SampleChunk(V, C · kSampleThreads), in four launches on the
// stream: pass 1 (phases 0 and 1; each block's argmax and raw max to partials), pass 2
// (phase 0, the chunks' argmax combined, phase 2; each block's normaliser, mass and last
// positive), pass 3 (phase 0, the argmax, phase 2's masses and scan again, the mass
// before the block from the partials, phase 3; each block's first crossing) and a finish
// kernel (one thread per row: every partial combined, the output). The chunks combine
// in chunk order through sample_rule.h's SampleCombineChunks, which the mirror runs too;
// a block's own offsets are the single-block kernel's with the mass before its chunk
// added in front.
//
// Global memory is read only, except out, which only thread 0 of each row (or the
// finish's thread of the row) writes, and partials, where thread 0 of each block writes
// its own entry. No allocation, no synchronisation with the host, no counters.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "models/gpu/sample.h"
#include "models/gpu/sample_rule.h"

namespace fwmodel::kernels {
namespace {

constexpr int kWarps = kSampleThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kSampleThreads % 32 == 0 && kWarps >= 1 && kWarps <= 32,
              "kSampleThreads: whole warps, at most 32 of them");
static_assert(kSampleMaxAdjustments < (int64_t{1} << 31), "entries fit a key's low 32 bits");

constexpr int64_t kEntryMask = 0xffffffff;
constexpr int kFinishThreads = 64;

// Id i's logit after the penalty and bias (the sorted pairs from `*next` on; *next moves
// past i's pairs when it has some) and the row's mask (null: none), −inf where not finite
// or not allowed.
__device__ __forceinline__ float AdjustedLogit(float raw, int64_t i, const int32_t* s_id,
                                               const float* s_value, int64_t n, int64_t* next,
                                               const uint8_t* __restrict__ mask) {
  float x = raw;
  int64_t j = *next;
  if (j < n && s_id[j] == i) {
    x = s_value[j];
    do {
      ++j;
    } while (j < n && s_id[j] == i);
    *next = j;
  }
  if (mask != nullptr && mask[i] == 0) return -INFINITY;
  return SampleFiniteOrMinusInf(x);
}

// Calls body(i, logits[i]) for i = begin, ..., end − 1 in order until it returns true,
// reading four floats at a time when `aligned` (logits + begin 16-byte aligned: begin is
// a multiple of 4, SampleChunk).
template <class Body>
__device__ __forceinline__ void ForEachLogit(const float* __restrict__ logits, int64_t begin,
                                             int64_t end, bool aligned, Body body) {
  int64_t i = begin;
  if (aligned) {
    for (; i + 4 <= end; i += 4) {
      const float4 four = *reinterpret_cast<const float4*>(logits + i);
      if (body(i, four.x) || body(i + 1, four.y) || body(i + 2, four.z) || body(i + 3, four.w)) {
        return;
      }
    }
  }
  for (; i < end; ++i) {
    if (body(i, logits[i])) return;
  }
}

// The block's Σ count (exact), to every thread. Barriers before and after: `s` (kWarps
// entries) may be reused by the next call.
__device__ __forceinline__ int64_t BlockCount(int64_t count, int64_t* s, int lane, int warp) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) count += __shfl_xor_sync(kFullMask, count, o);
  __syncthreads();
  if (lane == 0) s[warp] = count;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += s[w];
  return total;
}

// The block's Σ value in the kernel's fixed order (a butterfly in each warp, then 0.0 +
// the warps in order; sample_host.h's BlockSum), and the max of `bits`, to every thread.
__device__ __forceinline__ double BlockSumMax(double value, uint32_t* bits, double* s,
                                              uint32_t* s_bits, int lane, int warp) {
  uint32_t most = *bits;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    value += __shfl_xor_sync(kFullMask, value, o);
    const uint32_t other = __shfl_xor_sync(kFullMask, most, o);
    if (other > most) most = other;
  }
  __syncthreads();
  if (lane == 0) {
    s[warp] = value;
    s_bits[warp] = most;
  }
  __syncthreads();
  double total = 0.0;
  most = 0;
  for (int w = 0; w < kWarps; ++w) {
    total += s[w];
    if (s_bits[w] > most) most = s_bits[w];
  }
  *bits = most;
  return total;
}

// The Σ of `count` over the threads before this one (thread order), and the block's Σ in
// *total. Barriers before and after.
__device__ __forceinline__ int64_t BlockCountBefore(int64_t count, int64_t* s, int lane, int warp,
                                                    int64_t* total) {
  int64_t inclusive = count;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t below = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  __syncthreads();
  if (lane == 31) s[warp] = inclusive;
  __syncthreads();
  int64_t base = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) base = sum;
    sum += s[w];
  }
  *total = sum;
  return base + inclusive - count;
}

// kPass 0: the whole row in one block (chunks = 1, block = row), with the filters where
// kFilters. kPass 1, 2, 3 (never kFilters): block
// row · chunks + c takes chunk c of the row (ids of the threads c · kSampleThreads, ...,
// (c + 1) · kSampleThreads − 1 of a grid of chunks · kSampleThreads), pass 1 writing its
// argmax and raw max, pass 2 its normaliser, mass and last positive, pass 3 its first
// crossing to partials[block]; passes 2 and 3 combine the earlier passes' partials of
// the row in chunk order (SampleCombineChunks).
template <int kPass, bool kFilters>
__global__ void __launch_bounds__(kSampleThreads, kFilters ? 1 : 2)
    SampleKernel(const SampleArgs args, int chunks) {
  // 2n int64: the keys, then the sorted keys; after the sort the keys' bytes hold the n
  // sorted ids (int32) and then their n adjusted logits (float).
  extern __shared__ int64_t s_entries[];
  __shared__ float s_best_value[kWarps], s_raw_top[kWarps];
  __shared__ int64_t s_best_index[kWarps], s_last[kWarps], s_found[kWarps];
  __shared__ double s_total[kWarps], s_mass[kWarps];
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, warp = t >> 5;
  const int64_t block = blockIdx.x, row = block / chunks, c = block % chunks;
  const int64_t vocab = args.vocab;
  const float* __restrict__ logits = args.logits + row * vocab;
  const uint8_t* __restrict__ mask = args.allowed == nullptr ? nullptr : args.allowed + row * vocab;
  const int64_t W = args.penalty_width, n = W + args.bias_width;
  int64_t* s_key = s_entries;
  int64_t* s_sorted = s_entries + n;
  int32_t* s_id = reinterpret_cast<int32_t*>(s_entries);
  float* s_value = reinterpret_cast<float*>(s_entries) + n;

  // ---- 0. The penalty and bias entries, sorted by id, resolved.
  if (n > 0) {
    for (int64_t e = t; e < n; e += kSampleThreads) {
      int64_t id = e < W ? args.penalty_index[row * W + e]
                         : args.bias_index[row * args.bias_width + (e - W)];
      if (id < 0 || id >= vocab) id = vocab;  // skipped: no id of the row is vocab
      s_key[e] = (id << 32) | e;
    }
    __syncthreads();
    for (int64_t e = t; e < n; e += kSampleThreads) {
      const int64_t key = s_key[e];
      int64_t rank = 0;
      for (int64_t f = 0; f < n; ++f) rank += s_key[f] < key ? 1 : 0;
      s_sorted[rank] = key;
    }
    __syncthreads();
    const float factor = W > 0 ? static_cast<float>(args.penalty_factor[row]) : 1.0f;
    for (int64_t e = t; e < n; e += kSampleThreads) {
      const int64_t id = s_sorted[e] >> 32;
      if (e > 0 && (s_sorted[e - 1] >> 32) == id) continue;  // not the first of its id
      int64_t stop = e;
      bool penalised = false;
      while (stop < n && (s_sorted[stop] >> 32) == id) {
        penalised = penalised || (s_sorted[stop] & kEntryMask) < W;
        ++stop;
      }
      float value = 0.0f;
      if (id < vocab) {
        value = logits[id];
        if (penalised) value = SamplePenalized(value, factor);
        for (int64_t k = e; k < stop; ++k) {
          const int64_t entry = s_sorted[k] & kEntryMask;
          if (entry >= W) value += args.bias_value[row * args.bias_width + (entry - W)];
        }
      }
      for (int64_t k = e; k < stop; ++k) {
        s_id[k] = static_cast<int32_t>(id);
        s_value[k] = value;
      }
    }
    __syncthreads();
  }
  const int64_t chunk = SampleChunk(vocab, kSampleThreads * chunks);
  const int64_t vt = c * kSampleThreads + t;  // the thread in the row's grid of chunks
  const int64_t begin = vt * chunk < vocab ? vt * chunk : vocab;
  const int64_t end = begin + chunk < vocab ? begin + chunk : vocab;
  int64_t first = 0;  // the first sorted pair at or after begin
  {
    int64_t hi = n;
    while (first < hi) {
      const int64_t mid = (first + hi) / 2;
      if (s_id[mid] < begin) {
        first = mid + 1;
      } else {
        hi = mid;
      }
    }
  }

  // ---- 1. The argmax of the adjusted logits and the max of the finite raw ones.
  float best_value = -INFINITY, raw_top = -INFINITY;
  int64_t best_index = INT64_MAX, first_allowed = INT64_MAX;
  const bool aligned = (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  if (kPass <= 1) {
    int64_t next = first;
    ForEachLogit(logits, begin, end, aligned, [&](int64_t i, float raw) {
      const float x = AdjustedLogit(raw, i, s_id, s_value, n, &next, mask);
      if (SampleArgmaxBeats(x, i, best_value, best_index)) {
        best_value = x;
        best_index = i;
      }
      if (SampleIsFinite(raw) && raw > raw_top) raw_top = raw;
      if (mask != nullptr && mask[i] != 0 && i < first_allowed) first_allowed = i;
      return false;
    });
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const int64_t allowed = __shfl_xor_sync(kFullMask, first_allowed, o);
      if (allowed < first_allowed) first_allowed = allowed;
      const float value = __shfl_xor_sync(kFullMask, best_value, o);
      const int64_t index = __shfl_xor_sync(kFullMask, best_index, o);
      const float top = __shfl_xor_sync(kFullMask, raw_top, o);
      if (SampleArgmaxBeats(value, index, best_value, best_index)) {
        best_value = value;
        best_index = index;
      }
      if (top > raw_top) raw_top = top;
    }
    if (lane == 0) {
      s_best_value[warp] = best_value;
      s_best_index[warp] = best_index;
      s_raw_top[warp] = raw_top;
      s_found[warp] = first_allowed;
    }
    __syncthreads();
    best_value = s_best_value[0];
    best_index = s_best_index[0];
    raw_top = s_raw_top[0];
    first_allowed = s_found[0];
    for (int w = 1; w < kWarps; ++w) {
      if (SampleArgmaxBeats(s_best_value[w], s_best_index[w], best_value, best_index)) {
        best_value = s_best_value[w];
        best_index = s_best_index[w];
      }
      if (s_raw_top[w] > raw_top) raw_top = s_raw_top[w];
      if (s_found[w] < first_allowed) first_allowed = s_found[w];
    }
    // The mask allows no finite logit: the first allowed token, drawn as greedy (top −inf).
    if (!SampleIsFinite(best_value) && first_allowed != INT64_MAX) best_index = first_allowed;
    if (kPass == 1) {
      if (t == 0) {
        SampleChunkPartial& mine = args.partials[block];
        mine.best_value = best_value;
        mine.best_index = best_index;
        mine.raw_top = raw_top;
      }
      return;
    }
  } else {
    const SampleChunkResult whole =
        SampleCombineChunks(args.partials + row * chunks, chunks, -1, 1);
    best_value = whole.best_value;
    best_index = whole.best_index;
    raw_top = whole.raw_top;
  }
  const float top = best_value;
  const float temperature = static_cast<float>(args.temperature[row]);
  const bool greedy = SampleIsGreedy(temperature, top);
  if (kPass == 3 && greedy) {  // the same for every block of the row
    if (t == 0) args.partials[block].found = INT64_MAX;
    return;
  }

  // ---- F. (kFilters, not greedy) The row's cuts: each a binary search over the float32
  // bits of the probabilities with a block-wide count or share per candidate, then the
  // ties at the value found counted in id order (thread order is id order).
  SampleFilter filter;
  if (kFilters && !greedy) {
    __shared__ int64_t s_counts[kWarps], s_cut;
    __shared__ double s_sums[kWarps];
    __shared__ uint32_t s_bits[kWarps];
    // Calls body(i, p) for the thread's ids in order, p the unfiltered probability.
    auto each_p = [&](auto body) {
      int64_t next = first;
      ForEachLogit(logits, begin, end, aligned, [&](int64_t i, float raw) {
        body(i, SampleProbability(AdjustedLogit(raw, i, s_id, s_value, n, &next, mask), top,
                                  temperature));
        return false;
      });
    };
    // The id of the `want`-th (from 1) token of the row with in(i, p), where `before` of
    // them precede this thread's and `mine` are its own, to every thread.
    auto nth_id = [&](int64_t want, int64_t before, int64_t mine, auto in) {
      if (want > before && want <= before + mine) {
        int64_t seen = before;
        each_p([&](int64_t i, double p) {
          if (in(i, p) && ++seen == want) s_cut = i;
        });
      }
      __syncthreads();
      return s_cut;
    };
    const int64_t keep = SampleKeepCount(args.top_k[row], vocab);
    if (keep == 0) {
      filter.k_bits = kSampleNoBits;
      filter.k_last = -1;
    } else if (keep < vocab) {  // the value of rank keep − 1: the largest bits ≥ which keep are
      uint32_t lo = 0, hi = kSampleMaxBits;
      while (lo < hi) {
        const uint32_t mid = SampleSearchMid(lo, hi);
        int64_t count = 0;
        each_p([&](int64_t, double p) { count += SampleBits(p) >= mid ? 1 : 0; });
        if (BlockCount(count, s_counts, lane, warp) >= keep) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      int64_t above = 0, ties = 0;
      each_p([&](int64_t, double p) {
        const uint32_t bits = SampleBits(p);
        above += bits > lo ? 1 : 0;
        ties += bits == lo ? 1 : 0;
      });
      const int64_t all_above = BlockCount(above, s_counts, lane, warp);
      int64_t all_ties = 0;
      const int64_t before = BlockCountBefore(ties, s_counts, lane, warp, &all_ties);
      filter.k_bits = lo;
      filter.k_last = nth_id(keep - all_above, before, ties,
                             [&](int64_t, double p) { return SampleBits(p) == lo; });
    }
    filter.min_p = args.min_p[row];
    const double top_p = args.top_p[row];
    if (top_p < 1.0) {
      double kept = 0.0;
      uint32_t hi = 0;
      each_p([&](int64_t i, double p) {
        if (!SampleInTopKMinP(filter, p, i)) return;
        kept += p;
        const uint32_t bits = SampleBits(p);
        if (bits > hi) hi = bits;
      });
      const double total_kept = BlockSumMax(kept, &hi, s_sums, s_bits, lane, warp);
      if (total_kept > 0.0) {  // else A has no mass: nothing to cut
        // The largest bits whose share (A's tokens at or above them) reaches top_p; 0:
        // none does (A's zeros add nothing to the share of its smallest positive value).
        uint32_t lo = 0;
        while (lo < hi) {
          const uint32_t mid = SampleSearchMid(lo, hi);
          double share = 0.0;
          each_p([&](int64_t i, double p) {
            if (SampleBits(p) >= mid && SampleInTopKMinP(filter, p, i)) share += p / total_kept;
          });
          uint32_t unused = 0;
          if (BlockSumMax(share, &unused, s_sums, s_bits, lane, warp) >= top_p) {
            lo = mid;
          } else {
            hi = mid - 1;
          }
        }
        if (lo > 0) {
          double above = 0.0;
          int64_t ties = 0;
          each_p([&](int64_t i, double p) {
            if (!SampleInTopKMinP(filter, p, i)) return;
            const uint32_t bits = SampleBits(p);
            if (bits > lo) above += p / total_kept;
            ties += bits == lo ? 1 : 0;
          });
          uint32_t unused = 0;
          const double share_above = BlockSumMax(above, &unused, s_sums, s_bits, lane, warp);
          int64_t all_ties = 0;
          const int64_t before = BlockCountBefore(ties, s_counts, lane, warp, &all_ties);
          const double value = static_cast<double>(__uint_as_float(lo));
          const int64_t m = SampleNucleusTies(share_above, value / total_kept, all_ties, top_p);
          filter.p_bits = lo;
          filter.p_last = nth_id(m, before, ties, [&](int64_t i, double p) {
            return SampleBits(p) == lo && SampleInTopKMinP(filter, p, i);
          });
        }
      }
    }
  }

  // ---- 2. The normaliser, the chunks' masses (scanned) and the last positive id.
  double total = 0.0, mass = 0.0;
  int64_t last_positive = -1;
  {
    int64_t next = first;
    ForEachLogit(logits, begin, end, aligned, [&](int64_t i, float raw) {
      if (kPass != 3) total += SampleSoftmaxTerm(raw, raw_top);
      if (greedy) return false;
      double p =
          SampleProbability(AdjustedLogit(raw, i, s_id, s_value, n, &next, mask), top, temperature);
      if (kFilters) p = SampleFiltered(filter, p, i);
      mass += p;
      if (p > 0.0) last_positive = i;
      return false;
    });
  }
  double inclusive = mass;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    total += __shfl_xor_sync(kFullMask, total, o);
    const int64_t last = __shfl_xor_sync(kFullMask, last_positive, o);
    if (last > last_positive) last_positive = last;
  }
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const double below = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  double offset = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) offset = 0.0;
  if (lane == 0) {
    s_total[warp] = total;
    s_last[warp] = last_positive;
  }
  if (lane == 31) s_mass[warp] = inclusive;
  __syncthreads();
  total = 0.0;
  last_positive = -1;
  double row_mass = 0.0, base = 0.0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) base = row_mass;
    total += s_total[w];
    row_mass += s_mass[w];
    if (s_last[w] > last_positive) last_positive = s_last[w];
  }
  offset = base + offset;
  if (kPass == 2) {
    if (t == 0) {
      SampleChunkPartial& mine = args.partials[block];
      mine.total = total;
      mine.mass = row_mass;
      mine.last_positive = last_positive;
    }
    return;
  }
  if (kPass == 3) {  // the mass before the chunk and the row's, in chunk order
    const SampleChunkResult whole = SampleCombineChunks(args.partials + row * chunks, chunks, c, 2);
    offset = whole.mass_before + offset;
    row_mass = whole.mass;
  }

  // ---- 3. The first id whose running sum exceeds u · mass.
  int64_t found = INT64_MAX;
  if (!greedy) {
    const double target = args.uniform[row] * row_mass;
    double running = offset;
    int64_t next = first;
    ForEachLogit(logits, begin, end, aligned, [&](int64_t i, float raw) {
      double p =
          SampleProbability(AdjustedLogit(raw, i, s_id, s_value, n, &next, mask), top, temperature);
      if (kFilters) p = SampleFiltered(filter, p, i);
      running += p;
      if (p > 0.0 && running > target) {
        found = i;
        return true;
      }
      return false;
    });
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const int64_t other = __shfl_xor_sync(kFullMask, found, o);
      if (other < found) found = other;
    }
    if (lane == 0) s_found[warp] = found;
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
      if (s_found[w] < found) found = s_found[w];
    }
  }
  if (kPass == 3) {
    if (t == 0) args.partials[block].found = found;
    return;
  }
  if (t == 0) {
    const int64_t token =
        SampleChooseToken(greedy, best_index, found == INT64_MAX ? -1 : found, last_positive);
    args.out[2 * row] = static_cast<double>(token);
    args.out[2 * row + 1] = SampleLogProb(logits[token], raw_top, total);
  }
}

// LaunchSample's fourth chunked launch: one thread per row combines the row's partials in
// chunk order and writes (token, log-probability).
__global__ void __launch_bounds__(kFinishThreads)
    SampleFinishKernel(const SampleArgs args, int chunks) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kFinishThreads + threadIdx.x;
  if (row >= args.rows) return;
  const SampleChunkResult whole = SampleCombineChunks(args.partials + row * chunks, chunks, -1, 3);
  const bool greedy = SampleIsGreedy(static_cast<float>(args.temperature[row]), whole.best_value);
  const int64_t token = SampleChooseToken(
      greedy, whole.best_index, whole.found == INT64_MAX ? -1 : whole.found, whole.last_positive);
  args.out[2 * row] = static_cast<double>(token);
  args.out[2 * row + 1] =
      SampleLogProb(args.logits[row * args.vocab + token], whole.raw_top, whole.total);
}

}  // namespace

int LaunchSample(const SampleArgs& args, void* cuda_stream) {
  if (args.rows < 0 || args.rows > INT_MAX || args.vocab < 1 || args.vocab > INT_MAX ||
      args.penalty_width < 0 || args.bias_width < 0 ||
      args.penalty_width + args.bias_width > kSampleMaxAdjustments) {
    return cudaErrorInvalidValue;
  }
  if (args.rows == 0) return cudaSuccess;
  if (args.logits == nullptr || args.temperature == nullptr || args.uniform == nullptr ||
      args.out == nullptr ||
      (args.penalty_width > 0 &&
       (args.penalty_index == nullptr || args.penalty_factor == nullptr)) ||
      (args.bias_width > 0 && (args.bias_index == nullptr || args.bias_value == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const bool filters = SampleFilters(args);
  if ((args.top_p != nullptr) != filters || (args.min_p != nullptr) != filters) {
    return cudaErrorInvalidValue;
  }
  const int64_t chunks = SampleLaunchChunks(args);
  const size_t shared = static_cast<size_t>(SampleSharedBytes(args));
  const cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const unsigned rows = static_cast<unsigned>(args.rows);
  if (filters || args.allowed != nullptr) {
    if (!filters) {
      SampleKernel<0, false><<<rows, kSampleThreads, shared, stream>>>(args, 1);
      return cudaGetLastError();
    }
    SampleKernel<0, true><<<rows, kSampleThreads, shared, stream>>>(args, 1);
    return cudaGetLastError();
  }
  if (chunks == 1) {
    SampleKernel<0, false><<<rows, kSampleThreads, shared, stream>>>(args, 1);
    return cudaGetLastError();
  }
  if (args.partials == nullptr) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>(args.rows * chunks);  // < 64 · 32
  const int c = static_cast<int>(chunks);
  SampleKernel<1, false><<<blocks, kSampleThreads, shared, stream>>>(args, c);
  SampleKernel<2, false><<<blocks, kSampleThreads, shared, stream>>>(args, c);
  SampleKernel<3, false><<<blocks, kSampleThreads, shared, stream>>>(args, c);
  SampleFinishKernel<<<static_cast<unsigned>((args.rows + kFinishThreads - 1) / kFinishThreads),
                       kFinishThreads, 0, stream>>>(args, c);
  return cudaGetLastError();
}

const char* SampleErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
