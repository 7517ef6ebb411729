// fwbench: the load generator for fwserve. For each concurrency level C it runs C client
// streams, each issuing Generate requests back to back (over gRPC or the HTTP API, see
// "Protocols"), and reports aggregate output
// tokens/s, requests/s, time to first token (TTFT) and inter-token latency (ITL)
// percentiles, and errors by status code. docs/benchmarks.md ("Serving (fwbench)") shows
// how it is run; scripts/bench-serving.sh runs the standard sweep.
//
// Measurement. A level runs --warmup, then a measured window of --duration (or, with
// --requests-per-stream N, until the first stream has completed N requests started inside
// the window). Samples are kept by the time they are observed: a token counts if it arrives
// inside the window, an ITL sample if its second token does, a TTFT sample if its request
// started inside the window and its first token arrived before the window ended. ITL is
// per token: a message of n tokens gives the gap since the previous message for its
// first token and 0 for the other n-1 (they arrived together). Messages (gRPC
// GenerateResponse messages with token ids; HTTP SSE chunks with text, neither the usage
// chunk nor [DONE]) count as tokens do, by arrival inside the window: "messages",
// "messages_per_s" and "tokens_per_message" (tokens / messages, 0 without messages; the
// tok/msg column). At the end of the window the requests still running are cancelled
// (not counted as errors), so every level starts from an idle server.
//
// Clients (gRPC). All threads of a process share one fwserve::Client (thread-safe by
// contract). Separate Clients would not give separate connections anyway: gRPC channels
// with the same target and arguments share one subchannel (its global subchannel pool),
// and client.h does not expose channel arguments. So every level runs over one HTTP/2
// connection per client process (one connection without --processes), as a server
// behind one proxy would see it.
//
// Client processes (--processes N, default 1). One process's threads (and its one HTTP/2
// connection, or its one asio thread) can be the bound before the server is. With N > 1,
// a level of C streams runs in min(N, C) worker processes instead: stream i in process
// i % N, with the stream index, seeds, prompt and session prefix it has with N = 1. A
// worker is this binary re-executed (/proc/self/exe --worker_of=PID, so no gRPC state
// crosses a fork) with its own fwserve::Client (its own channel and connection) and, over
// HTTP, its own asio thread and connections; it talks to the parent over its stdin and
// stdout. The parent waits until every worker's streams have done their set-up, then
// sends each the same window as steady-clock times (one clock for the processes of one
// machine); each worker returns its streams' raw samples and its own CPU time over the
// window, and the parent merges the streams exactly as it merges the streams of one
// process (sums; percentiles over all the samples together). The parent takes the
// snapshots (--metrics-target, --server-pid) itself. The level's "processes" is min(N, C)
// (1: the level ran in this process, as without the flag); the bench's CPU figures are
// the parent's plus every worker's, and "bench_cpu_fraction_by_process" lists them
// (parent first; a worker near 1.0 is a bound again). A worker that exits, is killed or
// has not reported 120 s after the window becomes one error of the level ("worker
// process: exit 1", "worker process: killed by signal 9", ...), its streams counting
// nothing; workers die with the parent. --requests-per-stream is refused with N > 1: the
// first stream to finish ends the window, and the workers do not share that.
//
// Long context (--context-tokens N > 0): before a level starts, each stream creates a
// session prefilled with N tokens of text (CreateSession prefix; the bytes tokenizer makes
// one byte one token). Each request then forks that session (an O(state) copy), generates
// on the fork and deletes it, so every request starts at the same context length instead
// of the session growing by --max-tokens per request. Fork and delete are outside TTFT.
//
// Sessions (--sessions): each stream creates one session (prefilled with
// --context-tokens tokens, if any) and generates every request on it, so the session
// grows and every request ends with a write-through to the server's session store.
// "END" is the time from a request's last token to its final message: with a durable
// store, the write-through happens there.
//
// Protocols (--protocol grpc,http): the same workload over gRPC (the client library,
// --target) or over the OpenAI-compatible HTTP API (--http-target, docs/http.md): each
// request is a POST /v1/completions with "stream": true and
// stream_options.include_usage, read as server-sent events. With both, every level runs
// once per protocol, one right after the other (gRPC, HTTP, gRPC, HTTP, ... with
// --repeat), and the HTTP levels are compared with the gRPC level of the same repeat,
// concurrency and context ("HTTP/gRPC" lines, "protocol_ratios" in the JSON).
// The HTTP mode mirrors the gRPC mode step for step: sessions through
// /fwserve/v1/sessions (create with a prefix, fork, delete), generation on a session with
// the completions extension field session_id, the same prompt, max_tokens, temperature
// and seeds, the same window rules. Differences, by construction:
//   - Client structure: gRPC runs a thread per stream over one HTTP/2 connection; HTTP
//     runs every stream on one asio thread (asynchronous Boost.Beast), each stream on its
//     own keep-alive HTTP/1.1 connection (opened before the window; reopened only if the
//     server closes it or the bench cancels a request).
//   - Tokens: an SSE chunk carries text, not token ids. A chunk counts as many tokens as
//     its text has bytes (exact for the bytes tokenizer, which every model uses so far,
//     while the output is valid UTF-8; an invalid byte arrives as U+FFFD, 3 bytes);
//     the final usage chunk's completion_tokens then corrects the request's total
//     (the correction is counted when the usage chunk arrives, and reported as
//     "usage_token_correction"), so tokens/s is exact; ITL and TTFT are per SSE chunk as
//     they are per gRPC message.
//   - Cancellation at the end of the window closes the request's connection (the HTTP
//     API has no other way to cancel a stream).
//   - Errors are keyed "HTTP <status>" (a refused request), "SSE error <code>" (an error
//     event after the stream began), "connection: ..." (transport), "incomplete stream".
//
// Per-request overhead: every level reports the latency of its completed requests
// ("request_ms", send to the last byte) and, with --server-pid, the server's CPU time per
// completed request; `--max-tokens 1 --prompt-bytes 1` at --concurrency 1,64 makes that
// the cost of a minimal request in each protocol.
//
// Per-token cost: CPU time over the window per output token of the window:
// "bench_cpu_us_per_token" (the bench, all its client processes), and with --server-pid
// "server_cpu_us_per_token" (every server thread) and
// "server_engine_thread_cpu_us_per_token" (the threads named fwserve-engine: the engine
// loop, and the OpenMP workers it starts, which inherit its name; also as
// "server_engine_thread_cpu_fraction"). Absent when the window has no tokens.
//
// Server-side numbers (optional): --metrics-target scrapes the server's Prometheus
// endpoint at both ends of the window (decode steps, mean batch size, share of the
// window spent in the batched model step and in prefill); --server-pid reads the server's
// CPU time per thread name from /proc (same machine only).
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/fwbench_http.h"
#include "bench/process_cpu.h"
#include "client/client.h"
#include "common/cli_util.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "HOST:PORT of the fwserve gRPC API");
ABSL_FLAG(std::string, http_target, "127.0.0.1:8000",
          "HOST:PORT of the fwserve HTTP API (fwserve --http-listen), for --protocol http");
ABSL_FLAG(std::vector<std::string>, protocol, std::vector<std::string>({"grpc"}),
          "comma-separated: grpc (the client library, --target), http (streamed POST "
          "/v1/completions with server-sent events, --http-target), or grpc,http: every "
          "level runs once per protocol, back to back, and HTTP is reported as a ratio of "
          "gRPC");
ABSL_FLAG(std::string, client, "retrying",
          "how the gRPC client meets overload refusals: retrying (the client library's default: "
          "waits the server's retry hint plus exponential jitter, under a retry budget) or "
          "naive (no retries in the library; the stream sends its next request 10 ms after a "
          "refusal, as a careless client would)");
ABSL_FLAG(std::string, api_key_file, "",
          "file holding the API key sent with every gRPC call (a server with --api-keys); "
          "runs one tenant's load, e.g. two fwbench processes for two tenants. gRPC only");
ABSL_FLAG(std::string, model, "", "model name; empty = the server's default model");
ABSL_FLAG(std::vector<std::string>, concurrency, std::vector<std::string>({"1", "8", "32", "128"}),
          "comma-separated concurrency levels (client streams issuing requests back to back)");
ABSL_FLAG(std::vector<std::string>, context_tokens, std::vector<std::string>({"0"}),
          "comma-separated context lengths; N > 0: each stream generates on a copy of a "
          "session prefilled with N tokens. Levels are every (concurrency, context) pair");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10), "measured time per level (e.g. 10s)");
ABSL_FLAG(int32_t, requests_per_stream, 0,
          "if > 0, replaces --duration: the window ends when the first stream has completed "
          "this many requests started inside it");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(2),
          "load applied before each level's window, not measured");
ABSL_FLAG(int32_t, repeat, 1, "run the whole sweep this many times (to see the noise)");
ABSL_FLAG(int32_t, max_tokens, 128, "tokens generated per request");
ABSL_FLAG(int32_t, min_tokens_per_message, 0,
          "gRPC: each request's StreamOptions.min_tokens_per_message (fewer, fuller "
          "messages); 0 = the server's default");
ABSL_FLAG(bool, sessions, false,
          "each stream generates all its requests on one session of its own (which grows); "
          "default: throwaway requests, or forks with --context-tokens");
ABSL_FLAG(std::string, prompt, "", "prompt text; empty = --prompt-bytes bytes of --text-file");
ABSL_FLAG(int32_t, prompt_bytes, 64, "prompt length when --prompt is empty");
ABSL_FLAG(std::string, text_file, "",
          "text for prompts and session prefixes; empty = a built-in Shakespeare passage");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature");
ABSL_FLAG(int64_t, seed, 1,
          "base sampling seed (request i of stream s uses seed + 1000003*s + i); negative = "
          "let the server pick");
ABSL_FLAG(std::string, json, "", "write every number as JSON to this file");
ABSL_FLAG(std::string, label, "", "free text recorded in the output (e.g. commit, notes)");
ABSL_FLAG(std::string, metrics_target, "",
          "HOST:PORT of the server's /metrics endpoint; adds engine statistics per level");
ABSL_FLAG(int32_t, server_pid, 0, "the server's pid (same machine): adds its CPU time per level");
ABSL_FLAG(std::string, trace, "",
          "append one JSON line per measured request to this file (stream, start, status, "
          "TTFT and every inter-token gap, ms), for looking at where latency goes");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(30),
          "how long to wait for the server's health check to pass");
ABSL_FLAG(int32_t, processes, 1,
          "client processes per level: N > 1 splits each level's streams over N worker "
          "processes (stream i in process i % N, each process with its own gRPC channel and "
          "HTTP connections), so that one client process is not the bound; the bench's CPU "
          "figures add them all up. 1 = every stream in this process. Not with "
          "--requests-per-stream");
ABSL_FLAG(int32_t, worker_of, 0,
          "internal (--processes): run as a worker process of the fwbench with this pid, "
          "which sends the level on stdin; not for use by hand");

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kBuiltinText[] =
    "First Citizen:\n"
    "Before we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "All:\nResolved. resolved.\n\n"
    "First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\n"
    "All:\nWe know't, we know't.\n\n"
    "First Citizen:\nLet us kill him, and we'll have corn at our own price.\nIs't a verdict?\n\n"
    "All:\nNo more talking on't; let it be done: away, away!\n\n"
    "Second Citizen:\nOne word, good citizens.\n\n"
    "First Citizen:\nWe are accounted poor citizens, the patricians good.\n"
    "What authority surfeits on would relieve us: if they\n"
    "would yield us but the superfluity, while it were\n"
    "wholesome, we might guess they relieved us humanely;\n"
    "but they think we are too dear: the leanness that\n"
    "afflicts us, the object of our misery, is as an\n"
    "inventory to particularise their abundance; our\n"
    "sufferance is a gain to them Let us revenge this with\n"
    "our pikes, ere we become rakes: for the gods know I\n"
    "speak this in hunger for bread, not in thirst for revenge.\n\n"
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n"
    "It is the east, and Juliet is the sun.\n"
    "Arise, fair sun, and kill the envious moon,\n"
    "Who is already sick and pale with grief,\n"
    "That thou her maid art far more fair than she.\n\n"
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"
    "Deny thy father and refuse thy name;\n"
    "Or, if thou wilt not, be but sworn my love,\n"
    "And I'll no longer be a Capulet.\n\n";

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// `bytes` bytes of `source` from `offset` on (wrapping around), never starting or ending
// inside a UTF-8 character.
std::string TextOfLength(const std::string& source, size_t offset, size_t bytes) {
  std::string out;
  if (source.empty()) return out;
  auto continuation = [](char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; };
  size_t pos = offset % source.size();
  while (pos > 0 && continuation(source[pos])) --pos;
  out.reserve(bytes);
  while (out.size() < bytes) {
    const size_t take = std::min(bytes - out.size(), source.size() - pos);
    out.append(source, pos, take);
    pos = (pos + take) % source.size();
  }
  // Drop a trailing incomplete character.
  size_t start = out.size();
  while (start > 0 && out.size() - start < 4 && continuation(out[start - 1])) --start;
  if (start > 0) {
    const unsigned char lead = static_cast<unsigned char>(out[start - 1]);
    const size_t need = lead < 0xC0 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (out.size() - (start - 1) < need) out.resize(start - 1);
  }
  return out;
}

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return std::nan("");
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

