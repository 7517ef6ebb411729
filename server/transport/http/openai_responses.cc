#include "server/transport/http/openai_responses.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

// The fields /v1/responses has beyond the shared ones; `input` is kept for after the
// loop (it renders with `instructions`, which may come later).
std::optional<absl::Status> ParseResponsesField(const std::string& key, const json& v,
                                                OpenAiGenerateRequest* out, const json** input) {
  GenerateParams& p = out->params;
  auto set_string = [&](std::string* target) {
    absl::StatusOr<std::string> s = GetString(key, v);
    if (s.ok()) *target = std::move(*s);
    return s.status();
  };
  auto must_be = [&](const json& expected, absl::string_view why) {
    return v == expected ? absl::OkStatus() : Unsupported(key, v, why);
  };
  if (key == "max_output_tokens") {
    absl::StatusOr<int32_t> n = GetTokens(key, v);
    if (n.ok()) p.max_tokens = *n;
    return n.status();
  }
  if (std::optional<absl::Status> shared = ParseEchoedField(key, v, out); shared.has_value()) {
    return shared;
  }
  if (key == "store") {
    absl::StatusOr<bool> b = GetBool(key, v);
    if (b.ok()) out->store = *b;
    return b.status();
  }
  if (key == "input") {
    *input = &v;
    return absl::OkStatus();
  }
  if (key == "instructions") return set_string(&out->instructions);
  if (key == "previous_response_id") return set_string(&out->previous_response_id);
  if (key == "conversation") {
    if (v.is_object() && v.contains("id")) {
      absl::Status error = GetString("conversation.id", v["id"]).status();
      if (error.ok()) out->conversation = v["id"].get<std::string>();
      return error;
    }
    return set_string(&out->conversation);
  }
  if (key == "text") return ParseTextField(v, &out->structured);
  if (key == "tools") return ParseTools(v, ToolApi::kResponses, &out->structured);
  if (key == "tool_choice") return ParseToolChoice(v, ToolApi::kResponses, &out->structured);
  if (key == "truncation") return must_be("disabled", "a recurrent state is never truncated");
  if (key == "background" || key == "include" || key == "reasoning") {
    return (v == false || (v.is_array() && v.empty()) || (v.is_object() && v.empty()))
               ? absl::OkStatus()
               : Unsupported(key, v, "not supported");
  }
  return std::nullopt;
}

class ResponsesProtocol final : public EndpointProtocol {
 public:
  ResponsesProtocol(std::string model, int64_t created)
      : model_(std::move(model)), created_(created) {}

  // On a session (the conversation's, or a fork of the previous response's), the
  // session's model.
  void AdjustParams(const OpenAiGenerateRequest& request, GenerateParams* params) const override {
    if (!request.params.session_id.empty() || !request.params.fork_from.empty()) {
      params->model.clear();
    }
  }

  json Usage(const GenerateSummary& summary) const override {
    const UsageCounts u = CountUsage(summary);
    return {{"input_tokens", u.input},
            {"input_tokens_details", {{"cached_tokens", u.cached}}},
            {"output_tokens", u.output},
            {"output_tokens_details", {{"reasoning_tokens", 0}}},
            {"total_tokens", u.total}};
  }

  json Body(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome) const override {
    const bool incomplete = outcome.reason == FinishReason::kLength && !outcome.stopped;
    json out =
        ResponseJson(request.params.session_id, created_, incomplete ? "incomplete" : "completed",
                     model_, outcome.text, outcome.usage, &request);
    if (incomplete) out["incomplete_details"] = {{"reason", "max_output_tokens"}};
    return out;
  }

