// Structured output on the OpenAI endpoints (docs/http.md "Structured output",
// docs/structured-output.md): `response_format` (chat, completions) and `text.format`
// (responses) as a JSON constraint, and `tools` with a forced `tool_choice` as a
// constraint on a tool call, answered in OpenAI's `tool_calls` shape. The constraint
// itself is the model library's (models/constraints): this file maps the API's fields
// onto it and the constrained reply back onto the API. Pure (no I/O), torch-free.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "models/constraints/json_schema.h"

namespace fwserve {

// A function tool the request lists.
struct ToolSpec {
  std::string name;
  nlohmann::json parameters;  // a JSON schema (an empty object schema when not sent)
};

// What a request asks of its reply's shape.
struct StructuredOutput {
  // The constraint the reply is decoded under; null = free text.
  std::shared_ptr<const constraints::Grammar> grammar;
  // The function tools listed (`tools`), and `tool_choice`.
  std::vector<ToolSpec> tools;
  enum class ToolChoice { kNone, kAuto, kRequired, kNamed };
  // Unset: OpenAI's default (auto with tools, none without).
  std::optional<ToolChoice> tool_choice;
  std::string named_tool;  // kNamed's
  // The reply is a tool call (FinishStructuredOutput set a tool choice that forces one).
  bool forced_tool_call = false;
  // Whether response_format / text.format asked for JSON (then `grammar` is set).
  bool json_format = false;
};

// Which API's shapes the tool fields take: chat ({"type": "function", "function":
// {...}}) or responses ({"type": "function", "name": ...}).
enum class ToolApi { kChat, kResponses };

// `response_format` (chat and completions): {"type": "text"}, {"type": "json_object"}
// or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
// "description"}}. Errors are INVALID_ARGUMENT naming the field (FieldError), a schema
// keyword outside the supported subset with its JSON pointer.
absl::Status ParseResponseFormat(const nlohmann::json& value, StructuredOutput* out);
// Responses' `text` object: {"format": {"type": "text"} | {"type": "json_object"} |
// {"type": "json_schema", "name", "schema", "strict", "description"}, "verbosity"}.
absl::Status ParseTextField(const nlohmann::json& value, StructuredOutput* out);
// `tools`: function tools only (another type is a 400 naming it).
absl::Status ParseTools(const nlohmann::json& value, ToolApi api, StructuredOutput* out);
// `tool_choice`: "none", "auto", "required", or a named function.
absl::Status ParseToolChoice(const nlohmann::json& value, ToolApi api, StructuredOutput* out);
// After every field: a forced tool choice (required, or a named function) becomes the
// tool call's constraint ({"name": <a listed tool>, "arguments": <its parameters>});
// auto with tools is refused naming `tool_choice` (no model declares a tool format);
// a JSON format and a forced tool call together are refused naming `response_format`.
absl::Status FinishStructuredOutput(StructuredOutput* out);

// A forced tool call's reply text ({"name": ..., "arguments": {...}}) as OpenAI's
// `tool_calls` entry {"id", "type": "function", "function": {"name", "arguments"}}
// (arguments as a JSON string). A reply cut short (max_tokens) keeps what can be read:
// the name, and the arguments' text so far.
nlohmann::json ToolCallOf(const std::string& reply, const std::string& id);
// "call_" and 24 random characters.
std::string NewToolCallId();

// Streams a forced tool call's reply as OpenAI's tool-call deltas: nothing until the
// name is known, then {"index": 0, "id", "type": "function", "function": {"name",
// "arguments": ""}}, then {"index": 0, "function": {"arguments": <piece>}} as the
// arguments arrive (the wrapper's closing brace held back and never sent). Not
// thread-safe.
class ToolCallStream {
 public:
  explicit ToolCallStream(std::string id) : id_(std::move(id)) {}
  // The deltas `text` (the reply's next bytes) releases: each a tool_calls array.
  std::vector<nlohmann::json> Push(const std::string& text);
  // At the end: what is still held (the arguments of a reply cut short), if any.
  std::vector<nlohmann::json> Finish();

 private:
  std::string id_;
  std::string buffer_;  // before the name: the reply so far; after: the held tail
  bool named_ = false;
  bool started_ = false;  // the arguments' first byte was seen
};

}  // namespace fwserve
