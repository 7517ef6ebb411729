// What generate and chat share: the sampling options, and running one Generate stream
// with its output on stdout, cancelled by Ctrl-C.
#ifndef FWSERVE_CLIENT_FWCTL_STREAM_H_
#define FWSERVE_CLIENT_FWCTL_STREAM_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace fwctl {

// --max-tokens, the sampling parameters and --stop. Unset parameters are left to the
// server.
struct SamplingOptions {
  int64_t max_tokens = 0;
  std::optional<float> temperature;
  int64_t top_k = 0;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  int64_t repetition_window = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;  // as given (C escapes not yet replaced)
};

// Adds the sampling options to `command`, bound to `options` (which must outlive it);
// --max-tokens defaults to `default_max_tokens`.
void AddSamplingOptions(CLI::App& command, int64_t default_max_tokens, SamplingOptions* options);

// Sets the request's max_tokens, sampling and stop texts.
void FillGenerateRequest(const SamplingOptions& options, fwserve::v1::GenerateRequest* request);

struct StreamOutcome {
  absl::Status status;
  bool interrupted = false;  // a SIGINT came while the stream ran
  int64_t generated = 0;     // tokens received
  std::string text;
  fwserve::v1::GenerateResponse last;  // carries finish_reason and usage when complete
  std::vector<int64_t> token_ids;      // with request.logprobs()
  std::vector<float> logprobs;         // with request.logprobs()
  absl::Duration time_to_first_token = absl::ZeroDuration();
  absl::Duration elapsed = absl::ZeroDuration();
};

// Runs one Generate, writing the text (or with `json_lines` each message as a JSON line)
// to stdout as it arrives. A SIGINT while it runs cancels the stream (and only that).
StreamOutcome StreamGenerate(fwserve::Client& client, const fwserve::v1::GenerateRequest& request,
                             bool json_lines);

// "[finish: REASON; prompt P, generated G, session S tokens]" on stderr; with `verbose`
// also the time to the first token, the time in all and tokens/s.
void PrintSummary(const StreamOutcome& outcome, bool verbose);

// A table on stderr: each generated token's index, id, log-probability and byte.
void PrintLogprobs(const StreamOutcome& outcome);

// Waits (up to `timeout`) until the server no longer holds the session for a request
// (after a cancelled stream it lets go within moments). Returns its last info.
absl::StatusOr<fwserve::v1::SessionInfo> WaitUntilIdle(fwserve::Client& client,
                                                       const std::string& session_id,
                                                       absl::Duration timeout = absl::Seconds(10));

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_STREAM_H_
