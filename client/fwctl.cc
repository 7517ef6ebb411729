// fwctl: the command-line client of fwserve (fwserve.v1 over gRPC), built on
// fwserve::Client. `fwctl --help` lists the commands, `fwctl COMMAND --help` their
// options; docs/client.md is the reference.
//
// Exit codes: 0 success; 1 the server answered an error (its gRPC code name is printed
// on stderr) or a local file could not be read or written; 2 usage error; 3 `health`
// found the server NOT_SERVING; 130 interrupted by SIGINT (Ctrl-C).
//
// SIGINT: blocked in every thread and taken by a watcher thread with sigwait(), which
// runs whatever handler the current command installed (a Generate stream's Cancel(),
// thread-safe) or, with none, ends the process with 130. So no gRPC code ever runs in
// a signal handler.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "google/protobuf/util/json_util.h"

namespace {

namespace v1 = fwserve::v1;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotServing = 3;
constexpr int kExitInterrupted = 130;

// ----------------------------------------------------------------------------------
// SIGINT.

class Interrupts {
 public:
  // Blocks SIGINT in the calling thread (and so in every thread started after this:
  // call it first thing in main) and starts the watcher thread.
  static void Start() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    if (pipe(wake_pipe_) == 0) {
      fcntl(wake_pipe_[0], F_SETFL, fcntl(wake_pipe_[0], F_GETFL) | O_NONBLOCK);
      fcntl(wake_pipe_[1], F_SETFL, fcntl(wake_pipe_[1], F_GETFL) | O_NONBLOCK);
    }
    std::thread([set] {
      for (;;) {
        int signal_number = 0;
        if (sigwait(&set, &signal_number) != 0) continue;
        count_.fetch_add(1);
        [[maybe_unused]] ssize_t written = write(wake_pipe_[1], "i", 1);
        std::lock_guard<std::mutex> lock(mutex_);
        if (handler_) {
          handler_();
        } else {
          std::fflush(stdout);
          std::fputs("\nfwctl: interrupted\n", stderr);
          std::_Exit(kExitInterrupted);
        }
      }
    }).detach();
  }

  // SIGINTs received so far.
  static int count() { return count_.load(); }
  // Readable after each SIGINT (one byte per signal), for poll().
  static int wake_fd() { return wake_pipe_[0]; }
  // Discards the pending wake bytes.
  static void DrainWakeups() {
    char buffer[64];
    while (read(wake_pipe_[0], buffer, sizeof(buffer)) > 0) {
    }
  }

  // While alive, each SIGINT runs `handler` on the watcher thread instead of ending the
  // process. Handlers nest: the previous one is restored when this one goes.
  class Handler {
   public:
    explicit Handler(std::function<void()> handler) {
      std::lock_guard<std::mutex> lock(mutex_);
      previous_ = std::move(handler_);
      handler_ = std::move(handler);
    }
    ~Handler() {
      std::lock_guard<std::mutex> lock(mutex_);
      handler_ = std::move(previous_);
    }
    Handler(const Handler&) = delete;
    Handler& operator=(const Handler&) = delete;

   private:
    std::function<void()> previous_;  // restored when this one goes
  };

 private:
  static inline std::atomic<int> count_{0};
  static inline int wake_pipe_[2] = {-1, -1};
  static inline std::mutex mutex_;
  static inline std::function<void()> handler_;
};

// ----------------------------------------------------------------------------------
// Command-line model: global options, commands and their options.

struct OptionSpec {
  std::string name;        // without the leading dashes, e.g. "max-tokens"
  std::string value_name;  // empty: a switch without a value
  std::string help;
  bool repeatable = false;
};

struct Args;
using RunFunction = int (*)(Args&);

struct CommandSpec {
  std::string name;      // "generate", "session create"
  std::string synopsis;  // positional arguments, e.g. "[PROMPT... | -]"
  std::string summary;   // one line for the command list
  std::string details;   // paragraphs for `fwctl COMMAND --help`
  std::vector<OptionSpec> options;
  RunFunction run = nullptr;
};

const std::vector<OptionSpec>& GlobalOptions() {
  static const auto* options = new std::vector<OptionSpec>{
      {"target", "HOST:PORT",
       "server address: HOST:PORT or a gRPC target such as dns:///HOST:PORT (every address "
       "the name resolves to) or ipv4:ADDR:PORT,ADDR:PORT (default $FWSERVE_TARGET, else "
       "127.0.0.1:50051)"},
      {"lb-policy", "POLICY",
       "how calls spread over the target's addresses: pick_first (one connection, the "
       "default) or round_robin (every address in turn; replicas must share a session "
       "store)"},
      {"api-key-file", "FILE",
       "file whose first line is the API key, sent as 'authorization: Bearer KEY' (default "
       "$FWSERVE_API_KEY). A key is never sent in plaintext to a non-loopback server "
       "without --insecure"},
      {"token", "KEY",
       "the API key itself (prefer --api-key-file: a command line is "
       "visible to other users of the machine)"},
      {"insecure", "", "allow sending the API key without TLS to a non-loopback server"},
      {"timeout", "DURATION", "deadline of each unary call, e.g. 500ms, 60s, 2m (default 60s)"},
      {"stream-timeout", "DURATION",
       "deadline of each generate/chat stream (default none: 0 or 'inf')"},
      {"retries", "N",
       "retries of idempotent calls (get, list, score, export, models, health) on "
       "UNAVAILABLE, with exponential backoff from 100ms (default 3)"},
      {"tls", "", "use TLS (system roots unless --tls-ca)"},
      {"tls-ca", "FILE", "PEM root certificates to verify the server with (implies --tls)"},
      {"tls-cert", "FILE", "PEM client certificate chain, for mutual TLS (implies --tls)"},
      {"tls-key", "FILE", "PEM private key of --tls-cert (implies --tls)"},
      {"verbose", "", "more detail on stderr (timings, ids)"},
      {"help", "", "show help (of the command, after one)"},
  };
  return *options;
}

