// The sampling kernel (sample.cu): fwserve::SampleOnDevice (models/sampling/batch_sampler.h)
// with `filters` false (no top_k, top_p or min_p) or true, with or without its constraint
// mask. The plain case (no filters, no mask) is one launch of one block per row of logits
// where there are many rows, or, with few rows (SampleChunksPerRow > 1), four launches over
// C blocks per row that pass per-chunk partial results through a scratch array; with the
// filters (SampleArgs::top_k set) or a mask (SampleArgs::allowed) it is always one launch
// of one block per row, however few the rows (no chunked form: the filters' threshold
// searches need block-wide reductions of the whole row). Each applies the repetition
// penalty and logit bias, the mask, the argmax, the temperature, top_k, min_p and top_p,
// the inverse CDF in id order and the raw logits' log-probability of the drawn token,
// written as SampleOnDevice's [rows, 2] float64 (token, logprob). The bodies are
// sample_rule.h's; sample_host.h runs the same grid on the CPU. Torch-free and CUDA-free:
// the launcher takes the stream as a `cudaStream_t` in a void*.
#pragma once

#include <cstdint>

namespace fwmodel::kernels {

// The block's threads (a multiple of 32, at most 32 warps: the reductions' layout).
constexpr int kSampleThreads = 512;
// Rows from which a launch takes one block per row; below, SampleChunksPerRow (0: every
// launch one block per row, the switch back to the unchunked kernel).
constexpr int64_t kSampleChunkedRowsBelow = 64;
// The most blocks (chunks) per row.
constexpr int64_t kSampleMaxChunks = 32;
// The most penalty and bias entries a row may have together (penalty_width + bias_width):
// they are sorted in shared memory, 16 bytes each.
constexpr int64_t kSampleMaxAdjustments = 2048;

// One chunk's (row, block's) partial results, written by one pass and read by the later
// ones (sample.cu): the scratch of a chunked launch, 48 bytes each.
struct SampleChunkPartial {
  double total = 0.0;          // pass 2: the chunk's Σ exp(ℓ − max ℓ)
  double mass = 0.0;           // pass 2: the chunk's Σ p (0 when greedy)
  int64_t best_index = 0;      // pass 1: the chunk's argmax (INT64_MAX: none)
  int64_t last_positive = -1;  // pass 2: the chunk's last id with p > 0 (−1: none)
  int64_t found = 0;           // pass 3: the chunk's first crossing (INT64_MAX: none)
  float best_value = 0.0f;     // pass 1: the adjusted logit at best_index
  float raw_top = 0.0f;        // pass 1: the chunk's max finite raw logit (−inf: none)
};

// The blocks (chunks) each row takes: 1 (one block per row) from kSampleChunkedRowsBelow
// rows on, else ceil(vocab / 2048) clamped to [1, kSampleMaxChunks] (at least 4 ids a
// thread: 32 at the 65,536 vocabulary). The kernel and its mirror both take this.
inline int64_t SampleChunksPerRow(int64_t rows, int64_t vocab) {
  if (rows >= kSampleChunkedRowsBelow || vocab < 1) return 1;
  const int64_t chunks = (vocab + 2047) / 2048;
  return chunks < 1 ? 1 : (chunks > kSampleMaxChunks ? kSampleMaxChunks : chunks);
}

// One launch. Device pointers; every array contiguous, row-major.
struct SampleArgs {
  int64_t rows = 0;                     // rows to sample (the grid)
  int64_t vocab = 0;                    // ≥ 1, at most INT32_MAX
  const float* logits = nullptr;        // [rows, vocab], raw (the log-probability's input)
  const double* temperature = nullptr;  // [rows]: SampleOnDevice's kSampleTemperature column
  const double* uniform = nullptr;      // [rows]: its kSampleUniform column, in [0, 1)
  // The repetition penalty: penalty_width ids per row (repeats allowed: each id is
  // penalised once; ids outside [0, vocab) are skipped) and the row's factor (1: none).
  // Both unread when penalty_width is 0.
  int64_t penalty_width = 0;
  const int64_t* penalty_index = nullptr;  // [rows, penalty_width]
  const double* penalty_factor = nullptr;  // [rows], applied in float32
  // The logit bias, added after the penalty in entry order: bias_width (id, value) pairs
  // per row (pads (0, 0) add nothing; ids outside [0, vocab) skipped). Unread when
  // bias_width is 0.
  int64_t bias_width = 0;
  const int64_t* bias_index = nullptr;  // [rows, bias_width]
  const float* bias_value = nullptr;    // [rows, bias_width]
  double* out = nullptr;                // [rows, 2]: (token, log-probability); written only
  // [rows, SampleChunksPerRow(rows, vocab)] scratch (SampleScratchBytes), needed only where
  // SampleLaunchChunks is > 1; any contents (each pass writes what the later ones read),
  // not shared by two launches in flight at once.
  SampleChunkPartial* partials = nullptr;
  // The filters (SampleOnDevice with `filters` true): all three set, or all three null
  // (the plain case). Per row: top_k keeps the tokens of rank < top_k (ranks by descending
  // probability, lower ids first among equals; ≥ vocab: all), min_p drops probabilities
  // < min_p (relative to the top token's 1), top_p (< 1; else off) keeps the smallest set
  // of most likely tokens, in rank order, whose share of the kept mass reaches it.
  const double* top_k = nullptr;  // [rows]: SampleOnDevice's kSampleTopK column
  const double* top_p = nullptr;  // [rows]: its kSampleTopP column
  const double* min_p = nullptr;  // [rows]: its kSampleMinP column
  // The constraint mask (null: none; then one block per row, like the filters): 0 = never
  // drawn, applied after the bias; a row that allows no finite logit draws its first
  // allowed id (none allowed: id 0), as SampleOnDevice's `allowed`.
  const uint8_t* allowed = nullptr;  // [rows, vocab]
};

// Whether a launch applies the filters (SampleArgs::top_k set).
inline bool SampleFilters(const SampleArgs& args) { return args.top_k != nullptr; }

// The blocks each row of this launch takes: 1 with the filters or a mask, else
// SampleChunksPerRow.
inline int64_t SampleLaunchChunks(const SampleArgs& args) {
  return SampleFilters(args) || args.allowed != nullptr ? 1
                                                        : SampleChunksPerRow(args.rows, args.vocab);
}

// The bytes of SampleArgs::partials a plain launch needs (0: none; a filtered launch needs
// none).
inline int64_t SampleScratchBytes(int64_t rows, int64_t vocab) {
  const int64_t chunks = SampleChunksPerRow(rows, vocab);
  return chunks > 1 ? rows * chunks * static_cast<int64_t>(sizeof(SampleChunkPartial)) : 0;
}

// The dynamic shared memory of a launch with these widths, in bytes.
inline int64_t SampleSharedBytes(const SampleArgs& args) {
  return 16 * (args.penalty_width + args.bias_width);
}

// Launches the kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream):
// one block per row (or, plain, C = SampleLaunchChunks blocks per row in four launches),
// kSampleThreads threads. Nothing to do when rows is 0. Returns 0
// (cudaSuccess) or the cudaError_t of a bad argument (cudaErrorInvalidValue: vocab < 1
// or > INT32_MAX, rows < 0 or > INT32_MAX, a negative width or more than
// kSampleMaxAdjustments entries, a null pointer the launch needs, partials included, some
// but not all of top_k, top_p and min_p) or of the launch
// (cudaGetLastError). Asynchronous; no allocation, no synchronisation: safe during CUDA
// Graph capture.
int LaunchSample(const SampleArgs& args, void* cuda_stream);

// cudaGetErrorString of a LaunchSample result.
const char* SampleErrorString(int error);

}  // namespace fwmodel::kernels
