// What the scheduler (scheduler.h) is told: its slots, its prefill chunks and its batch
// wait. Embedded in EngineOptions (EngineOptions::scheduler), which is embedded in
// CoreOptions: each field is set once, where the flag is read (server/fwserve.cc).
// Torch-free.
#pragma once

#include <cstdint>

#include "absl/time/time.h"

namespace fwserve {

struct SchedulerOptions {
  // Generate/Score/CreateSession streams served at once (--max-active-streams; > 0):
  // what admission, parking and resuming keep to; more wait in the engine's queue.
  // On a CUDA device the default is 4096 unless the flag is given (server/fwserve.cc).
  int64_t max_active_streams = 256;
  // Prompt tokens one task absorbs per prefill chunk, in the sequence form
  // (--prefill-chunk-tokens; > 0): bounds how long a long prompt can stall other
  // streams. Also the chunk of a Score's prefill.
  int64_t prefill_chunk_tokens = 256;
  // Tokens one prefill chunk absorbs at most over all the tasks it batches (prompts whose
  // next pieces have the same length go together; --prefill-batch-tokens; >= 0);
  // 0 = prefill_chunk_tokens. A GPU runs a wide batch for about the time of one prompt:
  // on a CUDA device 0 becomes 16384 (server/fwserve.cc).
  int64_t prefill_batch_tokens = 0;
  // How long a decode step waits for streams still writing to join it (--batch-wait;
  // >= 0). On a CUDA device the default is 0 unless the flag is given.
  absl::Duration batch_wait = absl::Microseconds(300);
};

}  // namespace fwserve