  std::string StreamOpening(const OpenAiGenerateRequest& request) override {
    const std::string message_id = ResponseMessageId(request.params.session_id);
    json in_progress = ResponseJson(request.params.session_id, created_, "in_progress", model_, "",
                                    nullptr, &request);
    std::string data = Event("response.created", {{"response", in_progress}});
    data += Event("response.in_progress", {{"response", in_progress}});
    data += Event("response.output_item.added", {{"output_index", 0},
                                                 {"item",
                                                  {{"type", "message"},
                                                   {"id", message_id},
                                                   {"status", "in_progress"},
                                                   {"role", "assistant"},
                                                   {"content", json::array()}}}});
    data +=
        Event("response.content_part.added",
              {{"item_id", message_id},
               {"output_index", 0},
               {"content_index", 0},
               {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}});
    return data;
  }

  std::string StreamDelta(const OpenAiGenerateRequest& request, const std::string& text,
                          const GenerateChunk*) override {
    return Event("response.output_text.delta",
                 {{"item_id", ResponseMessageId(request.params.session_id)},
                  {"output_index", 0},
                  {"content_index", 0},
                  {"delta", text},
                  {"logprobs", json::array()}});
  }

  std::string StreamClosing(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome,
                            const json& body) override {
    const std::string message_id = ResponseMessageId(request.params.session_id);
    std::string events = Event("response.output_text.done", {{"item_id", message_id},
                                                             {"output_index", 0},
                                                             {"content_index", 0},
                                                             {"text", outcome.text},
                                                             {"logprobs", json::array()}});
    const json& item = body["output"][0];
    events += Event("response.content_part.done", {{"item_id", message_id},
                                                   {"output_index", 0},
                                                   {"content_index", 0},
                                                   {"part", item["content"][0]}});
    events += Event("response.output_item.done", {{"output_index", 0}, {"item", item}});
    events += Event(body["status"] == "completed" ? "response.completed" : "response.incomplete",
                    {{"response", body}});
    return events;
  }

  std::string StreamError(const json& error) override {
    const json& e = error["error"];
    return Event("error", {{"code", e["code"]}, {"message", e["message"]}, {"param", e["param"]}});
  }

 private:
  // One event of the stream, numbered.
  std::string Event(const char* type, json data) {
    data["type"] = type;
    data["sequence_number"] = sequence_number_++;
    return absl::StrCat("event: ", type, "\n", SseData(data));
  }

  const std::string model_;
  const int64_t created_;
  int64_t sequence_number_ = 0;
};

}  // namespace

std::vector<std::string> ItemReferences(const json& input) {
  std::vector<std::string> ids;
  if (!input.is_array()) return ids;
  for (const json& item : input) {
    if (!IsItemReference(item)) continue;
    auto id = item.find("id");
    if (id == item.end() || !id->is_string()) continue;
    const std::string text = id->get<std::string>();
    if (std::find(ids.begin(), ids.end(), text) == ids.end()) ids.push_back(text);
  }
  return ids;
}

absl::StatusOr<std::string> RenderResponsesInput(const json& input, const std::string& instructions,
                                                 const ChatTemplate& chat_template,
                                                 const ItemTexts* references) {
  std::string prompt;
  if (!instructions.empty()) {
    absl::StatusOr<std::string> system =
        RenderChat(json::array({{{"role", "system"}, {"content", instructions}}}), chat_template,
                   "instructions", false, MessageList::kResponses);
    if (!system.ok()) return system.status();
    prompt = *system;
  }
  absl::StatusOr<std::string> rendered =
      input.is_string()
          ? RenderChat(json::array({{{"role", "user"}, {"content", input}}}), chat_template,
                       "input", true, MessageList::kResponses)
          : RenderChat(input, chat_template, "input", true, MessageList::kResponses, references);
  if (!rendered.ok()) return rendered.status();
  return prompt + *rendered;
}

