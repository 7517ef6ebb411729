#include "server/transport/http/openai_api.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/transport/http/openai_chat.h"
#include "server/transport/http/openai_completions.h"
#include "server/transport/http/openai_responses.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

constexpr char kParamPayload[] = "type.fwserve/http.param";
constexpr char kCodePayload[] = "type.fwserve/http.code";

// Client-supplied text echoed in an error: at most this many bytes.
constexpr size_t kQuotedBytes = 64;
// Deeper nesting is elided ("[...]", "{...}"): a body may nest millions of levels, and
// Dump recurses once per level. A value shorter than kQuotedBytes nests at most half as
// deep, so it is rendered whole.
constexpr int kQuotedDepth = 32;

// Appends `value`'s JSON text to `out`, nesting below `depth` more levels elided,
// stopping early once `out` is longer than kQuotedBytes. Recurses at most kQuotedDepth
// levels.
void AppendQuoted(const json& value, int depth, std::string* out) {
  if (!value.is_structured()) {
    *out += Dump(value);
    return;
  }
  const bool array = value.is_array();
  if (depth == 0 && !value.empty()) {
    *out += array ? "[...]" : "{...}";
    return;
  }
  *out += array ? '[' : '{';
  bool first = true;
  for (auto it = value.begin(); it != value.end() && out->size() <= kQuotedBytes; ++it) {
    if (!first) *out += ',';
    first = false;
    if (!array) *out += Dump(it.key()) + ":";
    AppendQuoted(it.value(), depth - 1, out);
  }
  *out += array ? ']' : '}';
}

std::string Quoted(const json& value) {
  std::string text;
  AppendQuoted(value, kQuotedDepth, &text);
  if (text.size() > kQuotedBytes) text = absl::StrCat(text.substr(0, kQuotedBytes), "...");
  return text;
}

// %XX and '+' decoding of a query key or value.
std::string UrlDecode(absl::string_view in) {
  std::string out;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '+') {
      out += ' ';
    } else if (in[i] == '%' && i + 2 < in.size() && absl::ascii_isxdigit(in[i + 1]) &&
               absl::ascii_isxdigit(in[i + 2])) {
      out += static_cast<char>(std::stoi(std::string(in.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += in[i];
    }
  }
  return out;
}

}  // namespace

absl::Status TypeError(const std::string& field, absl::string_view expected, const json& value) {
  return FieldError(field,
                    absl::StrCat("'", field, "' must be ", expected, ", got ", Quoted(value)));
}

absl::StatusOr<bool> GetBool(const std::string& field, const json& value) {
  if (!value.is_boolean()) return TypeError(field, "a boolean", value);
  return value.get<bool>();
}

namespace {

absl::StatusOr<double> GetNumber(const std::string& field, const json& value) {
  if (!value.is_number()) return TypeError(field, "a number", value);
  return value.get<double>();
}

}  // namespace

absl::StatusOr<int64_t> GetInteger(const std::string& field, const json& value) {
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(v);
    }
  }
  if (value.is_number_float()) {
    const double v = value.get<double>();
    if (std::floor(v) == v && std::abs(v) < 9e15) return static_cast<int64_t>(v);
  }
  return TypeError(field, "an integer", value);
}

absl::StatusOr<std::string> GetString(const std::string& field, const json& value) {
  if (!value.is_string()) return TypeError(field, "a string", value);
  return value.get<std::string>();
}

absl::StatusOr<int32_t> GetTokens(const std::string& field, const json& value) {
  absl::StatusOr<int64_t> v = GetInteger(field, value);
  if (!v.ok()) return v.status();
  if (*v < 0 || *v > std::numeric_limits<int32_t>::max()) {
    return FieldError(field, absl::StrCat("'", field, "' must be >= 0, got ", *v));
  }
  return static_cast<int32_t>(*v);
}

absl::Status Unsupported(const std::string& field, const json& value, absl::string_view why) {
  return FieldError(field, absl::StrCat("'", field, "' = ", Quoted(value),
                                        " is not supported by fwserve: ", why));
}

