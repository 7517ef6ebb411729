#include "server/transport/http/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace fwserve {
namespace {

using json = nlohmann::json;

constexpr char kParamPayload[] = "type.fwserve/http.param";

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

absl::Status TypeError(const std::string& field, absl::string_view expected, const json& value) {
  return FieldError(field,
                    absl::StrCat("'", field, "' must be ", expected, ", got ", Quoted(value)));
}

absl::StatusOr<bool> GetBool(const std::string& field, const json& value) {
  if (!value.is_boolean()) return TypeError(field, "a boolean", value);
  return value.get<bool>();
}

absl::StatusOr<double> GetNumber(const std::string& field, const json& value) {
  if (!value.is_number()) return TypeError(field, "a number", value);
  return value.get<double>();
}

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

// Stop strings: a string or an array of at most 4 non-empty strings.
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

}  // namespace

absl::Status FieldError(absl::string_view field, absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kParamPayload, absl::Cord(field));
  return status;
}

std::string ParamOf(const absl::Status& status) {
  auto param = status.GetPayload(kParamPayload);
  return param.has_value() ? std::string(*param) : std::string();
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
  const std::string param = ParamOf(status);
  json error = {{"message", std::string(status.message())},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code}};
  return json{{"error", std::move(error)}};
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

absl::StatusOr<std::string> BearerKey(absl::string_view authorization) {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("no API key: send the header 'Authorization: Bearer <key>'");
  }
  if (authorization.size() > 7 && absl::EqualsIgnoreCase(authorization.substr(0, 7), "bearer ")) {
    return std::string(absl::StripAsciiWhitespace(authorization.substr(7)));
  }
  return absl::UnauthenticatedError("the Authorization header must be 'Bearer <key>'");
}

std::string RouteLabel(absl::string_view method, const RequestTarget& target) {
  const std::vector<std::string>& parts = target.parts;
  const size_t n = parts.size();
  const char* route = "(other)";
  if (target.path == "/health" || target.path == "/ready") {
    route = target.path == "/health" ? "/health" : "/ready";
  } else if (target.path == "/") {
    route = "/";  // the web playground
  } else if (n >= 2 && parts[0] == "v1") {
    const std::string& what = parts[1];
    if (n == 2 && what == "models") route = "/v1/models";
    if (n == 3 && what == "models") route = "/v1/models/{model}";
    if (n == 2 && what == "completions") route = "/v1/completions";
    if (n == 3 && what == "chat" && parts[2] == "completions") route = "/v1/chat/completions";
    if (n == 2 && what == "responses") route = "/v1/responses";
    if (n == 3 && what == "responses") route = "/v1/responses/{id}";
    if (n == 2 && what == "conversations") route = "/v1/conversations";
    if (n == 3 && what == "conversations") route = "/v1/conversations/{id}";
  } else if (n >= 3 && parts[0] == "fwserve" && parts[1] == "v1" && parts[2] == "sessions") {
    if (n == 3) route = "/fwserve/v1/sessions";
    if (n == 4 && parts[3] == "import") route = "/fwserve/v1/sessions/import";
    if (n == 4 && parts[3] != "import") route = "/fwserve/v1/sessions/{id}";
    if (n == 5 && parts[4] == "fork") route = "/fwserve/v1/sessions/{id}/fork";
    if (n == 5 && parts[4] == "export") route = "/fwserve/v1/sessions/{id}/export";
  }
  return absl::StrCat(method, " ", route);
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
  return out;
}

absl::StatusOr<std::string> RenderChat(const json& messages, const ChatTemplate& chat_template,
                                       absl::string_view field_name, bool add_generation_prompt) {
  const std::string field(field_name);
  if (!messages.is_array()) return TypeError(field, "an array of messages", messages);
  if (messages.empty()) return FieldError(field, absl::StrCat("'", field, "' must not be empty"));
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string item = absl::StrCat(field, "[", i, "]");
    const json& m = messages[i];
    if (!m.is_object()) return TypeError(item, "an object", m);
    auto type = m.find("type");
    if (type != m.end() && !(type->is_string() && type->get<std::string>() == "message")) {
      return Unsupported(item + ".type", *type, "only message items");
    }
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (it.key() != "role" && it.key() != "content" && it.key() != "type" && it.key() != "name") {
        return Unsupported(absl::StrCat(item, ".", it.key()), it.value(),
                           "messages carry only role and content");
      }
    }
    auto role = m.find("role");
    if (role == m.end() || !role->is_string() || role->get<std::string>().empty()) {
      return TypeError(item + ".role", "a non-empty string", role != m.end() ? *role : json());
    }
    auto content = m.find("content");
    absl::StatusOr<std::string> text =
        ContentText(item + ".content", content != m.end() ? *content : json());
    if (!text.ok()) return text.status();
    // {role}: upper-cased ("USER"); {Role}: the first letter capitalised ("User", as
    // RWKV's G1 template writes it).
    std::string capitalised = absl::AsciiStrToLower(role->get<std::string>());
    capitalised[0] = absl::ascii_toupper(static_cast<unsigned char>(capitalised[0]));
    out += absl::StrReplaceAll(chat_template.message,
                               {{"{role}", absl::AsciiStrToUpper(role->get<std::string>())},
                                {"{Role}", capitalised},
                                {"{content}", *text}});
  }
  if (add_generation_prompt) out += chat_template.generation_prompt;
  return out;
}

