// /v1/responses (docs/http.md): its request fields (`input` items and
// `item_reference`s, `instructions`, `previous_response_id` or `conversation`, `store`)
// and its answer: the "response" object, named after the session it generated on
// ("resp_<session>"), and a stream of typed events (response.created ...
// response.completed, each with its sequence_number). Also the response object GET
// /v1/responses/{id} returns. Pure, torch-free; in fwserve_openai_api.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "server/transport/http/endpoint_protocol.h"
#include "server/transport/http/openai_api.h"

namespace fwserve {

// The ids the Responses API derives from a session id: a response "resp_<session>", a
// conversation "conv_<session>".
inline constexpr char kResponsePrefix[] = "resp_";
inline constexpr char kConversationPrefix[] = "conv_";

// ParseGenerateRequest for /v1/responses (its contract, openai_api.h).
absl::StatusOr<OpenAiGenerateRequest> ParseResponsesRequest(const nlohmann::json& body,
                                                            const ChatTemplate& chat_template,
                                                            int32_t default_max_tokens);

// The ids of the `item_reference` items of a Responses `input` (in order, unique).
std::vector<std::string> ItemReferences(const nlohmann::json& input);

// The prompt of a Responses request: its `instructions` as a system message, then its
// `input` (a string or items), references resolved by `references` (see RenderChat).
absl::StatusOr<std::string> RenderResponsesInput(const nlohmann::json& input,
                                                 const std::string& instructions,
                                                 const ChatTemplate& chat_template,
                                                 const ItemTexts* references);

// The one message of the response on `session_id`: its id is derived from the session,
// like the response's, so that GET /v1/responses/{id} names it as the POST did.
std::string ResponseMessageId(const std::string& session_id);

// The OpenAI response object of the response on `session_id` ("resp_<session>"), built
// the same way by POST /v1/responses (`request`: what it asked for) and by GET
// /v1/responses/{id} (`request` null: the request's parameters are not kept, and are
// null). A "completed" or "incomplete" response has one assistant message with `text`,
// whose status is the response's. Fields that do not change the output are echoed as
// the request sent them (docs/http.md, "Field policy").
nlohmann::json ResponseJson(const std::string& session_id, int64_t created_at,
                            const std::string& status, const std::string& model,
                            const std::string& text, const nlohmann::json& usage,
                            const OpenAiGenerateRequest* request);

// The protocol of one response (NewEndpointProtocol's arguments; the id suffix is
// unused). Its request's params.session_id must be set before the first rendering.
std::unique_ptr<EndpointProtocol> NewResponsesProtocol(std::string model, int64_t created);

}  // namespace fwserve
