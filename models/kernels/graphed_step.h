// The batched decode step on an accelerator, made worth having. A small model's step
// is a few hundred small kernels: on a GPU it is bound by their launches, not by the
// arithmetic. GraphedStep runs Model::StepUnchecked on fixed per-bucket buffers. On a
// CUDA model, in a build with FWSERVE_CUDA_GRAPHS (CMake sets it when LibTorch has
// CUDA), it captures each bucket's step once, as a CUDA Graph, and then replays it: one
// launch per step instead of hundreds.
//
// A step of n rows:
//   1. pads to the smallest bucket >= n; a batch above the largest bucket runs as
//      several steps of the largest;
//   2. copies the tokens and row indices to the device in one copy;
//   3. gathers the rows' states from the pool into the bucket's input buffers (one
//      index_select per state tensor);
//   4. replays the bucket's graph (or, without capture, runs the same step eagerly on
//      the same buffers);
//   5. copies the n rows' new states back into the pool (one index_copy_ per state
//      tensor).
// Pad rows repeat the first row, with token 0. Their results are dropped, and no pool
// row other than the n given ones is written. The gather and scatter stay outside the
// graph, so a graph never refers to the pool's memory. The pool may grow (reallocate)
// between steps without a new capture.
//
// In place (a PoolBinding given to Create): the pool is bound for the step's lifetime
// and never reallocated, so each bucket's graph reads and writes it directly through
// the bucket's rows tensor: the gather, the step, the scatter, the logits row copy and
// (with sample_in_step) the sampling of every row are one replay. Pad rows point at
// the binding's pad row, which no session uses, with token 0 and greedy sampling. Per
// step the host makes one copy to the device (tokens, rows, sampling parameters; from
// pinned memory) and one back ([n, 2] token and logprob), then waits for it: one
// synchronisation per step, in place of a blocking index upload, an index_select and
// an index_copy_ per state tensor, and SampleRows' ~100 launches and two copies.
//
// Every bucket is captured in Create: before serving, while no other thread uses the
// device. Capturing later, on the engine thread, could race the prefill thread's own
// CUDA calls.
//
// Without capture (a CPU model, a build without CUDA, or `capture = false`), the same
// code runs eagerly. That is how the CPU-side logic is tested
// (tests/unit/graphed_step_test.cc) and served (`--decode-kernel graph`).
//
// Ownership: reads the Model, which is not owned and must outlive this. Owns its buffers
// and graphs.
// Thread-safety: one thread at a time (the engine's).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/architectures/model.h"
#include "models/sampling/batch_sampler.h"

namespace fwmodel {

using fwserve::RowDraw;
using fwserve::SampledToken;
using fwserve::SamplingParams;

struct GraphedStepOptions {
  // Batch-size buckets: ascending, distinct, each >= 1. A step pads to the smallest
  // bucket that fits. Each bucket costs its input and output buffers and, when captured,
  // one graph with its own memory pool (about bucket × (state + activations) bytes).
  std::vector<int64_t> buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  // Capture CUDA Graphs where that is possible: a CUDA model in a FWSERVE_CUDA_GRAPHS
  // build. When false, steps run eagerly on the same buffers everywhere, with the same
  // results (for tests and debugging).
  bool capture = true;
  // Eager runs of each bucket before its capture. cuBLAS handles, workspaces and lazy
  // initialisation must exist before capture starts.
  int warmup_runs = 2;
  // In place only: each bucket's step ends by sampling its rows (StepInPlace with
  // draws). When false, StepInPlace steps only and the caller samples apart.
  bool sample_in_step = true;
  // In place with sample_in_step: the repetition-penalty tokens a row may bring (the
  // width of each bucket's penalty buffer; the default repetition window is 64). A step
  // with a wider row is refused with FailedPrecondition: sample it apart.
  int64_t penalty_width = 64;
  // In place with sample_in_step: each bucket also captures a graph whose sampling leaves
  // out the sort and the ranked filters, replayed for passes where no row needs top_k,
  // top_p or min_p (fwserve::NeedsFilters); the same draws. False: one graph per bucket,
  // every pass sorts.
  bool plain_sampling = true;
  // In place with sample_in_step: each bucket also captures a graph whose sampling takes
  // constraint masks (RowDraw::allowed) for up to `masked_rows` rows of a pass, uploaded
  // with the step's inputs (one [masked_rows, vocab] byte copy, only when a row has a
  // mask); the other rows sample as without it. 0: no such graph, and masked rows are
  // sampled apart (SampleRows).
  int64_t masked_rows = 16;
};

// The pool an in-place GraphedStep reads and writes. Not owned; its tensors must keep
// their storage (no reallocation, no reassignment) while the step is alive.
struct PoolBinding {
  State* state = nullptr;           // [capacity, spec...] per state tensor, contiguous
  torch::Tensor* logits = nullptr;  // [capacity, vocab] float32: next-token logits
  int64_t pad_row = -1;             // a row no session uses; pad rows read and write it
};

class GraphedStep {
 public:
  // InvalidArgument for bad buckets. Internal when a capture fails (the message says
  // which bucket). Allocates every bucket's buffers and, with capture, captures them.
  // With `pool` bound (its state non-null): in place (above). InvalidArgument when the
  // binding does not match the model (shapes, device, dtype, pad row).
  static absl::StatusOr<std::unique_ptr<GraphedStep>> Create(const Model& model,
                                                             GraphedStepOptions options = {},
                                                             PoolBinding pool = {});

