// The OpenAI-compatible request vocabulary: JSON bodies of /v1/completions,
// /v1/chat/completions and /v1/responses mapped to the core's GenerateParams, the chat
// template, the stop-string filter, OpenAI-shaped errors, and the pure steps of routing
// (the request target, its query, the Authorization header, the metrics label). Pure
// functions, no I/O (the seam of the http_request fuzz target, tests/fuzz). Torch-free;
// its own library, fwserve_openai_api.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/api/requests.h"

namespace fwserve {

// An INVALID_ARGUMENT naming `field` (the error's "param").
absl::Status FieldError(absl::string_view field, absl::string_view message);
// The "param" a status carries (FieldError), or empty.
std::string ParamOf(const absl::Status& status);

// The one mapping from a status to an HTTP status code: OK 200; INVALID_ARGUMENT,
// FAILED_PRECONDITION and OUT_OF_RANGE 400; UNAUTHENTICATED 401; PERMISSION_DENIED 403;
// NOT_FOUND 404; ABORTED (session busy) and ALREADY_EXISTS 409; RESOURCE_EXHAUSTED 429;
// CANCELLED 499; UNIMPLEMENTED 501; UNAVAILABLE 503; DEADLINE_EXCEEDED 504; anything
// else 500.
int HttpStatusOf(const absl::Status& status);

// {"error": {"message", "type", "param", "code"}} (all four present; param and code may
// be null). `http_status` picks the type (e.g. 401 authentication_error).
nlohmann::json ErrorJson(const absl::Status& status, int http_status);

// The JSON text of `value`; invalid UTF-8 is replaced by U+FFFD, never thrown on.
// Recursive: only for values whose nesting the server bounds (client-supplied values
// reach error messages through a depth-bounded rendering instead).
std::string Dump(const nlohmann::json& value);

// A request body as a JSON object (an empty body is {} when `empty_ok`). Errors are
// INVALID_ARGUMENT with no param (400): not JSON, or not an object.
absl::StatusOr<nlohmann::json> ParseBody(const std::string& body, bool empty_ok);

// A request target ("/v1/x?k=v") as the router reads it.
struct RequestTarget {
  // Before the first '?', trailing slashes removed ("/" stays "/").
  std::string path;
  // After the first '?' (empty without one), not decoded.
  std::string query;
  // The non-empty '/'-separated segments of `path` (routing uses these: "/v1//models"
  // is /v1/models).
  std::vector<std::string> parts;
};
RequestTarget SplitTarget(absl::string_view target);

// The query's '&'-separated "key=value" pairs (no '=': an empty value), '+' and %XX
// decoded (a '%' without two hex digits stays); a repeated key keeps its last value.
std::map<std::string, std::string> ParseQuery(absl::string_view query);

// The metrics label of a request: "`method` <route>", the route being the template of
// the documented route the path names, ids as {id} or {model} (e.g. "GET
// /fwserve/v1/sessions/{id}/export"), "(other)" for any other path. Whether the method
// fits the route is left to the router. Apart from `method` (the caller bounds it), the
// label is one of a fixed set: a client cannot grow the series set.
std::string RouteLabel(absl::string_view method, const RequestTarget& target);

// How chat messages become a prompt (docs/http.md). Each message renders as `message`
// with "{role}" (upper-cased, e.g. USER) and "{content}" substituted; then
// `generation_prompt` asks for the reply.
struct ChatTemplate {
  std::string message = "{role}:\n{content}\n\n";
  std::string generation_prompt = "ASSISTANT:\n";
};

// The template of a model: its config's optional "chat_template" object ({"message":
// ..., "generation_prompt": ...}), else the default above. Never fails: a malformed
// template is ignored.
ChatTemplate ChatTemplateOf(const std::string& config_json);

enum class OpenAiEndpoint { kCompletions, kChat, kResponses };

// What a completions, chat or responses request asks for.
struct OpenAiGenerateRequest {
  GenerateParams params;  // prompt rendered (chat template for chat/responses)
  std::string model;      // as sent (empty: the default model)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions: logprobs == 0 asked (the sampled tokens' logprobs); chat: logprobs true.
  bool logprobs = false;
  // Responses only.
  std::string previous_response_id;  // "resp_<session>"
  std::string conversation;          // "conv_<session>"
  bool store = true;
  std::string instructions;
};

// Parses and checks a request body. Errors are INVALID_ARGUMENT naming the field (its
// "param"): wrong types, values we cannot honour (n > 1, best_of, echo, suffix,
// penalties, logit_bias, tools, non-text formats, top_logprobs > 0) and unknown fields.
// `default_max_tokens` applies to chat and responses (completions: 16, as OpenAI).
absl::StatusOr<OpenAiGenerateRequest> ParseGenerateRequest(const nlohmann::json& body,
                                                           OpenAiEndpoint endpoint,
                                                           const ChatTemplate& chat_template,
                                                           int32_t default_max_tokens);

// Renders chat messages ([{role, content}], content a string or an array of text
// parts) with `chat_template`; `field` names the array in errors ("messages", "input").
// With `add_generation_prompt`, the reply's prompt follows.
absl::StatusOr<std::string> RenderChat(const nlohmann::json& messages,
                                       const ChatTemplate& chat_template, absl::string_view field,
                                       bool add_generation_prompt = true);

// Strips stop strings from streamed text as OpenAI does: text that could be the start
// of a stop string is held back until it is known not to be; the stop string and
// anything after it are never emitted (the session keeps them).
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stop) : stop_(std::move(stop)) {}
  // The text that may be sent now.
  std::string Push(absl::string_view text);
  // At the end of the stream: what was held back (nothing once a stop string matched).
  std::string Finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stop_;
  std::string held_;
  bool stopped_ = false;
};

// The finish_reason OpenAI clients expect: "stop" (a stop string), "length" (max
// tokens; also cancel and shutdown, which end the text early).
const char* FinishReasonName(FinishReason reason);

}  // namespace fwserve
