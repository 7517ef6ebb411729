// What one model's engine is told: its limits, its batching and its kernels. Filled by
// the core from CoreOptions (the flags are documented there and in docs/serving.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/time/time.h"

namespace fwserve {

class SessionSealer;

struct EngineOptions {
  // Work items waiting for the engine (--max-queued-requests); beyond it
  // RESOURCE_EXHAUSTED.
  int64_t max_queued_requests = 1024;
  // The longest a stream should wait in the queue (--max-queue-wait): once the engine
  // has measured how fast its slots free up, the queue holds only what drains within
  // it (at least 2 items, at most max_queued_requests). Zero = no such bound.
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // CoDel with adaptive LIFO (--queue-codel-target, --queue-codel-interval;
  // AdmissionQueue): once the queue has not been empty for codel_interval, or was full
  // within it, streams start newest first and one queued longer than codel_target is
  // refused with a retry hint. Zero target = off.
  absl::Duration codel_target = absl::ZeroDuration();
  absl::Duration codel_interval = absl::Milliseconds(100);
  // With every stream slot taken, a waiting stream of a tenant below its fair share
  // (max_active_streams over the tenants with streams) parks the newest running stream
  // of the tenant furthest above it, which resumes when a slot frees
  // (--preempt-for-fair-share).
  bool preempt_for_fair_share = false;
  // Generate/Score/CreateSession streams served at once (--max-active-streams).
  int64_t max_active_streams = 256;
  // Tokens of one prompt absorbed per prefill job (--prefill-chunk-tokens).
  int32_t prefill_chunk_tokens = 256;
  // Tokens of one prefill job over all the prompts it batches (--prefill-batch-tokens);
  // 0 = prefill_chunk_tokens.
  int32_t prefill_batch_tokens = 0;
  // How long a decode step may wait for more streams to become ready (--batch-wait).
  absl::Duration batch_wait = absl::Microseconds(300);
  // Intra-op threads of the engine and prefill threads; 0 = the libraries' defaults.
  int32_t intra_op_threads = 0;
  // Threads one native prefill chunk may use; 0 = the CPUs this process may run on
  // (--prefill-threads). The decode step's count is intra_op_threads.
  int32_t prefill_threads = 0;
  // "native", "graph" or "libtorch" (CoreOptions::decode_kernel).
  std::string decode_kernel = "native";
  // The graph kernel on a preallocated pool samples inside its step (--sample-in-step;
  // Stepper). Off: the step only steps, and sampling runs apart (the A/B of issue 39).
  bool sample_in_step = true;
  // Tokens one decode launch may draw and absorb per throwaway stream
  // (--decode-steps-per-launch; Stepper::StepAhead); 1 = one.
  int32_t decode_steps_per_launch = 1;
  // A decode step runs on the runner's step thread while the engine plans the next
  // prefill chunk (--overlap-steps; Runner).
  bool overlap_steps = false;
  // Sessions held at once (--max-sessions): with the graph kernel the pool is allocated
  // whole at start, min(this, max_state_memory_bytes / state bytes) rows.
  int64_t max_sessions = 100000;
  // The native kernel's GEMMs on libxsmm (true) or cblas_sgemm (CoreOptions::native_gemm).
  bool packed_gemm = true;
  // Tokens a stream may sample beyond the last confirmed write (--decode-lookahead).
  int32_t decode_lookahead = 16;
  // How long a stream's tokens may wait to go out together (--stream-flush-interval).
  absl::Duration stream_flush_interval = absl::ZeroDuration();
  // Bytes of resident state over all models (--max-state-memory-bytes); sizes the pool.
  int64_t max_state_memory_bytes = int64_t{1} << 30;
  // Idle sessions are deleted after this long (--session-ttl).
  absl::Duration session_ttl = absl::Hours(24);
  // Seals exported blobs and opens imported ones; null = unsigned. Not owned.
  const SessionSealer* sealer = nullptr;
  // Test-only: runs on the step thread (--overlap-steps) before each step.
  std::function<void()> step_started_for_testing;
  // Test-only (CoreOptions::before_decode_step_for_testing).
  std::function<void(const std::function<bool()>& ending)> before_decode_step_for_testing;
  // Test-only (CoreOptions::stream_admitted_for_testing).
  std::function<void(const std::string& tenant)> stream_admitted_for_testing;
};

}  // namespace fwserve
