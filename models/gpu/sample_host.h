// LaunchSample's grid (sample.cu) run on the CPU with host pointers: the CPU test of the
// kernel's phases, reductions and scan (tests/unit/gpu_sample_test.cc), since the kernel
// itself only runs on a GPU machine. Rows one after another; in each, the kernel's phases
// between two barriers in order, every thread's work of a phase in turn (thread t: ids
// [t · chunk, (t + 1) · chunk); a chunked launch's C blocks as one grid of C ·
// kSampleThreads threads, block c from thread c · kSampleThreads), then each warp's
// butterfly (lane l combines with lane l ^ o, o = 16, ..., 1) or Hillis–Steele scan (lane
// l adds lane l − d, d = 1, ..., 16) on arrays of 32 lanes, then the warps' results in
// warp order: the same float64 additions in the same order as the kernel, with
// sample_rule.h's bodies, and each block's results combined through SampleCombineChunks
// as the chunked passes combine them (a one-block row: the same values as the kernel's,
// 0.0 + x being x). The sort of the penalty and bias entries is std::sort of the same
// unique keys (the kernel ranks them: the same order). With the filters (one block per
// row), the kernel's phase F (and a mask, also one block per row, as the kernel applies
// it): the same binary searches over the same candidates, each
// candidate's count exact and its share summed as the kernel sums it (SampleBlockSum),
// the same ties cut. Not a fast path. Torch-free, header-only.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "models/gpu/sample.h"
#include "models/gpu/sample_rule.h"

namespace fwmodel::kernels {

// The block's Σ of one float64 a thread (kSampleThreads values, thread order) as the
// kernel's BlockSumMax adds them: a butterfly in each warp (lane l adds lane l ^ o, o =
// 16, ..., 1; every lane ends with lane 0's value), then 0.0 + the warps in order.
inline double SampleBlockSum(const double* values) {
  double total = 0.0;
  for (int w = 0; w < kSampleThreads / 32; ++w) {
    double lanes[32];
    for (int l = 0; l < 32; ++l) lanes[l] = values[32 * w + l];
    for (int o = 16; o > 0; o /= 2) {
      double next[32];
      for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ o];
      for (int l = 0; l < 32; ++l) lanes[l] = next[l];
    }
    total += lanes[0];
  }
  return total;
}

