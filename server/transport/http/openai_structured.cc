#include "server/transport/http/openai_structured.h"

#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "server/transport/http/openai_api.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

// Compiles `schema` for `field`; the library's message names the keyword and pointer.
absl::StatusOr<std::shared_ptr<const constraints::Grammar>> Compile(const std::string& field,
                                                                    const json& schema) {
  auto grammar = constraints::CompileJsonSchemaCached(schema);
  if (!grammar.ok())
    return FieldError(field, absl::StrCat(field, ": ", grammar.status().message()));
  return grammar;
}

// The JSON format of {"type": ...} objects shared by response_format and text.format:
// `schema_holder` is where json_schema's fields are (response_format.json_schema, or the
// format object itself).
absl::Status ParseFormat(const std::string& field, const json& value, bool nested_schema,
                         StructuredOutput* out) {
  if (!value.is_object()) return TypeError(field, "an object", value);
  auto type = value.find("type");
  if (type == value.end() || !type->is_string()) {
    return FieldError(field + ".type", absl::StrCat("'", field,
                                                    ".type' must be one of text, json_object, "
                                                    "json_schema"));
  }
  const std::string kind = type->get<std::string>();
  if (kind == "text") {
    out->grammar = nullptr;
    out->json_format = false;
    return absl::OkStatus();
  }
  if (kind == "json_object") {
    out->grammar = constraints::AnyJsonObject();
    out->json_format = true;
    return absl::OkStatus();
  }
  if (kind != "json_schema") {
    return Unsupported(field + ".type", *type, "text, json_object and json_schema only");
  }
  const std::string holder_field = nested_schema ? field + ".json_schema" : field;
  const json* holder = &value;
  if (nested_schema) {
    auto it = value.find("json_schema");
    if (it == value.end() || !it->is_object()) {
      return FieldError(holder_field, absl::StrCat("'", holder_field, "' must be an object"));
    }
    holder = &*it;
  }
  auto schema = holder->find("schema");
  if (schema == holder->end()) {
    return FieldError(holder_field + ".schema",
                      absl::StrCat("'", holder_field, ".schema' is required"));
  }
  if (!schema->is_object() && !schema->is_boolean()) {
    return TypeError(holder_field + ".schema", "a JSON schema object", *schema);
  }
  auto grammar = Compile(holder_field + ".schema", *schema);
  if (!grammar.ok()) return grammar.status();
  out->grammar = std::move(*grammar);
  out->json_format = true;
  return absl::OkStatus();
}

// Rewrites every "$ref" in `schema` (a tool's parameters) to point into the wrapper's
// $defs under `prefix`: "#" -> "#/$defs/<prefix>", "#/$defs/X" and "#/definitions/X" ->
// "#/$defs/<prefix>.X". Refs elsewhere are left for the compiler to refuse.
template <typename Json>
void RebaseRefs(Json* schema, const std::string& prefix) {
  if (schema->is_object()) {
    for (auto it = schema->begin(); it != schema->end(); ++it) {
      if (it.key() == "$ref" && it->is_string()) {
        const std::string ref = it->template get<std::string>();
        for (const char* root : {"#/$defs/", "#/definitions/"}) {
          const std::string r(root);
          if (ref.compare(0, r.size(), r) == 0) {
            *it = absl::StrCat("#/$defs/", prefix, ".", ref.substr(r.size()));
          }
        }
        if (ref == "#") *it = absl::StrCat("#/$defs/", prefix);
      } else {
        RebaseRefs(&it.value(), prefix);
      }
    }
  } else if (schema->is_array()) {
    for (Json& item : *schema) RebaseRefs(&item, prefix);
  }
}

}  // namespace

absl::Status ParseResponseFormat(const json& value, StructuredOutput* out) {
  return ParseFormat("response_format", value, /*nested_schema=*/true, out);
}

