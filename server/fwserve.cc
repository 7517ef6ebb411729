// fwserve: serves recurrent-state language models over gRPC and the OpenAI-compatible
// HTTP API. `fwserve --help` lists every flag by group; README.md and docs/serving.md
// describe them.
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"  // WasPresentOnCommandLine: no public form
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cli_util.h"
#include "common/load_time_env.h"
#include "models/base/blas_check.h"
#include "models/base/file_util.h"
#include "server/base/log.h"
#include "server/core/core.h"
#include "server/engine/engine_options.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_seal.h"
#include "server/tenancy/authenticator.h"
#include "server/tenancy/tenants.h"
#include "server/transport/grpc/grpc_server.h"
#include "server/transport/http/http_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT for the gRPC API (port 0 picks a free port and logs it)");
ABSL_FLAG(std::string, http_listen, "",
          "HOST:PORT for the OpenAI-compatible HTTP API (docs/http.md); empty (the default) "
          "turns it off; port 0 picks a free port and logs it");
ABSL_FLAG(int64_t, http_max_body_bytes, int64_t{4} << 20,
          "largest HTTP request body in bytes (session imports are the big ones); larger gets "
          "413");
ABSL_FLAG(absl::Duration, http_idle_timeout, absl::Seconds(60),
          "an HTTP connection with no request in progress, or whose client does not read a "
          "write, is closed after this long");
ABSL_FLAG(std::vector<std::string>, http_cors_origins, {},
          "comma-separated origins allowed to call the HTTP API from a browser (CORS), or '*' "
          "for any; empty (the default) sends no CORS headers");
ABSL_FLAG(std::vector<std::string>, model, {},
          "checkpoint directory to serve; repeat the flag (or give a comma-separated list) "
          "for several models. The first is the default model; a model is named after its "
          "directory. Default: the shipped models/pretrained/aft-shakespeare");
ABSL_FLAG(std::string, session_store, "memory",
          "where sessions live durably: 'memory' (nothing is stored: a restart or crash loses "
          "every session, and over --max-state-memory-bytes idle sessions are evicted) or "
          "'dir:PATH' (one file per session in PATH, written through before each request that "
          "changes a session is answered, so sessions survive a crash; PATH is locked against "
          "a second server) or 'redis://HOST:PORT[/DB]' (a Redis shared by any number of "
          "replicas: any replica serves any session, each request holds the session's lease "
          "in Redis, and writes are fenced). See docs/sessions.md");
ABSL_FLAG(std::string, session_dir, "", "alias of --session-store=dir:PATH");
ABSL_FLAG(int32_t, session_store_threads, 2,
          "threads that write and read the session store (shared by all models; with "
          "redis:// they also take and release sessions' leases)");
ABSL_FLAG(std::string, session_store_password_file, "",
          "redis:// only: a file whose first line is the Redis password (AUTH); the password "
          "itself never goes on the command line");
ABSL_FLAG(absl::Duration, session_store_timeout, absl::Seconds(1),
          "redis:// only: bound on connecting and on each store command; a request that "
          "needs the store gets UNAVAILABLE 'session store unavailable' past it");
ABSL_FLAG(absl::Duration, session_lease_ttl, absl::Seconds(10),
          "redis:// only: a request's lease on its session expires this long after it was "
          "taken or last renewed (renewed every third of it while the request runs); a "
          "replica stalled longer loses the lease and its late write is refused");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N (cuda needs a CUDA LibTorch)");
ABSL_FLAG(bool, gpu_tf32, false,
          "with --device=cuda: let cuBLAS run float32 products on TF32 tensor cores "
          "(inputs rounded to 10-bit mantissas: logits differ from float32's by about 1e-3 "
          "relative; the decode step above 16 rows and the prefill are GEMMs). Off: exact "
          "float32, as the CUDA equivalence tests check");