namespace {

// Text of a message's content: a string, or an array of {type: text|input_text|
// output_text, text}.
absl::StatusOr<std::string> ContentText(const std::string& field, const json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return std::string();
  if (!content.is_array()) return TypeError(field, "a string or an array of text parts", content);
  std::string out;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string part_field = absl::StrCat(field, "[", i, "]");
    const json& part = content[i];
    if (!part.is_object()) return TypeError(part_field, "an object", part);
    auto type = part.find("type");
    const std::string type_name =
        type != part.end() && type->is_string() ? type->get<std::string>() : "";
    if (type_name != "text" && type_name != "input_text" && type_name != "output_text") {
      return Unsupported(part_field + ".type", type != part.end() ? *type : json(),
                         "only text parts");
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return TypeError(part_field + ".text", "a string", text != part.end() ? *text : json());
    }
    out += text->get<std::string>();
  }
  return out;
}

}  // namespace

absl::Status ParseStop(const json& value, std::vector<std::string>* stop) {
  if (value.is_string()) {
    if (!value.get<std::string>().empty()) stop->push_back(value.get<std::string>());
    return absl::OkStatus();
  }
  if (!value.is_array()) return TypeError("stop", "a string or an array of strings", value);
  if (value.size() > 4) {
    return FieldError("stop",
                      absl::StrCat("'stop' may hold at most 4 strings, got ", value.size()));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    absl::StatusOr<std::string> s = GetString(absl::StrCat("stop[", i, "]"), value[i]);
    if (!s.ok()) return s.status();
    if (!s->empty()) stop->push_back(std::move(*s));
  }
  return absl::OkStatus();
}

absl::Status FieldError(absl::string_view field, absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kParamPayload, absl::Cord(field));
  return status;
}

absl::Status WithParam(absl::Status status, absl::string_view field) {
  status.SetPayload(kParamPayload, absl::Cord(field));
  return status;
}

std::string ParamOf(const absl::Status& status) {
  auto param = status.GetPayload(kParamPayload);
  return param.has_value() ? std::string(*param) : std::string();
}

absl::Status WithErrorCode(absl::Status status, absl::string_view code) {
  status.SetPayload(kCodePayload, absl::Cord(code));
  return status;
}

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

json ErrorJson(const absl::Status& status, int http_status) {
  const char* type = "invalid_request_error";
  json code = nullptr;
  switch (http_status) {
    case 401:
      type = "authentication_error";
      code = "invalid_api_key";
      break;
    case 403:
      type = "permission_error";
      break;
    case 404:
      code = "not_found";
      break;
    case 409:
      type = "conflict_error";
      code = "session_busy";
      break;
    case 413:
      code = "payload_too_large";
      break;
    case 429:
      type = "rate_limit_error";
      code = "rate_limit_exceeded";
      break;
    case 400:
      code = "invalid_value";
      break;
    default:
      if (http_status >= 500) type = "server_error";
      break;
  }
  if (auto given = status.GetPayload(kCodePayload); given.has_value()) code = std::string(*given);
  const std::string param = ParamOf(status);
  json error = {{"message", std::string(status.message())},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code}};
  return json{{"error", std::move(error)}};
}

std::string SseData(const json& value) { return absl::StrCat("data: ", Dump(value), "\n\n"); }

std::string TokenBytesAt(const GenerateChunk& chunk, size_t i) {
  return i < chunk.token_bytes.size() ? chunk.token_bytes[i] : std::string();
}

json ByteValues(const std::string& bytes) {
  json out = json::array();
  for (unsigned char b : bytes) out.push_back(b);
  return out;
}

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::StatusOr<json> ParseBody(const std::string& body, bool empty_ok) {
  if (body.empty() && empty_ok) return json::object();
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return FieldError("", "the request body is not valid JSON");
  }
  if (!parsed.is_object()) return FieldError("", "the request body must be a JSON object");
  return parsed;
}

RequestTarget SplitTarget(absl::string_view target) {
  RequestTarget out;
  const size_t question = target.find('?');
  out.path = std::string(target.substr(0, question));
  if (question != absl::string_view::npos) out.query = std::string(target.substr(question + 1));
  while (out.path.size() > 1 && out.path.back() == '/') out.path.pop_back();
  out.parts = absl::StrSplit(out.path, '/', absl::SkipEmpty());
  return out;
}

