// What one OpenAI generate endpoint does its own way (docs/http.md): the adjustments to
// the core's GenerateParams, the usage block, the answer's body, and a stream's opening,
// delta, closing and error events. The HTTP server's GenerateJob (http_generate.cc)
// runs one generation for any endpoint through this interface; each endpoint's file
// pair holds its parse and its rendering: openai_completions.h (/v1/completions),
// openai_chat.h (/v1/chat/completions), openai_responses.h (/v1/responses). Pure (no
// I/O), torch-free; in fwserve_openai_api.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "server/api/requests.h"
#include "server/transport/http/openai_api.h"

namespace fwserve {

// How a generation ended, as its answer shows it.
struct GenerateOutcome {
  // The answer's text: everything sent, the stop string and what follows it cut.
  std::string text;
  FinishReason reason = FinishReason::kLength;
  // A stop string of the request ended the text.
  bool stopped = false;
  // The endpoint's usage block (EndpointProtocol::Usage).
  nlohmann::json usage;
  // Every sampled token with its logprob and bytes; filled only when the request asked
  // for logprobs.
  GenerateChunk tokens;

  // OpenAI's finish_reason: "stop" after a stop string, else FinishReasonName's.
  const char* finish_reason() const { return stopped ? "stop" : FinishReasonName(reason); }
};

// The token counts of a usage block, by OpenAI's rule: the input counts the cached
// tokens (the state the session held before the request) and the new ones; the total
// is input plus output.
struct UsageCounts {
  int64_t cached = 0;
  int64_t input = 0;
  int64_t output = 0;
  int64_t total = 0;
};
UsageCounts CountUsage(const GenerateSummary& summary);
// The usage block of chat and completions: prompt_tokens, completion_tokens,
// total_tokens and prompt_tokens_details.cached_tokens (CountUsage's counts).
nlohmann::json ChoiceUsage(const GenerateSummary& summary);

// One answer's protocol: made per generation (NewEndpointProtocol), used on the
// connection's strand only (not thread-safe). The `request` each call takes is the
// request being answered; its params.session_id is the session generated on once that
// is known (a response names itself after it).
class EndpointProtocol {
 public:
  virtual ~EndpointProtocol() = default;

  // The core's parameters for `request`, adjusted before StartGenerate: `params` comes
  // as request.params with the model the request named.
  virtual void AdjustParams(const OpenAiGenerateRequest& request, GenerateParams* params) const = 0;

  // The usage block of a finished generation.
  virtual nlohmann::json Usage(const GenerateSummary& summary) const = 0;

  // The answer of a finished generation: the body of a non-streamed 200, and what a
  // stream's closing events carry.
  virtual nlohmann::json Body(const OpenAiGenerateRequest& request,
                              const GenerateOutcome& outcome) const = 0;

  // Server-sent events, each string whole events ("data: ...\n\n" or "event: ...\n"
  // + data), in the order a stream sends them:
  // the events before any text (may be empty);
  virtual std::string StreamOpening(const OpenAiGenerateRequest& request) = 0;
  // `text` as a delta; `chunk` is the engine's chunk it came from (its tokens' logprobs
  // when the request asked for them), null for text released at the end;
  virtual std::string StreamDelta(const OpenAiGenerateRequest& request, const std::string& text,
                                  const GenerateChunk* chunk) = 0;
  // the events after the last delta (`body`: Body's for `outcome`);
  virtual std::string StreamClosing(const OpenAiGenerateRequest& request,
                                    const GenerateOutcome& outcome, const nlohmann::json& body) = 0;
  // or, in their place, the event of a failure (`error`: ErrorJson's object).
  virtual std::string StreamError(const nlohmann::json& error) = 0;

  // Several choices (GenerateParams::choices > 1; chat and completions): each choice has
  // its own protocol, which renders its choice as `index` of the answer; only the last
  // choice's closing events end the stream (the usage chunk and "data: [DONE]").
  void set_choice(int32_t index, bool closes_stream) {
    choice_index_ = index;
    closes_stream_ = closes_stream;
  }
  int32_t choice_index() const { return choice_index_; }
  bool closes_stream() const { return closes_stream_; }

 private:
  int32_t choice_index_ = 0;
  bool closes_stream_ = true;
};

// A chat or completions stream chunk: {id, object, created, model, one choice (`index`,
// `logprobs`, no finish reason yet) whose `field` ("delta" or "text") is `value`}, and
// "usage": null when the request asked for usage (the closing chunk carries it).
nlohmann::json ChoiceChunk(const OpenAiGenerateRequest& request, const std::string& id,
                           const char* object, int64_t created, const std::string& model,
                           const char* field, nlohmann::json value, const nlohmann::json& logprobs,
                           int32_t index = 0);

// The closing events of a chat or completions choice: `last` (a chunk with one choice,
// given `finish_reason`, else the outcome's finish reason); then, when `closes_stream`
// (the last choice), `usage_chunk` with no choices and the usage when the request asked
// for usage, and "data: [DONE]".
std::string ChoiceStreamClosing(const OpenAiGenerateRequest& request,
                                const GenerateOutcome& outcome, nlohmann::json last,
                                nlohmann::json usage_chunk, const char* finish_reason = nullptr,
                                bool closes_stream = true);

// The protocol of one answer of `endpoint`, on the model named `model` (as answers show
// it), created at `created` (Unix seconds). `id_suffix` makes the ids of completions and
// chat answers ("cmpl-<suffix>", "chatcmpl-<suffix>"); a response is named after its
// session instead.
std::unique_ptr<EndpointProtocol> NewEndpointProtocol(OpenAiEndpoint endpoint, std::string model,
                                                      int64_t created, std::string id_suffix);

}  // namespace fwserve
