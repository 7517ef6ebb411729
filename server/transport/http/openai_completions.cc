#include "server/transport/http/openai_completions.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

// The fields only /v1/completions has.
std::optional<absl::Status> ParseCompletionsField(const std::string& key, const json& v,
                                                  OpenAiGenerateRequest* out, bool* have_prompt) {
  GenerateParams& p = out->params;
  if (key == "max_tokens") {
    absl::StatusOr<int32_t> n = GetTokens(key, v);
    if (n.ok()) p.max_tokens = *n;
    return n.status();
  }
  if (key == "stop") return ParseStop(v, &p.stop);
  if (key == "session_id") {  // extension
    absl::StatusOr<std::string> s = GetString(key, v);
    if (s.ok()) p.session_id = std::move(*s);
    return s.status();
  }
  if (key == "prompt") {
    absl::Status error;
    if (v.is_array() && v.size() == 1 && v[0].is_string()) {
      p.prompt = v[0].get<std::string>();
    } else if (v.is_array()) {
      error = Unsupported(key, v, "one prompt string per request");
    } else {
      absl::StatusOr<std::string> s = GetString(key, v);
      if (s.ok()) p.prompt = std::move(*s);
      error = s.status();
    }
    *have_prompt = error.ok();
    return error;
  }
  if (key == "logprobs") {
    // The legacy API's logprobs: n = the sampled token's and the n most likely ones'.
    absl::StatusOr<int64_t> n = GetInteger(key, v);
    if (!n.ok()) return n.status();
    if (*n < 0 || *n > GenerateParams::kMaxTopLogprobs) {
      return FieldError(key, absl::StrCat("'logprobs' must be in [0, ",
                                          GenerateParams::kMaxTopLogprobs, "], got ", *n));
    }
    out->logprobs = true;
    out->params.top_logprobs = static_cast<int32_t>(*n);
    return absl::OkStatus();
  }
  if (key == "echo") {
    return v == json(false) ? absl::OkStatus() : Unsupported(key, v, "the prompt is not echoed");
  }
  if (key == "suffix") return Unsupported(key, v, "no insertion");
  // An extension on completions (OpenAI's chat field): the text is constrained to JSON.
  if (key == "response_format") return ParseResponseFormat(v, &out->structured);
  return std::nullopt;
}

class CompletionsProtocol final : public EndpointProtocol {
 public:
  CompletionsProtocol(std::string model, int64_t created, std::string id_suffix)
      : model_(std::move(model)), created_(created), id_(absl::StrCat("cmpl-", id_suffix)) {}

  void AdjustParams(const OpenAiGenerateRequest&, GenerateParams*) const override {}

  json Usage(const GenerateSummary& summary) const override { return ChoiceUsage(summary); }

  json Body(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome) const override {
    json choice = {{"index", choice_index()},
                   {"finish_reason", outcome.finish_reason()},
                   {"logprobs", request.logprobs ? Logprobs(outcome.tokens) : json(nullptr)},
                   {"text", outcome.text}};
    json out = {{"id", id_},       {"object", "text_completion"},      {"created", created_},
                {"model", model_}, {"choices", json::array({choice})}, {"usage", outcome.usage}};
    if (!request.params.session_id.empty()) out["session_id"] = request.params.session_id;
    return out;
  }

  std::string StreamOpening(const OpenAiGenerateRequest&) override { return ""; }

  std::string StreamDelta(const OpenAiGenerateRequest& request, const std::string& text,
                          const GenerateChunk* chunk) override {
    const json logprobs = request.logprobs && chunk != nullptr ? Logprobs(*chunk) : json(nullptr);
    return SseData(Chunk(request, text, logprobs));
  }

  std::string StreamClosing(const OpenAiGenerateRequest& request, const GenerateOutcome& outcome,
                            const json&) override {
    return ChoiceStreamClosing(request, outcome, Chunk(request, "", nullptr),
                               Chunk(request, nullptr, nullptr), nullptr, closes_stream());
  }

  std::string StreamError(const json& error) override { return SseData(error); }

 private:
  // A stream's chunk with one choice whose text is `text`.
  json Chunk(const OpenAiGenerateRequest& request, json text, const json& logprobs) const {
    return ChoiceChunk(request, id_, "text_completion", created_, model_, "text", std::move(text),
                       logprobs, choice_index());
  }

  // The legacy logprobs object of `chunk`'s tokens.
  static json Logprobs(const GenerateChunk& chunk) {
    json tokens = json::array(), values = json::array(), top = json::array();
    for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
      tokens.push_back(TokenBytesAt(chunk, i));
      values.push_back(i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f);
      if (i < chunk.top_logprobs.size()) {
        // {token text: logprob}; a text two alternatives share keeps the likelier one.
        json entry = json::object();
        for (const GenerateChunk::Alternative& a : chunk.top_logprobs[i]) {
          if (!entry.contains(a.bytes)) entry[a.bytes] = a.logprob;
        }
        top.push_back(std::move(entry));
      }
    }
    return json{{"tokens", tokens},
                {"token_logprobs", values},
                {"top_logprobs", chunk.top_logprobs.empty() ? json(nullptr) : top}};
  }

  const std::string model_;
  const int64_t created_;
  const std::string id_;
};

}  // namespace

absl::StatusOr<OpenAiGenerateRequest> ParseCompletionsRequest(const json& body) {
  bool have_prompt = false;
  absl::StatusOr<OpenAiGenerateRequest> out = ParseGenerateFields(
      body, /*max_tokens=*/16, /*include_usage=*/true,
      [&](const std::string& key, const json& v, OpenAiGenerateRequest* request) {
        return ParseCompletionsField(key, v, request, &have_prompt);
      });
  if (!out.ok()) return out;
  if (!have_prompt) return FieldError("prompt", "'prompt' is required");
  if (absl::Status finished = FinishGenerateRequest(&*out); !finished.ok()) return finished;
  return out;
}

std::unique_ptr<EndpointProtocol> NewCompletionsProtocol(std::string model, int64_t created,
                                                         std::string id_suffix) {
  return std::make_unique<CompletionsProtocol>(std::move(model), created, std::move(id_suffix));
}

}  // namespace fwserve