ABSL_FLAG(std::string, gpu_matrices, "float32",
          "float32 or bf16: with --device=cuda, bf16 keeps an RWKV-7 model's matrices in "
          "bfloat16 on the GPU (half their memory and of the bytes a decode step reads; "
          "products widen them to float32 exactly; a float32 file is rounded). Other "
          "architectures and the CPU refuse bf16");
ABSL_FLAG(int64_t, max_prompt_bytes, 1 << 20,
          "longest prompt, session prefix or scored text, in bytes");
ABSL_FLAG(int32_t, max_tokens, 4096, "largest max_tokens a Generate request may ask for");
ABSL_FLAG(int64_t, max_sessions, 100000, "most sessions held at once (resident plus spilled)");
ABSL_FLAG(int64_t, max_state_memory_bytes, int64_t{1} << 30,
          "budget for recurrent state resident in memory, in bytes, over all models");
ABSL_FLAG(int32_t, max_queued_requests, 1024,
          "requests waiting per model; beyond it the server answers RESOURCE_EXHAUSTED");
ABSL_FLAG(bool, preempt_for_fair_share, false,
          "with every stream slot taken, a waiting stream of a tenant below its fair share "
          "of --max-active-streams parks the newest running stream of the tenant furthest "
          "above it; the parked stream keeps its state and resumes when a slot frees");
ABSL_FLAG(absl::Duration, max_queue_wait, absl::ZeroDuration(),
          "the longest a request should wait in a model's queue (e.g. 100ms): once the "
          "server has measured how fast streams finish, the queue holds only what starts "
          "within it, and more is refused with RESOURCE_EXHAUSTED and a retry hint; 0 = "
          "only --max-queued-requests bounds the queue");
ABSL_FLAG(absl::Duration, queue_codel_target, absl::ZeroDuration(),
          "CoDel for a model's queue (e.g. 20ms): once the queue has not been empty for "
          "--queue-codel-interval, or was full within it (more arrives than the stream "
          "slots drain), streams start newest first and one that has waited longer than "
          "this is refused with RESOURCE_EXHAUSTED and a retry hint, so what starts has "
          "waited at most this (a tenant below its fair share of the slots is never "
          "refused so); 0 = off (first come, first served, nothing shed)");
ABSL_FLAG(absl::Duration, queue_codel_interval, absl::Milliseconds(100),
          "how long a model's queue must stay non-empty, or how recently it must have been "
          "full, for --queue-codel-target to apply");
ABSL_FLAG(int32_t, max_active_streams, 256,
          "Generate/Score/CreateSession requests each model serves at once (more wait in "
          "its queue); 4096 on a CUDA device unless given (a GPU step batches them)");
ABSL_FLAG(int32_t, prefill_chunk_tokens, 256,
          "prompt tokens absorbed per engine iteration; bounds how long a long prompt "
          "delays other streams' next token");
ABSL_FLAG(int32_t, prefill_batch_tokens, 0,
          "tokens one prefill job absorbs over all the prompts it batches (those whose next "
          "pieces have the same length); 0 = --prefill-chunk-tokens on the CPU, 16384 on a "
          "CUDA device");
ABSL_FLAG(int32_t, prefix_reuse_entries, 64,
          "conversations of stateless chat and responses requests kept per tenant and model "
          "(each a session of the tenant), so that a client replaying its history continues "
          "from the kept state and prefills only the new turn; 0 = off");
ABSL_FLAG(absl::Duration, session_ttl, absl::Hours(24),
          "idle sessions are deleted after this long (e.g. 30m, 24h)");
ABSL_FLAG(absl::Duration, batch_wait, absl::Microseconds(300),
          "how long a decode step may wait for more streams to join its batch (0 on a "
          "CUDA device unless given: a GPU step is cheaper than the wait)");
ABSL_FLAG(bool, sample_in_step, true,
          "graph kernel (the default on CUDA): sample the next tokens inside the in-place "
          "decode step, one copy each way per step; false samples in a separate pass");
ABSL_FLAG(bool, sample_without_sort, true,
          "graph kernel with --sample-in-step: a step whose streams ask for no top_k, top_p "
          "or min_p samples without sorting the vocabulary (a second graph per batch size); "
          "false sorts on every step");