std::map<std::string, std::string> ParseQuery(absl::string_view query) {
  std::map<std::string, std::string> params;
  for (absl::string_view pair : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
    params[UrlDecode(kv.first)] = UrlDecode(kv.second);
  }
  return params;
}

namespace {

// A route's path as segments; "{id}" and "{model}" match any one segment.
struct RoutePattern {
  std::vector<absl::string_view> segments;
  Route route;
};

const std::vector<RoutePattern>& RouteTable() {
  // Literal segments before placeholders: ".../sessions/import" precedes
  // ".../sessions/{id}".
  static const auto* table = new std::vector<RoutePattern>{
      {{}, {RouteId::kPlayground, "/", {"GET"}}},
      {{"health"}, {RouteId::kHealth, "/health", {"GET"}}},
      {{"ready"}, {RouteId::kReady, "/ready", {"GET"}}},
      {{"v1", "models"}, {RouteId::kModels, "/v1/models", {"GET"}}},
      {{"v1", "models", "{model}"}, {RouteId::kModel, "/v1/models/{model}", {"GET"}}},
      {{"v1", "completions"}, {RouteId::kCompletions, "/v1/completions", {"POST"}}},
      {{"v1", "chat", "completions"},
       {RouteId::kChatCompletions, "/v1/chat/completions", {"POST"}}},
      {{"v1", "responses"}, {RouteId::kResponses, "/v1/responses", {"POST"}}},
      {{"v1", "responses", "{id}"}, {RouteId::kResponse, "/v1/responses/{id}", {"GET", "DELETE"}}},
      {{"v1", "conversations"}, {RouteId::kConversations, "/v1/conversations", {"POST"}}},
      {{"v1", "conversations", "{id}"},
       {RouteId::kConversation, "/v1/conversations/{id}", {"GET", "DELETE"}}},
      {{"fwserve", "v1", "sessions"},
       {RouteId::kSessions, "/fwserve/v1/sessions", {"GET", "POST"}}},
      {{"fwserve", "v1", "sessions", "import"},
       {RouteId::kSessionImport, "/fwserve/v1/sessions/import", {"POST"}}},
      {{"fwserve", "v1", "sessions", "{id}"},
       {RouteId::kSession, "/fwserve/v1/sessions/{id}", {"GET", "DELETE"}}},
      {{"fwserve", "v1", "sessions", "{id}", "fork"},
       {RouteId::kSessionFork, "/fwserve/v1/sessions/{id}/fork", {"POST"}}},
      {{"fwserve", "v1", "sessions", "{id}", "export"},
       {RouteId::kSessionExport, "/fwserve/v1/sessions/{id}/export", {"GET"}}},
  };
  return *table;
}

}  // namespace

const Route* MatchRoute(const RequestTarget& target) {
  const std::vector<std::string>& parts = target.parts;
  for (const RoutePattern& pattern : RouteTable()) {
    if (pattern.segments.size() != parts.size()) continue;
    bool match = true;
    for (size_t i = 0; i < parts.size() && match; ++i) {
      const absl::string_view segment = pattern.segments[i];
      match = absl::StartsWith(segment, "{") || segment == parts[i];
    }
    if (match) return &pattern.route;
  }
  return nullptr;
}

bool RouteAllows(const Route& route, absl::string_view method) {
  if (method == "OPTIONS") return true;
  if (method == "HEAD") method = "GET";
  return std::find(route.methods.begin(), route.methods.end(), method) != route.methods.end();
}

std::string AllowHeader(const Route& route) {
  std::string out;
  for (const std::string& m : route.methods) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", m, m == "GET" ? ", HEAD" : "");
  }
  absl::StrAppend(&out, ", OPTIONS");
  return out;
}

std::string RouteLabel(absl::string_view method, const RequestTarget& target) {
  const Route* route = MatchRoute(target);
  return absl::StrCat(method, " ", route != nullptr ? route->label : "(other)");
}