nlohmann::ordered_json Summary(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  nlohmann::ordered_json out;
  out["count"] = values.size();
  if (values.empty()) return out;
  double sum = 0;
  for (double v : values) sum += v;
  out["mean"] = sum / static_cast<double>(values.size());
  out["p50"] = Percentile(values, 50);
  out["p90"] = Percentile(values, 90);
  out["p99"] = Percentile(values, 99);
  out["min"] = values.front();
  out["max"] = values.back();
  return out;
}

double CpuSecondsSelf() { return fwbench::ProcessCpuSeconds(); }

// CPU seconds of each thread of a process, keyed "name/tid" (gRPC and LibTorch threads
// mostly carry the executable's name, so the tid tells them apart). Empty when the process
// cannot be read.
std::map<std::string, double> ThreadCpuSeconds(int pid) {
  std::map<std::string, double> by_name;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  std::error_code error;
  const std::filesystem::path tasks = absl::StrCat("/proc/", pid, "/task");
  for (const auto& entry : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream in(entry.path() / "stat");
    std::string line;
    if (!std::getline(in, line)) continue;
    const size_t open = line.find('(');
    const size_t close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close < open) continue;
    const std::string name = line.substr(open + 1, close - open - 1);
    std::vector<std::string> fields =
        absl::StrSplit(line.substr(close + 2), ' ', absl::SkipEmpty());
    // Fields after the name start at field 3 (state); utime and stime are fields 14, 15.
    if (fields.size() < 13) continue;
    double utime = 0, stime = 0;
    if (!absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime)) continue;
    by_name[absl::StrCat(name, "/", entry.path().filename().string())] += (utime + stime) / tick;
  }
  return by_name;
}

std::optional<std::vector<double>> LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double a = 0, b = 0, c = 0;
  if (!(in >> a >> b >> c)) return std::nullopt;
  return std::vector<double>{a, b, c};
}

// GET http://target/metrics (HTTP/1.0, so the server closes the connection after the
// body). Returns the body.
absl::StatusOr<std::string> HttpGetMetrics(const std::string& target) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError("--metrics-target: HOST:PORT");
  const std::string host = target.substr(0, colon);
  const std::string port = target.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &addresses) != 0 || addresses == nullptr) {
    return absl::UnavailableError("cannot resolve " + target);
  }
  int fd = -1;
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(addresses);
  if (fd < 0) return absl::UnavailableError("cannot connect to " + target);
  const std::string request = absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", target, "\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, 0);
    if (n <= 0) {
      close(fd);
      return absl::UnavailableError("send to " + target + " failed");
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[16384];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos ||
      response.find(" 200 ") > response.find("\r\n")) {
    return absl::UnavailableError("bad /metrics response from " + target);
  }
  return response.substr(body + 4);
}

// Prometheus text format: every sample's value, summed over label sets, by metric name.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> sums;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos) continue;
    const std::string name(line.substr(0, name_end));
    size_t value_start = name_end;
    if (line[name_end] == '{') {
      const size_t close = line.rfind('}');
      if (close == absl::string_view::npos) continue;
      value_start = close + 1;
    }
    std::vector<absl::string_view> rest =
        absl::StrSplit(line.substr(value_start), ' ', absl::SkipEmpty());
    double value = 0;
    if (rest.empty() || !absl::SimpleAtod(rest[0], &value)) continue;
    sums[name] += value;
  }
  return sums;
}

// One instant, read by the bench's own process: its CPU time, and with --server-pid /
// --metrics-target the server's CPU time per thread and its metrics.
struct ServerSnapshot {
  std::map<std::string, double> metrics;
  std::map<std::string, double> thread_cpu;
  double self_cpu = 0;
  int64_t at_ns = 0;
};

ServerSnapshot Snapshot(const std::string& metrics_target, int server_pid) {
  ServerSnapshot s;
  s.at_ns = NowNs();
  s.self_cpu = CpuSecondsSelf();
  if (server_pid > 0) s.thread_cpu = ThreadCpuSeconds(server_pid);
  if (!metrics_target.empty()) {
    auto body = HttpGetMetrics(metrics_target);
    if (body.ok()) {
      s.metrics = ParseMetrics(*body);
    } else {
      std::fprintf(stderr, "fwbench: %s\n", std::string(body.status().message()).c_str());
    }
  }
  return s;
}

struct Config {
  std::string model;
  int max_tokens = 128;
  int min_tokens_per_message = 0;
  std::string prompt;
  std::string text;  // source of session prefixes
  double temperature = 0.8;
  int64_t seed = 1;
  absl::Duration duration;
  absl::Duration warmup;
  int requests_per_stream = 0;
  bool trace = false;
  bool sessions = false;
};

// What one stream observed in one level.
struct StreamResult {
  std::vector<double> ttft_ms;
  std::vector<double> itl_ms;
  std::vector<double> finish_ms;   // last token -> final message, completed requests
  std::vector<double> request_ms;  // sent -> final message, completed requests of the window
  std::vector<double> session_create_ms;
  int64_t tokens = 0;              // token messages' tokens inside the window
  int64_t messages = 0;            // messages (SSE chunks) with tokens (text) inside it
  int64_t requests_completed = 0;  // OK inside the window
  int64_t requests_started = 0;    // started inside the window
  int64_t measured_done = 0;       // completed requests that started inside the window
  int64_t context_tokens_seen = -1;
  int64_t usage_token_correction = 0;     // HTTP: usage's tokens minus the chunks' text bytes
  std::map<std::string, int64_t> errors;  // inside the window
  std::map<std::string, int64_t> warmup_errors;  // before it
  std::string setup_error;
  std::vector<std::string> trace;  // with --trace: one JSON line per request
};

enum class Protocol { kGrpc, kHttp };

const char* ProtocolName(Protocol p) { return p == Protocol::kGrpc ? "grpc" : "http"; }

// Where the HTTP API is: resolved once, before any level (once per worker process).
struct HttpTarget {
  fwbench::Endpoints endpoints;
  std::string host;  // HOST:PORT, the Host header
};

// What one level measured, in this process or in its worker processes: the input of
// LevelReport().
struct Measured {
  std::vector<StreamResult> results;  // by stream index, all C of them
  int processes = 1;                  // the client processes the streams ran in
  int64_t begin_ns = 0;               // the window
  int64_t end_ns = 0;
  ServerSnapshot first, last;  // taken by this process at both ends of the window
  // CPU seconds of the bench over the window: this process's (last.self_cpu -
  // first.self_cpu) plus, with worker processes, theirs.
  double bench_cpu_s = 0;
  std::vector<double> process_cpu_s;  // with workers: this process's, then each worker's
  std::map<std::string, int64_t> process_errors;  // "worker process: exit 1", ...
  std::optional<std::vector<double>> load_before, load_after;
};

// One level: `concurrency` streams against one server, or of them the streams i with
// i % processes == process (a worker process's share; stream indices, seeds and prompts
// are those of the whole level). gRPC: a worker thread per stream, all sharing `client`.
// HTTP: every stream on one io_context thread, each on its own keep-alive connection to
// `http`.
class Level {
 public:
  Level(Protocol protocol, fwserve::Client* client, const HttpTarget* http, const Config& config,
        int concurrency, int context_tokens, int repeat, int process = 0, int processes = 1)
      : protocol_(protocol),
        client_(client),
        http_(http),
        config_(config),
        concurrency_(concurrency),
        context_tokens_(context_tokens),
        repeat_(repeat),
        results_(concurrency),
        slots_(concurrency) {
    for (int i = process; i < concurrency; i += processes) streams_.push_back(i);
  }

  // The whole level in this process: Start(), the window from now (after --warmup),
  // Go(), WaitForEnd() and Stop(), with snapshots at both ends of the window.
  Measured Run(const std::string& metrics_target, int server_pid);

  // The phases, for a worker process whose window the parent sets. Start() starts this
  // process's streams and returns once each has done its set-up (connection, session);
  // Go() sets the window (steady-clock ns: load starts, window begins, window ends;
  // INT64_MAX = --requests-per-stream ends it) and lets them run; WaitForEnd() returns
  // at the end of the window (earlier with --requests-per-stream, or at once when every
  // stream failed its set-up); Stop() cancels what is in flight and ends the streams.
  void Start();
  void Go(int64_t start_ns, int64_t begin_ns, int64_t end_ns);
  void WaitForEnd();
  void Stop();
  // After Start(): this process's streams whose set-up failed.
  int setup_failures() const;
  const std::vector<int>& streams() const { return streams_; }
  // After Stop(): what stream i observed (empty for streams of other processes).
  const StreamResult& result(int i) const { return results_[i]; }

 private:
  struct Slot {
    std::mutex mu;
    fwserve::GenerateStream* stream = nullptr;  // the request in flight
  };

  class HttpStream;  // one stream of the HTTP mode (defined below)
  struct HttpLoad;

