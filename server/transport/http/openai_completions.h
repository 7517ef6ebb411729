// /v1/completions (docs/http.md): its request fields (a `prompt`, integer `logprobs`,
// `echo` and `suffix` refused, 16 tokens unless told) and its answer
// ("text_completion" objects with choices[].text; a stream of such chunks ending in
// "data: [DONE]"). Pure, torch-free; in fwserve_openai_api.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "server/transport/http/endpoint_protocol.h"
#include "server/transport/http/openai_api.h"

namespace fwserve {

// ParseGenerateRequest for /v1/completions (its contract, openai_api.h).
absl::StatusOr<OpenAiGenerateRequest> ParseCompletionsRequest(const nlohmann::json& body);

// The protocol of one completion (NewEndpointProtocol's arguments).
std::unique_ptr<EndpointProtocol> NewCompletionsProtocol(std::string model, int64_t created,
                                                         std::string id_suffix);

}  // namespace fwserve
