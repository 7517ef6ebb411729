// /v1/chat/completions (docs/http.md): its request fields (`messages` rendered with the
// model's chat template, boolean `logprobs`, `max_completion_tokens` over `max_tokens`)
// and its answer ("chat.completion" objects with choices[].message; a stream of
// "chat.completion.chunk"s with choices[].delta, opened by the assistant's role, ending
// in "data: [DONE]"). A chat without a session may continue a conversation the server
// kept (docs/http.md "Replayed histories"). Pure, torch-free; in fwserve_openai_api.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "server/transport/http/endpoint_protocol.h"
#include "server/transport/http/openai_api.h"

namespace fwserve {

// ParseGenerateRequest for /v1/chat/completions (its contract, openai_api.h).
absl::StatusOr<OpenAiGenerateRequest> ParseChatRequest(const nlohmann::json& body,
                                                       const ChatTemplate& chat_template,
                                                       int32_t default_max_tokens);

// The protocol of one chat completion (NewEndpointProtocol's arguments).
std::unique_ptr<EndpointProtocol> NewChatProtocol(std::string model, int64_t created,
                                                  std::string id_suffix);

}  // namespace fwserve
