// The host path, measured without a model and without a transport (issue 48): a Core
// in-process with the benchmark-only null step (EngineOptions::null_step: no model work,
// pre-drawn tokens), N streams of T tokens each started through Core::StartGenerate and
// answered by an observer that acknowledges every message at once (the cheapest possible
// transport). What is left is the server's own work per token: admission, scheduling,
// the engine's iteration, UTF-8 assembly, delivery. Reports, for each N, the engine
// thread's CPU time per token (the ceiling one engine thread puts on a GPU), the whole
// process's CPU per token, tokens/s, messages/s and tokens per message.
//
// Usage: host_path_bench --model DIR [--streams 64,1024,4096] [--tokens 256]
//                        [--rounds 3] [--json]
// One JSON object per line with --json. The process's CPU includes this program's
// observers (a counter and an acknowledgement per message).
#include <pthread.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/process_cpu.h"
#include "server/core/core.h"

ABSL_FLAG(std::string, model, "",
          "model directory (required), e.g. models/pretrained/aft-shakespeare");
ABSL_FLAG(std::string, streams, "64,1024,4096", "comma-separated stream counts, one run each");
ABSL_FLAG(int32_t, tokens, 256, "tokens each stream generates (max_tokens)");
ABSL_FLAG(int32_t, rounds, 3, "runs per stream count; the report gives the median");
ABSL_FLAG(bool, json, false, "one JSON object per stream count instead of a table");

namespace {

using fwbench::ProcessCpuSeconds;
using fwserve::Caller;
using fwserve::GenerateChunk;
using fwserve::GenerateControl;
using fwserve::GenerateObserver;
using fwserve::GenerateSummary;

// CPU seconds (user + system) of thread `tid` of this process, from /proc.
double ThreadCpuSeconds(const std::string& tid) {
  std::ifstream stat("/proc/self/task/" + tid + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command name, which is in parentheses and may hold spaces.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(text.substr(close + 2), ' ');
  // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
  if (fields.size() < 13) return 0;
  double utime = 0, stime = 0;
  (void)absl::SimpleAtod(fields[11], &utime);
  (void)absl::SimpleAtod(fields[12], &stime);
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The ids of this process's threads named `name`.
std::vector<std::string> ThreadsNamed(const std::string& name) {
  std::vector<std::string> tids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return tids;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + entry->d_name + "/comm");
    std::string comm_name;
    std::getline(comm, comm_name);
    if (comm_name == name) tids.push_back(entry->d_name);
  }
  closedir(dir);
  return tids;
}

// Counts what the streams received; every stream's observer. Thread-safe.
class Tally {
 public:
  explicit Tally(int64_t streams) : remaining_(streams) {}
  void Add(int64_t tokens) {
    tokens_.fetch_add(tokens, std::memory_order_relaxed);
    messages_.fetch_add(1, std::memory_order_relaxed);
  }
  void Finished(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && first_error_.ok()) first_error_ = status;
    --remaining_;
  }
  // Waits until every stream finished; their first error, if any.
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int64_t* remaining) { return *remaining == 0; }, &remaining_));
    return first_error_;
  }
  int64_t tokens() const { return tokens_.load(); }
  int64_t messages() const { return messages_.load(); }

 private:
  std::atomic<int64_t> tokens_{0};
  std::atomic<int64_t> messages_{0};
  absl::Mutex mu_;
  int64_t remaining_ ABSL_GUARDED_BY(mu_);
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

// One stream: counts each message and acknowledges it at once.
class CountingObserver : public GenerateObserver {
 public:
  explicit CountingObserver(Tally* tally) : tally_(tally) {}
  void OnStart(std::shared_ptr<GenerateControl> stream) override { control_ = std::move(stream); }
  void OnChunk(GenerateChunk chunk) override {
    tally_->Add(static_cast<int64_t>(chunk.token_ids.size()));
    control_->WriteDone(true);
  }
  void OnFinish(absl::Status status, GenerateSummary summary) override {
    (void)summary;
    tally_->Finished(status);
  }

 private:
  Tally* const tally_;
  std::shared_ptr<GenerateControl> control_;
};

struct RunResult {
  double seconds = 0;
  int64_t tokens = 0;
  int64_t messages = 0;
  double engine_cpu = 0;
  double process_cpu = 0;
};