double EchoFloat(float value) {
  if (!std::isfinite(value)) return value;
  char text[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, static_cast<double>(value));
    const double shortest = std::strtod(text, nullptr);
    if (static_cast<float>(shortest) == value) return shortest;
  }
  return value;
}

ChatTemplate ChatTemplateOf(const std::string& config_json) {
  ChatTemplate out;
  json config = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) return out;
  auto t = config.find("chat_template");
  if (t == config.end() || !t->is_object()) return out;
  auto message = t->find("message");
  auto prompt = t->find("generation_prompt");
  if (message != t->end() && message->is_string()) out.message = message->get<std::string>();
  if (prompt != t->end() && prompt->is_string()) out.generation_prompt = prompt->get<std::string>();
  auto stop = t->find("stop");
  if (stop != t->end() && stop->is_array()) {
    for (const json& marker : *stop) {
      if (marker.is_string()) out.stop.push_back(marker.get<std::string>());
    }
  }
  return out;
}

bool IsItemReference(const json& item) {
  if (!item.is_object()) return false;
  auto type = item.find("type");
  if (type != item.end() && !type->is_null()) return *type == "item_reference";
  return item.contains("id") && !item.contains("role") && !item.contains("content");
}

namespace {

// Checks the keys of chat message `m` (role `role`) beyond role and content, as the
// chat API returns and accepts them: an assistant message may carry what a reply
// carries (refusal, annotations, audio: null, an empty tool_calls).
absl::Status CheckChatMessageKeys(const json& m, const std::string& item, const std::string& role) {
  const bool assistant = role == "assistant";
  for (auto it = m.begin(); it != m.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    const std::string field = absl::StrCat(item, ".", key);
    if (key == "role" || key == "content" || key == "name") continue;
    if (key == "type" && v == "message") continue;  // tolerated, as in Responses items
    if (assistant && key == "refusal") {
      if (!v.is_null() && !v.is_string()) return TypeError(field, "a string or null", v);
    } else if (assistant && key == "annotations") {
      if (!v.is_null() && !v.is_array()) return TypeError(field, "an array", v);
    } else if (assistant && (key == "audio" || key == "function_call")) {
      if (!v.is_null()) return Unsupported(field, v, "no audio or function calls");
    } else if (assistant && key == "tool_calls") {
      if (!v.is_null() && !(v.is_array() && v.empty())) return Unsupported(field, v, "no tools");
    } else {
      return Unsupported(field, v, "not a key of a chat message");
    }
  }
  return absl::OkStatus();
}

// Checks the keys of Responses message item `m`: type, role, content, id, status.
absl::Status CheckResponsesItemKeys(const json& m, const std::string& item) {
  for (auto it = m.begin(); it != m.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    const std::string field = absl::StrCat(item, ".", key);
    if (key == "role" || key == "content" || key == "type") continue;
    if (key == "id" || key == "status") {
      if (!v.is_null() && !v.is_string()) return TypeError(field, "a string", v);
    } else {
      return Unsupported(field, v, "message items carry type, id, status, role and content");
    }
  }
  return absl::OkStatus();
}

// An optional participant name (chat `name`): as OpenAI documents it, 1 to 64 of
// a-z, A-Z, 0-9, '_' and '-'.
absl::StatusOr<std::string> ParticipantName(const json& m, const std::string& item) {
  auto name = m.find("name");
  if (name == m.end() || name->is_null()) return std::string();
  const std::string field = item + ".name";
  if (!name->is_string()) return TypeError(field, "a string", *name);
  const std::string& text = name->get_ref<const std::string&>();
  const bool valid =
      !text.empty() && text.size() <= 64 && std::all_of(text.begin(), text.end(), [](char c) {
        return absl::ascii_isalnum(c) || c == '_' || c == '-';
      });
  if (!valid) {
    return FieldError(field, absl::StrCat("'", field,
                                          "' must be 1 to 64 of a-z, A-Z, 0-9, '_' "
                                          "and '-', got ",
                                          Quoted(*name)));
  }
  return text;
}

}  // namespace