  // Row rows[b] of `pool` ([capacity, spec...] per state tensor, on the model's device, in
  // its dtype) absorbs tokens[b], in place. Returns the logits, [n, vocab] on the
  // model's device: a view that stays valid until the next Step. With `row_logits`
  // ([capacity, vocab] float32 on the model's device: the pool's next-token logits), row
  // rows[b] of it gets row b of the logits as well, with no other copy. Validates the
  // sizes, token ids, rows (distinct, inside the pool) and the layouts of the pool and
  // `row_logits` (InvalidArgument, nothing changed). LibTorch errors become Internal.
  // Never throws.
  absl::StatusOr<torch::Tensor> Step(absl::Span<const int64_t> tokens,
                                     absl::Span<const int64_t> rows, State* pool,
                                     torch::Tensor* row_logits = nullptr);

  // In place only: rows rows[b] of the bound pool absorb tokens[b], and their
  // next-token logits are written to the bound logits. With `draws` (one per row, in
  // order; RowDraw::row is ignored) each row's next token is drawn from those logits as
  // SampleRows would draw it, and returned; without, nothing is returned. Validates as
  // Step, and that no row is the pad row (InvalidArgument, nothing changed);
  // FailedPrecondition when draws are given without sample_in_step, or when a draw's
  // penalty set is wider than penalty_width. LibTorch errors become Internal. Never
  // throws.
  absl::StatusOr<std::vector<SampledToken>> StepInPlace(absl::Span<const int64_t> tokens,
                                                        absl::Span<const int64_t> rows,
                                                        absl::Span<const RowDraw> draws);
  bool in_place() const { return binding_.state != nullptr; }
  // In place with sample_in_step: up to `steps` tokens per row in one call (multi-step
  // decode). Each drawn token is fed back as the row's next input on the device, with no
  // host round trip between steps. Row b absorbs tokens[b] and draws its next token
  // with draws[b] (its parameters) and uniforms[b * steps]. While it may go on, it
  // absorbs the token it drew and draws again with uniforms[b * steps + j]. Row b stops
  // after limits[b] draws (1 <= limits[b] <= steps), or after it draws a token in
  // `stop_tokens`. Returns each row's drawn tokens, in order. The row has then absorbed
  // tokens[b] and every drawn token but its last, exactly as that many StepInPlace
  // calls would leave it; its logits are those after its last absorbed token. A row
  // that stopped early reads and writes the pad row for the rest of the call.
  // Cost: one copy to the device, `steps` replays with a few masking kernels between
  // them, one copy back, one synchronisation.
  // Validates as StepInPlace, plus: steps >= 1, uniforms of n * steps, limits in
  // [1, steps], stop tokens inside the vocabulary (InvalidArgument); a draw with a
  // repetition penalty is FailedPrecondition (the penalty window would move on the
  // device: step such rows one token at a time). Never throws.
  absl::StatusOr<std::vector<std::vector<SampledToken>>> MultiStepInPlace(
      absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
      absl::Span<const RowDraw> draws, absl::Span<const double> uniforms, int64_t steps,
      absl::Span<const int64_t> limits, absl::Span<const int64_t> stop_tokens);
  // Whether StepInPlace can draw for `draws` (sample_in_step, penalty widths, no logit
  // bias, at most masked_rows constraint masks).
  bool CanSampleInStep(absl::Span<const RowDraw> draws) const;
  // The last Step's or StepInPlace's time: device time between CUDA events around its
  // copies and replays on a CUDA model in a FWSERVE_CUDA_GRAPHS build, else host time.
  absl::Duration last_step_time() const { return last_step_time_; }