absl::Status ParseTextField(const json& value, StructuredOutput* out) {
  if (!value.is_object()) return TypeError("text", "an object", value);
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (it->is_null()) continue;
    if (it.key() == "format") {
      absl::Status parsed = ParseFormat("text.format", *it, /*nested_schema=*/false, out);
      if (!parsed.ok()) return parsed;
    } else if (it.key() == "verbosity") {
      // How wordy a reasoning model should be; the model is not told here.
      static const std::set<std::string> kLevels = {"low", "medium", "high"};
      if (!it->is_string() || kLevels.count(it->get<std::string>()) == 0) {
        return TypeError("text.verbosity", "one of low, medium, high", *it);
      }
    } else {
      return Unsupported("text." + it.key(), *it, "unknown option");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseTools(const json& value, ToolApi api, StructuredOutput* out) {
  if (!value.is_array()) return TypeError("tools", "an array", value);
  out->tools.clear();
  std::set<std::string> names;
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string field = absl::StrCat("tools[", i, "]");
    const json& tool = value[i];
    if (!tool.is_object()) return TypeError(field, "an object", tool);
    if (tool.value("type", "") != "function") {
      return Unsupported(field + ".type", tool.value("type", json()), "function tools only");
    }
    const json* function = &tool;
    std::string function_field = field;
    if (api == ToolApi::kChat) {
      auto it = tool.find("function");
      if (it == tool.end() || !it->is_object()) {
        return FieldError(field + ".function",
                          absl::StrCat("'", field, ".function' must be an object"));
      }
      function = &*it;
      function_field = field + ".function";
    }
    auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get<std::string>().empty()) {
      return FieldError(function_field + ".name",
                        absl::StrCat("'", function_field, ".name' must be a non-empty string"));
    }
    if (!names.insert(name->get<std::string>()).second) {
      return FieldError(function_field + ".name",
                        absl::StrCat("tool names must be distinct, '", name->get<std::string>(),
                                     "' is listed twice"));
    }
    ToolSpec spec;
    spec.name = name->get<std::string>();
    auto parameters = function->find("parameters");
    if (parameters == function->end() || parameters->is_null()) {
      spec.parameters = {{"type", "object"}, {"properties", json::object()}};
    } else if (!parameters->is_object()) {
      return TypeError(function_field + ".parameters", "a JSON schema object", *parameters);
    } else {
      spec.parameters = *parameters;
      // Checked now, so that an error names this tool.
      auto compiled = Compile(function_field + ".parameters", spec.parameters);
      if (!compiled.ok()) return compiled.status();
    }
    out->tools.push_back(std::move(spec));
  }
  return absl::OkStatus();
}

