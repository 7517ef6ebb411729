// The trainer behind `fwtrain`: trains any contract-v1 configuration on a byte text.
//
// Resumable: everything needed to continue bit-for-bit (weights, optimizer moments,
// step, options) lives in the output directory, which is also a servable checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "models/architectures/model.h"
#include "models/base/config.h"

namespace fwmodel {

struct TrainOptions {
  std::string text_path;  // training corpus; bytes are tokens
  std::string out_dir;    // checkpoint + trainer state; resumed from if it holds a run
  ModelConfig config;     // used only when starting a new run
  uint64_t seed = 1;      // initialisation and data order

  int64_t steps = 2000;     // optimizer steps in the whole run
  int64_t batch_size = 32;  // sequences per step
  int64_t seq_len = 256;    // tokens per window (truncated-backprop length)
  // true: each batch row reads its own contiguous segment of the text and carries its
  // recurrent state from window to window (truncated backprop through time), so the
  // model learns the long contexts it is scored on. false: independent random windows
  // that each start from a fresh state.
  bool stateful = true;
  // Stateful only. 0: row b reads its own segment (text / batch_size bytes) front to
  // back, and every pass over the segments starts from fresh states, so contexts reach
  // one segment. R > 0: row b reads the whole split circularly from its own offset and
  // its state is reset every R steps, staggered across rows, so training sees context
  // ages spread evenly over [0, R * seq_len) tokens. Use R * seq_len >= the length the
  // model is scored on (validation: 111,540 bytes) when the state keeps evolving over
  // that horizon (fast_weight).
  int64_t state_reset_steps = 0;
  double lr = 2e-3;  // peak learning rate
  // Learning rate of the product-key memories' value tables (ffn.values.weight) as a
  // multiple of lr, following the same schedule. Lample et al. train the values with
  // a higher rate than the rest; the values are never weight-decayed (a token reads
  // only k·H_m rows, so decay would shrink the rows it does not read).
  double values_lr_scale = 1.0;
  double min_lr_ratio = 0.1;   // cosine decays to lr * min_lr_ratio at the last step
  int64_t warmup_steps = 100;  // linear warm-up from 0 to lr
  double weight_decay = 0.1;   // AdamW decay for matrices (not embeddings, norms, biases)
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.99;
  double grad_clip = 1.0;  // max global gradient L2 norm; 0 disables

  double train_fraction = 0.9;        // contract split: first 90% train, rest validation
  int64_t eval_interval = 250;        // steps between validations (and at the end)
  int64_t eval_bytes = 0;             // validation bytes scored at intervals; 0 = all
  int64_t checkpoint_interval = 250;  // steps between checkpoints (and at the end)
  int threads = 0;                    // LibTorch intra-op threads; 0 = all cores
  bool progress = true;               // live progress line on stderr
  std::string command_line;           // recorded in the run summary
};

struct TrainReport {
  int64_t step = 0;              // optimizer steps completed
  int64_t tokens_seen = 0;       // training tokens consumed (batch * seq_len * steps)
  double train_loss = 0;         // mean loss over the last eval interval, nats/token
  double val_loss = 0;           // last validation, nats/byte (NaN if none yet)
  double wall_seconds = 0;       // training wall time summed over resumed sessions
  double tokens_per_second = 0;  // this session's training throughput
  // Where this session's time went, in seconds: forward includes the loss, backward
  // is loss.backward() alone (gradient clipping is in none of them), eval is
  // validation scoring.
  double forward_seconds = 0, backward_seconds = 0, optimizer_seconds = 0, eval_seconds = 0;
  bool resumed = false;  // this session continued an earlier one
};

// Called after every optimizer step (on the training thread).
using TrainProgressFn = std::function<void(const TrainReport&)>;

// Runs (or resumes) training to options.steps. Stops with FailedPrecondition when the
// loss or gradient becomes NaN/Inf; the last checkpoint is left intact.
// `stop_after_steps` > 0 ends this session early after that many steps (testing
// interruption); the run remains resumable.
absl::StatusOr<TrainReport> Train(const TrainOptions& options, int64_t stop_after_steps = 0,
                                  const TrainProgressFn& on_step = nullptr);

// Mean negative log-likelihood (nats/byte) of `text` from a fresh state, by the
// contract's scoring convention.
absl::StatusOr<double> ValidationLoss(const Model& model, const std::string& text);

// ValidationLoss of the checkpoint in `dir`.
absl::StatusOr<double> EvaluateCheckpoint(const std::string& dir, const std::string& text);

// Contract validation split of a corpus: bytes [floor(size * train_fraction), size).
std::string ValidationSplit(const std::string& corpus, double train_fraction = 0.9);

}  // namespace fwmodel