ABSL_FLAG(int32_t, decode_steps_per_launch, 1,
          "graph kernel with --sample-in-step: tokens one decode launch may draw and absorb "
          "per stream without a repetition penalty (a session's stream only behind a write "
          "in flight and without stop strings), each fed back on the device (1..64; 1 = one "
          "token per launch); 4 on a CUDA device unless given (1.24x at 1,024 streams on an "
          "H200)");
ABSL_FLAG(int32_t, threads, 0,
          "intra-op threads: LibTorch's, and those one decode step of the native kernel may "
          "use; 0 = OMP_NUM_THREADS if set, else the physical cores this process may run on "
          "(its CPU affinity, capped by a cgroup CPU quota such as a Kubernetes limit)");
ABSL_FLAG(int32_t, prefill_threads, 0,
          "threads one prefill chunk of the native kernel may use (its projections split "
          "by rows, its sessions over tasks); 0 = the physical cores this process may run "
          "on (its CPU affinity, capped by a cgroup CPU quota)");
ABSL_FLAG(int32_t, decode_lookahead, 16,
          "tokens a stream may decode beyond its last confirmed write; those sampled while "
          "a write is in flight go out as one message when it returns (1..4096)");
ABSL_FLAG(absl::Duration, stream_flush_interval, absl::ZeroDuration(),
          "how long a stream's tokens may wait to be sent together in one message (0 = as "
          "soon as the previous write returns; at most --decode-lookahead tokens per "
          "message). Trades up to this much latency for less CPU per token");
ABSL_FLAG(int32_t, stream_min_tokens_per_message, 0,
          "tokens a stream's message waits for (0..--decode-lookahead; 0 = adaptive: a "
          "message per step while the writer keeps up, the tokens decoded meanwhile "
          "coalesced when it lags). The last tokens never wait; --stream-flush-interval > 0 "
          "bounds the wait. A request's stream options replace both");
ABSL_FLAG(std::string, decode_kernel, "native",
          "decode step: native (float32 CPU models: fused GEMMs, state updated in place; "
          "on CUDA it means graph), graph (the step on per-batch-size buffers, replayed "
          "as CUDA Graphs on CUDA, eager on the CPU; sampling on the device) or libtorch "
          "(the reference Model::Step on gathered rows)");
ABSL_FLAG(std::string, native_gemm, "libxsmm",
          "the native decode step's projections: libxsmm (JIT small-GEMM kernels on weights "
          "laid out once at load; OpenBLAS where libxsmm is not built in or its JIT does "
          "not serve this CPU, and for products over 128 rows) or openblas (cblas_sgemm, "
          "which repacks the weights on every call)");
ABSL_FLAG(bool, benchmark_null_step, false,
          "BENCHMARK ONLY: the decode step and prefill do no model work and tokens are "
          "pre-drawn, to measure the host path (scheduling, delivery, transports) alone; "
          "what it generates is not the model's");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "on SIGTERM/SIGINT, how long in-flight requests may run before they are ended");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "HOST:PORT for the Prometheus /metrics endpoint; empty turns it off");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the server; with --tls-key-file turns TLS on (default: "
          "plaintext)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls-cert-file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle; clients must then present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, api_keys_file, "",
          "API keys, their tenants and quotas, one per line ('sha256:<hex> tenant=NAME "
          "[max_sessions=N] [max_streams=N] [tokens_per_second=X]' or 'x509-cn:<name> "
          "tenant=NAME ...'; docs/security.md). Every fwserve.v1 call must then send "
          "'authorization: Bearer <key>' (or a mapped client certificate); a session is seen "
          "only by its tenant. Re-read on SIGHUP. Default: none, an open server");
ABSL_FLAG(std::string, session_key_file, "",
          "a secret of at least 32 bytes shared by the replicas of one deployment: exported "
          "session blobs are signed with it (HMAC-SHA-256) and imports must carry a valid "
          "signature. Default: blobs are not signed");