absl::StatusOr<RunResult> Run(fwserve::Core& core, int64_t streams, int32_t tokens) {
  Tally tally(streams);
  std::vector<std::unique_ptr<CountingObserver>> observers;
  observers.reserve(static_cast<size_t>(streams));
  // The engine names its thread once it runs.
  std::vector<std::string> engine_threads = ThreadsNamed("fwserve-engine");
  for (int i = 0; i < 200 && engine_threads.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    engine_threads = ThreadsNamed("fwserve-engine");
  }
  if (engine_threads.empty()) return absl::InternalError("no fwserve-engine thread");
  // Threads the engine thread starts (OpenMP's workers) inherit its name: the engine
  // thread is the first of them.
  const std::string engine_thread = *std::min_element(
      engine_threads.begin(), engine_threads.end(),
      [](const std::string& a, const std::string& b) { return std::stoll(a) < std::stoll(b); });
  const double engine_before = ThreadCpuSeconds(engine_thread);
  const double process_before = ProcessCpuSeconds();
  const absl::Time start = absl::Now();
  Caller caller;
  for (int64_t i = 0; i < streams; ++i) {
    fwserve::GenerateParams params;
    params.prompt = "ROMEO:";
    params.max_tokens = tokens;
    params.sampling.temperature = 0;
    observers.push_back(std::make_unique<CountingObserver>(&tally));
    absl::Status started = core.StartGenerate(caller, std::move(params), observers.back().get());
    if (!started.ok()) return started;
  }
  if (absl::Status finished = tally.Wait(); !finished.ok()) return finished;
  RunResult result;
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  result.engine_cpu = ThreadCpuSeconds(engine_thread) - engine_before;
  result.process_cpu = ProcessCpuSeconds() - process_before;
  result.tokens = tally.tokens();
  result.messages = tally.messages();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "host_path_bench --model DIR [--streams 64,1024,4096] [--tokens 256] [--rounds 3] "
      "[--json]: the server's host path per token with the null step, no transport");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    std::fprintf(stderr, "host_path_bench: --model is required\n");
    return 2;
  }
  std::vector<int64_t> counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_streams), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n <= 0) {
      std::fprintf(stderr, "host_path_bench: --streams: bad count '%s'\n",
                   std::string(part).c_str());
      return 2;
    }
    counts.push_back(n);
  }
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  fwserve::CoreOptions options;
  options.model_dirs = {model};
  options.engine.null_step = true;
  options.engine.scheduler.max_active_streams = most;
  options.engine.max_queued_requests = most;
  options.engine.max_sessions = std::max<int64_t>(options.engine.max_sessions, 2 * most);
  options.prefix_reuse_entries = 0;
  auto core = fwserve::Core::Create(options);
  if (!core.ok()) {
    std::fprintf(stderr, "host_path_bench: %s\n", std::string(core.status().message()).c_str());
    return 1;
  }
  const int32_t tokens = absl::GetFlag(FLAGS_tokens);
  const int32_t rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("%8s %12s %16s %17s %12s %12s %10s\n", "streams", "tokens/s", "engine us/token",
                "process us/token", "messages/s", "tokens/msg", "wall s");
  }
  for (int64_t streams : counts) {
    std::vector<RunResult> runs;
    for (int32_t r = 0; r < rounds; ++r) {
      auto run = Run(**core, streams, tokens);
      if (!run.ok()) {
        std::fprintf(stderr, "host_path_bench: %lld streams: %s\n", static_cast<long long>(streams),
                     std::string(run.status().message()).c_str());
        return 1;
      }
      runs.push_back(*run);
    }
    // The median run by engine CPU per token.
    std::sort(runs.begin(), runs.end(), [](const RunResult& a, const RunResult& b) {
      return a.engine_cpu / a.tokens < b.engine_cpu / b.tokens;
    });
    const RunResult& m = runs[runs.size() / 2];
    const double per_token = 1e6 / static_cast<double>(std::max<int64_t>(1, m.tokens));
    const double engine_us = m.engine_cpu * per_token;
    const double process_us = m.process_cpu * per_token;
    const double lowest = runs.front().engine_cpu * 1e6 / runs.front().tokens;
    const double highest = runs.back().engine_cpu * 1e6 / runs.back().tokens;
    if (json) {
      std::printf(
          "{\"streams\": %lld, \"tokens_per_stream\": %d, \"rounds\": %d, \"tokens_per_s\": %.0f, "
          "\"engine_cpu_us_per_token\": %.3f, \"engine_cpu_us_per_token_range\": [%.3f, %.3f], "
          "\"process_cpu_us_per_token\": %.3f, \"messages_per_s\": %.0f, "
          "\"tokens_per_message\": %.2f, \"seconds\": %.3f}\n",
          static_cast<long long>(streams), tokens, rounds, m.tokens / m.seconds, engine_us, lowest,
          highest, process_us, m.messages / m.seconds,
          static_cast<double>(m.tokens) / std::max<int64_t>(1, m.messages), m.seconds);
    } else {
      std::printf("%8lld %12.0f %9.3f (%.2f-%.2f) %17.3f %12.0f %12.2f %10.3f\n",
                  static_cast<long long>(streams), m.tokens / m.seconds, engine_us, lowest, highest,
                  process_us, m.messages / m.seconds,
                  static_cast<double>(m.tokens) / std::max<int64_t>(1, m.messages), m.seconds);
    }
    std::fflush(stdout);
  }
  (*core)->BeginShutdown();
  (*core)->WaitIdle(absl::Now() + absl::Seconds(10));
  (*core)->EndAllWork();
  (*core)->Stop();
  return 0;
}
