#include "server/transport/http/openai_chat.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

// What parsing a chat request keeps beside the request.
struct ChatFields {
  bool have_prompt = false;
  // max_completion_tokens wins over the deprecated max_tokens.
  std::optional<int32_t> max_tokens, max_completion_tokens;
};

// The fields /v1/chat/completions has beyond the shared ones.
std::optional<absl::Status> ParseChatField(const std::string& key, const json& v,
                                           const ChatTemplate& chat_template,
                                           OpenAiGenerateRequest* out, ChatFields* fields) {
  GenerateParams& p = out->params;
  auto must_be = [&](const json& expected, absl::string_view why) {
    return v == expected ? absl::OkStatus() : Unsupported(key, v, why);
  };
  if (key == "max_tokens" || key == "max_completion_tokens") {
    absl::StatusOr<int32_t> n = GetTokens(key, v);
    if (n.ok())
      (key == "max_completion_tokens" ? fields->max_completion_tokens : fields->max_tokens) = *n;
    return n.status();
  }
  if (key == "stop") return ParseStop(v, &p.stop);
  if (std::optional<absl::Status> shared = ParseEchoedField(key, v, out); shared.has_value()) {
    return shared;
  }
  if (key == "modalities") return must_be(json::array({"text"}), "text output only");
  if (key == "session_id") {  // extension
    absl::StatusOr<std::string> s = GetString(key, v);
    if (s.ok()) p.session_id = std::move(*s);
    return s.status();
  }
  if (key == "messages") {
    absl::StatusOr<std::string> prompt = RenderChat(v, chat_template, "messages");
    if (prompt.ok()) p.prompt = std::move(*prompt);
    fields->have_prompt = prompt.ok();
    return prompt.status();
  }
  if (key == "logprobs") {
    absl::StatusOr<bool> b = GetBool(key, v);
    if (b.ok()) out->logprobs = *b;
    return b.status();
  }
  if (key == "top_logprobs") {
    absl::StatusOr<int64_t> n = GetInteger(key, v);
    if (!n.ok()) return n.status();
    if (*n < 0 || *n > GenerateParams::kMaxTopLogprobs) {
      return FieldError(key, absl::StrCat("'top_logprobs' must be in [0, ",
                                          GenerateParams::kMaxTopLogprobs, "], got ", *n));
    }
    p.top_logprobs = static_cast<int32_t>(*n);
    return absl::OkStatus();
  }
  if (key == "store") {
    // Whether OpenAI keeps the completion for its dashboard; nothing is kept here either
    // way (state lives in sessions: 'session_id').
    return GetBool(key, v).status();
  }
  if (key == "response_format") return ParseResponseFormat(v, &out->structured);
  if (key == "tools") return ParseTools(v, ToolApi::kChat, &out->structured);
  if (key == "tool_choice") return ParseToolChoice(v, ToolApi::kChat, &out->structured);
  return std::nullopt;
}

class ChatProtocol final : public EndpointProtocol {
 public:
  ChatProtocol(std::string model, int64_t created, std::string id_suffix)
      : model_(std::move(model)), created_(created), id_(absl::StrCat("chatcmpl-", id_suffix)) {}

  // A stateless chat may replay a conversation the server kept: it continues from there
  // (docs/http.md "Replayed histories").
  void AdjustParams(const OpenAiGenerateRequest&, GenerateParams* params) const override {
    if (params->session_id.empty()) {
      params->prefix_reuse = GenerateParams::PrefixReuse::kServerKept;
    }
  }

  json Usage(const GenerateSummary& summary) const override { return ChoiceUsage(summary); }

  json Body(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome) const override {
    json choice = {{"index", choice_index()},
                   {"finish_reason", outcome.finish_reason()},
                   {"logprobs", request.logprobs ? Logprobs(outcome.tokens) : json(nullptr)}};
    choice["message"] = {{"role", "assistant"},
                         {"content", outcome.text},
                         {"refusal", nullptr},
                         {"annotations", json::array()}};
    if (request.structured.forced_tool_call) {
      choice["message"]["content"] = nullptr;
      choice["message"]["tool_calls"] = json::array({ToolCallOf(outcome.text, ToolCallId())});
      choice["finish_reason"] = FinishReason(request, outcome);
    }
    json out = {{"id", id_},
                {"object", "chat.completion"},
                {"created", created_},
                {"model", model_},
                {"choices", json::array({choice})},
                {"usage", outcome.usage},
                {"service_tier", ServiceTier(request)}};
    if (!request.params.session_id.empty()) out["session_id"] = request.params.session_id;
    return out;
  }

  std::string StreamOpening(const OpenAiGenerateRequest& request) override {
    // A tool call's reply has no content (null, as OpenAI streams one).
    return SseData(Chunk(request,
                         {{"role", "assistant"},
                          {"content", request.structured.forced_tool_call ? json() : json("")}},
                         nullptr));
  }

  std::string StreamDelta(const OpenAiGenerateRequest& request, const std::string& text,
                          const GenerateChunk* chunk) override {
    const json logprobs = request.logprobs && chunk != nullptr ? Logprobs(*chunk) : json(nullptr);
    if (request.structured.forced_tool_call) {
      if (tool_stream_ == nullptr) tool_stream_ = std::make_unique<ToolCallStream>(ToolCallId());
      return ToolCallEvents(request, tool_stream_->Push(text), logprobs);
    }
    return SseData(Chunk(request, {{"content", text}}, logprobs));
  }