  void Worker(int index);
  void Work(int index);
  // HTTP mode: starts the io thread and every stream's set-up; Go() starts their loops;
  // StopHttp() cancels the generations in flight, waits for the streams to end and
  // deletes the sessions they left (blocking).
  void StartHttp();
  void GoHttp();
  void StopHttp();
  // Counts one finished request's common numbers (both protocols): the window's
  // completed requests and their latencies, and the end of a --requests-per-stream window.
  void CountCompleted(StreamResult& r, bool in_window, int64_t sent, int64_t last, int64_t done);
  // With --trace: one JSON line for a request started inside the window.
  void TraceRequest(StreamResult& r, int index, int64_t sent, const std::string& status,
                    double ttft_ms, const std::vector<double>& gaps_ms) const;
  // Counts an error into the window's or the warm-up's tally by when it happened; after
  // the window, errors are the bench's own cancellations and are not counted.
  void Record(StreamResult& r, int64_t t, const std::string& key) {
    if (t >= end_ns_.load()) return;
    ++(t >= begin_ns_ ? r.errors : r.warmup_errors)[key];
  }
  bool Stopped() const { return stop_.load(); }
  void EndWindowAt(int64_t t) {
    int64_t expected = end_ns_.load();
    while (t < expected && !end_ns_.compare_exchange_weak(expected, t)) {
    }
  }
  void CancelAll();
  // DeleteSession, retried while the session is still busy (ABORTED): a cancelled
  // Generate holds its session until the server has finished ending it.
  absl::Status DeleteSoon(const std::string& session_id) {
    absl::Status status;
    for (int attempt = 0; attempt < 500; ++attempt) {
      status = client_->DeleteSession(session_id);
      if (status.code() != absl::StatusCode::kAborted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return status;
  }

  const Protocol protocol_;
  fwserve::Client* const client_;
  const HttpTarget* const http_;
  std::unique_ptr<HttpLoad> http_load_;
  const Config& config_;
  const int concurrency_;
  const int context_tokens_;
  const int repeat_;
  std::vector<StreamResult> results_;
  std::vector<Slot> slots_;
  std::vector<int> streams_;          // this process's stream indices
  std::vector<std::thread> threads_;  // gRPC: one per stream

  int64_t start_ns_ = 0;  // load starts
  int64_t begin_ns_ = 0;  // window starts
  std::atomic<int64_t> end_ns_{INT64_MAX};
  std::atomic<bool> stop_{false};
  std::atomic<int> live_workers_{0};

  // Setup barrier: every stream has its session before the clock starts.
  std::mutex setup_mu_;
  std::condition_variable setup_cv_;
  int setup_pending_ = 0;
  bool go_ = false;
};

void Level::CancelAll() {
  for (Slot& slot : slots_) {
    std::lock_guard<std::mutex> lock(slot.mu);
    if (slot.stream != nullptr) slot.stream->Cancel();
  }
}

void Level::CountCompleted(StreamResult& r, bool in_window, int64_t sent, int64_t last,
                           int64_t done) {
  if (done < begin_ns_ || done >= end_ns_.load()) return;
  ++r.requests_completed;
  if (last >= 0) r.finish_ms.push_back(static_cast<double>(done - last) * 1e-6);
  if (!in_window) return;
  r.request_ms.push_back(static_cast<double>(done - sent) * 1e-6);
  ++r.measured_done;
  if (config_.requests_per_stream > 0 && r.measured_done >= config_.requests_per_stream) {
    EndWindowAt(done);
  }
}

void Level::TraceRequest(StreamResult& r, int index, int64_t sent, const std::string& status,
                         double ttft_ms, const std::vector<double>& gaps_ms) const {
  nlohmann::ordered_json line;
  line["protocol"] = ProtocolName(protocol_);
  line["concurrency"] = concurrency_;
  line["context_tokens"] = context_tokens_;
  line["repeat"] = repeat_;
  line["stream"] = index;
  line["start_ms"] = static_cast<double>(sent - begin_ns_) * 1e-6;
  line["status"] = status;
  line["ttft_ms"] = ttft_ms;
  line["itl_ms"] = gaps_ms;
  r.trace.push_back(line.dump());
}

void Level::Worker(int index) {
  Work(index);
  live_workers_.fetch_sub(1);
}

void Level::Work(int index) {
  StreamResult& r = results_[index];
  Slot& slot = slots_[index];
  std::string base_session;
  if (context_tokens_ > 0 || config_.sessions) {
    const std::string prefix =
        TextOfLength(config_.text, static_cast<size_t>(index) * 977, context_tokens_);
    const int64_t t0 = NowNs();
    auto session = client_->CreateSession(config_.model, prefix);
    if (session.ok()) {
      r.session_create_ms.push_back(static_cast<double>(NowNs() - t0) * 1e-6);
      r.context_tokens_seen = session->tokens();
      base_session = session->session_id();
    } else {
      r.setup_error = session.status().ToString();
    }
  }
  {
    std::unique_lock<std::mutex> lock(setup_mu_);
    if (--setup_pending_ == 0) setup_cv_.notify_all();
    setup_cv_.wait(lock, [this] { return go_; });
  }
  if (!r.setup_error.empty()) return;

  fwserve::v1::GenerateRequest request;
  request.set_model(config_.model);
  request.set_prompt(config_.prompt);
  request.set_max_tokens(config_.max_tokens);
  if (config_.min_tokens_per_message > 0) {
    request.mutable_stream()->set_min_tokens_per_message(config_.min_tokens_per_message);
  }
  request.mutable_sampling()->set_temperature(static_cast<float>(config_.temperature));
  fwserve::v1::GenerateResponse message;
  for (int64_t i = 0; !Stopped(); ++i) {
    if (config_.seed >= 0) {
      request.mutable_sampling()->set_seed(static_cast<uint64_t>(config_.seed) +
                                           1000003ULL * static_cast<uint64_t>(index) +
                                           static_cast<uint64_t>(i));
    }
    std::string fork;
    if (config_.sessions) {
      request.set_session_id(base_session);
    } else if (!base_session.empty()) {
      auto copy = client_->ForkSession(base_session);
      if (!copy.ok()) {
        Record(r, NowNs(),
               absl::StrCat("ForkSession ", absl::StatusCodeToString(copy.status().code())));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      fork = copy->session_id();
      request.set_session_id(fork);
    }
    const int64_t sent = NowNs();
    const bool in_window = sent >= begin_ns_ && sent < end_ns_.load();
    std::unique_ptr<fwserve::GenerateStream> stream;
    {
      std::lock_guard<std::mutex> lock(slot.mu);
      if (Stopped()) {
        if (!fork.empty()) (void)DeleteSoon(fork);
        break;
      }
      stream = client_->StartGenerate(request);
      slot.stream = stream.get();
    }
    if (in_window) ++r.requests_started;
    int64_t last = -1;
    bool cancelled_by_us = false;
    double ttft_ms = -1;
    std::vector<double> gaps_ms;
    while (stream->Next(&message)) {
      const int64_t now = NowNs();
      if (now >= end_ns_.load()) {
        if (!cancelled_by_us) stream->Cancel();
        cancelled_by_us = true;
        continue;
      }
      if (message.token_ids_size() == 0) continue;
      if (now >= begin_ns_) {
        r.tokens += message.token_ids_size();
        ++r.messages;
        // Per token: the message's first token waited the gap since the previous
        // message; the others in the same message (decode pipelining, a flush
        // interval) arrived with it, a gap of 0.
        int64_t same_message = message.token_ids_size() - 1;
        if (last < 0) {
          ttft_ms = static_cast<double>(now - sent) * 1e-6;
          if (in_window) r.ttft_ms.push_back(ttft_ms);
        } else {
          gaps_ms.push_back(static_cast<double>(now - last) * 1e-6);
          r.itl_ms.push_back(gaps_ms.back());
        }
        for (; same_message > 0; --same_message) {
          gaps_ms.push_back(0.0);
          r.itl_ms.push_back(0.0);
        }
      }
      last = now;
    }
    const absl::Status status = stream->Finish();
    const int64_t done = NowNs();
    {
      std::lock_guard<std::mutex> lock(slot.mu);
      slot.stream = nullptr;
    }
    // Cancelled by the end of the window (by this thread or CancelAll): not an error.
    const bool ended_by_window = done >= end_ns_.load() || Stopped();
    if (status.ok()) {
      CountCompleted(r, in_window, sent, last, done);
    } else if (!(ended_by_window && status.code() == absl::StatusCode::kCancelled)) {
      Record(r, done, absl::StatusCodeToString(status.code()));
    }
    if (config_.trace && in_window) {
      TraceRequest(r, index, sent, absl::StatusCodeToString(status.code()), ttft_ms, gaps_ms);
    }
    if (!fork.empty()) {
      if (absl::Status deleted = DeleteSoon(fork); !deleted.ok()) {
        Record(r, NowNs(),
               absl::StrCat("DeleteSession ", absl::StatusCodeToString(deleted.code())));
      }
    }
    if (!status.ok() && !ended_by_window) {
      // Do not spin on a server that refuses work.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (!base_session.empty()) (void)DeleteSoon(base_session);
}

// ---- HTTP mode ----

namespace net = boost::asio;
namespace http = boost::beast::http;

// A request body as JSON text; invalid UTF-8 is replaced, never thrown on.
std::string JsonText(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The body of an HTTP reply, capped for an error message.
std::string Excerpt(const std::string& body) {
  return body.size() <= 200 ? body : absl::StrCat(body.substr(0, 200), "...");
}

struct Level::HttpLoad {
  net::io_context io;
  net::executor_work_guard<net::io_context::executor_type> guard{io.get_executor()};
  std::vector<std::shared_ptr<HttpStream>> streams;
  std::thread thread;
};

// One stream of the HTTP mode: Level::Work()'s loop as a state machine on the io thread,
// step for step (see the file comment for the differences). Set-up: connect, and create
// the stream's session (with --context-tokens or --sessions); then the barrier; then per
// request: fork the session (--context-tokens without --sessions), generate (POST
// /v1/completions, streamed), delete the fork, next, until the level stops. Every
// method runs on the io thread; the Level's shared state is read as Work() reads it.
class Level::HttpStream : public std::enable_shared_from_this<HttpStream> {
 public:
  HttpStream(Level* level, int index, net::io_context& io)
      : level_(level),
        config_(level->config_),
        index_(index),
        r_(level->results_[index]),
        timer_(io),
        conn_(std::make_shared<fwbench::HttpConnection>(io, level->http_->endpoints,
                                                        level->http_->host)) {}

  void Setup();
  // After the barrier.
  void Go() {
    if (!r_.setup_error.empty()) return Finish();
    Next();
  }
  // After stop_: cancels the generation in flight, as Level::CancelAll() cancels a gRPC
  // stream (fork and delete calls in flight complete).
  void Cancel() {
    if (!generating_) return;
    closed_by_us_ = true;
    conn_->Close();
  }
  // Sessions still to delete once the stream has ended (the base session, a fork whose
  // delete the stop pre-empted).
  const std::vector<std::string>& leftovers() const { return leftovers_; }

 private:
  using Reply = std::function<void(int status, const std::string& body, const std::string& error)>;

  // One request on the stream's connection, its reply collected.
  void Call(http::verb method, const std::string& target, std::string body, Reply done) {
    auto status = std::make_shared<int>(0);
    auto reply = std::make_shared<std::string>();
    fwbench::HttpConnection::Handlers handlers;
    handlers.on_header = [status](int s) { *status = s; };
    handlers.on_body = [reply](absl::string_view bytes) {
      reply->append(bytes.data(), bytes.size());
    };
    handlers.on_done = [status, reply, done = std::move(done)](const std::string& error) {
      done(*status, *reply, error);
    };
    conn_->Request(method, target, std::move(body), std::move(handlers));
  }
  void After(std::chrono::milliseconds delay, std::function<void()> then) {
    timer_.expires_after(delay);
    timer_.async_wait([self = shared_from_this(),
                       then = std::move(then)](const boost::system::error_code&) { then(); });
  }
  void SetupDone() {
    std::lock_guard<std::mutex> lock(level_->setup_mu_);
    if (--level_->setup_pending_ == 0) level_->setup_cv_.notify_all();
  }
  void Next();
  void Generate(std::string fork);
  void OnBody(absl::string_view bytes);
  void OnEvent(absl::string_view data, int64_t now);
  void OnGenerateDone(const std::string& error);
  void DeleteFork(std::string fork, int attempt, std::function<void()> then);
  void Finish() {
    if (!base_session_.empty()) leftovers_.push_back(base_session_);
    base_session_.clear();
    level_->live_workers_.fetch_sub(1);
  }

  Level* const level_;
  const Config& config_;
  const int index_;
  StreamResult& r_;
  net::steady_timer timer_;
  const std::shared_ptr<fwbench::HttpConnection> conn_;
  std::string base_session_;
  std::vector<std::string> leftovers_;
  int64_t next_request_ = 0;  // the request number i of Work()'s loop (seeds)

  // The generation in flight.
  bool generating_ = false;
  std::string fork_;
  int64_t sent_ = 0;
  bool in_window_ = false;
  int status_ = 0;
  std::string error_body_;
  fwbench::SseParser sse_;
  fwbench::ChunkFields fields_;
  int64_t last_ = -1;
  int64_t tokens_in_events_ = 0;
  bool saw_done_ = false;
  bool closed_by_us_ = false;
  std::string stream_error_;
  double ttft_ms_ = -1;
  std::vector<double> gaps_ms_;
};

void Level::HttpStream::Setup() {
  conn_->Connect([self = shared_from_this()](const std::string& error) {
    if (!error.empty()) {
      self->r_.setup_error = error;
      return self->SetupDone();
    }
    if (self->level_->context_tokens_ == 0 && !self->config_.sessions) return self->SetupDone();
    nlohmann::json body;
    if (!self->config_.model.empty()) body["model"] = self->config_.model;
    body["prefix"] = TextOfLength(self->config_.text, static_cast<size_t>(self->index_) * 977,
                                  self->level_->context_tokens_);
    const int64_t t0 = NowNs();
    self->Call(
        http::verb::post, "/fwserve/v1/sessions", JsonText(body),
        [self, t0](int status, const std::string& reply, const std::string& error) {
          if (!error.empty() || status != 200) {
            self->r_.setup_error = absl::StrCat(
                "CreateSession: ",
                error.empty() ? absl::StrCat("HTTP ", status, " ", Excerpt(reply)) : error);
            return self->SetupDone();
          }
          const nlohmann::json session =
              nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
          if (!session.is_object() || !session.contains("id") || !session["id"].is_string()) {
            self->r_.setup_error = "CreateSession: no id in " + Excerpt(reply);
            return self->SetupDone();
          }
          self->r_.session_create_ms.push_back(static_cast<double>(NowNs() - t0) * 1e-6);
          self->base_session_ = session["id"].get<std::string>();
          self->r_.context_tokens_seen = session.value("tokens", int64_t{-1});
          self->SetupDone();
        });
  });
}

void Level::HttpStream::Next() {
  if (level_->Stopped()) return Finish();
  if (config_.sessions || base_session_.empty()) return Generate("");
  Call(http::verb::post, absl::StrCat("/fwserve/v1/sessions/", base_session_, "/fork"), "",
       [self = shared_from_this()](int status, const std::string& reply, const std::string& error) {
         nlohmann::json copy;
         if (error.empty() && status == 200) {
           copy = nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
         }
         if (!copy.is_object() || !copy.contains("id") || !copy["id"].is_string()) {
           ++self->next_request_;  // as Work()'s `continue`
           self->level_->Record(
               self->r_, NowNs(),
               absl::StrCat("ForkSession ", error.empty() ? absl::StrCat("HTTP ", status)
                                                          : std::string("connection")));
           return self->After(std::chrono::milliseconds(10), [self] { self->Next(); });
         }
         self->Generate(copy["id"].get<std::string>());
       });
}

void Level::HttpStream::Generate(std::string fork) {
  const int64_t i = next_request_++;
  if (level_->Stopped()) {
    if (!fork.empty()) leftovers_.push_back(fork);
    return Finish();
  }
  nlohmann::json body;
  if (!config_.model.empty()) body["model"] = config_.model;
  body["prompt"] = config_.prompt;
  body["max_tokens"] = config_.max_tokens;
  body["temperature"] = config_.temperature;
  if (config_.seed >= 0) {
    body["seed"] = static_cast<uint64_t>(config_.seed) +
                   1000003ULL * static_cast<uint64_t>(index_) + static_cast<uint64_t>(i);
  }
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (config_.sessions) {
    body["session_id"] = base_session_;
  } else if (!fork.empty()) {
    body["session_id"] = fork;
  }
  std::string text = JsonText(body);

  fork_ = std::move(fork);
  status_ = 0;
  error_body_.clear();
  sse_.Reset();
  last_ = -1;
  tokens_in_events_ = 0;
  saw_done_ = false;
  closed_by_us_ = false;
  stream_error_.clear();
  ttft_ms_ = -1;
  gaps_ms_.clear();
  generating_ = true;
  sent_ = NowNs();
  in_window_ = sent_ >= level_->begin_ns_ && sent_ < level_->end_ns_.load();
  if (in_window_) ++r_.requests_started;
  fwbench::HttpConnection::Handlers handlers;
  auto self = shared_from_this();
  handlers.on_header = [self](int status) { self->status_ = status; };
  handlers.on_body = [self](absl::string_view bytes) { self->OnBody(bytes); };
  handlers.on_done = [self](const std::string& error) { self->OnGenerateDone(error); };
  conn_->Request(http::verb::post, "/v1/completions", std::move(text), std::move(handlers));
}

void Level::HttpStream::OnBody(absl::string_view bytes) {
  const int64_t now = NowNs();
  if (now >= level_->end_ns_.load()) {
    // The window is over: cancel, as Work() does.
    if (!closed_by_us_) {
      closed_by_us_ = true;
      conn_->Close();
    }
    return;
  }
  if (status_ != 200) {
    if (error_body_.size() < 4096) error_body_.append(bytes.data(), bytes.size());
    return;
  }
  sse_.Feed(bytes, [this, now](absl::string_view data) { OnEvent(data, now); });
}

void Level::HttpStream::OnEvent(absl::string_view data, int64_t now) {
  if (data == "[DONE]") {
    saw_done_ = true;
    return;
  }
  if (!fields_.Parse(data)) {
    if (stream_error_.empty()) stream_error_ = "bad SSE JSON";
    return;
  }
  if (fields_.is_error) {
    stream_error_ = "SSE error " + fields_.error_code;
    return;
  }
  const int64_t begin = level_->begin_ns_;
  if (fields_.text_bytes > 0) {
    const int64_t n = fields_.text_bytes;
    tokens_in_events_ += n;
    if (now >= begin) {
      // As Work(): the chunk's first token waited the gap since the previous chunk, the
      // others arrived with it.
      r_.tokens += n;
      ++r_.messages;
      int64_t same_chunk = n - 1;
      if (last_ < 0) {
        ttft_ms_ = static_cast<double>(now - sent_) * 1e-6;
        if (in_window_) r_.ttft_ms.push_back(ttft_ms_);
      } else {
        gaps_ms_.push_back(static_cast<double>(now - last_) * 1e-6);
        r_.itl_ms.push_back(gaps_ms_.back());
      }
      for (; same_chunk > 0; --same_chunk) {
        gaps_ms_.push_back(0.0);
        r_.itl_ms.push_back(0.0);
      }
    }
    last_ = now;
  }
  if (fields_.completion_tokens >= 0 && now >= begin) {
    const int64_t correction = fields_.completion_tokens - tokens_in_events_;
    r_.tokens += correction;
    r_.usage_token_correction += correction;
  }
}

void Level::HttpStream::OnGenerateDone(const std::string& error) {
  generating_ = false;
  const int64_t done = NowNs();
  const bool ok = error.empty() && status_ == 200 && saw_done_ && stream_error_.empty();
  std::string key;
  if (!ok) {
    if (status_ != 0 && status_ != 200) {
      key = absl::StrCat("HTTP ", status_);
    } else if (!stream_error_.empty()) {
      key = stream_error_;
    } else if (closed_by_us_) {
      key = "CANCELLED";
    } else if (!error.empty()) {
      key = "connection: " + error;
    } else {
      key = "incomplete stream";
    }
  }
  // Cancelled by the end of the window (here or by Cancel()): not an error.
  const bool ended_by_window = done >= level_->end_ns_.load() || level_->Stopped();
  if (ok) {
    level_->CountCompleted(r_, in_window_, sent_, last_, done);
  } else if (!(ended_by_window && closed_by_us_)) {
    level_->Record(r_, done, key);
  }
  if (config_.trace && in_window_) {
    level_->TraceRequest(r_, index_, sent_, ok ? "OK" : key, ttft_ms_, gaps_ms_);
  }
  // Do not spin on a server that refuses work.
  const bool pause = !ok && !ended_by_window;
  auto next = [self = shared_from_this(), pause] {
    if (pause) return self->After(std::chrono::milliseconds(10), [self] { self->Next(); });
    self->Next();
  };
  std::string fork = std::move(fork_);
  fork_.clear();
  if (fork.empty()) return next();
  if (level_->Stopped()) {
    leftovers_.push_back(std::move(fork));
    return next();
  }
  DeleteFork(std::move(fork), 0, std::move(next));
}

// DELETE, retried while the session is still busy (409), as Level::DeleteSoon().
void Level::HttpStream::DeleteFork(std::string fork, int attempt, std::function<void()> then) {
  const std::string target = absl::StrCat("/fwserve/v1/sessions/", fork);
  Call(http::verb::delete_, target, "",
       [self = shared_from_this(), fork = std::move(fork), attempt, then = std::move(then)](
           int status, const std::string&, const std::string& error) mutable {
         if (error.empty() && status == 409 && attempt + 1 < 500) {
           return self->After(std::chrono::milliseconds(2),
                              [self, fork = std::move(fork), attempt, then = std::move(then)] {
                                self->DeleteFork(fork, attempt + 1, then);
                              });
         }
         if (!error.empty() || status != 200) {
           self->level_->Record(
               self->r_, NowNs(),
               absl::StrCat("DeleteSession ", error.empty() ? absl::StrCat("HTTP ", status)
                                                            : std::string("connection")));
         }
         then();
       });
}

void Level::StartHttp() {
  http_load_ = std::make_unique<HttpLoad>();
  HttpLoad& load = *http_load_;
  for (int i : streams_) load.streams.push_back(std::make_shared<HttpStream>(this, i, load.io));
  for (auto& stream : load.streams) net::post(load.io, [stream] { stream->Setup(); });
  load.thread = std::thread([&load] { load.io.run(); });
}

void Level::GoHttp() {
  HttpLoad& load = *http_load_;
  for (auto& stream : load.streams) net::post(load.io, [stream] { stream->Go(); });
  load.guard.reset();  // run() returns once every stream has ended
}

void Level::StopHttp() {
  HttpLoad& load = *http_load_;
  net::post(load.io, [&load] {
    for (auto& stream : load.streams) stream->Cancel();
  });
  load.thread.join();
  // The sessions left behind, deleted one by one (as Work() deletes its base session).
  for (auto& stream : load.streams) {
    for (const std::string& id : stream->leftovers()) {
      for (int attempt = 0; attempt < 500; ++attempt) {
        auto reply = fwbench::HttpCall(http_->endpoints, http_->host, http::verb::delete_,
                                       absl::StrCat("/fwserve/v1/sessions/", id));
        if (!reply.ok() || reply->status != 409) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
  }
  http_load_.reset();
}

void Level::Start() {
  setup_pending_ = static_cast<int>(streams_.size());
  live_workers_ = static_cast<int>(streams_.size());
  if (protocol_ == Protocol::kGrpc) {
    threads_.reserve(streams_.size());
    for (int i : streams_) threads_.emplace_back([this, i] { Worker(i); });
  } else {
    StartHttp();
  }
  std::unique_lock<std::mutex> lock(setup_mu_);
  setup_cv_.wait(lock, [this] { return setup_pending_ == 0; });
}

int Level::setup_failures() const {
  int failed = 0;
  for (int i : streams_) failed += results_[i].setup_error.empty() ? 0 : 1;
  return failed;
}

void Level::Go(int64_t start_ns, int64_t begin_ns, int64_t end_ns) {
  {
    std::lock_guard<std::mutex> lock(setup_mu_);
    start_ns_ = start_ns;
    begin_ns_ = begin_ns;
    end_ns_ = end_ns;
    go_ = true;
    setup_cv_.notify_all();
  }
  if (protocol_ == Protocol::kHttp) GoHttp();
}

void Level::WaitForEnd() {
  while (NowNs() < end_ns_.load()) {
    if (live_workers_.load() == 0) EndWindowAt(NowNs());  // every stream failed its setup
    const int64_t left = end_ns_.load() - NowNs();
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::clamp<int64_t>(left, 0, 5000000)));
  }
}

void Level::Stop() {
  stop_ = true;
  if (protocol_ == Protocol::kGrpc) {
    CancelAll();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  } else {
    StopHttp();
  }
}

void SleepUntil(int64_t t_ns) {
  std::this_thread::sleep_for(std::chrono::nanoseconds(std::max<int64_t>(0, t_ns - NowNs())));
}

Measured Level::Run(const std::string& metrics_target, int server_pid) {
  Start();
  const int64_t start = NowNs();
  const int64_t begin = start + absl::ToInt64Nanoseconds(config_.warmup);
  Go(start, begin,
     config_.requests_per_stream > 0 ? INT64_MAX
                                     : begin + absl::ToInt64Nanoseconds(config_.duration));
  Measured m;
  m.load_before = LoadAverage();
  SleepUntil(begin_ns_);
  m.first = Snapshot(metrics_target, server_pid);
  WaitForEnd();
  m.last = Snapshot(metrics_target, server_pid);
  Stop();
  m.load_after = LoadAverage();
  m.begin_ns = begin_ns_;
  m.end_ns = end_ns_.load();
  m.bench_cpu_s = m.last.self_cpu - m.first.self_cpu;
  m.results = std::move(results_);
  return m;
}

// ---- Worker processes (--processes N > 1) ----
//
// Each level with N > 1 (and C > 1) runs min(N, C) workers: this binary re-executed
// (/proc/self/exe --worker_of=PID), so that no gRPC state crosses a fork. Parent and
// worker exchange messages on the worker's stdin and stdout (the worker moves its
// stdout to a private descriptor first and points fd 1 at stderr, so nothing it prints
// can corrupt them): CBOR documents, each after its length (8 bytes, host order; both
// ends are one binary on one machine), sample vectors as binary arrays of doubles.
//   parent -> worker: the level (config, protocol, targets, C, context, which share);
//   worker -> parent: {"setup_failures"} once its streams have done their set-up;
//   parent -> worker: the window {"start_ns", "begin_ns", "end_ns"} (steady clock, which
//                     the processes of one machine share);
//   worker -> parent: after the window and Stop(): its CPU seconds over the window and
//                     every one of its streams' StreamResult; then it exits 0.
// A worker that exits, is killed or says nothing becomes one error of the level
// ("worker process: exit 1", "worker process: killed by signal 9", "worker process: no
// result 120 s after the window (killed)"), its streams counting nothing; it says why on
// stderr. A worker dies with its parent (PR_SET_PDEATHSIG, which watches the thread that
// spawned it: the parent's main thread).

constexpr int64_t kNoDeadline = INT64_MAX;

absl::Status WriteAll(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("write: ", std::strerror(errno)));
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Exactly `size` bytes, or an error: end of stream, a read error, or the deadline (steady
// ns) passing (DEADLINE_EXCEEDED).
absl::Status ReadExactly(int fd, void* data, size_t size, int64_t deadline_ns) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    int timeout_ms = -1;
    if (deadline_ns != kNoDeadline) {
      const int64_t left = deadline_ns - NowNs();
      if (left <= 0) return absl::DeadlineExceededError("no message in time");
      timeout_ms = static_cast<int>(std::min<int64_t>(left / 1000000 + 1, 60000));
    }
    pollfd waiting{fd, POLLIN, 0};
    const int ready = poll(&waiting, 1, timeout_ms);
    if (ready < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
    }
    if (ready <= 0) continue;
    const ssize_t n = read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat("read: ", std::strerror(errno)));
    if (n == 0) return absl::UnavailableError("end of stream");
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteMessage(int fd, const nlohmann::json& message) {
  const std::vector<uint8_t> bytes = nlohmann::json::to_cbor(message);
  const uint64_t size = bytes.size();
  if (absl::Status s = WriteAll(fd, &size, sizeof(size)); !s.ok()) return s;
  return WriteAll(fd, bytes.data(), bytes.size());
}

absl::StatusOr<nlohmann::json> ReadMessage(int fd, int64_t deadline_ns) {
  uint64_t size = 0;
  if (absl::Status s = ReadExactly(fd, &size, sizeof(size), deadline_ns); !s.ok()) return s;
  if (size > (uint64_t{1} << 36)) return absl::DataLossError("message length out of range");
  std::vector<uint8_t> bytes(size);
  if (absl::Status s = ReadExactly(fd, bytes.data(), bytes.size(), deadline_ns); !s.ok()) {
    return s;
  }
  nlohmann::json message = nlohmann::json::from_cbor(bytes, true, /*allow_exceptions=*/false);
  if (message.is_discarded()) return absl::DataLossError("message is not CBOR");
  return message;
}

nlohmann::json DoublesToIpc(const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(double));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return nlohmann::json::binary(std::move(bytes));
}

std::vector<double> DoublesFromIpc(const nlohmann::json& value) {
  if (!value.is_binary()) return {};
  const auto& bytes = value.get_binary();
  std::vector<double> values(bytes.size() / sizeof(double));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(double));
  return values;
}

nlohmann::json StreamResultToIpc(const StreamResult& r) {
  nlohmann::json j;
  j["ttft_ms"] = DoublesToIpc(r.ttft_ms);
  j["itl_ms"] = DoublesToIpc(r.itl_ms);
  j["finish_ms"] = DoublesToIpc(r.finish_ms);
  j["request_ms"] = DoublesToIpc(r.request_ms);
  j["session_create_ms"] = DoublesToIpc(r.session_create_ms);
  j["tokens"] = r.tokens;
  j["messages"] = r.messages;
  j["requests_completed"] = r.requests_completed;
  j["requests_started"] = r.requests_started;
  j["measured_done"] = r.measured_done;
  j["context_tokens_seen"] = r.context_tokens_seen;
  j["usage_token_correction"] = r.usage_token_correction;
  j["errors"] = r.errors;
  j["warmup_errors"] = r.warmup_errors;
  j["setup_error"] = r.setup_error;
  j["trace"] = r.trace;
  return j;
}

StreamResult StreamResultFromIpc(const nlohmann::json& j) {
  StreamResult r;
  r.ttft_ms = DoublesFromIpc(j.at("ttft_ms"));
  r.itl_ms = DoublesFromIpc(j.at("itl_ms"));
  r.finish_ms = DoublesFromIpc(j.at("finish_ms"));
  r.request_ms = DoublesFromIpc(j.at("request_ms"));
  r.session_create_ms = DoublesFromIpc(j.at("session_create_ms"));
  r.tokens = j.at("tokens").get<int64_t>();
  r.messages = j.at("messages").get<int64_t>();
  r.requests_completed = j.at("requests_completed").get<int64_t>();
  r.requests_started = j.at("requests_started").get<int64_t>();
  r.measured_done = j.at("measured_done").get<int64_t>();
  r.context_tokens_seen = j.at("context_tokens_seen").get<int64_t>();
  r.usage_token_correction = j.at("usage_token_correction").get<int64_t>();
  r.errors = j.at("errors").get<std::map<std::string, int64_t>>();
  r.warmup_errors = j.at("warmup_errors").get<std::map<std::string, int64_t>>();
  r.setup_error = j.at("setup_error").get<std::string>();
  r.trace = j.at("trace").get<std::vector<std::string>>();
  return r;
}

// The client options a worker needs to make its own fwserve::Client like the parent's.
struct WorkerTargets {
  fwserve::ClientOptions client;  // target, auth_token, max_overload_retries
  std::string http_target;        // HOST:PORT
};

// One worker process, as the parent sees it.
struct WorkerProcess {
  pid_t pid = -1;
  int to = -1;          // its stdin
  int from = -1;        // its stdout
  std::string failure;  // the level's error key once it failed ("" = fine so far)
  std::string exit;     // once reaped: "exit 0", "killed by signal 9", ...
  bool killed = false;  // by the parent
};

// Reaps `w` (once), waiting up to `grace` for it to exit and then killing it.
void Reap(WorkerProcess& w, absl::Duration grace) {
  if (w.pid <= 0 || !w.exit.empty()) return;
  const absl::Time give_up = absl::Now() + grace;
  int status = 0;
  while (true) {
    const pid_t done = waitpid(w.pid, &status, WNOHANG);
    if (done == w.pid) break;
    if (done < 0 && errno != EINTR) {
      w.exit = absl::StrCat("waitpid: ", std::strerror(errno));
      return;
    }
    if (absl::Now() >= give_up) {
      w.killed = true;
      kill(w.pid, SIGKILL);
      while (waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (WIFEXITED(status)) {
    w.exit = absl::StrCat("exit ", WEXITSTATUS(status));
  } else if (WIFSIGNALED(status)) {
    w.exit = absl::StrCat("killed by signal ", WTERMSIG(status));
  } else {
    w.exit = absl::StrCat("wait status ", status);
  }
}

// Marks `w` failed (once): reaps it (killing it if it still runs after 2 s) and keys the
// level's error by how it ended ("worker process: exit 1", "worker process: killed by
// signal 11"), or by `why` when it exited 0 or the parent killed it.
void FailWorker(WorkerProcess& w, int k, const std::string& why) {
  if (!w.failure.empty()) return;
  Reap(w, absl::Seconds(2));
  const bool own_words = w.exit.empty() || w.exit == "exit 0" || w.killed;
  w.failure = absl::StrCat("worker process: ", own_words ? why : w.exit);
  std::fprintf(stderr, "fwbench: worker process %d (pid %d): %s (%s)\n", k, static_cast<int>(w.pid),
               why.c_str(), w.exit.empty() ? "not started" : w.exit.c_str());
}

// Starts /proc/self/exe --worker_of=<this pid> with pipes on its stdin and stdout.
absl::Status SpawnWorker(WorkerProcess& w, const char* argv0) {
  int to[2], from[2];
  if (pipe2(to, O_CLOEXEC) != 0) return absl::InternalError(std::strerror(errno));
  if (pipe2(from, O_CLOEXEC) != 0) {
    close(to[0]);
    close(to[1]);
    return absl::InternalError(std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from[1], STDOUT_FILENO);
  std::string arg0 = argv0;
  std::string flag = absl::StrCat("--worker_of=", getpid());
  char* args[] = {arg0.data(), flag.data(), nullptr};
  pid_t pid = -1;
  const int error = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, args, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(to[0]);
  close(from[1]);
  if (error != 0) {
    close(to[1]);
    close(from[0]);
    return absl::InternalError(absl::StrCat("posix_spawn: ", std::strerror(error)));
  }
  w.pid = pid;
  w.to = to[1];
  w.from = from[0];
  return absl::OkStatus();
}

// The level in `processes` worker processes (2 <= processes <= concurrency): the parent
// spawns them, waits for every one's set-up, sets the window, takes the snapshots and
// merges what they return. A worker's streams are the Level's streams i with
// i % processes == its number.
Measured RunInProcesses(Protocol protocol, const WorkerTargets& targets, const Config& config,
                        int concurrency, int context_tokens, int repeat, int processes,
                        const char* argv0, const std::string& metrics_target, int server_pid) {
  Measured m;
  m.processes = processes;
  m.results.resize(concurrency);
  std::vector<WorkerProcess> workers(processes);

  nlohmann::json level;
  level["protocol"] = ProtocolName(protocol);
  level["target"] = targets.client.target;
  level["auth_token"] = targets.client.auth_token;
  level["max_overload_retries"] = targets.client.max_overload_retries;
  level["http_target"] = targets.http_target;
  level["model"] = config.model;
  level["max_tokens"] = config.max_tokens;
  level["min_tokens_per_message"] = config.min_tokens_per_message;
  level["prompt"] = config.prompt;
  level["text"] = config.text;
  level["temperature"] = config.temperature;
  level["seed"] = config.seed;
  level["trace"] = config.trace;
  level["sessions"] = config.sessions;
  level["concurrency"] = concurrency;
  level["context_tokens"] = context_tokens;
  level["repeat"] = repeat;
  level["processes"] = processes;
  for (int k = 0; k < processes; ++k) {
    WorkerProcess& w = workers[k];
    if (absl::Status s = SpawnWorker(w, argv0); !s.ok()) {
      FailWorker(w, k, s.ToString());
      continue;
    }
    level["process"] = k;
    if (absl::Status s = WriteMessage(w.to, level); !s.ok()) FailWorker(w, k, s.ToString());
  }
  // Set-up: every worker's streams connected (and their sessions created).
  int idle_streams = 0;  // streams that will not run: failed set-up, or a failed worker's
  for (int k = 0; k < processes; ++k) {
    WorkerProcess& w = workers[k];
    const int owned = (concurrency - k + processes - 1) / processes;
    if (w.failure.empty()) {
      auto ready = ReadMessage(w.from, kNoDeadline);
      if (ready.ok() && ready->contains("setup_failures") &&
          (*ready)["setup_failures"].is_number_integer()) {
        idle_streams += (*ready)["setup_failures"].get<int>();
        continue;
      }
      FailWorker(w, k, ready.ok() ? "bad ready message" : std::string(ready.status().message()));
    }
    idle_streams += owned;
  }
  const int64_t start = NowNs();
  const int64_t begin = start + absl::ToInt64Nanoseconds(config.warmup);
  // As Level::WaitForEnd(): the window ends at once when no stream can run.
  const int64_t end = idle_streams == concurrency
                          ? begin + 1000000
                          : begin + absl::ToInt64Nanoseconds(config.duration);
  const nlohmann::json window = {{"start_ns", start}, {"begin_ns", begin}, {"end_ns", end}};
  for (int k = 0; k < processes; ++k) {
    WorkerProcess& w = workers[k];
    if (!w.failure.empty()) continue;
    if (absl::Status s = WriteMessage(w.to, window); !s.ok()) FailWorker(w, k, s.ToString());
  }
  m.load_before = LoadAverage();
  SleepUntil(begin);
  m.first = Snapshot(metrics_target, server_pid);
  SleepUntil(end);
  m.last = Snapshot(metrics_target, server_pid);
  m.begin_ns = begin;
  m.end_ns = end;
  m.bench_cpu_s = m.last.self_cpu - m.first.self_cpu;
  m.process_cpu_s.push_back(m.bench_cpu_s);
  // Results: each worker stops its streams at the end of the window (cancelling what is
  // in flight, deleting its sessions), then reports; 120 s is far beyond that.
  const int64_t result_deadline = end + int64_t{120} * 1000000000;
  for (int k = 0; k < processes; ++k) {
    WorkerProcess& w = workers[k];
    double cpu = 0;
    if (w.failure.empty()) {
      auto result = ReadMessage(w.from, result_deadline);
      bool merged = false;
      if (result.ok() && result->contains("streams") && result->contains("cpu_s")) {
        try {
          std::vector<std::pair<int, StreamResult>> streams;
          for (const auto& s : (*result)["streams"]) {
            const int i = s.at("index").get<int>();
            if (i < 0 || i >= concurrency || i % processes != k) {
              throw std::out_of_range("stream index");
            }
            streams.emplace_back(i, StreamResultFromIpc(s));
          }
          for (auto& [i, r] : streams) m.results[i] = std::move(r);
          cpu = (*result)["cpu_s"].get<double>();
          merged = true;
        } catch (const std::exception& e) {
          FailWorker(w, k, absl::StrCat("bad result message: ", e.what()));
        }
      } else if (result.ok()) {
        FailWorker(w, k, "bad result message");
      } else if (absl::IsDeadlineExceeded(result.status())) {
        w.killed = true;
        kill(w.pid, SIGKILL);
        FailWorker(w, k, "no result 120 s after the window (killed)");
      } else {
        FailWorker(w, k, std::string(result.status().message()));
      }
      if (merged) {
        Reap(w, absl::Seconds(10));
        if (w.killed) {
          FailWorker(w, k, "did not exit after its result (killed)");
        } else if (w.exit != "exit 0") {
          FailWorker(w, k, w.exit);
        }
      }
    }
    m.bench_cpu_s += cpu;
    m.process_cpu_s.push_back(cpu);
    if (w.to >= 0) close(w.to);
    if (w.from >= 0) close(w.from);
    Reap(w, absl::Seconds(10));
    if (!w.failure.empty()) ++m.process_errors[w.failure];
  }
  m.load_after = LoadAverage();
  return m;
}

// A worker's failure: said on stderr, then exit 1 (which the parent reports). _exit:
// the Level's threads may be waiting for a window that will not come.
[[noreturn]] void WorkerExit(int process, const std::string& message) {
  std::fprintf(stderr, "fwbench worker %d: %s\n", process, message.c_str());
  std::fflush(stderr);
  _exit(1);
}

// --worker_of=PID: one share of one level, as RunInProcesses() describes.
int WorkerMain(int parent_pid) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent_pid) return 1;  // the parent is gone already
  signal(SIGPIPE, SIG_IGN);
  const int out = fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  if (out < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) WorkerExit(-1, "cannot move stdout");
  auto message = ReadMessage(STDIN_FILENO, kNoDeadline);
  if (!message.ok()) WorkerExit(-1, "no level: " + message.status().ToString());
  const nlohmann::json& l = *message;
  int process = -1;
  Config config;
  Protocol protocol = Protocol::kGrpc;
  int concurrency = 0, context_tokens = 0, repeat = 0, processes = 0;
  fwserve::ClientOptions options;
  std::string http_target_name;
  try {
    process = l.at("process").get<int>();
    protocol = l.at("protocol").get<std::string>() == "http" ? Protocol::kHttp : Protocol::kGrpc;
    options.target = l.at("target").get<std::string>();
    options.auth_token = l.at("auth_token").get<std::string>();
    options.max_overload_retries = l.at("max_overload_retries").get<int>();
    http_target_name = l.at("http_target").get<std::string>();
    config.model = l.at("model").get<std::string>();
    config.max_tokens = l.at("max_tokens").get<int>();
    config.min_tokens_per_message = l.at("min_tokens_per_message").get<int>();
    config.prompt = l.at("prompt").get<std::string>();
    config.text = l.at("text").get<std::string>();
    config.temperature = l.at("temperature").get<double>();
    config.seed = l.at("seed").get<int64_t>();
    config.trace = l.at("trace").get<bool>();
    config.sessions = l.at("sessions").get<bool>();
    concurrency = l.at("concurrency").get<int>();
    context_tokens = l.at("context_tokens").get<int>();
    repeat = l.at("repeat").get<int>();
    processes = l.at("processes").get<int>();
  } catch (const std::exception& e) {
    WorkerExit(process, absl::StrCat("bad level message: ", e.what()));
  }
  if (processes < 1 || process < 0 || process >= processes) WorkerExit(process, "bad share");

  std::unique_ptr<fwserve::Client> client;
  HttpTarget http_target;
  if (protocol == Protocol::kGrpc) {
    auto connected = fwserve::Client::Connect(options);
    if (!connected.ok()) WorkerExit(process, connected.status().ToString());
    client = std::move(*connected);
    // Connected before the window, as the parent's client is.
    auto healthy = client->Health();
    if (!healthy.ok() || !*healthy) {
      WorkerExit(process, absl::StrCat("server at ", options.target, " is not healthy: ",
                                       healthy.ok() ? "NOT_SERVING" : healthy.status().ToString()));
    }
  } else {
    auto endpoints = fwbench::Resolve(http_target_name);
    if (!endpoints.ok()) WorkerExit(process, endpoints.status().ToString());
    http_target.endpoints = *endpoints;
    http_target.host = http_target_name;
  }
  Level level(protocol, client.get(), &http_target, config, concurrency, context_tokens, repeat,
              process, processes);
  level.Start();
  if (absl::Status s = WriteMessage(out, {{"setup_failures", level.setup_failures()}}); !s.ok()) {
    WorkerExit(process, s.ToString());
  }
  auto window = ReadMessage(STDIN_FILENO, kNoDeadline);
  if (!window.ok()) WorkerExit(process, "no window: " + window.status().ToString());
  int64_t begin = 0;
  try {
    begin = window->at("begin_ns").get<int64_t>();
    level.Go(window->at("start_ns").get<int64_t>(), begin, window->at("end_ns").get<int64_t>());
  } catch (const std::exception& e) {
    WorkerExit(process, absl::StrCat("bad window message: ", e.what()));
  }
  SleepUntil(begin);
  const double cpu_before = CpuSecondsSelf();
  level.WaitForEnd();
  const double cpu_after = CpuSecondsSelf();
  level.Stop();
  nlohmann::json result;
  result["cpu_s"] = cpu_after - cpu_before;
  result["streams"] = nlohmann::json::array();
  for (int i : level.streams()) {
    nlohmann::json s = StreamResultToIpc(level.result(i));
    s["index"] = i;
    result["streams"].push_back(std::move(s));
  }
  if (absl::Status s = WriteMessage(out, result); !s.ok()) WorkerExit(process, s.ToString());
  close(out);
  return 0;
}

// The level's JSON, merged over its streams exactly as one process's: sums, and
// percentiles of all the streams' raw samples together.
nlohmann::ordered_json LevelReport(Protocol protocol, int repeat, int concurrency,
                                   int context_tokens, const Measured& m, int server_pid) {
  StreamResult all;
  std::vector<std::string> setup_errors;
  int64_t context_seen = -1;
  for (const StreamResult& r : m.results) {
    all.ttft_ms.insert(all.ttft_ms.end(), r.ttft_ms.begin(), r.ttft_ms.end());
    all.itl_ms.insert(all.itl_ms.end(), r.itl_ms.begin(), r.itl_ms.end());
    all.finish_ms.insert(all.finish_ms.end(), r.finish_ms.begin(), r.finish_ms.end());
    all.request_ms.insert(all.request_ms.end(), r.request_ms.begin(), r.request_ms.end());
    all.usage_token_correction += r.usage_token_correction;
    all.session_create_ms.insert(all.session_create_ms.end(), r.session_create_ms.begin(),
                                 r.session_create_ms.end());
    all.tokens += r.tokens;
    all.messages += r.messages;
    all.requests_completed += r.requests_completed;
    all.requests_started += r.requests_started;
    for (const auto& [k, v] : r.errors) all.errors[k] += v;
    for (const auto& [k, v] : r.warmup_errors) all.warmup_errors[k] += v;
    if (!r.setup_error.empty()) setup_errors.push_back(r.setup_error);
    if (r.context_tokens_seen >= 0) context_seen = r.context_tokens_seen;
  }
  for (const auto& [k, v] : m.process_errors) all.errors[k] += v;
  const double window_s = static_cast<double>(m.end_ns - m.begin_ns) * 1e-9;
  const ServerSnapshot& first = m.first;
  const ServerSnapshot& last = m.last;

  nlohmann::ordered_json out;
  out["protocol"] = ProtocolName(protocol);
  out["repeat"] = repeat;
  out["concurrency"] = concurrency;
  out["processes"] = m.processes;
  out["context_tokens"] = context_tokens;
  if (context_tokens > 0) {
    out["session_tokens_after_prefill"] = context_seen;
    out["session_create_ms"] = Summary(all.session_create_ms);
  }
  out["window_s"] = window_s;
  out["output_tokens"] = all.tokens;
  out["output_tokens_per_s"] = static_cast<double>(all.tokens) / window_s;
  out["output_tokens_per_s_per_stream"] = static_cast<double>(all.tokens) / window_s / concurrency;
  // Messages carrying tokens (gRPC GenerateResponse with token ids, SSE chunks with text)
  // inside the window; tokens_per_message is the mean message size.
  out["messages"] = all.messages;
  out["messages_per_s"] = static_cast<double>(all.messages) / window_s;
  out["tokens_per_message"] =
      all.messages > 0 ? static_cast<double>(all.tokens) / static_cast<double>(all.messages) : 0.0;
  out["requests_started"] = all.requests_started;
  out["requests_completed"] = all.requests_completed;
  out["requests_per_s"] = static_cast<double>(all.requests_completed) / window_s;
  out["ttft_ms"] = Summary(all.ttft_ms);
  out["itl_ms"] = Summary(all.itl_ms);
  out["finish_ms"] = Summary(all.finish_ms);
  // Completed requests that started inside the window: sent -> final message (HTTP: the
  // end of the response).
  out["request_ms"] = Summary(all.request_ms);
  if (protocol == Protocol::kHttp) out["usage_token_correction"] = all.usage_token_correction;
  out["errors"] = all.errors;
  out["warmup_errors"] = all.warmup_errors;
  if (!setup_errors.empty()) out["setup_errors"] = setup_errors;
  const double measured_s = static_cast<double>(last.at_ns - first.at_ns) * 1e-9;
  out["bench_cpu_fraction"] = m.bench_cpu_s / measured_s;
  if (m.process_cpu_s.size() > 1) {
    // This process's, then each worker's: none should be near 1 (one core).
    std::vector<double> fractions;
    for (double s : m.process_cpu_s) fractions.push_back(s / measured_s);
    out["bench_cpu_fraction_by_process"] = fractions;
  }
  // Per-request cost: CPU time per request completed inside the window (the window and
  // the CPU interval are the same up to the two snapshots' timing).
  const double completed = static_cast<double>(all.requests_completed);
  if (completed > 0) {
    out["bench_cpu_ms_per_request"] = m.bench_cpu_s * 1e3 / completed;
  }
  // Per-token cost, likewise per output token of the window.
  const double tokens = static_cast<double>(all.tokens);
  if (tokens > 0) out["bench_cpu_us_per_token"] = m.bench_cpu_s * 1e6 / tokens;
  if (m.load_before) out["loadavg_before"] = *m.load_before;
  if (m.load_after) out["loadavg_after"] = *m.load_after;
  if (server_pid > 0 && !first.thread_cpu.empty()) {
    std::vector<std::pair<double, std::string>> busy;
    double total = 0;
    double engine = 0;  // threads named fwserve-engine (the engine loop, and OpenMP's
                        // workers it started, which inherit its name)
    bool saw_engine = false;
    for (const auto& [name, seconds] : last.thread_cpu) {
      auto before = first.thread_cpu.find(name);
      const double delta = seconds - (before == first.thread_cpu.end() ? 0 : before->second);
      total += delta;
      if (absl::StartsWith(name, "fwserve-engine")) {
        engine += delta;
        saw_engine = true;
      }
      if (delta > 0) busy.emplace_back(delta / measured_s, name);
    }
    std::sort(busy.rbegin(), busy.rend());
    nlohmann::ordered_json threads_json = nlohmann::ordered_json::array();
    for (const auto& [fraction, name] : busy) threads_json.push_back({{name, fraction}});
    out["server_cpu_fraction"] = total / measured_s;
    if (completed > 0) out["server_cpu_ms_per_request"] = total * 1e3 / completed;
    if (tokens > 0) out["server_cpu_us_per_token"] = total * 1e6 / tokens;
    // Busiest first; under load the busiest is the engine thread (model steps, sampling).
    out["server_cpu_fraction_by_thread"] = threads_json;
    out["server_busiest_thread_cpu_fraction"] = busy.empty() ? 0.0 : busy.front().first;
    if (saw_engine) {
      out["server_engine_thread_cpu_fraction"] = engine / measured_s;
      if (tokens > 0) out["server_engine_thread_cpu_us_per_token"] = engine * 1e6 / tokens;
    }
  }
  if (!first.metrics.empty() && !last.metrics.empty()) {
    auto delta = [&](const std::string& name) {
      auto a = first.metrics.find(name);
      auto b = last.metrics.find(name);
      if (a == first.metrics.end() || b == last.metrics.end()) return 0.0;
      return b->second - a->second;
    };
    const double steps = delta("fwserve_engine_step_duration_seconds_count");
    const double step_s = delta("fwserve_engine_step_duration_seconds_sum");
    const double batch_sum = delta("fwserve_engine_batch_size_sum");
    const double prefill_s = delta("fwserve_engine_prefill_chunk_duration_seconds_sum");
    nlohmann::ordered_json engine;
    engine["decode_steps"] = steps;
    engine["decode_steps_per_s"] = steps / measured_s;
    engine["mean_batch_size"] = steps > 0 ? batch_sum / steps : 0.0;
    engine["mean_step_ms"] = steps > 0 ? step_s / steps * 1e3 : 0.0;
    engine["step_fraction_of_window"] = step_s / measured_s;
    engine["prefill_fraction_of_window"] = prefill_s / measured_s;
    engine["generated_tokens"] = delta("fwserve_generated_tokens_total");
    out["server_engine"] = engine;
  }
  return out;
}

std::string Ms(const nlohmann::ordered_json& summary, const char* key) {
  if (!summary.contains(key)) return "-";
  return absl::StrFormat("%.2f", summary[key].get<double>());
}

std::string HumanCount(double v) {
  if (v >= 1e6) return absl::StrFormat("%.2fM", v / 1e6);
  if (v >= 1e4) return absl::StrFormat("%.1fk", v / 1e3);
  if (v >= 100) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.1f", v);
}

void PrintTable(const std::vector<nlohmann::ordered_json>& levels) {
  std::printf(
      "%5s %3s %5s %7s %7s %8s %7s %7s | %7s %7s %7s | %6s %6s %6s %6s | %6s %6s | %6s %6s | %5s "
      "%5s %5s %5s %5s | %s\n",
      "proto", "rep", "C", "context", "req/s", "tok/s", "tok/s/C", "tok/msg", "TTFTp50", "p90",
      "p99", "ITLp50", "p90", "p99", "mean", "ENDp50", "p99", "REQp50", "p99", "batch", "step%",
      "srv%", "top%", "cli%", "errors");
  for (const auto& l : levels) {
    std::string errors;
    for (const auto& [code, n] : l["errors"].items()) {
      absl::StrAppend(&errors, errors.empty() ? "" : ",", code, "=", n.get<int64_t>());
    }
    if (errors.empty()) errors = "0";
    std::string batch = "-", step = "-", server = "-", top = "-", per_message = "-";
    if (l["messages"].get<int64_t>() > 0) {
      per_message = absl::StrFormat("%.1f", l["tokens_per_message"].get<double>());
    }
    if (l.contains("server_engine")) {
      const auto& e = l["server_engine"];
      batch = absl::StrFormat("%.1f", e["mean_batch_size"].get<double>());
      step = absl::StrFormat("%.0f", 100 * e["step_fraction_of_window"].get<double>());
    }
    if (l.contains("server_cpu_fraction")) {
      server = absl::StrFormat("%.0f", 100 * l["server_cpu_fraction"].get<double>());
      top = absl::StrFormat("%.0f", 100 * l["server_busiest_thread_cpu_fraction"].get<double>());
    }
    std::printf(
        "%5s %3d %5d %7d %7s %8s %7s %7s | %7s %7s %7s | %6s %6s %6s %6s | %6s %6s | %6s %6s | %5s "
        "%5s %5s %5s %5.0f | %s\n",
        l["protocol"].get<std::string>().c_str(), l["repeat"].get<int>(),
        l["concurrency"].get<int>(), l["context_tokens"].get<int>(),
        HumanCount(l["requests_per_s"].get<double>()).c_str(),
        HumanCount(l["output_tokens_per_s"].get<double>()).c_str(),
        HumanCount(l["output_tokens_per_s_per_stream"].get<double>()).c_str(), per_message.c_str(),
        Ms(l["ttft_ms"], "p50").c_str(), Ms(l["ttft_ms"], "p90").c_str(),
        Ms(l["ttft_ms"], "p99").c_str(), Ms(l["itl_ms"], "p50").c_str(),
        Ms(l["itl_ms"], "p90").c_str(), Ms(l["itl_ms"], "p99").c_str(),
        Ms(l["itl_ms"], "mean").c_str(), Ms(l["finish_ms"], "p50").c_str(),
        Ms(l["finish_ms"], "p99").c_str(), Ms(l["request_ms"], "p50").c_str(),
        Ms(l["request_ms"], "p99").c_str(), batch.c_str(), step.c_str(), server.c_str(),
        top.c_str(), 100 * l["bench_cpu_fraction"].get<double>(), errors.c_str());
  }
  std::fflush(stdout);
}

// Throughput against the lowest concurrency of the same (repeat, context), and ITL
// against the shortest context of the same (repeat, concurrency).
nlohmann::ordered_json Ratios(const std::vector<nlohmann::ordered_json>& levels) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& l : levels) {
    const nlohmann::ordered_json* by_c = nullptr;
    const nlohmann::ordered_json* by_context = nullptr;
    for (const auto& b : levels) {
      if (b["repeat"] != l["repeat"] || b["protocol"] != l["protocol"]) continue;
      if (b["context_tokens"] == l["context_tokens"] &&
          (by_c == nullptr || b["concurrency"] < (*by_c)["concurrency"])) {
        by_c = &b;
      }
      if (b["concurrency"] == l["concurrency"] &&
          (by_context == nullptr || b["context_tokens"] < (*by_context)["context_tokens"])) {
        by_context = &b;
      }
    }
    nlohmann::ordered_json r;
    r["protocol"] = l["protocol"];
    r["repeat"] = l["repeat"];
    r["concurrency"] = l["concurrency"];
    r["context_tokens"] = l["context_tokens"];
    if (by_c != &l) {
      r["baseline_concurrency"] = (*by_c)["concurrency"];
      r["output_tokens_per_s_ratio"] =
          l["output_tokens_per_s"].get<double>() / (*by_c)["output_tokens_per_s"].get<double>();
    }
    if (by_context != &l && l["itl_ms"].contains("p50") &&
        (*by_context)["itl_ms"].contains("p50")) {
      r["baseline_context_tokens"] = (*by_context)["context_tokens"];
      r["itl_p50_ratio"] =
          l["itl_ms"]["p50"].get<double>() / (*by_context)["itl_ms"]["p50"].get<double>();
      r["itl_mean_ratio"] =
          l["itl_ms"]["mean"].get<double>() / (*by_context)["itl_ms"]["mean"].get<double>();
    }
    if (r.size() > 4) out.push_back(r);
  }
  return out;
}

// A level's number at `path` ("output_tokens_per_s", or "ttft_ms/p50"); nullopt when the
// level does not have it.
std::optional<double> LevelNumber(const nlohmann::ordered_json& level, const std::string& path) {
  const nlohmann::ordered_json* at = &level;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    auto it = at->find(std::string(part));
    if (it == at->end()) return std::nullopt;
    at = &*it;
  }
  if (!at->is_number()) return std::nullopt;
  return at->get<double>();
}

struct ComparedNumber {
  const char* name;   // in the JSON
  const char* path;   // in a level
  const char* label;  // in the text output
};
constexpr ComparedNumber kCompared[] = {
    {"output_tokens_per_s", "output_tokens_per_s", "tok/s"},
    {"requests_per_s", "requests_per_s", "req/s"},
    {"ttft_p50", "ttft_ms/p50", "TTFT p50"},
    {"itl_mean", "itl_ms/mean", "ITL mean"},
    {"request_p50", "request_ms/p50", "request p50"},
    {"request_p99", "request_ms/p99", "request p99"},
    {"server_cpu_ms_per_request", "server_cpu_ms_per_request", "server CPU/request"},
    {"bench_cpu_ms_per_request", "bench_cpu_ms_per_request", "client CPU/request"},
};

// HTTP against gRPC: each HTTP level divided by the gRPC level of the same repeat,
// concurrency and context (they ran back to back), number by number (kCompared);
// "per_repeat" holds every pair, "summary" the median, minimum and maximum over the
// repeats of each (concurrency, context). Empty unless both protocols ran.
nlohmann::ordered_json ProtocolRatios(const std::vector<nlohmann::ordered_json>& levels) {
  nlohmann::ordered_json per_repeat = nlohmann::ordered_json::array();
  std::map<std::pair<int, int>, std::map<std::string, std::vector<double>>> by_level;
  for (const auto& h : levels) {
    if (h["protocol"] != "http") continue;
    for (const auto& g : levels) {
      if (g["protocol"] != "grpc" || g["repeat"] != h["repeat"] ||
          g["concurrency"] != h["concurrency"] || g["context_tokens"] != h["context_tokens"]) {
        continue;
      }
      nlohmann::ordered_json r;
      r["repeat"] = h["repeat"];
      r["concurrency"] = h["concurrency"];
      r["context_tokens"] = h["context_tokens"];
      auto& samples = by_level[{h["concurrency"].get<int>(), h["context_tokens"].get<int>()}];
      for (const ComparedNumber& n : kCompared) {
        const std::optional<double> a = LevelNumber(h, n.path), b = LevelNumber(g, n.path);
        if (!a || !b || *b <= 0) continue;
        r[n.name] = *a / *b;
        samples[n.name].push_back(*a / *b);
      }
      if (r.size() > 3) per_repeat.push_back(r);
    }
  }
  nlohmann::ordered_json summary = nlohmann::ordered_json::array();
  for (auto& [key, samples] : by_level) {
    if (samples.empty()) continue;
    nlohmann::ordered_json s;
    s["concurrency"] = key.first;
    s["context_tokens"] = key.second;
    for (const ComparedNumber& n : kCompared) {
      auto it = samples.find(n.name);
      if (it == samples.end()) continue;
      std::vector<double>& v = it->second;
      std::sort(v.begin(), v.end());
      const size_t m = v.size() / 2;
      const double median = v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
      s[n.name] = {{"median", median}, {"min", v.front()}, {"max", v.back()}, {"n", v.size()}};
    }
    summary.push_back(s);
  }
  nlohmann::ordered_json out;
  if (per_repeat.empty()) return out;
  out["per_repeat"] = per_repeat;
  out["summary"] = summary;
  return out;
}

void PrintProtocolRatios(const nlohmann::ordered_json& ratios) {
  if (ratios.empty()) return;
  for (const auto& r : ratios["per_repeat"]) {
    std::string line = absl::StrFormat("HTTP/gRPC rep %d C=%d context=%d:", r["repeat"].get<int>(),
                                       r["concurrency"].get<int>(), r["context_tokens"].get<int>());
    for (const ComparedNumber& n : kCompared) {
      if (!r.contains(n.name)) continue;
      absl::StrAppend(&line, absl::StrFormat(" %s %.3fx;", n.label, r[n.name].get<double>()));
    }
    std::printf("%s\n", line.c_str());
  }
  for (const auto& s : ratios["summary"]) {
    std::string line =
        absl::StrFormat("HTTP/gRPC C=%d context=%d, median (range):", s["concurrency"].get<int>(),
                        s["context_tokens"].get<int>());
    for (const ComparedNumber& n : kCompared) {
      if (!s.contains(n.name)) continue;
      const auto& v = s[n.name];
      absl::StrAppend(&line, absl::StrFormat(" %s %.3fx (%.3f-%.3f, n=%d);", n.label,
                                             v["median"].get<double>(), v["min"].get<double>(),
                                             v["max"].get<double>(), v["n"].get<int>()));
    }
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "";
}

std::string UtcNow() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "fwbench: %s\n", message.c_str());
  return 2;
}

absl::StatusOr<std::vector<int>> ParseList(const std::vector<std::string>& items, int min,
                                           const char* flag) {
  std::vector<int> out;
  for (const std::string& item : items) {
    int v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < min) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", item, "' is not an integer >= ", min));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "load generator for fwserve: Generate throughput, TTFT and inter-token latency per "
      "concurrency level, over gRPC and/or the OpenAI-compatible HTTP API.\n"
      "Usage: fwbench [--protocol grpc|http|grpc,http] [--target HOST:PORT] "
      "[--http-target HOST:PORT] [--concurrency 1,8,32,128] [--duration 10s] "
      "[--context-tokens N,...] [--json FILE] [flags]");
  const std::string command_line = fwserve::QuotedCommandLine(argc, argv);
  std::vector<std::string> positional = fwserve::ParseFlagsAllowingDashes(argc, argv);
  if (positional.size() > 1) return Fail("unexpected argument '" + positional[1] + "'");
  if (const int parent = absl::GetFlag(FLAGS_worker_of); parent > 0) return WorkerMain(parent);

  auto concurrency = ParseList(absl::GetFlag(FLAGS_concurrency), 1, "concurrency");
  if (!concurrency.ok()) return Fail(std::string(concurrency.status().message()));
  auto contexts = ParseList(absl::GetFlag(FLAGS_context_tokens), 0, "context-tokens");
  if (!contexts.ok()) return Fail(std::string(contexts.status().message()));
  std::vector<Protocol> protocols;
  for (const std::string& name : absl::GetFlag(FLAGS_protocol)) {
    Protocol p;
    if (name == "grpc") {
      p = Protocol::kGrpc;
    } else if (name == "http") {
      p = Protocol::kHttp;
    } else {
      return Fail("--protocol: '" + name + "' is not grpc or http");
    }
    if (std::find(protocols.begin(), protocols.end(), p) == protocols.end()) protocols.push_back(p);
  }
  if (protocols.empty()) return Fail("--protocol is empty");
  auto uses = [&](Protocol p) {
    return std::find(protocols.begin(), protocols.end(), p) != protocols.end();
  };

  Config config;
  config.model = absl::GetFlag(FLAGS_model);
  config.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  config.min_tokens_per_message = absl::GetFlag(FLAGS_min_tokens_per_message);
  config.temperature = absl::GetFlag(FLAGS_temperature);
  config.seed = absl::GetFlag(FLAGS_seed);
  config.duration = absl::GetFlag(FLAGS_duration);
  config.warmup = absl::GetFlag(FLAGS_warmup);
  config.requests_per_stream = absl::GetFlag(FLAGS_requests_per_stream);
  config.sessions = absl::GetFlag(FLAGS_sessions);
  const std::string trace_path = absl::GetFlag(FLAGS_trace);
  config.trace = !trace_path.empty();
  std::ofstream trace_out;
  if (config.trace) {
    trace_out.open(trace_path, std::ios::app);
    if (!trace_out) return Fail("cannot open --trace " + trace_path);
  }
  if (config.max_tokens < 1) return Fail("--max-tokens must be >= 1");
  if (config.min_tokens_per_message < 0) {
    return Fail("--min-tokens-per-message must be >= 0");
  }
  if (config.duration <= absl::ZeroDuration() && config.requests_per_stream <= 0) {
    return Fail("--duration must be positive (or give --requests-per-stream)");
  }
  if (config.warmup < absl::ZeroDuration()) return Fail("--warmup must not be negative");
  const int repeats = absl::GetFlag(FLAGS_repeat);
  if (repeats < 1) return Fail("--repeat must be >= 1");
  const int processes = absl::GetFlag(FLAGS_processes);
  if (processes < 1) return Fail("--processes must be >= 1");
  if (processes > 1 && config.requests_per_stream > 0) {
    return Fail(
        "--requests-per-stream cannot be used with --processes > 1 (the first stream to "
        "finish ends the window, and worker processes do not share that); use --duration");
  }
  // A worker that has died must not kill the bench when it writes to its pipe.
  if (processes > 1) signal(SIGPIPE, SIG_IGN);

  config.text = kBuiltinText;
  const std::string text_file = absl::GetFlag(FLAGS_text_file);
  if (!text_file.empty()) {
    std::ifstream in(text_file, std::ios::binary);
    if (!in) return Fail("cannot read --text-file " + text_file);
    std::ostringstream contents;
    contents << in.rdbuf();
    config.text = contents.str();
    if (config.text.empty()) return Fail("--text-file " + text_file + " is empty");
  }
  config.prompt = absl::GetFlag(FLAGS_prompt);
  if (config.prompt.empty()) {
    const int bytes = absl::GetFlag(FLAGS_prompt_bytes);
    if (bytes < 1) return Fail("--prompt-bytes must be >= 1");
    config.prompt = TextOfLength(config.text, 0, static_cast<size_t>(bytes));
  }

  const absl::Time give_up = absl::Now() + absl::GetFlag(FLAGS_connect_timeout);
  fwserve::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  if (const std::string key_file = absl::GetFlag(FLAGS_api_key_file); !key_file.empty()) {
    std::ifstream in(key_file);
    std::string key;
    if (!in || !std::getline(in, key) || absl::StripAsciiWhitespace(key).empty()) {
      return Fail(absl::StrCat("--api-key-file: cannot read a key from '", key_file, "'"));
    }
    options.auth_token = std::string(absl::StripAsciiWhitespace(key));
  }
  const std::string client_behavior = absl::GetFlag(FLAGS_client);
  if (client_behavior == "naive") {
    options.max_overload_retries = 0;
  } else if (client_behavior != "retrying") {
    return Fail(absl::StrCat("--client must be retrying or naive, got '", client_behavior, "'"));
  }
  std::unique_ptr<fwserve::Client> client;
  nlohmann::ordered_json model_json;
  if (uses(Protocol::kGrpc)) {
    auto connected = fwserve::Client::Connect(options);
    if (!connected.ok()) return Fail(std::string(connected.status().message()));
    client = std::move(*connected);
    while (true) {
      auto healthy = client->Health();
      if (healthy.ok() && *healthy) break;
      if (absl::Now() >= give_up) {
        return Fail(absl::StrCat("server at ", options.target, " is not healthy: ",
                                 healthy.ok() ? "NOT_SERVING" : healthy.status().ToString()));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    auto model = client->DescribeModel(config.model);
    if (!model.ok()) return Fail("DescribeModel: " + model.status().ToString());
    model_json["name"] = model->name();
    model_json["architecture"] = model->architecture();
    model_json["parameters"] = model->parameters();
    model_json["state_bytes_per_session"] = model->state_bytes_per_session();
    model_json["fingerprint"] = model->fingerprint();
  }
  const std::string http_target_flag = absl::GetFlag(FLAGS_http_target);
  HttpTarget http_target;
  if (uses(Protocol::kHttp)) {
    if (!options.auth_token.empty()) {
      return Fail(
          "--api-key-file is sent with gRPC calls only; it cannot be used with "
          "--protocol http");
    }
    auto endpoints = fwbench::Resolve(http_target_flag);
    if (!endpoints.ok()) return Fail("--http-target: " + endpoints.status().ToString());
    http_target.endpoints = *endpoints;
    http_target.host = http_target_flag;
    // GET /ready until 200 (models loaded, serving).
    while (true) {
      auto ready =
          fwbench::HttpCall(http_target.endpoints, http_target.host, boost::beast::http::verb::get,
                            "/ready", "", absl::Seconds(10));
      if (ready.ok() && ready->status == 200) break;
      if (absl::Now() >= give_up) {
        return Fail(absl::StrCat("HTTP API at ", http_target_flag, " is not ready: ",
                                 ready.ok() ? absl::StrCat("HTTP ", ready->status, " ", ready->body)
                                            : ready.status().ToString()));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!uses(Protocol::kGrpc)) {
      // The model as GET /v1/models describes it (no fingerprint there).
      auto models = fwbench::HttpCall(http_target.endpoints, http_target.host,
                                      boost::beast::http::verb::get, "/v1/models");
      if (!models.ok() || models->status != 200) {
        return Fail("GET /v1/models: " + (models.ok() ? absl::StrCat("HTTP ", models->status)
                                                      : models.status().ToString()));
      }
      const nlohmann::json list = nlohmann::json::parse(models->body, nullptr, false);
      if (list.is_object() && list.contains("data") && list["data"].is_array()) {
        for (const auto& m : list["data"]) {
          const nlohmann::json ext = m.value("fwserve", nlohmann::json::object());
          const bool match = config.model.empty() ? ext.value("default", false)
                                                  : m.value("id", "") == config.model;
          if (!match) continue;
          model_json["name"] = m.value("id", "");
          model_json["architecture"] = ext.value("architecture", "");
          model_json["parameters"] = ext.value("parameters", int64_t{0});
          model_json["state_bytes_per_session"] = ext.value("state_bytes_per_session", int64_t{0});
        }
      }
      if (model_json.empty()) {
        return Fail("GET /v1/models: no model " +
                    (config.model.empty() ? std::string("marked default") : config.model));
      }
    }
  }

  const std::string metrics_target = absl::GetFlag(FLAGS_metrics_target);
  const int server_pid = absl::GetFlag(FLAGS_server_pid);

  nlohmann::ordered_json report;
  report["tool"] = "fwbench";
  report["label"] = absl::GetFlag(FLAGS_label);
  report["started_at"] = UtcNow();
  report["command"] = command_line;
  nlohmann::ordered_json machine;
  machine["nproc"] = std::thread::hardware_concurrency();
  machine["cpu_model"] = CpuModel();
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  machine["hostname"] = host;
  if (auto load = LoadAverage()) machine["loadavg_at_start"] = *load;
  report["machine"] = machine;
  nlohmann::ordered_json flags;
  std::vector<std::string> protocol_names;
  for (Protocol p : protocols) protocol_names.push_back(ProtocolName(p));
  flags["protocol"] = protocol_names;
  flags["target"] = options.target;
  flags["http_target"] = http_target_flag;
  flags["model"] = config.model;
  flags["concurrency"] = *concurrency;
  flags["context_tokens"] = *contexts;
  flags["duration_s"] = absl::ToDoubleSeconds(config.duration);
  flags["requests_per_stream"] = config.requests_per_stream;
  flags["warmup_s"] = absl::ToDoubleSeconds(config.warmup);
  flags["repeat"] = repeats;
  flags["processes"] = processes;
  flags["max_tokens"] = config.max_tokens;
  flags["min_tokens_per_message"] = config.min_tokens_per_message;
  flags["prompt_bytes"] = config.prompt.size();
  flags["text_file"] = text_file;
  flags["temperature"] = config.temperature;
  flags["seed"] = config.seed;
  flags["client"] = absl::GetFlag(FLAGS_client);
  flags["metrics_target"] = metrics_target;
  flags["server_pid"] = server_pid;
  flags["trace"] = trace_path;
  report["flags"] = flags;
  report["model"] = model_json;

  std::string where;
  for (Protocol p : protocols) {
    absl::StrAppend(&where, where.empty() ? "" : " and ",
                    p == Protocol::kGrpc ? "gRPC " + options.target
                                         : "HTTP " + http_target_flag + " (SSE /v1/completions)");
  }
  std::printf(
      "fwbench: %s, model %s (%s, %lld parameters), %d cores; max_tokens %d, prompt %zu bytes, "
      "temperature %.2f; %s per level after %s warmup%s\n",
      where.c_str(), model_json["name"].get<std::string>().c_str(),
      model_json["architecture"].get<std::string>().c_str(),
      static_cast<long long>(model_json["parameters"].get<int64_t>()),
      std::thread::hardware_concurrency(), config.max_tokens, config.prompt.size(),
      config.temperature,
      config.requests_per_stream > 0
          ? absl::StrCat(config.requests_per_stream, " requests per stream").c_str()
          : absl::FormatDuration(config.duration).c_str(),
      absl::FormatDuration(config.warmup).c_str(),
      processes > 1 ? absl::StrCat("; streams split over ", processes, " client processes").c_str()
                    : "");
  std::fflush(stdout);

  WorkerTargets worker_targets;
  worker_targets.client = options;
  worker_targets.http_target = http_target_flag;
  std::vector<nlohmann::ordered_json> levels;
  for (int rep = 0; rep < repeats; ++rep) {
    for (int c : *concurrency) {
      for (int context : *contexts) {
        for (Protocol p : protocols) {
          const int n = std::min(processes, c);
          Measured measured = n > 1 ? RunInProcesses(p, worker_targets, config, c, context, rep, n,
                                                     argv[0], metrics_target, server_pid)
                                    : Level(p, client.get(), &http_target, config, c, context, rep)
                                          .Run(metrics_target, server_pid);
          levels.push_back(LevelReport(p, rep, c, context, measured, server_pid));
          for (const StreamResult& r : measured.results) {
            for (const std::string& line : r.trace) trace_out << line << "\n";
          }
          std::fprintf(stderr, "fwbench: done %s C=%d context=%d (%s tokens/s)\n", ProtocolName(p),
                       c, context,
                       HumanCount(levels.back()["output_tokens_per_s"].get<double>()).c_str());
        }
      }
    }
  }
  PrintTable(levels);
  const nlohmann::ordered_json ratios = Ratios(levels);
  for (const auto& r : ratios) {
    std::string line = absl::StrFormat(
        "%s rep %d C=%d context=%d:", r["protocol"].get<std::string>(), r["repeat"].get<int>(),
        r["concurrency"].get<int>(), r["context_tokens"].get<int>());
    if (r.contains("output_tokens_per_s_ratio")) {
      absl::StrAppend(&line, absl::StrFormat(" tok/s %.2fx of C=%d;",
                                             r["output_tokens_per_s_ratio"].get<double>(),
                                             r["baseline_concurrency"].get<int>()));
    }
    if (r.contains("itl_p50_ratio")) {
      absl::StrAppend(&line, absl::StrFormat(" ITL p50 %.3fx, mean %.3fx of context %d;",
                                             r["itl_p50_ratio"].get<double>(),
                                             r["itl_mean_ratio"].get<double>(),
                                             r["baseline_context_tokens"].get<int>()));
    }
    std::printf("%s\n", line.c_str());
  }

  const nlohmann::ordered_json protocol_ratios = ProtocolRatios(levels);
  PrintProtocolRatios(protocol_ratios);

  report["levels"] = levels;
  report["ratios"] = ratios;
  if (!protocol_ratios.empty()) report["protocol_ratios"] = protocol_ratios;
  report["finished_at"] = UtcNow();
  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << report.dump(2) << "\n";
    if (!out) return Fail("cannot write --json " + json_path);
    std::fprintf(stderr, "fwbench: wrote %s\n", json_path.c_str());
  }
  return 0;
}