ABSL_FLAG(int32_t, max_streams_per_connection, 256,
          "HTTP/2 streams (calls) one client connection may have open at once");
ABSL_FLAG(absl::Duration, max_refusal_delay, absl::Milliseconds(250),
          "an overload refusal (queue full) is answered after its retry hint, at most this "
          "long and never past the call's deadline, so that clients retrying at once cannot "
          "spend the server's CPU on refusals (docs/serving.md \"Overload\"); 0 = answer at "
          "once");
ABSL_FLAG(int64_t, grpc_memory_quota_bytes, int64_t{2} << 30,
          "memory gRPC may use for all connections' buffers, in bytes (0 = no bound)");
ABSL_FLAG(int32_t, writer_thread_from_streams, 1,
          "Generate streams open at once from which messages are started on a writer thread "
          "instead of the engine thread (0 = never)");
ABSL_FLAG(int32_t, writer_threads, 0,
          "writer threads the Generate streams' sends are sharded over, a stream always on "
          "the same one (0 = one per 4 CPUs, 1 to 8)");

namespace {

// True for listen addresses that only this machine can reach.
bool IsLoopbackListen(const std::string& listen) {
  return absl::StartsWith(listen, "127.") || absl::StartsWith(listen, "localhost:") ||
         absl::StartsWith(listen, "[::1]:") || absl::StartsWith(listen, "unix:");
}

// absl flags keep the last value of a repeated flag; --model accumulates instead.
std::vector<std::string> CollectRepeatedModelFlag(int argc, char** argv,
                                                  std::vector<std::string>* rest) {
  std::vector<std::string> models;
  rest->push_back(argv[0]);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if ((arg == "--model" || arg == "-model") && i + 1 < argc) {
      models.push_back(argv[++i]);
    } else if (arg.rfind("--model=", 0) == 0 || arg.rfind("-model=", 0) == 0) {
      models.push_back(arg.substr(arg.find('=') + 1));
    } else {
      rest->push_back(std::move(arg));
    }
  }
  return models;
}

std::string DefaultModelDir() {
  const std::string relative = "models/pretrained/aft-shakespeare";
  if (std::filesystem::exists(relative)) return relative;
  return std::string(FWSERVE_SOURCE_DIR) + "/" + relative;
}

int Fail(const std::string& message) {
  fwserve::FlushLog();  // after the log lines before it
  std::fprintf(stderr, "fwserve: %s\n", message.c_str());
  return 2;
}

// `fwserve --help`: what the server speaks, then its flags in the groups of
// docs/serving.md. A flag in no group is listed under "Other".
constexpr char kHelpIntro[] =
    "fwserve: serves recurrent-state language models over gRPC (fwserve.v1.Fwserve,\n"
    "--listen) and the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,\n"
    "/v1/responses, the sessions API and a web playground at /; --http-listen, off unless\n"
    "given), with Prometheus metrics (--metrics-listen).\n"
    "\n"
    "Usage: fwserve [--listen HOST:PORT] [--http-listen HOST:PORT] [--model DIR]...\n"
    "               [--session-store memory|dir:PATH|redis://HOST:PORT] [flags]\n"
    "With no flags, serves the shipped default model over gRPC on 127.0.0.1:50051.\n"
    "scripts/serve.sh adds --http-listen 127.0.0.1:8000 and a dir: session store.\n"
    "Documentation: docs/serving.md (flags), docs/http.md, docs/sessions.md.";

