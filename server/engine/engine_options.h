// What one model's engine is told: its limits, its batching and its kernels. Embedded in
// CoreOptions (CoreOptions::engine), which hands it to each model's engine as it is;
// each field is set where its flag is read (server/fwserve.cc; the flags are documented
// in docs/serving.md) and checked by Core::Create (errors name the flag). Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/time/time.h"
#include "server/engine/scheduler_options.h"

namespace fwserve {

class SessionSealer;

struct EngineOptions {
  // The scheduler's slots, prefill chunks and batch wait (--max-active-streams,
  // --prefill-chunk-tokens, --prefill-batch-tokens, --batch-wait).
  SchedulerOptions scheduler;
  // Work items waiting for the engine (--max-queued-requests; > 0); beyond it
  // RESOURCE_EXHAUSTED.
  int64_t max_queued_requests = 1024;
  // The longest a stream should wait in the queue (--max-queue-wait; >= 0): once the
  // engine has measured how fast its slots free up, the queue holds only what drains
  // within it (at least 2 items, at most max_queued_requests). Zero = no such bound.
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // CoDel with adaptive LIFO (--queue-codel-target >= 0, --queue-codel-interval > 0;
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
  // LibTorch intra-op threads of the engine, its decode step and model loading
  // (--threads; >= 0); 0 = OMP_NUM_THREADS if set, else the physical cores this process
  // may use (server/base/cpu_count.h: affinity mask, cgroup CPU quota).
  int32_t intra_op_threads = 0;
  // Threads one native prefill chunk may use (--prefill-threads; >= 0); 0 = the
  // physical cores this process may use (UsableCores; OMP_NUM_THREADS does not apply).
  int32_t prefill_threads = 0;
  // The decode step (--decode-kernel): "native" (float32 CPU models,
  // models/kernels/native_step.h: fused sgemm projections, state updated in place in the pool;
  // on a CUDA model it means "graph"), "graph" (models/kernels/graphed_step.h: the step on
  // per-batch-size buffers, replayed as CUDA Graphs on CUDA and run eagerly on the CPU,
  // with sampling on the device) or "libtorch" (Model::Step on gathered rows, the
  // reference). What a model cannot use falls back to "libtorch" (float64 models
  // always do).
  std::string decode_kernel = "native";
  // BENCHMARK ONLY (--benchmark-null-step): the decode step and prefill do no model work
  // and sampling hands out pre-drawn tokens (printable bytes for a byte vocabulary),
  // so that a benchmark measures the host path alone: scheduling, delivery, the
  // transports (docs/benchmarks.md, "The host path"). What it generates is not the
  // model's. Score still runs the model.
  bool null_step = false;
  // The native kernel's GEMMs (--native-gemm; models/kernels/packed_linear.h): "libxsmm" (JIT
  // kernels on weights laid out at load, OpenBLAS where unavailable) or "openblas"
  // (cblas_sgemm).
  std::string native_gemm = "libxsmm";
  // The graph kernel on a CUDA model (or with decode_kernel "graph") samples inside its
  // in-place step: one copy each way and one synchronisation per token
  // (--sample-in-step; Stepper). False: the step only steps; sampling runs apart (the
  // A/B of issue 39).
  bool sample_in_step = true;
  // With sample_in_step: a pass whose rows need no top_k, top_p or min_p replays a graph
  // sampled without the sort over the vocabulary (--sample-without-sort;
  // fwmodel::GraphedStepOptions::plain_sampling). False: every pass sorts (the A/B).
  bool sample_without_sort = true;
  // Multi-step decode (--decode-steps-per-launch; Stepper::StepAhead): with the in-place
  // graph step and sample_in_step, a launch may draw and absorb up to this many tokens
  // per stream, each fed back on the device, for streams without a repetition penalty
  // (bounded by their max tokens and decode_lookahead; the others draw one). A stop
  // string stops a throwaway stream on the host; the tokens drawn past it are dropped
  // with the stream's state. A session stream draws ahead only where no rollback point
  // falls inside the launch: without stop strings, its pending token in an unsent chunk
  // behind a write in flight (StreamDriver::TokensPerLaunch). 1 = one token per launch.
  // In [1, 64].
  int32_t decode_steps_per_launch = 1;
  // Sessions held, resident plus spilled (--max-sessions; > 0; the core's session
  // directory keeps to it): with the graph kernel the pool is allocated whole at start,
  // min(this, max_state_memory_bytes / state bytes) rows.
  int64_t max_sessions = 100000;
  // Decode pipelining (--decode-lookahead; in [1, 4096]): tokens a stream may sample and
  // absorb beyond the last one whose write was confirmed. While a write is in flight the
  // stream keeps decoding; what it samples meanwhile goes out as one chunk when the
  // write returns. 1 = the next token is computed during the write of the previous one.
  // Also the bound of a request's stream.min_tokens_per_message (checked by the core).
  int32_t decode_lookahead = 16;
  // How long a stream's tokens may wait to be written together (--stream-flush-interval;
  // in [0, 1s]; 0: each goes out as soon as the previous write returns). Fewer, fuller
  // messages cost less CPU per token in gRPC, the kernel and the client, for up to this
  // much added latency on the first token of each message. Bounded by decode_lookahead
  // tokens per message.
  absl::Duration stream_flush_interval = absl::ZeroDuration();
  // A message waits for this many tokens (--stream-min-tokens-per-message; in
  // [0, decode_lookahead]; 0: the adaptive default, a message per step while the writer
  // keeps up and the tokens decoded meanwhile coalesced when it lags). The last tokens
  // of a stream never wait; with stream_flush_interval > 0 nothing waits longer than
  // it. A request's own stream options replace both.
  int32_t stream_min_tokens_per_message = 0;
  // Bytes of recurrent state resident in memory, over all models (sessions in use and
  // idle; spilled ones do not count; --max-state-memory-bytes; > 0): the core's budget,
  // and the size of each engine's pool.
  int64_t max_state_memory_bytes = int64_t{1} << 30;
  // Idle sessions are deleted after this long (--session-ttl; > 0); the core's session
  // store expires stored ones after it too.
  absl::Duration session_ttl = absl::Hours(24);
  // Seals exported blobs and checks imported ones (--session-key-file). Null: blobs are
  // not signed, and signed ones are refused on import. Not owned.
  const SessionSealer* sealer = nullptr;
  // Test-only; null in production. Called on the engine thread before each decode step;
  // `ending()` is true once shutdown has asked the engine to end the remaining work
  // (EndAllWork). Tests block here to hold streams open without depending on how fast
  // the machine decodes (tests/integration/server_test.cc, StepGate).
  std::function<void(const std::function<bool()>& ending)> before_decode_step_for_testing;
  // Test-only; null in production. Called on the engine thread when a stream (Generate,
  // Score, CreateSession) is admitted, with its tenant: the server's own admission
  // order, which tests of the fair share read instead of racing client threads.
  std::function<void(const std::string& tenant)> stream_admitted_for_testing;
};

}  // namespace fwserve