absl::Status ParseToolChoice(const json& value, ToolApi api, StructuredOutput* out) {
  using Choice = StructuredOutput::ToolChoice;
  if (value.is_string()) {
    const std::string s = value.get<std::string>();
    if (s == "none") {
      out->tool_choice = Choice::kNone;
    } else if (s == "auto") {
      out->tool_choice = Choice::kAuto;
    } else if (s == "required") {
      out->tool_choice = Choice::kRequired;
    } else {
      return TypeError("tool_choice", "none, auto, required or a named function", value);
    }
    return absl::OkStatus();
  }
  if (!value.is_object() || value.value("type", "") != "function") {
    return TypeError("tool_choice", "none, auto, required or a named function", value);
  }
  const json* holder = &value;
  if (api == ToolApi::kChat) {
    auto it = value.find("function");
    if (it == value.end() || !it->is_object()) {
      return TypeError("tool_choice", "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                       value);
    }
    holder = &*it;
  }
  auto name = holder->find("name");
  if (name == holder->end() || !name->is_string()) {
    return TypeError("tool_choice", "a named function", value);
  }
  out->tool_choice = Choice::kNamed;
  out->named_tool = name->get<std::string>();
  return absl::OkStatus();
}

absl::Status FinishStructuredOutput(StructuredOutput* out) {
  using Choice = StructuredOutput::ToolChoice;
  const Choice choice =
      out->tool_choice.value_or(out->tools.empty() ? Choice::kNone : Choice::kAuto);
  if (choice == Choice::kNone) return absl::OkStatus();
  if (choice == Choice::kAuto) {
    if (out->tools.empty()) return absl::OkStatus();
    return Unsupported("tool_choice", "auto",
                       "the model declares no tool-call format, so a tool call cannot be told "
                       "from text: send tool_choice 'required' or a named function (the reply "
                       "is then constrained to a valid call)");
  }
  if (out->tools.empty()) {
    return FieldError("tool_choice", "'tool_choice' forces a tool call, but 'tools' lists none");
  }
  if (out->json_format) {
    return FieldError("response_format",
                      "a JSON response_format and a forced tool call cannot both shape the reply");
  }
  // The reply: {"name": <tool>, "arguments": <its parameters>}, one alternative per tool
  // the choice allows; each tool's schema (and its $defs) moved under the root's $defs.
  // Ordered: the name comes first, so a stream knows the call before its arguments.
  using ordered = nlohmann::ordered_json;
  ordered defs = ordered::object();
  ordered alternatives = ordered::array();
  for (size_t i = 0; i < out->tools.size(); ++i) {
    const ToolSpec& tool = out->tools[i];
    if (choice == Choice::kNamed && tool.name != out->named_tool) continue;
    const std::string prefix = absl::StrCat("fwtool", i);
    ordered parameters = ordered::parse(tool.parameters.dump());
    RebaseRefs(&parameters, prefix);
    for (const char* key : {"$defs", "definitions"}) {
      auto it = parameters.find(key);
      if (it == parameters.end()) continue;
      if (it->is_object()) {
        for (auto d = it->begin(); d != it->end(); ++d) defs[prefix + "." + d.key()] = d.value();
      }
      parameters.erase(it);
    }
    parameters.erase("$schema");
    defs[prefix] = parameters;
    ordered alternative = ordered::object();
    alternative["type"] = "object";
    alternative["properties"]["name"]["const"] = tool.name;
    alternative["properties"]["arguments"]["$ref"] = "#/$defs/" + prefix;
    alternative["required"] = {"name", "arguments"};
    alternative["additionalProperties"] = false;
    alternatives.push_back(std::move(alternative));
  }
  if (alternatives.empty()) {
    return FieldError("tool_choice",
                      absl::StrCat("'tool_choice' names the function '", out->named_tool,
                                   "', which 'tools' does not list"));
  }
  ordered wrapper = ordered::object();
  if (alternatives.size() == 1) {
    wrapper = alternatives[0];
  } else {
    wrapper["anyOf"] = alternatives;
  }
  wrapper["$defs"] = defs;
  auto grammar = constraints::CompileJsonSchemaCached(wrapper);
  if (!grammar.ok())
    return FieldError("tools", absl::StrCat("tools: ", grammar.status().message()));
  out->grammar = std::move(*grammar);
  out->forced_tool_call = true;
  return absl::OkStatus();
}

std::string NewToolCallId() {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::string id = "call_";
  std::uniform_int_distribution<int> pick(0, static_cast<int>(sizeof(kAlphabet)) - 2);
  for (int i = 0; i < 24; ++i) id.push_back(kAlphabet[pick(rng)]);
  return id;
}

namespace {

// The end of the wrapper's prefix {"name": "<name>", "arguments": in `text` (just after
// the colon), with the name; nullopt until it is all there.
std::optional<std::pair<size_t, std::string>> WrapperPrefix(const std::string& text) {
  size_t i = 0;
  auto skip_space = [&] {
    while (i < text.size() &&
           (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r')) {
      ++i;
    }
  };
  auto expect = [&](const std::string& literal) {
    skip_space();
    if (text.compare(i, literal.size(), literal) != 0) return false;
    i += literal.size();
    return true;
  };
  if (!expect("{") || !expect("\"name\"") || !expect(":")) return std::nullopt;
  skip_space();
  if (i >= text.size() || text[i] != '"') return std::nullopt;
  // The name as a JSON string (escapes included): parse it whole once it closes.
  size_t end = i + 1;
  while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
  if (end >= text.size()) return std::nullopt;
  std::string name;
  try {
    name = json::parse(text.substr(i, end + 1 - i)).get<std::string>();
  } catch (const json::exception&) {
    return std::nullopt;
  }
  i = end + 1;
  if (!expect(",") || !expect("\"arguments\"") || !expect(":")) return std::nullopt;
  return std::make_pair(i, name);
}

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// Where the held tail begins: the longest suffix of whitespace, at most one '}', and
// whitespace (the brace may be the wrapper's closing one; whitespace around the
// arguments is not theirs).
size_t HeldFrom(const std::string& text) {
  size_t end = text.size();
  while (end > 0 && IsSpace(text[end - 1])) --end;
  if (end > 0 && text[end - 1] == '}') {
    --end;
    while (end > 0 && IsSpace(text[end - 1])) --end;
  }
  return end;
}

// The arguments' text of a whole reply: between the prefix and the wrapper's closing
// brace, without the whitespace around it (what the stream sends).
std::string WholeArguments(const std::string& reply, size_t begin) {
  size_t end = reply.rfind('}');
  if (end == std::string::npos || end < begin) end = reply.size();
  while (begin < end && IsSpace(reply[begin])) ++begin;
  while (end > begin && IsSpace(reply[end - 1])) --end;
  return reply.substr(begin, end - begin);
}

}  // namespace

json ToolCallOf(const std::string& reply, const std::string& id) {
  // The arguments as generated (OpenAI's are the model's text too); a reply cut short
  // keeps its name and the arguments' text so far.
  std::string name, arguments;
  if (auto prefix = WrapperPrefix(reply); prefix.has_value()) {
    name = prefix->second;
    bool whole = false;
    try {
      whole = json::parse(reply).is_object();
    } catch (const json::exception&) {
    }
    if (whole) {
      arguments = WholeArguments(reply, prefix->first);
    } else {
      size_t begin = prefix->first;
      while (begin < reply.size() && IsSpace(reply[begin])) ++begin;
      arguments = reply.substr(begin);
    }
  }
  return {
      {"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", arguments}}}};
}