std::vector<OptionSpec> SamplingOptions() {
  return {
      {"max-tokens", "N", "tokens to generate; 0 = only absorb the prompt"},
      {"temperature", "T", "0 = greedy; range [0, 100] (default: the server's, 1)"},
      {"top-k", "K", "keep the K most likely tokens; 0 = off"},
      {"top-p", "P", "nucleus sampling; 0 or 1 = off"},
      {"min-p", "P", "drop tokens below P times the top probability; 0 = off"},
      {"repetition-penalty", "R", "penalize recently seen tokens; 0 or 1 = off"},
      {"repetition-window", "N", "tokens looked back by --repetition-penalty (default 64)"},
      {"seed", "S", "sampling seed: same seed, same output (default random)"},
      {"stop", "TEXT",
       "stop once the output ends with TEXT (included in the output); C escapes "
       "\\n \\t \\\\ are understood",
       true},
  };
}

struct Args {
  const CommandSpec* command = nullptr;
  std::map<std::string, std::vector<std::string>> values;  // option -> values ("" = switch)
  std::vector<std::string> positional;

  bool Has(const std::string& name) const { return values.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second.back();
  }
  std::vector<std::string> All(const std::string& name) const {
    auto it = values.find(name);
    return it == values.end() ? std::vector<std::string>{} : it->second;
  }
};

std::string CommandLabel(const Args& args) {
  return args.command == nullptr ? "fwctl" : "fwctl " + args.command->name;
}

int UsageError(const Args& args, const std::string& message) {
  std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", CommandLabel(args).c_str(), message.c_str(),
               CommandLabel(args).c_str());
  return kExitUsage;
}

int RpcError(const absl::Status& status) {
  std::fprintf(stderr, "fwctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return kExitError;
}

int LocalError(const std::string& message) {
  std::fprintf(stderr, "fwctl: %s\n", message.c_str());
  return kExitError;
}

// Typed option values. A bad value is a usage error (the returned status's message).
absl::Status ParseIntOption(const Args& args, const std::string& name, int64_t min, int64_t max,
                            int64_t* out) {
  if (!args.Has(name)) return absl::OkStatus();
  int64_t value = 0;
  if (!absl::SimpleAtoi(args.Get(name), &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": expected an integer in [", min,
                                                   ", ", max, "], got '", args.Get(name), "'"));
  }
  *out = value;
  return absl::OkStatus();
}

absl::Status ParseFloatOption(const Args& args, const std::string& name, float* out) {
  if (!args.Has(name)) return absl::OkStatus();
  float value = 0;
  if (!absl::SimpleAtof(args.Get(name), &value) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected a number, got '", args.Get(name), "'"));
  }
  *out = value;
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ParseDurationOption(const Args& args, const std::string& name,
                                                   absl::Duration fallback) {
  if (!args.Has(name)) return fallback;
  const std::string text = args.Get(name);
  if (text == "0" || text == "inf" || text == "none") return absl::InfiniteDuration();
  absl::Duration value;
  if (!absl::ParseDuration(text, &value) || value <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", name, ": expected a duration such as 500ms, 60s or 2m, got '", text, "'"));
  }
  return value;
}

// "\n", "\t", "\\" in --stop values (a shell makes real newlines awkward).
std::string UnescapeC(const std::string& text) {
  return absl::StrReplaceAll(text, {{"\\n", "\n"}, {"\\t", "\t"}, {"\\\\", "\\"}});
}

// A byte token for display, C-quoted: "T", " ", "\n", "\xc3" (ids past 255: <id>).
std::string ShowByteToken(int64_t token) {
  if (token < 0 || token > 255) return absl::StrCat("<", token, ">");
  const unsigned char c = static_cast<unsigned char>(token);
  switch (c) {
    case '\n':
      return "\"\\n\"";
    case '\t':
      return "\"\\t\"";
    case '\r':
      return "\"\\r\"";
    case '\\':
      return "\"\\\\\"";
    case '"':
      return "\"\\\"\"";
    default:
      break;
  }
  if (c >= 0x20 && c < 0x7f) return absl::StrCat("\"", std::string(1, static_cast<char>(c)), "\"");
  return absl::StrFormat("\"\\x%02x\"", c);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  if (path == "-") {
    std::ostringstream out;
    out << std::cin.rdbuf();
    return out.str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path, "'"));
  return out.str();
}

