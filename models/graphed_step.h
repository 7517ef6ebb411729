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
#include "absl/types/span.h"
#include "models/model.h"

namespace fwmodel {

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
};

class GraphedStep {
 public:
  // InvalidArgument for bad buckets. Internal when a capture fails (the message says
  // which bucket). Allocates every bucket's buffers and, with capture, captures them.
  static absl::StatusOr<std::unique_ptr<GraphedStep>> Create(const Model& model,
                                                             GraphedStepOptions options = {});

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
  GraphedStep(const Model& model, GraphedStepOptions options);
  absl::Status CheckArguments(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                              const State& pool, const torch::Tensor* row_logits) const;
  // One pass of at most the largest bucket's rows; returns the bucket's logits [n, vocab].
  torch::Tensor RunPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                        State* pool, torch::Tensor* row_logits);
  // Runs the model on the bucket's inputs: replay, or eagerly.
  void Compute(Bucket& bucket);
  // Throws c10::Error (caught by Create).
  void Capture(Bucket& bucket);

  const Model& model_;
  const GraphedStepOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // in options_.buckets' order
  // Tokens (row 0) and row indices (row 1) of a pass, [2, largest bucket] int64: host
  // staging (pinned on CUDA) and its copy on the model's device, where every bucket's
  // graph reads them.
  torch::Tensor host_indices_, device_indices_;
  bool captured_ = false;
  int64_t padded_rows_ = 0;
};

}  // namespace fwmodel
