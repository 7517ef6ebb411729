#include "client/fwctl/stream.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/fwctl/cli.h"
#include "client/fwctl/interrupts.h"
#include "client/fwctl/io.h"

namespace fwctl {

namespace v1 = fwserve::v1;

void AddSamplingOptions(CLI::App& command, int64_t default_max_tokens, SamplingOptions* options) {
  options->max_tokens = default_max_tokens;
  AddInteger(command, "max-tokens", "N",
             absl::StrCat("tokens to generate; 0 = only absorb the prompt (default ",
                          default_max_tokens, ")"),
             0, INT32_MAX, &options->max_tokens);
  AddNumber(command, "temperature", "T", "0 = greedy; range [0, 100] (default: the server's, 1)",
            &options->temperature);
  AddInteger(command, "top-k", "K", "keep the K most likely tokens; 0 = off (default off)", 0,
             INT32_MAX, &options->top_k);
  AddNumber(command, "top-p", "P", "nucleus sampling; 0 or 1 = off (default off)", &options->top_p);
  AddNumber(command, "min-p", "P",
            "drop tokens below P times the top probability; 0 = off (default off)",
            &options->min_p);
  AddNumber(command, "repetition-penalty", "R",
            "penalize recently seen tokens; 0 or 1 = off (default off)",
            &options->repetition_penalty);
  AddInteger(command, "repetition-window", "N",
             "tokens looked back by --repetition-penalty (default 64)", 0, INT32_MAX,
             &options->repetition_window);
  AddUnsigned(command, "seed", "S", "sampling seed: same seed, same output (default random)",
              &options->seed);
  AddRepeatableText(command, "stop", "TEXT",
                    "stop once the output ends with TEXT (included in the output); C escapes "
                    "\\n \\t \\\\ are understood",
                    &options->stop);
}

void FillGenerateRequest(const SamplingOptions& options, v1::GenerateRequest* request) {
  request->set_max_tokens(static_cast<int32_t>(options.max_tokens));
  v1::SamplingParams* sampling = request->mutable_sampling();
  if (options.temperature.has_value()) sampling->set_temperature(*options.temperature);
  if (options.top_p.has_value()) sampling->set_top_p(*options.top_p);
  if (options.min_p.has_value()) sampling->set_min_p(*options.min_p);
  if (options.repetition_penalty.has_value()) {
    sampling->set_repetition_penalty(*options.repetition_penalty);
  }
  sampling->set_top_k(static_cast<int32_t>(options.top_k));
  sampling->set_repetition_window(static_cast<int32_t>(options.repetition_window));
  if (options.seed.has_value()) sampling->set_seed(*options.seed);
  for (const std::string& stop : options.stop) request->add_stop(UnescapeC(stop));
}

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

namespace {

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

}  // namespace

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

absl::StatusOr<v1::SessionInfo> WaitUntilIdle(fwserve::Client& client,
                                              const std::string& session_id,
                                              absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    auto info = client.GetSession(session_id);
    if (!info.ok() || !info->busy() || absl::Now() >= end) return info;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace fwctl