absl::StatusOr<OpenAiGenerateRequest> ParseResponsesRequest(const json& body,
                                                            const ChatTemplate& chat_template,
                                                            int32_t default_max_tokens) {
  const json* input = nullptr;
  absl::StatusOr<OpenAiGenerateRequest> out = ParseGenerateFields(
      body, default_max_tokens, /*include_usage=*/false,
      [&](const std::string& key, const json& v, OpenAiGenerateRequest* request) {
        return ParseResponsesField(key, v, request, &input);
      });
  if (!out.ok()) return out;
  if (input == nullptr) return FieldError("input", "'input' is required");
  // References render empty here (this checks every item); the caller resolves them.
  absl::StatusOr<std::string> prompt =
      RenderResponsesInput(*input, out->instructions, chat_template, nullptr);
  if (!prompt.ok()) return prompt.status();
  out->params.prompt = std::move(*prompt);
  out->input = *input;
  out->item_references = ItemReferences(*input);
  if (!out->previous_response_id.empty() && !out->conversation.empty()) {
    return FieldError("conversation", "give 'previous_response_id' or 'conversation', not both");
  }
  if (absl::Status finished = FinishGenerateRequest(&*out); !finished.ok()) return finished;
  if (out->structured.forced_tool_call) {
    return Unsupported("tool_choice", body["tool_choice"],
                       "tool calls are served on /v1/chat/completions, not on responses yet");
  }
  // A turn ends at the template's end-of-turn marker (`stop` is no Responses field; a
  // body naming it null keeps none); a constrained reply ends where its JSON does (the
  // marker could only cut it).
  if (!body.contains("stop") && out->params.constraint == nullptr) {
    out->params.stop = chat_template.stop;
  }
  return out;
}

std::string ResponseMessageId(const std::string& session_id) { return "msg_" + session_id; }

json ResponseJson(const std::string& session_id, int64_t created_at, const std::string& status,
                  const std::string& model, const std::string& text, const json& usage,
                  const OpenAiGenerateRequest* request) {
  json output = json::array();
  if (status == "completed" || status == "incomplete") {
    output.push_back({{"type", "message"},
                      {"id", ResponseMessageId(session_id)},
                      {"status", status},
                      {"role", "assistant"},
                      {"content", json::array({{{"type", "output_text"},
                                                {"text", text},
                                                {"annotations", json::array()},
                                                {"logprobs", json::array()}}})}});
  }
  json r = {
      {"id", kResponsePrefix + session_id},
      {"object", "response"},
      {"created_at", created_at},
      {"status", status},
      {"error", nullptr},
      {"incomplete_details", nullptr},
      {"instructions", request == nullptr || request->instructions.empty()
                           ? json(nullptr)
                           : json(request->instructions)},
      {"max_output_tokens", request != nullptr ? json(request->params.max_tokens) : json(nullptr)},
      {"model", model},
      {"output", output},
      {"parallel_tool_calls", request != nullptr && request->parallel_tool_calls.is_boolean()
                                  ? request->parallel_tool_calls
                                  : json(false)},
      {"previous_response_id", request == nullptr || request->previous_response_id.empty()
                                   ? json(nullptr)
                                   : json(request->previous_response_id)},
      {"store", request == nullptr || request->store},
      {"temperature",
       request != nullptr ? json(EchoFloat(request->params.sampling.temperature)) : json(nullptr)},
      {"top_p",
       request != nullptr ? json(EchoFloat(request->params.sampling.top_p)) : json(nullptr)},
      {"service_tier", request != nullptr && !request->service_tier.is_null()
                           ? request->service_tier
                           : json("default")},
      {"user", request != nullptr ? request->user : json(nullptr)},
      {"prompt_cache_key", request != nullptr ? request->prompt_cache_key : json(nullptr)},
      {"safety_identifier", request != nullptr ? request->safety_identifier : json(nullptr)},
      {"text", {{"format", {{"type", "text"}}}}},
      {"tool_choice", "none"},
      {"tools", json::array()},
      {"truncation", "disabled"},
      {"usage", usage},
      {"metadata",
       request != nullptr && request->metadata.is_object() ? request->metadata : json::object()}};
  if (request != nullptr && !request->conversation.empty()) {
    r["conversation"] = {{"id", kConversationPrefix + session_id}};
  }
  return r;
}

std::unique_ptr<EndpointProtocol> NewResponsesProtocol(std::string model, int64_t created) {
  return std::make_unique<ResponsesProtocol>(std::move(model), created);
}

}  // namespace fwserve