absl::Status WriteFile(const std::string& path, const std::string& data) {
  if (path == "-") {
    if (std::fwrite(data.data(), 1, data.size(), stdout) != data.size() ||
        std::fflush(stdout) != 0) {
      return absl::DataLossError("error writing to stdout");
    }
    return absl::OkStatus();
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

std::string FormatUnixMs(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

void WriteOut(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

// ----------------------------------------------------------------------------------
// Connecting.

absl::StatusOr<fwserve::ClientOptions> ClientOptionsFrom(const Args& args) {
  fwserve::ClientOptions options;
  const char* env_target = std::getenv("FWSERVE_TARGET");
  const char* env_key = std::getenv("FWSERVE_API_KEY");
  options.target = args.Get(
      "target", env_target != nullptr && *env_target != '\0' ? env_target : "127.0.0.1:50051");
  if (args.Has("api-key-file")) {
    auto text = ReadFile(args.Get("api-key-file"));
    if (!text.ok()) return text.status();
    const std::string first_line = text->substr(0, text->find('\n'));
    options.auth_token = std::string(absl::StripAsciiWhitespace(first_line));
    if (options.auth_token.empty()) {
      return absl::InvalidArgumentError("--api-key-file: the file's first line is empty");
    }
  } else {
    options.auth_token = args.Get("token", env_key != nullptr ? env_key : "");
  }
  options.allow_plaintext_key = args.Has("insecure");
  if (args.Has("lb-policy")) {
    const std::string policy = args.Get("lb-policy");
    if (policy != "pick_first" && policy != "round_robin") {
      return absl::InvalidArgumentError(
          absl::StrCat("--lb-policy: expected pick_first or round_robin, got '", policy, "'"));
    }
    options.load_balancing_policy = policy;
  }
  auto timeout = ParseDurationOption(args, "timeout", absl::Seconds(60));
  if (!timeout.ok()) return timeout.status();
  options.deadline = *timeout;
  auto stream_timeout = ParseDurationOption(args, "stream-timeout", absl::InfiniteDuration());
  if (!stream_timeout.ok()) return stream_timeout.status();
  options.generate_deadline = *stream_timeout;
  int64_t retries = options.max_retries;
  if (absl::Status s = ParseIntOption(args, "retries", 0, 100, &retries); !s.ok()) return s;
  options.max_retries = static_cast<int>(retries);
  options.use_tls =
      args.Has("tls") || args.Has("tls-ca") || args.Has("tls-cert") || args.Has("tls-key");
  if (args.Has("tls-cert") != args.Has("tls-key")) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  return options;
}

// Reads the TLS files named by the options (a missing file is an error, exit 1).
absl::Status LoadTlsFiles(const Args& args, fwserve::ClientOptions* options) {
  const std::pair<const char*, std::string*> files[] = {{"tls-ca", &options->tls_root_certs_pem},
                                                        {"tls-cert", &options->tls_client_cert_pem},
                                                        {"tls-key", &options->tls_client_key_pem}};
  for (const auto& [name, target] : files) {
    if (!args.Has(name)) continue;
    auto text = ReadFile(args.Get(name));
    if (!text.ok()) return text.status();
    *target = std::move(*text);
  }
  return absl::OkStatus();
}

std::unique_ptr<fwserve::Client> g_client;

// Connects (lazily: errors appear at the first call). Exits with 1 on failure.
fwserve::Client& GetClient(const Args& args) {
  if (g_client != nullptr) return *g_client;
  auto options = ClientOptionsFrom(args);  // validated in main
  if (absl::Status tls = LoadTlsFiles(args, &*options); !tls.ok()) {
    std::exit(LocalError(std::string(tls.message())));
  }
  auto client = fwserve::Client::Connect(*options);
  if (!client.ok()) std::exit(RpcError(client.status()));
  g_client = std::move(*client);
  return *g_client;
}

// Waits (up to `timeout`) until the server no longer holds the session for a request
// (after a cancelled stream it lets go within moments). Returns its last info.
absl::StatusOr<v1::SessionInfo> WaitUntilIdle(fwserve::Client& client,
                                              const std::string& session_id,
                                              absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    auto info = client.GetSession(session_id);
    if (!info.ok() || !info->busy() || absl::Now() >= end) return info;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// ----------------------------------------------------------------------------------
// generate and chat.

// Builds a GenerateRequest's sampling, max_tokens, stop and logprobs from the options.
absl::Status FillGenerateOptions(const Args& args, int64_t default_max_tokens,
                                 v1::GenerateRequest* request) {
  int64_t max_tokens = default_max_tokens;
  if (absl::Status s = ParseIntOption(args, "max-tokens", 0, INT32_MAX, &max_tokens); !s.ok()) {
    return s;
  }
  request->set_max_tokens(static_cast<int32_t>(max_tokens));
  v1::SamplingParams* sampling = request->mutable_sampling();
  float value = 0;
  if (args.Has("temperature")) {
    if (absl::Status s = ParseFloatOption(args, "temperature", &value); !s.ok()) return s;
    sampling->set_temperature(value);
  }
  struct FloatField {
    const char* name;
    void (v1::SamplingParams::*set)(float);
  };
  for (const FloatField& field :
       {FloatField{"top-p", &v1::SamplingParams::set_top_p},
        FloatField{"min-p", &v1::SamplingParams::set_min_p},
        FloatField{"repetition-penalty", &v1::SamplingParams::set_repetition_penalty}}) {
    if (!args.Has(field.name)) continue;
    if (absl::Status s = ParseFloatOption(args, field.name, &value); !s.ok()) return s;
    (sampling->*field.set)(value);
  }
  int64_t integer = 0;
  if (absl::Status s = ParseIntOption(args, "top-k", 0, INT32_MAX, &integer); !s.ok()) return s;
  sampling->set_top_k(static_cast<int32_t>(integer));
  integer = 0;
  if (absl::Status s = ParseIntOption(args, "repetition-window", 0, INT32_MAX, &integer); !s.ok()) {
    return s;
  }
  sampling->set_repetition_window(static_cast<int32_t>(integer));
  if (args.Has("seed")) {
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(args.Get("seed"), &seed)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seed: expected a non-negative integer, got '", args.Get("seed"), "'"));
    }
    sampling->set_seed(seed);
  }
  for (const std::string& stop : args.All("stop")) request->add_stop(UnescapeC(stop));
  request->set_logprobs(args.Has("logprobs"));
  return absl::OkStatus();
}

struct StreamOutcome {
  absl::Status status;
  bool interrupted = false;
  int64_t generated = 0;  // tokens received
  std::string text;
  v1::GenerateResponse last;  // carries finish_reason and usage when complete
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;
  absl::Duration time_to_first_token = absl::ZeroDuration();
  absl::Duration elapsed = absl::ZeroDuration();
};

// Runs one Generate, writing text (or JSON lines) to stdout as it arrives. SIGINT
// cancels the stream.
StreamOutcome StreamGenerate(fwserve::Client& client, const v1::GenerateRequest& request,
                             bool json_lines) {
  StreamOutcome outcome;
  const absl::Time start = absl::Now();
  const int interrupts_before = Interrupts::count();
  std::unique_ptr<fwserve::GenerateStream> stream = client.StartGenerate(request);
  {
    fwserve::GenerateStream* raw = stream.get();
    Interrupts::Handler on_interrupt([raw] { raw->Cancel(); });
    // A SIGINT that came before the handler was in place.
    if (Interrupts::count() != interrupts_before) stream->Cancel();
    v1::GenerateResponse message;
    while (stream->Next(&message)) {
      if (outcome.generated == 0 && message.token_ids_size() > 0) {
        outcome.time_to_first_token = absl::Now() - start;
      }
      outcome.generated += message.token_ids_size();
      outcome.text += message.text();
      if (request.logprobs()) {
        outcome.token_ids.insert(outcome.token_ids.end(), message.token_ids().begin(),
                                 message.token_ids().end());
        outcome.logprobs.insert(outcome.logprobs.end(), message.logprobs().begin(),
                                message.logprobs().end());
      }
      if (json_lines) {
        WriteOut(ToJson(message) + "\n");
      } else if (!message.text().empty()) {
        WriteOut(message.text());
      }
      if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) outcome.last = message;
    }
    outcome.status = stream->Finish();
    outcome.interrupted = Interrupts::count() != interrupts_before;
  }
  outcome.elapsed = absl::Now() - start;
  return outcome;
}

std::string FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_SHUTDOWN:
      return "shutdown";
    default:
      return "unspecified";
  }
}

void PrintSummary(const StreamOutcome& outcome, bool verbose) {
  const v1::Usage& usage = outcome.last.usage();
  std::string line =
      absl::StrCat("[finish: ", FinishReasonName(outcome.last.finish_reason()), "; prompt ",
                   usage.prompt_tokens(), ", generated ", usage.generated_tokens(), ", session ",
                   usage.session_tokens(), " tokens");
  if (verbose) {
    const double seconds = absl::ToDoubleSeconds(outcome.elapsed);
    absl::StrAppend(
        &line, "; first token after ",
        absl::FormatDuration(absl::Trunc(outcome.time_to_first_token, absl::Microseconds(100))),
        ", ", absl::FormatDuration(absl::Trunc(outcome.elapsed, absl::Milliseconds(1))), " in all",
        seconds > 0
            ? absl::StrFormat(", %.1f tokens/s", static_cast<double>(outcome.generated) / seconds)
            : "");
  }
  std::fprintf(stderr, "%s]\n", line.c_str());
}

void PrintLogprobs(const StreamOutcome& outcome) {
  std::fprintf(stderr, "%6s %6s %10s  %s\n", "#", "id", "logprob", "token");
  for (size_t i = 0; i < outcome.token_ids.size(); ++i) {
    std::fprintf(stderr, "%6zu %6lld %10.4f  %s\n", i, static_cast<long long>(outcome.token_ids[i]),
                 i < outcome.logprobs.size() ? outcome.logprobs[i] : NAN,
                 ShowByteToken(outcome.token_ids[i]).c_str());
  }
}

// After an interrupted stream on a session: tell what the session now holds.
void ReportSessionAfterInterrupt(fwserve::Client& client, const std::string& session_id) {
  auto info = WaitUntilIdle(client, session_id);
  if (!info.ok()) {
    std::fprintf(stderr, "fwctl: session %s: %s\n", session_id.c_str(),
                 info.status().ToString().c_str());
  } else {
    std::fprintf(stderr, "fwctl: session %s holds %lld tokens%s\n", session_id.c_str(),
                 static_cast<long long>(info->tokens()), info->busy() ? " (still busy)" : "");
  }
}

int RunGenerate(Args& args) {
  v1::GenerateRequest request;
  request.set_model(args.Get("model"));
  request.set_session_id(args.Get("session"));
  if (args.positional.size() == 1 && args.positional[0] == "-") {
    auto text = ReadFile("-");
    if (!text.ok()) return LocalError(std::string(text.status().message()));
    request.set_prompt(*text);
  } else {
    request.set_prompt(absl::StrJoin(args.positional, " "));
  }
  if (request.prompt().empty() && request.session_id().empty()) {
    return UsageError(args, "a PROMPT is required (or --session ID to continue a session)");
  }
  if (absl::Status s = FillGenerateOptions(args, 128, &request); !s.ok()) {
    return UsageError(args, std::string(s.message()));
  }
  const bool json = args.Has("json");
  const bool verbose = args.Has("verbose");
  fwserve::Client& client = GetClient(args);
  StreamOutcome outcome = StreamGenerate(client, request, json);
  if (!json && isatty(STDOUT_FILENO) && !outcome.text.empty() && outcome.text.back() != '\n') {
    WriteOut("\n");
  }
  if (outcome.interrupted) {
    std::fprintf(stderr, "%sfwctl: interrupted after %lld generated tokens\n",
                 !json && !outcome.text.empty() && outcome.text.back() != '\n' ? "\n" : "",
                 static_cast<long long>(outcome.generated));
    if (!request.session_id().empty()) ReportSessionAfterInterrupt(client, request.session_id());
    return kExitInterrupted;
  }
  if (!outcome.status.ok()) return RpcError(outcome.status);
  if (request.logprobs() && !json) PrintLogprobs(outcome);
  if (!args.Has("quiet")) {
    // Keep the summary off the text's last line when both end up on one terminal.
    if (!json && !isatty(STDOUT_FILENO) && isatty(STDERR_FILENO) && !outcome.text.empty() &&
        outcome.text.back() != '\n') {
      std::fputs("\n", stderr);
    }
    PrintSummary(outcome, verbose);
  }
  return kExitOk;
}

// Reads one line from stdin (without its newline). Returns 1 with a line, 0 at EOF
// (a last unterminated line is returned first), -1 on SIGINT.
int ReadLine(std::string* line) {
  line->clear();
  for (;;) {
    pollfd fds[2] = {{STDIN_FILENO, POLLIN, 0}, {Interrupts::wake_fd(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    if (fds[1].revents & POLLIN) return -1;
    char c = 0;
    const ssize_t n = read(STDIN_FILENO, &c, 1);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return line->empty() ? 0 : 1;
    if (c == '\n') return 1;
    line->push_back(c);
  }
}

int RunChat(Args& args) {
  if (!args.positional.empty()) {
    return UsageError(args, "unexpected argument '" + args.positional[0] + "'");
  }
  v1::GenerateRequest request;
  if (absl::Status s = FillGenerateOptions(args, 200, &request); !s.ok()) {
    return UsageError(args, std::string(s.message()));
  }
  if (args.Has("session") && args.Has("prefix")) {
    return UsageError(args, "--prefix applies to a new session, not with --session");
  }
  const bool verbose = args.Has("verbose");
  fwserve::Client& client = GetClient(args);
  std::string session_id = args.Get("session");
  v1::SessionInfo info;
  {
    absl::StatusOr<v1::SessionInfo> session =
        session_id.empty() ? client.CreateSession(args.Get("model"), UnescapeC(args.Get("prefix")))
                           : client.GetSession(session_id);
    if (!session.ok()) return RpcError(session.status());
    info = *session;
  }
  session_id = info.session_id();
  request.set_session_id(session_id);
  const bool interactive = isatty(STDIN_FILENO);
  std::fprintf(stderr,
               "fwctl chat: session %s (model %s, %lld tokens). Enter a line to send it; "
               "Ctrl-C stops a reply, Ctrl-D ends.\n",
               session_id.c_str(), info.model().c_str(), static_cast<long long>(info.tokens()));
  const std::string suffix = UnescapeC(args.Get("suffix", "\\n"));
  // At the prompt SIGINT only wakes ReadLine (through the wake pipe), which ends the
  // chat; during a reply StreamGenerate's own handler cancels the reply.
  Interrupts::Handler at_prompt([] {});
  const auto goodbye = [&](int code) {
    std::fprintf(stderr, "fwctl chat: resume with: fwctl chat --session %s\n", session_id.c_str());
    return code;
  };
  for (;;) {
    Interrupts::DrainWakeups();
    if (interactive) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    std::string line;
    const int read = ReadLine(&line);
    if (read < 0) {
      std::fputs("\n", stderr);
      return goodbye(kExitInterrupted);
    }
    if (read == 0) return goodbye(kExitOk);
    request.set_prompt(line + suffix);
    StreamOutcome outcome;
    for (int attempt = 0;; ++attempt) {
      outcome = StreamGenerate(client, request, /*json_lines=*/false);
      // The session is still held by the previous (cancelled) reply for a moment.
      if (outcome.status.code() != absl::StatusCode::kAborted || attempt > 0 ||
          outcome.interrupted) {
        break;
      }
      (void)WaitUntilIdle(client, session_id);
    }
    if (!outcome.text.empty() && outcome.text.back() != '\n') WriteOut("\n");
    if (outcome.interrupted) {
      std::fprintf(stderr, "[reply interrupted after %lld tokens]\n",
                   static_cast<long long>(outcome.generated));
      (void)WaitUntilIdle(client, session_id);
      continue;
    }
    if (!outcome.status.ok()) {
      RpcError(outcome.status);
      return goodbye(kExitError);
    }
    if (verbose) PrintSummary(outcome, verbose);
  }
}

// ----------------------------------------------------------------------------------
// score, sessions, models, health.

int RunScore(Args& args) {
  v1::ScoreRequest request;
  request.set_model(args.Get("model"));
  request.set_session_id(args.Get("session"));
  if (args.positional.size() == 1 && args.positional[0] == "-") {
    auto text = ReadFile("-");
    if (!text.ok()) return LocalError(std::string(text.status().message()));
    request.set_text(*text);
  } else {
    request.set_text(absl::StrJoin(args.positional, " "));
  }
  if (request.text().empty()) return UsageError(args, "a TEXT to score is required");
  auto response = GetClient(args).Score(request);
  if (!response.ok()) return RpcError(response.status());
  if (args.Has("json")) {
    WriteOut(ToJson(*response) + "\n");
    return kExitOk;
  }
  // From a fresh state the first token has no prediction: log-probs are right-aligned.
  const int offset = response->token_ids_size() - response->logprobs_size();
  std::printf("%6s %6s %10s  %s\n", "#", "id", "logprob", "token");
  for (int i = 0; i < response->token_ids_size(); ++i) {
    const int64_t id = response->token_ids(i);
    std::string logprob =
        i < offset ? "-" : absl::StrFormat("%.4f", response->logprobs(i - offset));
    std::printf("%6d %6lld %10s  %s\n", i, static_cast<long long>(id), logprob.c_str(),
                ShowByteToken(id).c_str());
  }
  std::printf("total_logprob %.4f over %d scored tokens\nperplexity %.4f\n",
              response->total_logprob(), response->logprobs_size(), response->perplexity());
  return kExitOk;
}

void PrintSessionInfo(const Args& args, const v1::SessionInfo& info) {
  if (args.Has("json")) {
    WriteOut(ToJson(info) + "\n");
    return;
  }
  std::printf(
      "session_id: %s\nmodel: %s\ntokens: %lld\nstate_bytes: %lld\ncreated: %s\nlast_used: "
      "%s\nresident: %s\nbusy: %s\n",
      info.session_id().c_str(), info.model().c_str(), static_cast<long long>(info.tokens()),
      static_cast<long long>(info.state_bytes()), FormatUnixMs(info.created_unix_ms()).c_str(),
      FormatUnixMs(info.last_used_unix_ms()).c_str(), info.resident() ? "true" : "false",
      info.busy() ? "true" : "false");
}

// create, fork and import print the new session's id (or all of it with --json or
// --verbose).
int PrintNewSession(const Args& args, const absl::StatusOr<v1::SessionInfo>& info) {
  if (!info.ok()) return RpcError(info.status());
  if (args.Has("json") || args.Has("verbose")) {
    PrintSessionInfo(args, *info);
  } else {
    std::printf("%s\n", info->session_id().c_str());
  }
  return kExitOk;
}

int RequirePositional(const Args& args, size_t count) {
  if (args.positional.size() < count) {
    return UsageError(args, "missing argument (" + args.command->synopsis + ")");
  }
  if (args.positional.size() > count) {
    return UsageError(args, "unexpected argument '" + args.positional[count] + "'");
  }
  return kExitOk;
}

int RunSessionCreate(Args& args) {
  if (int code = RequirePositional(args, 0); code != kExitOk) return code;
  return PrintNewSession(
      args, GetClient(args).CreateSession(args.Get("model"), UnescapeC(args.Get("prefix"))));
}

int RunSessionGet(Args& args) {
  if (int code = RequirePositional(args, 1); code != kExitOk) return code;
  auto info = GetClient(args).GetSession(args.positional[0]);
  if (!info.ok()) return RpcError(info.status());
  PrintSessionInfo(args, *info);
  return kExitOk;
}

int RunSessionList(Args& args) {
  if (int code = RequirePositional(args, 0); code != kExitOk) return code;
  const bool all = args.Has("all");
  int64_t page_size = all ? 1000 : 0;
  if (absl::Status s = ParseIntOption(args, "page-size", 0, INT32_MAX, &page_size); !s.ok()) {
    return UsageError(args, std::string(s.message()));
  }
  fwserve::Client& client = GetClient(args);
  // One page, or with --all every page from --page-token on, gathered into `response`.
  v1::ListSessionsResponse response;
  std::string page_token = args.Get("page-token");
  do {
    auto page = client.ListSessions(args.Get("model"), static_cast<int32_t>(page_size), page_token);
    if (!page.ok()) return RpcError(page.status());
    for (v1::SessionInfo& info : *page->mutable_sessions()) {
      *response.add_sessions() = std::move(info);
    }
    if (all && !page->next_page_token().empty() && page->next_page_token() == page_token) {
      return LocalError("the server returned the page token it was given");
    }
    page_token = page->next_page_token();
  } while (all && !page_token.empty());
  response.set_next_page_token(page_token);
  if (args.Has("json")) {
    WriteOut(ToJson(response) + "\n");
    return kExitOk;
  }
  std::printf("%-36s %-24s %10s %12s %-8s %-5s %s\n", "SESSION", "MODEL", "TOKENS", "STATE_BYTES",
              "RESIDENT", "BUSY", "LAST_USED");
  for (const v1::SessionInfo& info : response.sessions()) {
    std::printf("%-36s %-24s %10lld %12lld %-8s %-5s %s\n", info.session_id().c_str(),
                info.model().c_str(), static_cast<long long>(info.tokens()),
                static_cast<long long>(info.state_bytes()), info.resident() ? "yes" : "no",
                info.busy() ? "yes" : "no", FormatUnixMs(info.last_used_unix_ms()).c_str());
  }
  std::fflush(stdout);
  if (!page_token.empty()) {
    std::fprintf(stderr, "fwctl: more sessions follow: --page-token %s (or --all)\n",
                 page_token.c_str());
  }
  return kExitOk;
}

int RunSessionRm(Args& args) {
  if (args.positional.empty()) return UsageError(args, "missing argument (ID...)");
  fwserve::Client& client = GetClient(args);
  int code = kExitOk;
  for (const std::string& id : args.positional) {
    if (absl::Status status = client.DeleteSession(id); !status.ok()) code = RpcError(status);
  }
  return code;
}

int RunSessionFork(Args& args) {
  if (int code = RequirePositional(args, 1); code != kExitOk) return code;
  return PrintNewSession(args, GetClient(args).ForkSession(args.positional[0]));
}

int RunSessionExport(Args& args) {
  if (int code = RequirePositional(args, 2); code != kExitOk) return code;
  auto exported = GetClient(args).ExportSession(args.positional[0]);
  if (!exported.ok()) return RpcError(exported.status());
  if (absl::Status written = WriteFile(args.positional[1], exported->blob()); !written.ok()) {
    return LocalError(std::string(written.message()));
  }
  std::fprintf(stderr, "exported session %s (model %s, %lld tokens, %zu bytes) to %s\n",
               args.positional[0].c_str(), exported->model().c_str(),
               static_cast<long long>(exported->tokens()), exported->blob().size(),
               args.positional[1] == "-" ? "stdout" : args.positional[1].c_str());
  return kExitOk;
}

int RunSessionImport(Args& args) {
  if (int code = RequirePositional(args, 1); code != kExitOk) return code;
  auto blob = ReadFile(args.positional[0]);
  if (!blob.ok()) return LocalError(std::string(blob.status().message()));
  return PrintNewSession(args, GetClient(args).ImportSession(*blob, args.Get("model")));
}

int RunModels(Args& args) {
  if (args.positional.size() > 1) {
    return UsageError(args, "unexpected argument '" + args.positional[1] + "'");
  }
  fwserve::Client& client = GetClient(args);
  if (args.positional.size() == 1) {
    auto model = client.DescribeModel(args.positional[0]);
    if (!model.ok()) return RpcError(model.status());
    if (args.Has("json")) {
      WriteOut(ToJson(*model) + "\n");
      return kExitOk;
    }
    std::printf(
        "name: %s\ndefault: %s\narchitecture: %s\nparameters: %lld\nstate_bytes_per_session: "
        "%lld\nvocab_size: %lld\nfingerprint: %s\nconfig: %s\n",
        model->name().c_str(), model->is_default() ? "true" : "false",
        model->architecture().c_str(), static_cast<long long>(model->parameters()),
        static_cast<long long>(model->state_bytes_per_session()),
        static_cast<long long>(model->vocab_size()), model->fingerprint().c_str(),
        model->config_json().c_str());
    return kExitOk;
  }
  auto models = client.ListModels();
  if (!models.ok()) return RpcError(models.status());
  if (args.Has("json")) {
    v1::ListModelsResponse response;
    for (const v1::ModelInfo& info : *models) *response.add_models() = info;
    WriteOut(ToJson(response) + "\n");
    return kExitOk;
  }
  std::printf("%-28s %-8s %-18s %12s %12s %6s\n", "MODEL", "DEFAULT", "ARCHITECTURE", "PARAMETERS",
              "STATE_BYTES", "VOCAB");
  for (const v1::ModelInfo& info : *models) {
    std::printf("%-28s %-8s %-18s %12lld %12lld %6lld\n", info.name().c_str(),
                info.is_default() ? "yes" : "", info.architecture().c_str(),
                static_cast<long long>(info.parameters()),
                static_cast<long long>(info.state_bytes_per_session()),
                static_cast<long long>(info.vocab_size()));
  }
  return kExitOk;
}

int RunHealth(Args& args) {
  if (int code = RequirePositional(args, 0); code != kExitOk) return code;
  auto serving = GetClient(args).Health(args.Get("service"));
  if (!serving.ok()) return RpcError(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? kExitOk : kExitNotServing;
}

// ----------------------------------------------------------------------------------
// Commands and help.

const std::vector<CommandSpec>& Commands() {
  static const auto* commands = [] {
    const OptionSpec model = {"model", "M",
                              "model name (see 'fwctl models'); default: the "
                              "server's default model"};
    const OptionSpec json = {"json", "", "print JSON (proto3 JSON mapping; int64 as strings)"};
    std::vector<OptionSpec> generate_options = {
        model,
        {"session", "ID", "continue this session (the prompt and output are appended to it)"}};
    for (const OptionSpec& option : SamplingOptions()) generate_options.push_back(option);
    generate_options.push_back(
        {"logprobs", "", "after the text, print each token's log-probability on stderr"});
    generate_options.push_back(
        {"json", "", "print every streamed message as one JSON line instead of the text"});
    generate_options.push_back({"quiet", "", "no finish/usage line on stderr"});
    std::vector<OptionSpec> chat_options = {
        model,
        {"session", "ID", "resume this session instead of creating one"},
        {"prefix", "TEXT", "text prefilled into the new session (C escapes understood)"},
        {"suffix", "TEXT", "appended to each input line before it is sent (default \\n)"}};
    for (const OptionSpec& option : SamplingOptions()) chat_options.push_back(option);
    auto* list = new std::vector<CommandSpec>{
        {"generate", "[PROMPT... | -]", "stream a generation to stdout",
         "Streams generated text to stdout as it arrives; the finish reason and token usage "
         "go to stderr. The PROMPT words are joined with spaces; '-' reads the prompt from "
         "stdin. With --session the prompt and every generated token are appended to the "
         "session (then PROMPT may be empty). --max-tokens defaults to 128 and must not "
         "exceed the server's --max-tokens.\n\nCtrl-C (SIGINT) cancels the stream: the "
         "session keeps exactly the tokens streamed so far, fwctl waits until the server "
         "has let go of the session, prints how many tokens it holds and exits 130.",
         generate_options, RunGenerate},
        {"chat", "", "interactive loop on one session",
         "Creates a session (or resumes --session ID), prints its id on stderr, then reads "
         "lines from stdin: each line (plus --suffix) is appended to the session and a reply "
         "of up to --max-tokens (default 200) tokens is streamed to stdout. Ctrl-C during a "
         "reply stops that reply only (the session keeps what was streamed); Ctrl-C at the "
         "prompt exits 130; end of input (Ctrl-D) exits 0. Both print the command that "
         "resumes the session.",
         chat_options, RunChat},
        {"score",
         "TEXT... | -",
         "per-token log-probabilities of a text",
         "Prints each token (id, byte, natural-log probability given everything before it), "
         "then the total log-probability and the perplexity. From a fresh state the first "
         "token has no prediction ('-'); with --session the text is scored as a continuation "
         "of that session, which is left unchanged.",
         {model, {"session", "ID", "score as a continuation of this session"}, json},
         RunScore},
        {"session create",
         "",
         "create a session; prints its id",
         "Creates a session, optionally prefilled with --prefix, and prints its id (all of "
         "its info with --verbose or --json). In --prefix, \\n, \\t and \\\\ stand for a "
         "newline, a tab and a backslash.",
         {model,
          {"prefix", "TEXT", "text prefilled into the session (C escapes understood)"},
          json},
         RunSessionCreate},
        {"session get",
         "ID",
         "show a session",
         "Prints a session's model, token count, state size, times, and whether it is "
         "resident (not spilled to disk) and busy (held by a request).",
         {json},
         RunSessionGet},
        {"session list",
         "",
         "list sessions",
         "Lists one page of sessions (optionally of one model), oldest first. When more "
         "follow, the token of the next page is printed on stderr ('fwctl: more sessions "
         "follow: --page-token TOKEN'; with --json it is the next_page_token field); pass it "
         "with --page-token for the next page. --all lists every page.",
         {{"model", "M", "only sessions of this model"},
          {"page-size", "N",
           "sessions per page: 0 = the server's default, 100; at most 1000 (larger is taken "
           "as 1000) (default 0, or 1000 with --all)"},
          {"page-token", "TOKEN", "start at this page (a previous listing's next page token)"},
          {"all", "",
           "list every page (from --page-token, if given): one table, or one JSON object "
           "with every session and an empty next_page_token"},
          json},
         RunSessionList},
        {"session rm",
         "ID...",
         "delete sessions",
         "Deletes each session; exits 1 if any deletion failed (ABORTED while busy).",
         {},
         RunSessionRm},
        {"session fork",
         "ID",
         "copy a session; prints the new id",
         "Copies a session's state into a new session (O(state)) and prints the new id.",
         {json},
         RunSessionFork},
        {"session export",
         "ID FILE",
         "save a session to a file ('-' = stdout)",
         "Writes the session's versioned, checksummed blob (model fingerprint and state) to "
         "FILE. 'fwctl session import' on any server with the same model restores it.",
         {},
         RunSessionExport},
        {"session import",
         "FILE",
         "restore an exported session; prints the new id",
         "Reads a blob written by 'session export' (FILE '-' = stdin) and makes it a new "
         "session of --model (default: the server's default model), which must be the model "
         "the blob was exported from.",
         {model, json},
         RunSessionImport},
        {"models",
         "[NAME]",
         "list models, or describe one",
         "Without NAME, lists the served models; with NAME, prints its description "
         "(architecture, sizes, fingerprint and config).",
         {json},
         RunModels},
        {"health",
         "",
         "check the server's health (exit 0 SERVING, 3 NOT_SERVING)",
         "Runs the standard gRPC health check and prints SERVING or NOT_SERVING.",
         {{"service", "NAME", "service to check, e.g. fwserve.v1.Fwserve (default: the server)"}},
         RunHealth},
    };
    return list;
  }();
  return *commands;
}

std::string FormatOptions(const std::vector<OptionSpec>& options) {
  std::string text;
  for (const OptionSpec& option : options) {
    std::string left = "  --" + option.name;
    if (!option.value_name.empty()) absl::StrAppend(&left, " ", option.value_name);
    if (left.size() < 28) {
      left.resize(28, ' ');
    } else {
      left += "\n" + std::string(28, ' ');
    }
    // Wrap the help at 100 columns, continuation lines aligned with its start.
    std::istringstream words(option.help + (option.repeatable ? " (repeatable)" : ""));
    std::string word;
    size_t column = 28;
    bool first = true;
    while (words >> word) {
      if (!first && column + 1 + word.size() > 100) {
        left += "\n" + std::string(28, ' ');
        column = 28;
      } else if (!first) {
        left += " ";
        ++column;
      }
      left += word;
      column += word.size();
      first = false;
    }
    absl::StrAppend(&text, left, "\n");
  }
  return text;
}

const char kExitCodes[] =
    "Exit codes:\n"
    "  0    success\n"
    "  1    the server answered an error (its gRPC code, e.g. NOT_FOUND, UNAVAILABLE,\n"
    "       is printed on stderr), or a local file could not be read or written\n"
    "  2    usage error\n"
    "  3    health: the server is NOT_SERVING\n"
    "  130  interrupted (Ctrl-C)\n";

void PrintMainHelp() {
  std::string text =
      "fwctl: command-line client of fwserve (fwserve.v1 over gRPC).\n\n"
      "Usage: fwctl [GLOBAL OPTIONS] COMMAND [OPTIONS] [ARGS]\n\nCommands:\n";
  for (const CommandSpec& command : Commands()) {
    std::string left = "  " + command.name;
    left.resize(18, ' ');
    absl::StrAppend(&text, left, command.summary, "\n");
  }
  absl::StrAppend(&text, "\nGlobal options (before or after the command):\n",
                  FormatOptions(GlobalOptions()), "\n", kExitCodes,
                  "\nRun 'fwctl COMMAND --help' for a command's options and arguments.\n"
                  "Options may be spelled --name VALUE or --name=VALUE; '--' ends the options.\n");
  std::fputs(text.c_str(), stdout);
}

// Wraps `text` at 88 columns, keeping blank lines.
std::string Wrap(const std::string& text) {
  std::string out;
  std::istringstream paragraphs(text);
  std::string paragraph;
  while (std::getline(paragraphs, paragraph)) {
    std::istringstream words(paragraph);
    std::string word;
    size_t column = 0;
    while (words >> word) {
      if (column > 0 && column + 1 + word.size() > 88) {
        out += "\n";
        column = 0;
      } else if (column > 0) {
        out += " ";
        ++column;
      }
      out += word;
      column += word.size();
    }
    out += "\n";
  }
  return out;
}

void PrintCommandHelp(const CommandSpec& command) {
  std::string text =
      absl::StrCat("Usage: fwctl ", command.name, " [OPTIONS]", command.synopsis.empty() ? "" : " ",
                   command.synopsis, "\n\n", Wrap(command.details), "\n");
  if (!command.options.empty()) {
    absl::StrAppend(&text, "Options:\n", FormatOptions(command.options), "\n");
  }
  absl::StrAppend(&text, "Global options:\n", FormatOptions(GlobalOptions()), "\n", kExitCodes);
  std::fputs(text.c_str(), stdout);
}

const OptionSpec* FindOption(const std::vector<OptionSpec>& options, const std::string& name) {
  for (const OptionSpec& option : options) {
    if (option.name == name) return &option;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  Interrupts::Start();
  Args args;
  std::vector<std::string> words;  // the command's name words
  bool options_done = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!options_done && arg == "--") {
      options_done = true;
      continue;
    }
    const bool is_option = !options_done && arg.size() > 1 && arg[0] == '-' &&
                           !(arg.size() > 1 && std::isdigit(static_cast<unsigned char>(arg[1])));
    if (!is_option) {
      // The first words name the command ("session" takes a second word).
      if (args.command == nullptr) {
        words.push_back(arg);
        const std::string name = absl::StrJoin(words, " ");
        bool prefix_of_some = false;
        for (const CommandSpec& command : Commands()) {
          if (command.name == name) args.command = &command;
          if (command.name.rfind(name + " ", 0) == 0) prefix_of_some = true;
        }
        if (args.command == nullptr && !prefix_of_some) {
          if (name == "help") {
            words.clear();
            args.values["help"].push_back("");
            continue;
          }
          return UsageError(args, "unknown command '" + name + "'");
        }
        continue;
      }
      args.positional.push_back(arg);
      continue;
    }
    // An option: -h, --name, --name=value, --name value (underscores read as dashes).
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    std::string value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      has_value = true;
    }
    std::replace(name.begin(), name.end(), '_', '-');
    if (name == "h") name = "help";
    if (name == "v") name = "verbose";
    if (name == "q") name = "quiet";
    const OptionSpec* spec = FindOption(GlobalOptions(), name);
    if (spec == nullptr && args.command != nullptr) spec = FindOption(args.command->options, name);
    if (spec == nullptr) {
      return UsageError(
          args, "unknown option '" + arg + "'" +
                    (args.command == nullptr && !words.empty()
                         ? " (after an incomplete command '" + absl::StrJoin(words, " ") + "')"
                         : ""));
    }
    if (spec->value_name.empty()) {
      if (has_value) return UsageError(args, "--" + name + " takes no value");
    } else if (!has_value) {
      if (i + 1 >= argc) return UsageError(args, "--" + name + " needs a value");
      value = argv[++i];
    }
    // A repeatable option accumulates; otherwise the last value wins.
    if (!spec->repeatable) args.values[name].clear();
    args.values[name].push_back(value);
  }

  if (args.command == nullptr && !words.empty()) {
    if (args.Has("help")) {
      // e.g. `fwctl session --help`: the commands of that group.
      PrintMainHelp();
      return kExitOk;
    }
    std::vector<std::string> completions;
    for (const CommandSpec& command : Commands()) {
      if (command.name.rfind(words[0] + " ", 0) == 0) completions.push_back(command.name);
    }
    return UsageError(args, "incomplete command '" + absl::StrJoin(words, " ") +
                                "' (one of: " + absl::StrJoin(completions, ", ") + ")");
  }
  if (args.Has("help")) {
    if (args.command == nullptr) {
      PrintMainHelp();
    } else {
      PrintCommandHelp(*args.command);
    }
    return kExitOk;
  }
  if (args.command == nullptr) {
    PrintMainHelp();
    return kExitUsage;
  }
  if (auto options = ClientOptionsFrom(args); !options.ok()) {
    return UsageError(args, std::string(options.status().message()));
  }
  const int code = args.command->run(args);
  std::fflush(stdout);
  g_client.reset();
  return code;
}