std::vector<fwserve::FlagGroup> HelpGroups() {
  return {
      {"Serving",
       {"listen", "model", "device", "gpu_matrices", "gpu_tf32", "metrics_listen", "log_level",
        "drain_timeout"}},
      {"HTTP API",
       {"http_listen", "http_max_body_bytes", "http_idle_timeout", "http_cors_origins"}},
      {"Sessions",
       {"session_store", "session_dir", "session_store_threads", "session_store_password_file",
        "session_store_timeout", "session_lease_ttl", "session_ttl"}},
      {"Security",
       {"tls_cert_file", "tls_key_file", "tls_client_ca_file", "api_keys_file",
        "session_key_file"}},
      {"Limits",
       {"max_prompt_bytes", "max_tokens", "max_sessions", "prefix_reuse_entries",
        "max_state_memory_bytes", "max_active_streams", "max_streams_per_connection",
        "grpc_memory_quota_bytes"}},
      {"Overload",
       {"max_queued_requests", "max_queue_wait", "queue_codel_target", "queue_codel_interval",
        "preempt_for_fair_share", "max_refusal_delay"}},
      {"Performance",
       {"threads", "prefill_threads", "prefill_chunk_tokens", "prefill_batch_tokens", "batch_wait",
        "decode_kernel", "sample_in_step", "sample_without_sort", "decode_steps_per_launch",
        "native_gemm", "decode_lookahead", "stream_flush_interval", "stream_min_tokens_per_message",
        "writer_thread_from_streams", "writer_threads", "benchmark_null_step"}},
  };
}

}  // namespace