absl::StatusOr<std::string> RenderChat(const json& messages, const ChatTemplate& chat_template,
                                       absl::string_view field_name, bool add_generation_prompt,
                                       MessageList list, const ItemTexts* references) {
  const std::string field(field_name);
  const bool chat = list == MessageList::kChat;
  if (!messages.is_array()) return TypeError(field, "an array of messages", messages);
  if (messages.empty()) return FieldError(field, absl::StrCat("'", field, "' must not be empty"));
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string item = absl::StrCat(field, "[", i, "]");
    const json& m = messages[i];
    if (!m.is_object()) return TypeError(item, "an object", m);
    std::string role_name, text;
    if (!chat && IsItemReference(m)) {
      auto id = m.find("id");
      if (id == m.end() || !id->is_string()) {
        return TypeError(item + ".id", "a string", id != m.end() ? *id : json());
      }
      for (auto it = m.begin(); it != m.end(); ++it) {
        if (it.key() != "id" && it.key() != "type") {
          return Unsupported(absl::StrCat(item, ".", it.key()), it.value(),
                             "an item_reference carries type and id");
        }
      }
      if (references != nullptr) {
        auto found = references->find(id->get<std::string>());
        if (found == references->end()) {
          return WithParam(absl::NotFoundError(absl::StrCat("no item ", Quoted(*id))),
                           item + ".id");
        }
        text = found->second;
      }
      role_name = "assistant";
    } else {
      auto type = m.find("type");
      if (type != m.end() && !type->is_null() && *type != "message") {
        return Unsupported(item + ".type", *type, "only message items and item_reference");
      }
      auto role = m.find("role");
      if (role == m.end() || !role->is_string() || role->get<std::string>().empty()) {
        return TypeError(item + ".role", "a non-empty string", role != m.end() ? *role : json());
      }
      role_name = role->get<std::string>();
      if (role_name == "tool" || role_name == "function") {
        return Unsupported(item + ".role", *role, "no tools");
      }
      if (role_name != "system" && role_name != "developer" && role_name != "user" &&
          role_name != "assistant") {
        return FieldError(item + ".role", absl::StrCat("'", item,
                                                       ".role' must be one of system, developer, "
                                                       "user, assistant; got ",
                                                       Quoted(*role)));
      }
      absl::Status keys =
          chat ? CheckChatMessageKeys(m, item, role_name) : CheckResponsesItemKeys(m, item);
      if (!keys.ok()) return keys;
      auto content = m.find("content");
      absl::StatusOr<std::string> content_text =
          ContentText(item + ".content", content != m.end() ? *content : json());
      if (!content_text.ok()) return content_text.status();
      text = std::move(*content_text);
      // A refusal is what the assistant said in place of content.
      if (auto refusal = m.find("refusal");
          text.empty() && refusal != m.end() && refusal->is_string()) {
        text = refusal->get<std::string>();
      }
    }
    std::string label = absl::AsciiStrToUpper(role_name);
    if (chat) {
      absl::StatusOr<std::string> name = ParticipantName(m, item);
      if (!name.ok()) return name.status();
      if (!name->empty()) absl::StrAppend(&label, " (", *name, ")");
    }
    // {role}: upper-cased ("USER", with the participant's name); {Role}: the first
    // letter capitalised ("User", as RWKV's G1 template writes it).
    std::string capitalised = absl::AsciiStrToLower(role_name);
    capitalised[0] = absl::ascii_toupper(static_cast<unsigned char>(capitalised[0]));
    out += absl::StrReplaceAll(chat_template.message,
                               {{"{role}", label}, {"{Role}", capitalised}, {"{content}", text}});
  }
  if (add_generation_prompt) out += chat_template.generation_prompt;
  return out;
}

absl::StatusOr<OpenAiGenerateRequest> ParseGenerateRequest(const json& body,
                                                           OpenAiEndpoint endpoint,
                                                           const ChatTemplate& chat_template,
                                                           int32_t default_max_tokens) {
  switch (endpoint) {
    case OpenAiEndpoint::kCompletions:
      return ParseCompletionsRequest(body);
    case OpenAiEndpoint::kChat:
      return ParseChatRequest(body, chat_template, default_max_tokens);
    case OpenAiEndpoint::kResponses:
      break;
  }
  return ParseResponsesRequest(body, chat_template, default_max_tokens);
}