absl::StatusOr<OpenAiGenerateRequest> ParseGenerateRequest(const json& body,
                                                           OpenAiEndpoint endpoint,
                                                           const ChatTemplate& chat_template,
                                                           int32_t default_max_tokens) {
  if (!body.is_object()) return FieldError("", "the request body must be a JSON object");
  OpenAiGenerateRequest out;
  GenerateParams& p = out.params;
  p.random_seed = true;
  p.max_tokens = endpoint == OpenAiEndpoint::kCompletions ? 16 : default_max_tokens;
  const bool completions = endpoint == OpenAiEndpoint::kCompletions;
  const bool chat = endpoint == OpenAiEndpoint::kChat;
  const bool responses = endpoint == OpenAiEndpoint::kResponses;
  bool have_prompt = false;
  const json* input = nullptr;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (v.is_null()) continue;  // null = not sent
    absl::Status error;
    auto set_string = [&](std::string* target) {
      absl::StatusOr<std::string> s = GetString(key, v);
      if (s.ok()) *target = std::move(*s);
      return s.status();
    };
    auto set_float = [&](float* target) {
      absl::StatusOr<double> d = GetNumber(key, v);
      if (d.ok()) *target = static_cast<float>(*d);
      return d.status();
    };
    auto must_be = [&](const json& expected, absl::string_view why) {
      return v == expected ? absl::OkStatus() : Unsupported(key, v, why);
    };
    if (key == "model") {
      error = set_string(&out.model);
    } else if (key == "stream") {
      absl::StatusOr<bool> b = GetBool(key, v);
      if (b.ok()) out.stream = *b;
      error = b.status();
    } else if (key == "stream_options" && !responses) {
      if (!v.is_object()) {
        error = TypeError(key, "an object", v);
      } else {
        for (auto o = v.begin(); o != v.end() && error.ok(); ++o) {
          if (o.key() == "include_usage") {
            absl::StatusOr<bool> b = GetBool("stream_options.include_usage", o.value());
            if (b.ok()) out.include_usage = *b;
            error = b.status();
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
    } else if (((completions || chat) && key == "max_tokens") ||
               (chat && key == "max_completion_tokens") ||
               (responses && key == "max_output_tokens")) {
      absl::StatusOr<int32_t> n = GetTokens(key, v);
      if (n.ok()) p.max_tokens = *n;
      error = n.status();
    } else if (key == "seed") {
      absl::StatusOr<int64_t> seed = GetInteger(key, v);
      if (seed.ok()) {
        p.sampling.seed = static_cast<uint64_t>(*seed);
        p.random_seed = false;
      }
      error = seed.status();
    } else if (key == "stop" && !responses) {
      error = ParseStop(v, &p.stop);
    } else if (key == "n" || key == "best_of") {
      absl::StatusOr<int64_t> n = GetInteger(key, v);
      error = !n.ok() ? n.status()
                      : (*n == 1 ? absl::OkStatus()
                                 : Unsupported(key, v,
                                               "one choice per request (fork a session "
                                               "and send a request per fork)"));
    } else if (key == "presence_penalty" || key == "frequency_penalty") {
      absl::StatusOr<double> d = GetNumber(key, v);
      error = !d.ok() ? d.status()
                      : (*d == 0 ? absl::OkStatus()
                                 : Unsupported(key, v, "use the extension 'repetition_penalty'"));
    } else if (key == "logit_bias") {
      error = v.is_object() && v.empty() ? absl::OkStatus() : Unsupported(key, v, "no logit bias");
    } else if (key == "user" || (key == "metadata" && !completions)) {
      if (key == "user" && !v.is_string()) error = TypeError(key, "a string", v);
      if (key == "metadata" && !v.is_object()) error = TypeError(key, "an object", v);
    } else if (key == "session_id" && !responses) {  // extension
      error = set_string(&p.session_id);
    } else if (completions && key == "prompt") {
      if (v.is_array() && v.size() == 1 && v[0].is_string()) {
        p.prompt = v[0].get<std::string>();
      } else if (v.is_array()) {
        error = Unsupported(key, v, "one prompt string per request");
      } else {
        error = set_string(&p.prompt);
      }
      have_prompt = error.ok();
    } else if (completions && key == "logprobs") {
      absl::StatusOr<int64_t> n = GetInteger(key, v);
      error = !n.ok() ? n.status()
                      : (*n == 0 ? absl::OkStatus()
                                 : Unsupported(key, v,
                                               "only the sampled tokens' logprobs "
                                               "(logprobs: 0)"));
      out.logprobs = error.ok();
    } else if (completions && key == "echo") {
      error = must_be(false, "the prompt is not echoed");
    } else if (completions && key == "suffix") {
      error = Unsupported(key, v, "no insertion");
    } else if (chat && key == "messages") {
      absl::StatusOr<std::string> prompt = RenderChat(v, chat_template, "messages");
      if (prompt.ok()) p.prompt = std::move(*prompt);
      error = prompt.status();
      have_prompt = error.ok();
    } else if (chat && key == "logprobs") {
      absl::StatusOr<bool> b = GetBool(key, v);
      if (b.ok()) out.logprobs = *b;
      error = b.status();
    } else if (chat && key == "top_logprobs") {
      error = must_be(0, "only the sampled tokens' logprobs");
    } else if ((chat || responses) && key == "store") {
      absl::StatusOr<bool> b = GetBool(key, v);
      if (b.ok()) out.store = *b;
      error = b.status();
      if (error.ok() && chat && *b) error = Unsupported(key, v, "use 'session_id' for state");
    } else if (chat && key == "response_format") {
      error = must_be(json{{"type", "text"}}, "text only");
    } else if ((chat || responses) && key == "tools") {
      error = v.is_array() && v.empty() ? absl::OkStatus() : Unsupported(key, v, "no tools");
    } else if ((chat || responses) && key == "tool_choice") {
      error = must_be("none", "no tools");
    } else if ((chat || responses) && key == "parallel_tool_calls") {
      absl::StatusOr<bool> b = GetBool(key, v);  // meaningless without tools
      error = b.status();
    } else if (responses && key == "input") {
      input = &v;
    } else if (responses && key == "instructions") {
      error = set_string(&out.instructions);
    } else if (responses && key == "previous_response_id") {
      error = set_string(&out.previous_response_id);
    } else if (responses && key == "conversation") {
      if (v.is_object() && v.contains("id")) {
        error = GetString("conversation.id", v["id"]).status();
        if (error.ok()) out.conversation = v["id"].get<std::string>();
      } else {
        error = set_string(&out.conversation);
      }
    } else if (responses && key == "text") {
      error = v == json{{"format", {{"type", "text"}}}} || v == json::object()
                  ? absl::OkStatus()
                  : Unsupported(key, v, "text output only");
    } else if (responses && key == "truncation") {
      error = must_be("disabled", "a recurrent state is never truncated");
    } else if (responses && (key == "background" || key == "include" || key == "reasoning")) {
      error = (v == false || (v.is_array() && v.empty()) || (v.is_object() && v.empty()))
                  ? absl::OkStatus()
                  : Unsupported(key, v, "not supported");
    } else {
      error = FieldError(key, absl::StrCat("unknown field '", key, "'"));
    }
    if (!error.ok()) return error;
  }
  if (responses) {
    if (input == nullptr) return FieldError("input", "'input' is required");
    std::string prompt;
    if (!out.instructions.empty()) {
      absl::StatusOr<std::string> system =
          RenderChat(json::array({{{"role", "system"}, {"content", out.instructions}}}),
                     chat_template, "instructions", false);
      if (!system.ok()) return system.status();
      prompt = *system;
    }
    absl::StatusOr<std::string> rendered =
        input->is_string() ? RenderChat(json::array({{{"role", "user"}, {"content", *input}}}),
                                        chat_template, "input")
                           : RenderChat(*input, chat_template, "input");
    if (!rendered.ok()) return rendered.status();
    p.prompt = prompt + *rendered;
    if (!out.previous_response_id.empty() && !out.conversation.empty()) {
      return FieldError("conversation", "give 'previous_response_id' or 'conversation', not both");
    }
  } else if (!have_prompt) {
    return chat ? FieldError("messages", "'messages' is required")
                : FieldError("prompt", "'prompt' is required");
  }
  if (!out.stream && out.include_usage) {
    return FieldError("stream_options", "'stream_options' needs 'stream': true");
  }
  p.logprobs = out.logprobs;
  return out;
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