std::vector<json> ToolCallStream::Push(const std::string& text) {
  std::vector<json> out;
  buffer_ += text;
  if (!named_) {
    auto prefix = WrapperPrefix(buffer_);
    if (!prefix.has_value()) return out;
    named_ = true;
    out.push_back(json::array({{{"index", 0},
                                {"id", id_},
                                {"type", "function"},
                                {"function", {{"name", prefix->second}, {"arguments", ""}}}}}));
    buffer_.erase(0, prefix->first);
  }
  if (!started_) {  // the whitespace before the arguments is not theirs
    size_t first = 0;
    while (first < buffer_.size() && IsSpace(buffer_[first])) ++first;
    buffer_.erase(0, first);
    if (buffer_.empty()) return out;
    started_ = true;
  }
  const size_t held = HeldFrom(buffer_);
  if (held > 0) {
    out.push_back(
        json::array({{{"index", 0}, {"function", {{"arguments", buffer_.substr(0, held)}}}}}));
    buffer_.erase(0, held);
  }
  return out;
}

std::vector<json> ToolCallStream::Finish() {
  std::vector<json> out;
  // A whole call ends with the wrapper's brace (held, dropped); a call cut short may
  // hold a piece of its arguments: sent as it is.
  if (named_ && !buffer_.empty()) {
    const size_t held = HeldFrom(buffer_);
    const bool closed = buffer_.find('}', held) != std::string::npos;
    const std::string rest = closed ? buffer_.substr(0, held) : buffer_;
    if (!rest.empty()) {
      out.push_back(json::array({{{"index", 0}, {"function", {{"arguments", rest}}}}}));
    }
  }
  buffer_.clear();
  return out;
}

}  // namespace fwserve