absl::StatusOr<OpenAiGenerateRequest> ParseGenerateFields(const json& body, int32_t max_tokens,
                                                          bool include_usage,
                                                          const EndpointFields& endpoint_fields) {
  if (!body.is_object()) return FieldError("", "the request body must be a JSON object");
  OpenAiGenerateRequest out;
  GenerateParams& p = out.params;
  p.random_seed = true;
  p.max_tokens = max_tokens;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (v.is_null()) continue;  // null = not sent
    absl::Status error;
    auto set_float = [&](float* target) {
      absl::StatusOr<double> d = GetNumber(key, v);
      if (d.ok()) *target = static_cast<float>(*d);
      return d.status();
    };
    if (key == "model") {
      absl::StatusOr<std::string> s = GetString(key, v);
      if (s.ok()) out.model = std::move(*s);
      error = s.status();
    } else if (key == "stream") {
      absl::StatusOr<bool> b = GetBool(key, v);
      if (b.ok()) out.stream = *b;
      error = b.status();
    } else if (key == "stream_options") {
      if (!v.is_object()) {
        error = TypeError(key, "an object", v);
      } else {
        for (auto o = v.begin(); o != v.end() && error.ok(); ++o) {
          if (o.key() == "include_usage" && include_usage) {
            absl::StatusOr<bool> b = GetBool("stream_options.include_usage", o.value());
            if (b.ok()) out.include_usage = *b;
            error = b.status();
          } else if (o.key() == "include_obfuscation") {
            // Padding against length side channels; the text is the same without it.
            error = GetBool("stream_options.include_obfuscation", o.value()).status();
          } else {
            error = Unsupported("stream_options." + o.key(), o.value(), "unknown option");
          }
        }
      }
    } else if (key == "temperature") {
      error = set_float(&p.sampling.temperature);
    } else if (key == "top_p") {
      error = set_float(&p.sampling.top_p);
    } else if (key == "min_p") {  // extension
      error = set_float(&p.sampling.min_p);
    } else if (key == "repetition_penalty") {  // extension
      error = set_float(&p.sampling.repetition_penalty);
    } else if (key == "top_k") {  // extension
      absl::StatusOr<int32_t> k = GetTokens(key, v);
      if (k.ok()) p.sampling.top_k = *k;
      error = k.status();
    } else if (key == "seed") {
      absl::StatusOr<int64_t> seed = GetInteger(key, v);
      if (seed.ok()) {
        p.sampling.seed = static_cast<uint64_t>(*seed);
        p.random_seed = false;
      }
      error = seed.status();
    } else if (key == "n") {
      // Several choices from one reading of the prompt (docs/http.md "Several choices").
      absl::StatusOr<int64_t> n = GetInteger(key, v);
      if (n.ok() && (*n < 1 || *n > GenerateParams::kMaxChoices)) {
        error = FieldError(key, absl::StrCat("'n' must be in [1, ", GenerateParams::kMaxChoices,
                                             "], got ", *n));
      } else if (n.ok()) {
        p.choices = static_cast<int32_t>(*n);
      } else {
        error = n.status();
      }
    } else if (key == "best_of") {
      absl::StatusOr<int64_t> n = GetInteger(key, v);
      error = !n.ok() ? n.status()
                      : (*n == 1 ? absl::OkStatus()
                                 : Unsupported(key, v,
                                               "no ranking of choices by log-probability (ask "
                                               "for 'n' choices with 'logprobs' and rank them)"));
    } else if (key == "presence_penalty" || key == "frequency_penalty") {
      absl::StatusOr<double> d = GetNumber(key, v);
      if (d.ok() && !(*d >= -2 && *d <= 2)) {
        error = FieldError(key, absl::StrCat("'", key, "' must be in [-2, 2], got ", *d));
      } else if (d.ok()) {
        (key == "presence_penalty" ? p.sampling.presence_penalty : p.sampling.frequency_penalty) =
            static_cast<float>(*d);
      } else {
        error = d.status();
      }
    } else if (key == "logit_bias") {
      // {"token id": value}: ids as decimal strings (OpenAI's form), values in [-100, 100]
      // (SamplingParams::Validate, in the core); the engine checks the ids against the
      // model's vocabulary.
      if (!v.is_object()) {
        error = FieldError(key, "'logit_bias' must be an object of token ids to numbers");
      }
      p.sampling.logit_bias.clear();
      for (auto it = v.is_object() ? v.begin() : v.end(); error.ok() && it != v.end(); ++it) {
        int64_t token = 0;
        if (!absl::SimpleAtoi(it.key(), &token) || token < 0) {
          error = FieldError(
              key, absl::StrCat("'logit_bias' keys must be token ids, got '", it.key(), "'"));
          break;
        }
        absl::StatusOr<double> value = GetNumber(absl::StrCat(key, ".", it.key()), it.value());
        if (!value.ok()) {
          error = value.status();
          break;
        }
        if (!(*value >= -100 && *value <= 100)) {
          error = FieldError(key, absl::StrCat("'logit_bias' values must be in [-100, 100], got ",
                                               *value, " for token ", token));
          break;
        }
        p.sampling.logit_bias.emplace_back(token, static_cast<float>(*value));
      }
      std::sort(p.sampling.logit_bias.begin(), p.sampling.logit_bias.end());
    } else if (key == "user") {
      error = GetString(key, v).status();
      if (error.ok()) out.user = v;
    } else if (std::optional<absl::Status> own = endpoint_fields(key, v, &out); own.has_value()) {
      error = std::move(*own);
    } else {
      error = FieldError(key, absl::StrCat("unknown field '", key, "'"));
    }
    if (!error.ok()) return error;
  }
  return out;
}