  std::string StreamClosing(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome,
                            const json&) override {
    if (request.structured.forced_tool_call) {
      std::string events;
      if (tool_stream_ != nullptr)
        events = ToolCallEvents(request, tool_stream_->Finish(), nullptr);
      return events + ChoiceStreamClosing(request, outcome, Chunk(request, json::object(), nullptr),
                                          Chunk(request, nullptr, nullptr),
                                          FinishReason(request, outcome), closes_stream());
    }
    return ChoiceStreamClosing(request, outcome, Chunk(request, json::object(), nullptr),
                               Chunk(request, nullptr, nullptr), nullptr, closes_stream());
  }

  std::string StreamError(const json& error) override { return SseData(error); }

 private:
  // A stream's chunk with one choice whose delta is `delta`.
  json Chunk(const OpenAiGenerateRequest& request, json delta, const json& logprobs) const {
    json chunk = ChoiceChunk(request, id_, "chat.completion.chunk", created_, model_, "delta",
                             std::move(delta), logprobs, choice_index());
    chunk["service_tier"] = ServiceTier(request);
    return chunk;
  }

  // The echo of service_tier: the tier asked for ("auto" as "default").
  static json ServiceTier(const OpenAiGenerateRequest& request) {
    return request.service_tier.is_null() ? json("default") : request.service_tier;
  }

  // The id of this reply's tool call (one per reply).
  const std::string& ToolCallId() const {
    if (tool_call_id_.empty()) tool_call_id_ = NewToolCallId();
    return tool_call_id_;
  }
  // A forced call's finish_reason: "tool_calls" when the call is whole, else OpenAI's.
  static const char* FinishReason(const OpenAiGenerateRequest&, const GenerateOutcome& outcome) {
    return outcome.reason == fwserve::FinishReason::kStop || outcome.stopped
               ? "tool_calls"
               : outcome.finish_reason();
  }
  // Chunks carrying tool-call deltas (each a tool_calls array); the first carries the
  // logprobs of the text that released them.
  std::string ToolCallEvents(const OpenAiGenerateRequest& request, const std::vector<json>& deltas,
                             const json& logprobs) const {
    std::string events;
    for (size_t i = 0; i < deltas.size(); ++i) {
      events +=
          SseData(Chunk(request, {{"tool_calls", deltas[i]}}, i == 0 ? logprobs : json(nullptr)));
    }
    return events;
  }

  // Token i's alternatives: [{token, logprob, bytes}], most likely first.
  static json TopLogprobs(const GenerateChunk& chunk, size_t i) {
    json top = json::array();
    if (i >= chunk.top_logprobs.size()) return top;
    for (const GenerateChunk::Alternative& a : chunk.top_logprobs[i]) {
      top.push_back({{"token", a.bytes}, {"logprob", a.logprob}, {"bytes", ByteValues(a.bytes)}});
    }
    return top;
  }

  // The chat logprobs object of `chunk`'s tokens.
  static json Logprobs(const GenerateChunk& chunk) {
    json content = json::array();
    for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
      const std::string bytes = TokenBytesAt(chunk, i);
      content.push_back({{"token", bytes},
                         {"logprob", i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f},
                         {"bytes", ByteValues(bytes)},
                         {"top_logprobs", TopLogprobs(chunk, i)}});
    }
    return json{{"content", content}};
  }

  mutable std::string tool_call_id_;
  std::unique_ptr<ToolCallStream> tool_stream_;
  const std::string model_;
  const int64_t created_;
  const std::string id_;
};

}  // namespace

absl::StatusOr<OpenAiGenerateRequest> ParseChatRequest(const json& body,
                                                       const ChatTemplate& chat_template,
                                                       int32_t default_max_tokens) {
  ChatFields fields;
  absl::StatusOr<OpenAiGenerateRequest> out = ParseGenerateFields(
      body, default_max_tokens, /*include_usage=*/true,
      [&](const std::string& key, const json& v, OpenAiGenerateRequest* request) {
        return ParseChatField(key, v, chat_template, request, &fields);
      });
  if (!out.ok()) return out;
  if (fields.max_completion_tokens.has_value()) {
    out->params.max_tokens = *fields.max_completion_tokens;
  } else if (fields.max_tokens.has_value()) {
    out->params.max_tokens = *fields.max_tokens;
  }
  if (!fields.have_prompt) return FieldError("messages", "'messages' is required");
  if (absl::Status finished = FinishGenerateRequest(&*out); !finished.ok()) return finished;
  // A chat turn ends at the template's end-of-turn marker unless the request gives its
  // own `stop`; a constrained reply ends where its JSON does (the marker could only cut
  // it).
  if (!body.contains("stop") && out->params.constraint == nullptr) {
    out->params.stop = chat_template.stop;
  }
  return out;
}

std::unique_ptr<EndpointProtocol> NewChatProtocol(std::string model, int64_t created,
                                                  std::string id_suffix) {
  return std::make_unique<ChatProtocol>(std::move(model), created, std::move(id_suffix));
}

}  // namespace fwserve