// LaunchSample's computation on host pointers (the same SampleArgs contract). Returns
// false, doing nothing, where the launcher would refuse the arguments
// (cudaErrorInvalidValue).
inline bool RunSampleOnHost(const SampleArgs& args) {
  if (args.rows < 0 || args.rows > INT_MAX || args.vocab < 1 || args.vocab > INT_MAX ||
      args.penalty_width < 0 || args.bias_width < 0 ||
      args.penalty_width + args.bias_width > kSampleMaxAdjustments) {
    return false;
  }
  if (args.rows == 0) return true;
  if (args.logits == nullptr || args.temperature == nullptr || args.uniform == nullptr ||
      args.out == nullptr ||
      (args.penalty_width > 0 &&
       (args.penalty_index == nullptr || args.penalty_factor == nullptr)) ||
      (args.bias_width > 0 && (args.bias_index == nullptr || args.bias_value == nullptr))) {
    return false;
  }
  const bool filters = SampleFilters(args);
  if ((args.top_p != nullptr) != filters || (args.min_p != nullptr) != filters) return false;
  constexpr int kThreads = kSampleThreads, kWarps = kSampleThreads / 32;
  constexpr int64_t kEntryMask = 0xffffffff;
  const int64_t vocab = args.vocab, W = args.penalty_width, n = W + args.bias_width;
  const int64_t chunks = SampleLaunchChunks(args);
  if (chunks > 1 && args.partials == nullptr) return false;
  // The row's grid: `chunks` blocks of kThreads; thread vt = kThreads · c + t of block c.
  const int total_threads = static_cast<int>(chunks) * kThreads;
  const int64_t chunk = SampleChunk(vocab, total_threads);
  // Per thread of the row's grid (index vt = 32 · warp + lane, warp = kWarps · c + w).
  std::vector<float> best_value(total_threads), raw_top(total_threads);
  std::vector<int64_t> best_index(total_threads), last_positive(total_threads),
      found(total_threads), first(total_threads);
  std::vector<double> total(total_threads), inclusive(total_threads), offset(total_threads);
  std::vector<int64_t> keys(static_cast<size_t>(n));
  std::vector<int32_t> s_id(static_cast<size_t>(n));
  std::vector<float> s_value(static_cast<size_t>(n));
  // The row's chunks' partials (the kernel's scratch; a local copy when chunks is 1,
  // where the kernel keeps them in its one block).
  std::vector<SampleChunkPartial> partials(static_cast<size_t>(chunks));
  auto begin_of = [&](int t) { return std::min<int64_t>(t * chunk, vocab); };
  auto end_of = [&](int t) { return std::min<int64_t>(begin_of(t) + chunk, vocab); };
  for (int64_t row = 0; row < args.rows; ++row) {
    const float* logits = args.logits + row * vocab;
    // ---- 0. The entries, sorted by (id, entry), resolved per id.
    for (int64_t e = 0; e < n; ++e) {
      int64_t id = e < W ? args.penalty_index[row * W + e]
                         : args.bias_index[row * args.bias_width + (e - W)];
      if (id < 0 || id >= vocab) id = vocab;
      keys[static_cast<size_t>(e)] = (id << 32) | e;
    }
    std::sort(keys.begin(), keys.end());
    const float factor = W > 0 ? static_cast<float>(args.penalty_factor[row]) : 1.0f;
    for (int64_t e = 0; e < n;) {
      const int64_t id = keys[static_cast<size_t>(e)] >> 32;
      int64_t stop = e;
      bool penalised = false;
      while (stop < n && (keys[static_cast<size_t>(stop)] >> 32) == id) {
        penalised = penalised || (keys[static_cast<size_t>(stop)] & kEntryMask) < W;
        ++stop;
      }
      float value = 0.0f;
      if (id < vocab) {
        value = logits[id];
        if (penalised) value = SamplePenalized(value, factor);
        for (int64_t k = e; k < stop; ++k) {
          const int64_t entry = keys[static_cast<size_t>(k)] & kEntryMask;
          if (entry >= W) value += args.bias_value[row * args.bias_width + (entry - W)];
        }
      }
      for (int64_t k = e; k < stop; ++k) {
        s_id[static_cast<size_t>(k)] = static_cast<int32_t>(id);
        s_value[static_cast<size_t>(k)] = value;
      }
      e = stop;
    }
    const uint8_t* mask = args.allowed == nullptr ? nullptr : args.allowed + row * vocab;
    auto adjusted = [&](float raw, int64_t i, int64_t* next) {
      float x = raw;
      int64_t j = *next;
      if (j < n && s_id[static_cast<size_t>(j)] == i) {
        x = s_value[static_cast<size_t>(j)];
        do {
          ++j;
        } while (j < n && s_id[static_cast<size_t>(j)] == i);
        *next = j;
      }
      if (mask != nullptr && mask[i] == 0) return -INFINITY;
      return SampleFiniteOrMinusInf(x);
    };
    for (int t = 0; t < total_threads; ++t) {
      first[t] = std::lower_bound(s_id.begin(), s_id.end(), begin_of(t),
                                  [](int32_t id, int64_t value) { return id < value; }) -
                 s_id.begin();
    }

    // ---- 1. Argmax and raw max: per thread, butterfly per warp, each block's warps in
    // order (a block's partial), the chunks in order.
    for (int t = 0; t < total_threads; ++t) {
      float bv = -INFINITY, rt = -INFINITY;
      int64_t bi = INT64_MAX, next = first[t];
      for (int64_t i = begin_of(t); i < end_of(t); ++i) {
        const float raw = logits[i];
        const float x = adjusted(raw, i, &next);
        if (SampleArgmaxBeats(x, i, bv, bi)) {
          bv = x;
          bi = i;
        }
        if (SampleIsFinite(raw) && raw > rt) rt = raw;
      }
      best_value[t] = bv;
      best_index[t] = bi;
      raw_top[t] = rt;
    }
    for (int w = 0; w < total_threads / 32; ++w) {
      for (int o = 16; o > 0; o /= 2) {
        const std::vector<float> bv(best_value.begin() + 32 * w, best_value.begin() + 32 * w + 32);
        const std::vector<int64_t> bi(best_index.begin() + 32 * w,
                                      best_index.begin() + 32 * w + 32);
        const std::vector<float> rt(raw_top.begin() + 32 * w, raw_top.begin() + 32 * w + 32);
        for (int l = 0; l < 32; ++l) {
          const int t = 32 * w + l, other = l ^ o;
          if (SampleArgmaxBeats(bv[other], bi[other], bv[l], bi[l])) {
            best_value[t] = bv[other];
            best_index[t] = bi[other];
          }
          if (rt[other] > rt[l]) raw_top[t] = rt[other];
        }
      }
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int w0 = static_cast<int>(c) * kWarps;
      float top = best_value[32 * w0], block_raw_top = raw_top[32 * w0];
      int64_t best = best_index[32 * w0];
      for (int w = w0 + 1; w < w0 + kWarps; ++w) {
        if (SampleArgmaxBeats(best_value[32 * w], best_index[32 * w], top, best)) {
          top = best_value[32 * w];
          best = best_index[32 * w];
        }
        if (raw_top[32 * w] > block_raw_top) block_raw_top = raw_top[32 * w];
      }
      partials[static_cast<size_t>(c)].best_value = top;
      partials[static_cast<size_t>(c)].best_index = best;
      partials[static_cast<size_t>(c)].raw_top = block_raw_top;
    }
    // The mask allows no finite logit: the first allowed id (any order: a min).
    if (mask != nullptr && !SampleIsFinite(partials[0].best_value)) {
      for (int64_t i = 0; i < vocab; ++i) {
        if (mask[i] != 0) {
          partials[0].best_index = i;
          break;
        }
      }
    }
    const SampleChunkResult argmax = SampleCombineChunks(partials.data(), chunks, -1, 1);
    const float top = argmax.best_value, row_raw_top = argmax.raw_top;
    const float temperature = static_cast<float>(args.temperature[row]);
    const bool greedy = SampleIsGreedy(temperature, top);

    // ---- F. (filters, not greedy; one block) The cuts: the kernel's binary searches,
    // each candidate's count (exact in any order) or share (SampleBlockSum: the kernel's
    // order) over the threads' ids, then the ties counted in thread (id) order.
    SampleFilter filter;
    if (filters && !greedy) {
      auto each_p = [&](int t, auto body) {
        int64_t next = first[t];
        for (int64_t i = begin_of(t); i < end_of(t); ++i) {
          body(i, SampleProbability(adjusted(logits[i], i, &next), top, temperature));
        }
      };
      auto count_all = [&](auto in) {
        int64_t count = 0;
        for (int t = 0; t < kThreads; ++t) {
          each_p(t, [&](int64_t i, double p) { count += in(i, p) ? 1 : 0; });
        }
        return count;
      };
      auto sum_all = [&](auto term) {
        for (int t = 0; t < kThreads; ++t) {
          double sum = 0.0;
          each_p(t, [&](int64_t i, double p) { sum += term(i, p); });
          total[t] = sum;
        }
        return SampleBlockSum(total.data());
      };
      // The id of the `want`-th (from 1) token with in(i, p) in id order.
      auto nth_id = [&](int64_t want, auto in) {
        int64_t seen = 0, id = -1;
        for (int t = 0; t < kThreads && id < 0; ++t) {
          each_p(t, [&](int64_t i, double p) {
            if (in(i, p) && ++seen == want) id = i;
          });
        }
        return id;
      };
      const int64_t keep = SampleKeepCount(args.top_k[row], vocab);
      if (keep == 0) {
        filter.k_bits = kSampleNoBits;
        filter.k_last = -1;
      } else if (keep < vocab) {
        uint32_t lo = 0, hi = kSampleMaxBits;
        while (lo < hi) {
          const uint32_t mid = SampleSearchMid(lo, hi);
          if (count_all([&](int64_t, double p) { return SampleBits(p) >= mid; }) >= keep) {
            lo = mid;
          } else {
            hi = mid - 1;
          }
        }
        const int64_t above = count_all([&](int64_t, double p) { return SampleBits(p) > lo; });
        filter.k_bits = lo;
        filter.k_last =
            nth_id(keep - above, [&](int64_t, double p) { return SampleBits(p) == lo; });
      }
      filter.min_p = args.min_p[row];
      const double top_p = args.top_p[row];
      if (top_p < 1.0) {
        uint32_t hi = 0;
        const double kept = sum_all([&](int64_t i, double p) {
          if (!SampleInTopKMinP(filter, p, i)) return 0.0;
          hi = std::max(hi, SampleBits(p));
          return p;
        });
        if (kept > 0.0) {
          uint32_t lo = 0;
          while (lo < hi) {
            const uint32_t mid = SampleSearchMid(lo, hi);
            const double share = sum_all([&](int64_t i, double p) {
              return SampleBits(p) >= mid && SampleInTopKMinP(filter, p, i) ? p / kept : 0.0;
            });
            if (share >= top_p) {
              lo = mid;
            } else {
              hi = mid - 1;
            }
          }
          if (lo > 0) {
            auto tie = [&](int64_t i, double p) {
              return SampleBits(p) == lo && SampleInTopKMinP(filter, p, i);
            };
            const double above = sum_all([&](int64_t i, double p) {
              return SampleBits(p) > lo && SampleInTopKMinP(filter, p, i) ? p / kept : 0.0;
            });
            float value;
            std::memcpy(&value, &lo, sizeof value);
            const int64_t m =
                SampleNucleusTies(above, static_cast<double>(value) / kept, count_all(tie), top_p);
            filter.p_bits = lo;
            filter.p_last = nth_id(m, tie);
          }
        }
      }
    }

    // ---- 2. Normaliser, chunk masses, last positive: per thread, butterfly and scan per
    // warp, each block's warps in order (the offsets inside the block, the block's
    // partial), the chunks in order (the mass before each chunk).
    for (int t = 0; t < total_threads; ++t) {
      double sum = 0.0, mass = 0.0;
      int64_t last = -1, next = first[t];
      for (int64_t i = begin_of(t); i < end_of(t); ++i) {
        const float raw = logits[i];
        sum += SampleSoftmaxTerm(raw, row_raw_top);
        if (greedy) continue;
        double p = SampleProbability(adjusted(raw, i, &next), top, temperature);
        if (filters) p = SampleFiltered(filter, p, i);
        mass += p;
        if (p > 0.0) last = i;
      }
      total[t] = sum;
      inclusive[t] = mass;
      last_positive[t] = last;
    }
    for (int w = 0; w < total_threads / 32; ++w) {
      for (int o = 16; o > 0; o /= 2) {
        const std::vector<double> sum(total.begin() + 32 * w, total.begin() + 32 * w + 32);
        const std::vector<int64_t> last(last_positive.begin() + 32 * w,
                                        last_positive.begin() + 32 * w + 32);
        for (int l = 0; l < 32; ++l) {
          total[32 * w + l] = sum[l] + sum[l ^ o];
          if (last[l ^ o] > last[l]) last_positive[32 * w + l] = last[l ^ o];
        }
      }
      for (int d = 1; d < 32; d *= 2) {
        const std::vector<double> in(inclusive.begin() + 32 * w, inclusive.begin() + 32 * w + 32);
        for (int l = d; l < 32; ++l) inclusive[32 * w + l] = in[l] + in[l - d];
      }
      for (int l = 0; l < 32; ++l) offset[32 * w + l] = l == 0 ? 0.0 : inclusive[32 * w + l - 1];
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int w0 = static_cast<int>(c) * kWarps;
      double block_total = 0.0, block_mass = 0.0;
      int64_t block_last = -1;
      for (int w = w0; w < w0 + kWarps; ++w) {
        for (int l = 0; l < 32; ++l) offset[32 * w + l] = block_mass + offset[32 * w + l];
        block_total += total[32 * w];
        block_mass += inclusive[32 * w + 31];
        if (last_positive[32 * w] > block_last) block_last = last_positive[32 * w];
      }
      partials[static_cast<size_t>(c)].total = block_total;
      partials[static_cast<size_t>(c)].mass = block_mass;
      partials[static_cast<size_t>(c)].last_positive = block_last;
    }
    const SampleChunkResult sums = SampleCombineChunks(partials.data(), chunks, -1, 2);
    for (int64_t c = 0; c < chunks; ++c) {
      const double before = SampleCombineChunks(partials.data(), chunks, c, 2).mass_before;
      for (int t = static_cast<int>(c) * kThreads; t < static_cast<int>(c + 1) * kThreads; ++t) {
        offset[t] = before + offset[t];
      }
    }

    // ---- 3. The first crossing of u · mass: per thread, then the min per block (exact in
    // any order), then the chunks' min.
    for (int64_t c = 0; c < chunks; ++c) partials[static_cast<size_t>(c)].found = INT64_MAX;
    if (!greedy) {
      const double target = args.uniform[row] * sums.mass;
      for (int t = 0; t < total_threads; ++t) {
        double running = offset[t];
        int64_t next = first[t];
        found[t] = INT64_MAX;
        for (int64_t i = begin_of(t); i < end_of(t); ++i) {
          double p = SampleProbability(adjusted(logits[i], i, &next), top, temperature);
          if (filters) p = SampleFiltered(filter, p, i);
          running += p;
          if (p > 0.0 && running > target) {
            found[t] = i;
            break;
          }
        }
      }
      for (int64_t c = 0; c < chunks; ++c) {
        partials[static_cast<size_t>(c)].found =
            *std::min_element(found.begin() + c * kThreads, found.begin() + (c + 1) * kThreads);
      }
    }
    // ---- The finish: the chunks combined, the token and its log-probability.
    const SampleChunkResult whole = SampleCombineChunks(partials.data(), chunks, -1, 3);
    const int64_t token = SampleChooseToken(
        greedy, whole.best_index, whole.found == INT64_MAX ? -1 : whole.found, whole.last_positive);
    args.out[2 * row] = static_cast<double>(token);
    args.out[2 * row + 1] = SampleLogProb(logits[token], whole.raw_top, whole.total);
    if (chunks > 1) {  // the kernel's scratch, as its passes leave it
      for (int64_t c = 0; c < chunks; ++c) {
        args.partials[row * chunks + c] = partials[static_cast<size_t>(c)];
      }
    }
  }
  return true;
}

}  // namespace fwmodel::kernels