  // The bucket a step of n >= 1 rows pads to: the largest bucket when n exceeds it (the
  // step then runs in several passes).
  int64_t BucketFor(int64_t n) const;
  const std::vector<int64_t>& buckets() const { return options_.buckets; }
  // True when steps replay captured CUDA Graphs; false when they run eagerly.
  bool captured() const { return captured_; }
  // Rows computed and dropped as padding since construction (for tests and metrics).
  int64_t padded_rows() const { return padded_rows_; }

  ~GraphedStep();

 private:
  struct Bucket;
  // The sampling a pass runs (in place with sample_in_step): without the sort (no row
  // needs top_k, top_p or min_p), with the ranked filters, or with the filters and the
  // staged constraint masks.
  enum class SamplingKind { kPlain, kFiltered, kMasked };
  SamplingKind KindOf(absl::Span<const RowDraw> draws) const;
  GraphedStep(const Model& model, GraphedStepOptions options);
  absl::Status CheckArguments(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                              const State& pool, const torch::Tensor* row_logits) const;
  // One pass of at most the largest bucket's rows; returns the bucket's logits [n, vocab].
  torch::Tensor RunPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                        State* pool, torch::Tensor* row_logits);
  // In place: one pass of at most the largest bucket's rows; writes n (token, logprob)
  // pairs to `sampled` when given.
  void RunInPlacePass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                      absl::Span<const RowDraw> draws, SampledToken* sampled);
  // In place: one multi-step pass of at most the largest bucket's rows; appends each
  // row's drawn tokens to `drawn` (n entries).
  void RunMultiStepPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                        absl::Span<const RowDraw> draws, absl::Span<const double> uniforms,
                        int64_t steps, absl::Span<const int64_t> limits,
                        absl::Span<const int64_t> stop_tokens, std::vector<SampledToken>* drawn);
  // Writes a pass's upload in the layout of a bucket of `size` rows (pads for the rest)
  // into host_upload_; returns the words used.
  int64_t StageUpload(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                      absl::Span<const RowDraw> draws, int64_t size);
  // The bucket a pass of n <= the largest bucket's rows runs on; counts its padding.
  Bucket& BucketForPass(int64_t n);
  // Runs the model on the bucket's inputs: replay, or eagerly, with the sampling `kind`
  // (in place with sampling).
  void Compute(Bucket& bucket, SamplingKind kind);
  // What a bucket computes (captured, or run eagerly): the step and, in place, the
  // gather, scatter and sampling around it.
  void BucketWork(Bucket& bucket, SamplingKind kind);
  // kMasked: writes the masks of `draws`' masked rows, and which row each is, into the
  // mask staging buffers (unused entries: all allowed, on row `size`, a scratch row) and
  // copies them to the device.
  void StageMasks(absl::Span<const RowDraw> draws, int64_t size);
  // Device timing around a step (CUDA events; no-ops elsewhere).
  void BeginTiming();
  void EndTiming(absl::Time host_start);
  // Throws c10::Error (caught by Create).
  void Capture(Bucket& bucket);

  const Model& model_;
  const GraphedStepOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // in options_.buckets' order
  // Tokens (row 0) and row indices (row 1) of a pass, [2, largest bucket] int64: host
  // staging (pinned on CUDA) and its copy on the model's device, where every bucket's
  // graph reads them.
  torch::Tensor host_indices_, device_indices_;
  // In place: per pass, int64 words laid out per bucket of size s as [tokens s][rows s]
  // [sampling columns kSampleColumns·s as float64][penalty index s·W][penalty factor s
  // as float64]; host staging (pinned on CUDA) and its device copy.
  PoolBinding binding_;
  int64_t upload_words_per_row_ = 0;
  torch::Tensor host_upload_, device_upload_;
  torch::Tensor host_sampled_;  // [largest, 2] float64 (pinned on CUDA)
  // Multi-step: [uniforms steps·s as float64][limits s][stop tokens], host staging
  // (pinned on CUDA) and device copy, grown on demand; and the drawn tokens of every
  // step, [steps, s, 2] float64, brought back in one copy.
  torch::Tensor host_multi_, device_multi_, host_drawn_;
  // Masked sampling: [masked_rows, vocab] uint8 masks and [masked_rows] int64 rows of the
  // pass (entry k's mask is row mask_rows[k]'s), host staging (pinned on CUDA) and device.
  torch::Tensor host_masks_, device_masks_, host_mask_rows_, device_mask_rows_;
  bool captured_ = false;
  int64_t padded_rows_ = 0;
  absl::Duration last_step_time_;
  bool timing_ = false;          // CUDA events exist
  void* start_event_ = nullptr;  // cudaEvent_t
  void* end_event_ = nullptr;
};

}  // namespace fwmodel