absl::Status FinishGenerateRequest(OpenAiGenerateRequest* request) {
  if (!request->stream && request->include_usage) {
    return FieldError("stream_options", "'stream_options' needs 'stream': true");
  }
  request->params.logprobs = request->logprobs;
  if (request->params.top_logprobs > 0 && !request->logprobs) {
    return FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  if (absl::Status structured = FinishStructuredOutput(&request->structured); !structured.ok()) {
    return structured;
  }
  request->params.constraint = request->structured.grammar;
  return absl::OkStatus();
}

std::optional<absl::Status> ParseEchoedField(const std::string& key, const json& v,
                                             OpenAiGenerateRequest* request) {
  if (key == "prompt_cache_key" || key == "safety_identifier") {
    absl::Status error = GetString(key, v).status();
    if (error.ok())
      (key == "prompt_cache_key" ? request->prompt_cache_key : request->safety_identifier) = v;
    return error;
  }
  if (key == "metadata") {
    if (!v.is_object()) return TypeError(key, "an object", v);
    request->metadata = v;
    return absl::OkStatus();
  }
  if (key == "service_tier") {
    // Which capacity pool serves the request: one pool here, the output is the same.
    static const std::set<std::string> kTiers = {"auto", "default", "flex", "scale", "priority"};
    if (!v.is_string() || kTiers.count(v.get<std::string>()) == 0) {
      return TypeError(key, "one of auto, default, flex, scale, priority", v);
    }
    request->service_tier = v == "auto" ? json("default") : v;
    return absl::OkStatus();
  }
  if (key == "parallel_tool_calls") {
    absl::Status error = GetBool(key, v).status();  // meaningless without tools
    if (error.ok()) request->parallel_tool_calls = v;
    return error;
  }
  return std::nullopt;
}

std::string StopFilter::Push(absl::string_view text) {
  if (stopped_) return "";
  held_.append(text.data(), text.size());
  if (stop_.empty()) {
    std::string out;
    out.swap(held_);
    return out;
  }
  // The earliest complete stop string ends the text.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t keep = 0;
  for (const std::string& s : stop_) {
    for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n) {
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopFilter::Finish() {
  std::string out;
  if (!stopped_) out.swap(held_);
  return out;
}

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

}  // namespace fwserve