int main(int argc, char** argv) {
  // OMP_WAIT_POLICY=PASSIVE when unset: LibTorch's OpenMP workers (libgomp) then sleep
  // between parallel regions instead of taking CPU from the engine, the transports and
  // the clients (1.14x-1.57x the tokens/s at 64 streams, 1.2x at 1, docs/benchmarks.md
  // "OpenMP wait policy"; set OMP_WAIT_POLICY, e.g. ACTIVE, to keep spinning); and
  // OPENBLAS_CORETYPE when OpenBLAS misdetected the CPU (docs/serving.md, "OpenBLAS
  // core"). Both are read at load, so this executes fwserve again once when it sets one.
  fwserve::LoadTimeEnvOptions load_time_env;
  load_time_env.passive_openmp_waits = true;
  fwserve::ReexecWithLoadTimeEnv(argv, load_time_env);
  // Debian's Abseil is built without NDEBUG, so absl::Mutex checks every lock against a
  // global lock-order graph (deadlock detection: a global spinlock and a graph update per
  // Lock), in this process's mutexes and gRPC's alike. The tests keep it (it finds lock
  // cycles); the server does not pay it per message (issue 48, docs/benchmarks.md).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(kHelpIntro);
  fwserve::SetGroupedHelp(kHelpIntro, HelpGroups(), "server/fwserve.cc");
  std::vector<std::string> rest;
  std::vector<std::string> models = CollectRepeatedModelFlag(argc, argv, &rest);
  if (!models.empty()) rest.push_back("--model=" + absl::StrJoin(models, ","));
  std::vector<char*> rest_pointers;
  for (std::string& s : rest) rest_pointers.push_back(s.data());
  std::vector<std::string> positional = fwserve::ParseFlagsAllowingDashes(
      static_cast<int>(rest_pointers.size()), rest_pointers.data());
  if (positional.size() > 1) return Fail("unexpected argument '" + positional[1] + "'");

  fwserve::LogLevel level;
  if (!fwserve::ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    return Fail("--log-level must be debug, info, warning or error");
  }
  fwserve::SetLogLevel(level);

  // SIGTERM/SIGINT are taken by sigwait below; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // Over a file-size limit (RLIMIT_FSIZE) a write must fail with EFBIG, which the
  // session store reports and retries, not kill the server with every session in it.
  signal(SIGXFSZ, SIG_IGN);

  if (auto warning = fwmodel::SlowBlasWarning())
    fwserve::Log(fwserve::LogLevel::kWarning, *warning);
  if (auto note = fwserve::LoadTimeEnvNote()) fwserve::Log(fwserve::LogLevel::kInfo, *note);

  std::shared_ptr<fwserve::Metrics> metrics = fwserve::Metrics::Create();
  std::unique_ptr<prometheus::Exposer> exposer;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(metrics_listen);
    } catch (const std::exception& e) {
      return Fail("--metrics-listen: cannot listen on '" + metrics_listen + "': " + e.what());
    }
    exposer->RegisterCollectable(metrics->registry());
  }

  fwserve::GrpcServerOptions server_options;
  server_options.listen = absl::GetFlag(FLAGS_listen);
  server_options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  server_options.metrics = metrics.get();
  for (auto [flag, path, pem] :
       {std::tuple{"--tls-cert-file", absl::GetFlag(FLAGS_tls_cert_file),
                   &server_options.tls_cert_pem},
        std::tuple{"--tls-key-file", absl::GetFlag(FLAGS_tls_key_file),
                   &server_options.tls_key_pem},
        std::tuple{"--tls-client-ca-file", absl::GetFlag(FLAGS_tls_client_ca_file),
                   &server_options.tls_client_ca_pem}}) {
    if (path.empty()) continue;
    auto contents = fwmodel::ReadFile(path);
    if (!contents.ok())
      return Fail(std::string(flag) + ": " + std::string(contents.status().message()));
    *pem = std::move(*contents);
  }
  server_options.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  server_options.grpc_memory_quota_bytes = absl::GetFlag(FLAGS_grpc_memory_quota_bytes);
  if (server_options.max_streams_per_connection < 1) {
    return Fail("--max-streams-per-connection must be >= 1");
  }
  server_options.max_refusal_delay = absl::GetFlag(FLAGS_max_refusal_delay);
  if (server_options.max_refusal_delay < absl::ZeroDuration() ||
      server_options.max_refusal_delay > absl::Seconds(10)) {
    return Fail(absl::StrCat("--max-refusal-delay must be in [0s, 10s], got ",
                             absl::FormatDuration(server_options.max_refusal_delay)));
  }
  server_options.writer_thread_from_streams = absl::GetFlag(FLAGS_writer_thread_from_streams);
  if (server_options.writer_thread_from_streams < 0) {
    return Fail(absl::StrCat("--writer-thread-from-streams must be >= 0, got ",
                             server_options.writer_thread_from_streams));
  }
  server_options.writer_threads = absl::GetFlag(FLAGS_writer_threads);
  if (server_options.writer_threads < 0 || server_options.writer_threads > 64) {
    return Fail(
        absl::StrCat("--writer-threads must be in [0, 64], got ", server_options.writer_threads));
  }
  std::unique_ptr<fwserve::Tenants> tenants;
  std::unique_ptr<fwserve::ApiKeyAuthenticator> authenticator;
  const std::string api_keys_file = absl::GetFlag(FLAGS_api_keys_file);
  if (!api_keys_file.empty()) {
    auto loaded = fwserve::Tenants::Load(api_keys_file);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    tenants = std::move(*loaded);
    authenticator = std::make_unique<fwserve::ApiKeyAuthenticator>(tenants.get(), metrics.get());
    server_options.authenticator = authenticator.get();
    fwserve::Log(fwserve::LogLevel::kInfo,
                 absl::StrCat("API keys: ", tenants->Names().size(), " tenants (",
                              absl::StrJoin(tenants->Names(), ", "), ")"));
  } else if (!IsLoopbackListen(server_options.listen) && server_options.tls_client_ca_pem.empty()) {
    fwserve::Log(fwserve::LogLevel::kWarning,
                 absl::StrCat("--listen=", server_options.listen,
                              " is reachable from other machines, and there is no "
                              "--api-keys-file and no mutual TLS: anyone who reaches it can "
                              "read, change and delete every session (docs/security.md)"));
  }
  std::unique_ptr<fwserve::SessionSealer> sealer;
  if (const std::string key_file = absl::GetFlag(FLAGS_session_key_file); !key_file.empty()) {
    auto loaded = fwserve::SessionSealer::FromKeyFile(key_file);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    sealer = std::move(*loaded);
  }
  fwserve::CoreOptions core_options;
  fwserve::EngineOptions& engine = core_options.engine;
  fwserve::SchedulerOptions& scheduler = engine.scheduler;
  core_options.tenants = tenants.get();
  engine.sealer = sealer.get();
  core_options.model_dirs = absl::GetFlag(FLAGS_model);
  if (core_options.model_dirs.empty()) core_options.model_dirs.push_back(DefaultModelDir());
  core_options.session_store = absl::GetFlag(FLAGS_session_store);
  if (const std::string dir = absl::GetFlag(FLAGS_session_dir); !dir.empty()) {
    if (core_options.session_store != "memory") {
      return Fail("--session-dir is an alias of --session-store=dir:PATH; give only one");
    }
    core_options.session_store = "dir:" + dir;
  }
  core_options.store_threads = absl::GetFlag(FLAGS_session_store_threads);
  core_options.session_store_password_file = absl::GetFlag(FLAGS_session_store_password_file);
  core_options.session_store_timeout = absl::GetFlag(FLAGS_session_store_timeout);
  core_options.session_lease_ttl = absl::GetFlag(FLAGS_session_lease_ttl);
  core_options.device = absl::GetFlag(FLAGS_device);
  core_options.gpu_matrices = absl::GetFlag(FLAGS_gpu_matrices);
  core_options.gpu_tf32 = absl::GetFlag(FLAGS_gpu_tf32);
  core_options.max_prompt_bytes = absl::GetFlag(FLAGS_max_prompt_bytes);
  core_options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  engine.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  engine.max_state_memory_bytes = absl::GetFlag(FLAGS_max_state_memory_bytes);
  engine.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  engine.max_queue_wait = absl::GetFlag(FLAGS_max_queue_wait);
  engine.preempt_for_fair_share = absl::GetFlag(FLAGS_preempt_for_fair_share);
  engine.codel_target = absl::GetFlag(FLAGS_queue_codel_target);
  engine.codel_interval = absl::GetFlag(FLAGS_queue_codel_interval);
  scheduler.max_active_streams = absl::GetFlag(FLAGS_max_active_streams);
  scheduler.prefill_chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens);
  scheduler.prefill_batch_tokens = absl::GetFlag(FLAGS_prefill_batch_tokens);
  core_options.prefix_reuse_entries = absl::GetFlag(FLAGS_prefix_reuse_entries);
  engine.session_ttl = absl::GetFlag(FLAGS_session_ttl);
  scheduler.batch_wait = absl::GetFlag(FLAGS_batch_wait);
  engine.sample_in_step = absl::GetFlag(FLAGS_sample_in_step);
  engine.sample_without_sort = absl::GetFlag(FLAGS_sample_without_sort);
  engine.decode_steps_per_launch = absl::GetFlag(FLAGS_decode_steps_per_launch);
  engine.decode_kernel = absl::GetFlag(FLAGS_decode_kernel);
  engine.native_gemm = absl::GetFlag(FLAGS_native_gemm);
  engine.null_step = absl::GetFlag(FLAGS_benchmark_null_step);
  engine.decode_lookahead = absl::GetFlag(FLAGS_decode_lookahead);
  engine.stream_flush_interval = absl::GetFlag(FLAGS_stream_flush_interval);
  engine.stream_min_tokens_per_message = absl::GetFlag(FLAGS_stream_min_tokens_per_message);
  if (absl::StartsWith(core_options.device, "cuda")) {
    // A GPU's defaults where the flag is not given (docs/serving.md): a graph step
    // batches up to 4,096 rows and costs less than waiting for more; a prefill job
    // batches many prompts in about the time of one.
    const auto given = [](const char* flag) {
      return absl::flags_internal::WasPresentOnCommandLine(flag);
    };
    if (!given("max_active_streams")) scheduler.max_active_streams = 4096;
    if (!given("batch_wait")) scheduler.batch_wait = absl::ZeroDuration();
    if (!given("decode_steps_per_launch")) engine.decode_steps_per_launch = 4;
    if (scheduler.prefill_batch_tokens == 0) scheduler.prefill_batch_tokens = 16384;
  }
  engine.intra_op_threads = absl::GetFlag(FLAGS_threads);
  engine.prefill_threads = absl::GetFlag(FLAGS_prefill_threads);
  core_options.metrics = metrics.get();
  auto core = fwserve::Core::Create(core_options);
  if (!core.ok()) return Fail(std::string(core.status().message()));

  auto server = fwserve::GrpcServer::Start(server_options, core->get());
  if (!server.ok()) return Fail(std::string(server.status().message()));
  std::unique_ptr<fwserve::HttpServer> http;
  if (const std::string http_listen = absl::GetFlag(FLAGS_http_listen); !http_listen.empty()) {
    fwserve::HttpServerOptions http_options;
    http_options.listen = http_listen;
    http_options.max_body_bytes = absl::GetFlag(FLAGS_http_max_body_bytes);
    http_options.idle_timeout = absl::GetFlag(FLAGS_http_idle_timeout);
    http_options.cors_origins = absl::GetFlag(FLAGS_http_cors_origins);
    http_options.authenticator = authenticator.get();
    http_options.metrics = metrics.get();
    auto started = fwserve::HttpServer::Start(http_options, core->get());
    if (!started.ok()) {
      (*server)->Shutdown();
      return Fail(std::string(started.status().message()));
    }
    http = std::move(*started);
    fwserve::Log(fwserve::LogLevel::kInfo, absl::StrCat("HTTP API (OpenAI-compatible) on ",
                                                        http_listen, " (port ", http->port(), ")"));
    if (tenants == nullptr && !IsLoopbackListen(http_listen)) {
      fwserve::Log(fwserve::LogLevel::kWarning,
                   absl::StrCat("--http-listen=", http_listen,
                                " is reachable from other machines, and there is no "
                                "--api-keys-file: anyone who reaches it can read, change and "
                                "delete every session (docs/security.md)"));
    }
  }
  fwserve::Log(fwserve::LogLevel::kInfo,
               absl::StrCat("fwserve listening on ", server_options.listen, " (port ",
                            (*server)->port(), ")",
                            metrics_listen.empty() ? ""
                                                   : absl::StrCat("; metrics on http://",
                                                                  metrics_listen, "/metrics")));

  int signal_number = 0;
  while (true) {
    sigwait(&signals, &signal_number);
    if (signal_number != SIGHUP) break;
    // SIGHUP: re-read the API keys; sessions and streams are untouched.
    if (tenants == nullptr) {
      fwserve::Log(fwserve::LogLevel::kInfo, "SIGHUP: no --api-keys-file to re-read");
    } else if (absl::Status reloaded = tenants->Reload(); !reloaded.ok()) {
      fwserve::Log(fwserve::LogLevel::kError,
                   absl::StrCat("SIGHUP: keeping the previous API keys: ", reloaded.message()));
    } else {
      fwserve::Log(fwserve::LogLevel::kInfo,
                   absl::StrCat("SIGHUP: API keys re-read: ", tenants->Names().size(), " tenants (",
                                absl::StrJoin(tenants->Names(), ", "), ")"));
    }
  }
  fwserve::Log(
      fwserve::LogLevel::kInfo,
      absl::StrCat("received ", signal_number == SIGTERM ? "SIGTERM" : "SIGINT",
                   "; draining (up to ", absl::FormatDuration(server_options.drain_timeout), ")"));
  // Both transports stop taking work, the core drains and ends what remains, the
  // transports stop, then the core (docs/serving.md, "Graceful shutdown").
  (*server)->BeginShutdown();
  if (http != nullptr) http->BeginShutdown();
  (*core)->BeginShutdown();
  const bool idle = (*core)->WaitIdle(absl::Now() + server_options.drain_timeout);
  if (!idle) {
    fwserve::Log(fwserve::LogLevel::kWarning, "drain timeout passed; ending the remaining streams");
  }
  (*core)->EndAllWork();
  (*server)->StopServing(idle);
  if (http != nullptr) http->Stop(idle ? absl::ZeroDuration() : absl::Seconds(5));
  (*core)->Stop();
  fwserve::Log(fwserve::LogLevel::kInfo, "fwserve stopped");
  return 0;
}
