#include "server/transport/http/endpoint_protocol.h"

#include <algorithm>
#include <utility>

#include "server/transport/http/openai_chat.h"
#include "server/transport/http/openai_completions.h"
#include "server/transport/http/openai_responses.h"

namespace fwserve {

UsageCounts CountUsage(const GenerateSummary& summary) {
  UsageCounts u;
  u.cached = std::max<int64_t>(
      0, summary.session_tokens - summary.prompt_tokens - summary.generated_tokens);
  u.input = u.cached + summary.prompt_tokens;
  u.output = summary.generated_tokens;
  u.total = u.input + u.output;
  return u;
}

nlohmann::json ChoiceUsage(const GenerateSummary& summary) {
  const UsageCounts u = CountUsage(summary);
  return {{"prompt_tokens", u.input},
          {"completion_tokens", u.output},
          {"total_tokens", u.total},
          {"prompt_tokens_details", {{"cached_tokens", u.cached}}}};
}

std::unique_ptr<EndpointProtocol> NewEndpointProtocol(OpenAiEndpoint endpoint, std::string model,
                                                      int64_t created, std::string id_suffix) {
  switch (endpoint) {
    case OpenAiEndpoint::kCompletions:
      return NewCompletionsProtocol(std::move(model), created, std::move(id_suffix));
    case OpenAiEndpoint::kChat:
      return NewChatProtocol(std::move(model), created, std::move(id_suffix));
    case OpenAiEndpoint::kResponses:
      break;
  }
  return NewResponsesProtocol(std::move(model), created);
}

nlohmann::json ChoiceChunk(const OpenAiGenerateRequest& request, const std::string& id,
                           const char* object, int64_t created, const std::string& model,
                           const char* field, nlohmann::json value,
                           const nlohmann::json& logprobs, int32_t index) {
  nlohmann::json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", nullptr}};
  choice[field] = std::move(value);
  nlohmann::json chunk = {{"id", id},
                          {"object", object},
                          {"created", created},
                          {"model", model},
                          {"choices", nlohmann::json::array({choice})}};
  if (request.include_usage) chunk["usage"] = nullptr;
  return chunk;
}

std::string ChoiceStreamClosing(const OpenAiGenerateRequest& request,
                                const GenerateOutcome& outcome, nlohmann::json last,
                                nlohmann::json usage_chunk, const char* finish_reason,
                                bool closes_stream) {
  last["choices"][0]["finish_reason"] =
      finish_reason != nullptr ? finish_reason : outcome.finish_reason();
  std::string events = SseData(last);
  if (!closes_stream) return events;
  if (request.include_usage) {
    usage_chunk["choices"] = nlohmann::json::array();
    usage_chunk["usage"] = outcome.usage;
    events += SseData(usage_chunk);
  }
  events += "data: [DONE]\n\n";
  return events;
}

}  // namespace fwserve
