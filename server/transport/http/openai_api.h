// The OpenAI-compatible request vocabulary shared by the endpoints: the request of
// /v1/completions, /v1/chat/completions and /v1/responses (OpenAiGenerateRequest, and
// ParseGenerateRequest, which hands each body to its endpoint's parser), the fields
// every endpoint reads alike, the chat template, the stop-string filter, OpenAI-shaped
// errors, server-sent events, and the pure steps of routing (the request target, its
// query, the metrics label). Each endpoint's own parse and rendering are in its file
// pair (endpoint_protocol.h lists them). Pure functions, no I/O (the seam of the
// http_request fuzz target, tests/fuzz). Torch-free; its own library, fwserve_openai_api.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/api/requests.h"
#include "server/transport/http/openai_structured.h"

namespace fwserve {

// An INVALID_ARGUMENT naming `field` (the error's "param").
absl::Status FieldError(absl::string_view field, absl::string_view message);
// `status` naming `field` as its "param" (any code, e.g. a NOT_FOUND of an input item).
absl::Status WithParam(absl::Status status, absl::string_view field);
// The "param" a status carries (FieldError, WithParam), or empty.
std::string ParamOf(const absl::Status& status);
// `status` with OpenAI's error "code" (e.g. "model_not_found"), which ErrorJson sends
// instead of the one it derives from the HTTP status.
absl::Status WithErrorCode(absl::Status status, absl::string_view code);

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

// The documented routes (docs/http.md): the one table the router and the metrics label
// read.
enum class RouteId {
  kPlayground,
  kHealth,
  kReady,
  kModels,
  kModel,
  kCompletions,
  kChatCompletions,
  kResponses,
  kResponse,
  kConversations,
  kConversation,
  kSessions,
  kSessionImport,
  kSession,
  kSessionFork,
  kSessionExport,
};
struct Route {
  RouteId id;
  // The path template, ids as {id} or {model} (e.g. "/fwserve/v1/sessions/{id}/export").
  const char* label;
  // The methods served ("GET", "POST", "DELETE"). HEAD is served wherever GET is, and
  // OPTIONS (the CORS preflight) on every path.
  std::vector<std::string> methods;
};
// The route `target`'s path names, or null (no route: 404).
const Route* MatchRoute(const RequestTarget& target);
// Whether `route` serves `method` (HEAD where GET is; OPTIONS everywhere).
bool RouteAllows(const Route& route, absl::string_view method);
// The Allow header of a 405 on `route`, e.g. "GET, HEAD, DELETE, OPTIONS".
std::string AllowHeader(const Route& route);

// The metrics label of a request: "`method` <route>", the route being MatchRoute's
// label, "(other)" for any other path. Whether the method fits the route is left to the
// router. Apart from `method` (the caller bounds it), the label is one of a fixed set: a
// client cannot grow the series set.
std::string RouteLabel(absl::string_view method, const RequestTarget& target);

// How chat messages become a prompt (docs/http.md). Each message renders as `message`
// with "{role}" (upper-cased, e.g. USER) and "{content}" substituted; then
// `generation_prompt` asks for the reply.
struct ChatTemplate {
  std::string message = "{role}:\n{content}\n\n";
  std::string generation_prompt = "ASSISTANT:\n";
  // End-of-turn markers: a chat or response without `stop` stops at them (none in the
  // default template).
  std::vector<std::string> stop;
};

// The template of a model: its config's optional "chat_template" object ({"message":
// ..., "generation_prompt": ...}), else the default above. Never fails: a malformed
// template is ignored.
ChatTemplate ChatTemplateOf(const std::string& config_json);

enum class OpenAiEndpoint { kCompletions, kChat, kResponses };

// Which API a message list belongs to (the keys and roles its messages may carry,
// docs/http.md): chat `messages`, or Responses `input` / conversation `items`.
enum class MessageList { kChat, kResponses };

// The text of the items that Responses `item_reference`s name, by item id.
using ItemTexts = std::map<std::string, std::string>;

// What a completions, chat or responses request asks for.
struct OpenAiGenerateRequest {
  GenerateParams params;  // prompt rendered (chat template for chat/responses)
  std::string model;      // as sent (empty: the default model)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions: logprobs == 0 asked (the sampled tokens' logprobs); chat: logprobs true.
  bool logprobs = false;
  // response_format / text.format and tools (openai_structured.h); FinishGenerateRequest
  // puts its grammar in params.constraint.
  StructuredOutput structured;
  // Responses only.
  std::string previous_response_id;  // "resp_<session>"
  std::string conversation;          // "conv_<session>"
  bool store = true;
  std::string instructions;
  // Responses: the `input` items as sent, and the ids its item_references name (in
  // order, unique). With references, `params.prompt` was rendered with each reference
  // as an empty assistant message; the caller resolves them and renders again with
  // RenderResponsesInput.
  nlohmann::json input;
  std::vector<std::string> item_references;
  // Fields that do not change the output, echoed in the answer in OpenAI's shape where
  // the API echoes them (docs/http.md, "Field policy"); null = not sent.
  nlohmann::json service_tier;         // chat, responses (echoed; "auto" as "default")
  nlohmann::json metadata;             // responses (echoed)
  nlohmann::json user;                 // responses (echoed)
  nlohmann::json prompt_cache_key;     // responses (echoed)
  nlohmann::json safety_identifier;    // responses (echoed)
  nlohmann::json parallel_tool_calls;  // responses (echoed)
};

// Parses and checks a request body for `endpoint` (ParseCompletionsRequest,
// ParseChatRequest, ParseResponsesRequest). Errors are INVALID_ARGUMENT naming the
// field (its "param"): wrong types, values we cannot honour (n > 1, best_of, echo,
// suffix, penalties, logit_bias, tools, non-text formats, top_logprobs > 0) and unknown
// fields; of several, the first in key order. `default_max_tokens` applies to chat and
// responses (completions: 16, as OpenAI). On chat, `max_completion_tokens` wins over the
// deprecated `max_tokens` when both are given.
absl::StatusOr<OpenAiGenerateRequest> ParseGenerateRequest(const nlohmann::json& body,
                                                           OpenAiEndpoint endpoint,
                                                           const ChatTemplate& chat_template,
                                                           int32_t default_max_tokens);

// --- Reading request fields (the endpoints' parsers share these) ---
// Errors are INVALID_ARGUMENT naming `field` (FieldError), quoting at most 64 bytes of
// the value sent.
// "'field' must be <expected>, got <value>".
absl::Status TypeError(const std::string& field, absl::string_view expected,
                       const nlohmann::json& value);
// "'field' = <value> is not supported by fwserve: <why>".
absl::Status Unsupported(const std::string& field, const nlohmann::json& value,
                         absl::string_view why);
absl::StatusOr<bool> GetBool(const std::string& field, const nlohmann::json& value);
absl::StatusOr<std::string> GetString(const std::string& field, const nlohmann::json& value);
// An integer: a JSON integer, or a float with no fraction (below 9e15 in magnitude).
absl::StatusOr<int64_t> GetInteger(const std::string& field, const nlohmann::json& value);
// A token count: an integer in [0, INT32_MAX].
absl::StatusOr<int32_t> GetTokens(const std::string& field, const nlohmann::json& value);
// Stop strings (`stop`): a string or an array of at most 4 strings, appended to `stop`
// (empty ones left out).
absl::Status ParseStop(const nlohmann::json& value, std::vector<std::string>* stop);

// An endpoint's own fields, for ParseGenerateFields: parses `key` = `value` (never null)
// into the request if the endpoint has that field (the status: OK or its error); nullopt
// if it has not (the field is then unknown).
using EndpointFields = std::function<std::optional<absl::Status>(
    const std::string& key, const nlohmann::json& value, OpenAiGenerateRequest* request)>;

// The shared part of an endpoint's parse: `body` must be an object; the request starts
// with a random seed and `max_tokens`; the fields every endpoint has (model, stream,
// stream_options, temperature, top_p, min_p, repetition_penalty, top_k, seed, n,
// best_of, presence_penalty, frequency_penalty, logit_bias, user) are read here, any
// other non-null one by `endpoint_fields`. The first error, in key order, is returned.
// `include_usage`: whether stream_options.include_usage is an option. The endpoint then
// checks what it requires and calls FinishGenerateRequest.
absl::StatusOr<OpenAiGenerateRequest> ParseGenerateFields(const nlohmann::json& body,
                                                          int32_t max_tokens, bool include_usage,
                                                          const EndpointFields& endpoint_fields);
// The checks after the endpoint's: stream_options.include_usage needs `stream`; the
// core's params.logprobs is the request's `logprobs`.
absl::Status FinishGenerateRequest(OpenAiGenerateRequest* request);
// The fields chat and responses share that do not change the output: `metadata`,
// `service_tier`, `prompt_cache_key` and `safety_identifier` (echoed),
// `parallel_tool_calls` (a boolean, echoed; one call at most is made). Nullopt for any
// other key. (`tools` and `tool_choice` are each endpoint's: openai_structured.h.)
std::optional<absl::Status> ParseEchoedField(const std::string& key, const nlohmann::json& value,
                                             OpenAiGenerateRequest* request);

// Renders chat messages ([{role, content}], content a string or an array of text
// parts) with `chat_template`; `field` names the array in errors ("messages", "input").
// With `add_generation_prompt`, the reply's prompt follows. `list` says which keys and
// roles a message may carry (docs/http.md). A Responses `item_reference` renders as an
// assistant message with `references`' text for its id; null `references` renders it
// empty, an id missing from non-null `references` is an error.
absl::StatusOr<std::string> RenderChat(const nlohmann::json& messages,
                                       const ChatTemplate& chat_template, absl::string_view field,
                                       bool add_generation_prompt = true,
                                       MessageList list = MessageList::kChat,
                                       const ItemTexts* references = nullptr);

// Whether `item` of a Responses input names an earlier item by id: {"type":
// "item_reference", "id"} (the type may be left out: an object with an id and no role
// or content).
bool IsItemReference(const nlohmann::json& item);

// `value` as the shortest decimal that reads back as the same float (0.8f echoes 0.8,
// not 0.800000011920929).
double EchoFloat(float value);

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

// --- Rendering answers ---
// One server-sent event's data line: "data: <value's JSON>\n\n".
std::string SseData(const nlohmann::json& value);

// Token i of `chunk` as the logprobs show it: the bytes it stands for (a byte-level
// token's byte, a world-vocabulary token's piece), as text and as byte values.
// (GenerateChunk::token_bytes, which the engine fills whenever logprobs are asked for.)
std::string TokenBytesAt(const GenerateChunk& chunk, size_t i);
nlohmann::json ByteValues(const std::string& bytes);

}  // namespace fwserve
