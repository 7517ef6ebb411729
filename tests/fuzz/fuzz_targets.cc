// libFuzzer targets for the parsers that read untrusted bytes. Built with clang
// -fsanitize=fuzzer they fuzz; built normally (tests/fuzz/regression_main.cc) they
// replay the seed corpora under tests/fuzz/corpus as ctest regression tests.
//
// Selected with FWSERVE_FUZZ_<NAME> at compile time: safetensors, config, utf8, api_keys,
// http_request (raw HTTP/1.1 bytes through Beast's request parser with the server's
// limits, the router's pure steps and the OpenAI JSON-to-request mapping of
// server/transport/http/openai_api.h). Each target's invariants trap when broken.
//
// To fuzz one: the clang sanitizer build of the fuzz_<name>_sanitized tests (made by
// `ctest -R fuzz_sanitizer_build`) also defines libFuzzer binaries fuzz_<name>:
//   ninja -C build/fuzz-sanitized fuzz_http_request
//   mkdir -p /tmp/http-corpus && fuzz=build/fuzz-sanitized/tests/fuzz/fuzz_http_request
//   $fuzz -max_total_time=300 -max_len=4096 -dict=tests/fuzz/http_request.dict
//       /tmp/http-corpus tests/fuzz/corpus/http_request           (one command line)
// New inputs go to the first directory. A crash is written to crash-<sha1>; shrink it
// with -minimize_crash=1 -runs=10000 and add it to the seed corpus once fixed.
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/base/config.h"
#include "models/checkpoints/safetensors.h"
#include "models/tokenizers/tokenizer.h"
#include "server/base/utf8.h"
#include "server/tenancy/authenticator.h"
#include "server/tenancy/tenants.h"

#ifdef FWSERVE_FUZZ_HTTP_REQUEST
#include <boost/asio/buffer.hpp>
#include <boost/beast/http.hpp>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/transport/http/openai_api.h"

namespace {

namespace http = boost::beast::http;
using json = nlohmann::json;

// The server's limits (HttpServerOptions' defaults): a Content-Length over the body
// limit fails at once. Fuzz with -max_len=4096 or so: the largest seed (deep_nesting,
// which needs 100000 levels to overflow a stack) would set it otherwise.
constexpr uint64_t kMaxBodyBytes = uint64_t{4} << 20;
constexpr uint32_t kMaxHeaderBytes = 16 << 10;
// Pipelined requests read from one input, each by a fresh parser (Connection::DoRead).
constexpr int kMaxRequests = 4;
// The one key of the target's tenant table (tenant "fuzz"); the seeds send it.
constexpr char kApiKey[] = "sk-fuzz";

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

bool IsUtf8(absl::string_view text) {
  return fwserve::FirstInvalidUtf8Offset(std::string_view(text.data(), text.size())) == -1;
}

// Dump promises valid UTF-8 JSON that parses back, never an exception.
std::string CheckedDump(const json& value) {
  const std::string text = fwserve::Dump(value);
  Check(IsUtf8(text));
  Check(!json::parse(text, nullptr, /*allow_exceptions=*/false).is_discarded());
  return text;
}

// HttpStatusOf and ErrorJson of any status: a code of the documented set, and an error
// object of exactly message/type/param/code that survives Dump.
void CheckError(const absl::Status& status, int http_status) {
  static const std::set<int> kCodes = {200, 400, 401, 403, 404, 409, 429, 499, 500, 501, 503, 504};
  Check(kCodes.count(fwserve::HttpStatusOf(status)) == 1);
  Check((fwserve::HttpStatusOf(status) == 200) == status.ok());
  const json body = fwserve::ErrorJson(status, http_status);
  Check(body.is_object() && body.size() == 1 && body.contains("error"));
  const json& error = body["error"];
  Check(error.is_object() && error.size() == 4);
  Check(error.contains("message") && error["message"].is_string() &&
        error["message"].get<std::string>() == status.message());
  Check(error.contains("type") && error["type"].is_string());
  const std::string param = fwserve::ParamOf(status);
  Check(error.contains("param") &&
        (param.empty() ? error["param"].is_null() : error["param"] == param));
  Check(error.contains("code") && (error["code"].is_null() || error["code"].is_string()));
  if (http_status == 401) Check(error["type"] == "authentication_error");
  if (http_status >= 500) Check(error["type"] == "server_error");
  const json back = json::parse(CheckedDump(body), nullptr, false);
  // Valid UTF-8 is kept as is (only invalid bytes are replaced).
  if (IsUtf8(status.message())) Check(back["error"]["message"] == std::string(status.message()));
}

// An error of the JSON-to-request mapping: INVALID_ARGUMENT (400) whose param, when
// set, names a field of `body` ("key", "key.sub", "key[i]...") or a required one.
void CheckFieldError(const absl::Status& status, const json& body) {
  Check(status.code() == absl::StatusCode::kInvalidArgument);
  Check(fwserve::HttpStatusOf(status) == 400);
  CheckError(status, 400);
  const std::string param = fwserve::ParamOf(status);
  if (param.empty()) return;
  static const std::set<std::string> kRequired = {"prompt", "messages", "input"};
  bool named = kRequired.count(param) == 1;
  if (body.is_object()) {
    for (auto it = body.begin(); it != body.end() && !named; ++it) {
      const std::string& key = it.key();
      named = param == key || (absl::StartsWith(param, key) &&
                               (param[key.size()] == '.' || param[key.size()] == '['));
    }
  }
  Check(named);
}

// The fields each endpoint accepts (docs/http.md); an accepted body has no other
// non-null field. A field added to ParseGenerateRequest goes here too.
const std::set<std::string>& Fields(fwserve::OpenAiEndpoint endpoint) {
  static const auto with = [](std::set<std::string> fields) {
    for (const char* common :
         {"model", "stream", "temperature", "top_p", "min_p", "repetition_penalty", "top_k", "seed",
          "n", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "user"}) {
      fields.insert(common);
    }
    return fields;
  };
  static const std::set<std::string> kCompletions =
      with({"stream_options", "max_tokens", "stop", "session_id", "prompt", "logprobs", "echo",
            "suffix"});
  static const std::set<std::string> kChat =
      with({"stream_options", "max_tokens", "max_completion_tokens", "stop", "session_id",
            "metadata", "messages", "logprobs", "top_logprobs", "store", "response_format", "tools",
            "tool_choice", "parallel_tool_calls", "service_tier", "modalities", "prompt_cache_key",
            "safety_identifier"});
  static const std::set<std::string> kResponses =
      with({"max_output_tokens", "metadata", "store", "tools", "tool_choice", "parallel_tool_calls",
            "input", "instructions", "previous_response_id", "conversation", "text", "truncation",
            "background", "include", "reasoning", "stream_options", "service_tier",
            "prompt_cache_key", "safety_identifier"});
  switch (endpoint) {
    case fwserve::OpenAiEndpoint::kCompletions:
      return kCompletions;
    case fwserve::OpenAiEndpoint::kChat:
      return kChat;
    default:
      return kResponses;
  }
}

// A non-null member of `body`, or null.
const json* Member(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// ParseGenerateRequest's contract (openai_api.h) on one endpoint.
void CheckGenerate(const json& body, fwserve::OpenAiEndpoint endpoint,
                   const fwserve::ChatTemplate& chat_template, int32_t default_max_tokens) {
  using fwserve::OpenAiEndpoint;
  absl::StatusOr<fwserve::OpenAiGenerateRequest> request =
      fwserve::ParseGenerateRequest(body, endpoint, chat_template, default_max_tokens);
  if (!request.ok()) {
    CheckFieldError(request.status(), body);
    return;
  }
  Check(body.is_object());
  for (auto it = body.begin(); it != body.end(); ++it) {
    Check(it->is_null() || Fields(endpoint).count(it.key()) == 1);
  }
  const fwserve::GenerateParams& p = request->params;
  Check(p.max_tokens >= 0 && p.sampling.top_k >= 0);
  const bool completions = endpoint == OpenAiEndpoint::kCompletions;
  const bool chat = endpoint == OpenAiEndpoint::kChat;
  const bool responses = endpoint == OpenAiEndpoint::kResponses;
  const bool max_given = Member(body, "max_tokens") != nullptr ||
                         Member(body, "max_completion_tokens") != nullptr ||
                         Member(body, "max_output_tokens") != nullptr;
  if (!max_given) Check(p.max_tokens == (completions ? 16 : default_max_tokens));
  Check(p.random_seed == (Member(body, "seed") == nullptr));
  Check(p.logprobs == request->logprobs);
  Check(p.stop.size() <= 4);
  for (const std::string& s : p.stop) Check(!s.empty());
  if (responses) Check(p.stop.empty());
  Check(!request->include_usage || request->stream);
  const json* model = Member(body, "model");
  Check(request->model == (model != nullptr ? model->get<std::string>() : std::string()));
  if (completions) {
    const json& prompt = *Member(body, "prompt");
    Check(p.prompt == (prompt.is_array() ? prompt[0] : prompt).get<std::string>());
  }
  if (chat) {
    // The prompt is the rendered messages, ending with the generation prompt.
    absl::StatusOr<std::string> rendered =
        fwserve::RenderChat(*Member(body, "messages"), chat_template, "messages");
    Check(rendered.ok() && *rendered == p.prompt);
    Check(absl::EndsWith(p.prompt, chat_template.generation_prompt));
    // max_completion_tokens wins over max_tokens.
    if (const json* max = Member(body, "max_completion_tokens"); max != nullptr) {
      Check(p.max_tokens == max->get<int64_t>());
    }
  }
  if (responses) {
    Check(Member(body, "input") != nullptr);
    Check(request->previous_response_id.empty() || request->conversation.empty());
    Check(absl::EndsWith(p.prompt, chat_template.generation_prompt));
  }
}

// RenderChat's contract on `messages` (any JSON): errors name `field`; the prompt with
// the generation prompt is the prompt without it, followed by it.
void CheckRenderChat(const json& messages, const fwserve::ChatTemplate& chat_template,
                     const char* field) {
  absl::StatusOr<std::string> with = fwserve::RenderChat(messages, chat_template, field);
  absl::StatusOr<std::string> without =
      fwserve::RenderChat(messages, chat_template, field, /*add_generation_prompt=*/false);
  Check(with.ok() == without.ok());
  if (!with.ok()) {
    Check(with.status() == without.status());
    Check(with.status().code() == absl::StatusCode::kInvalidArgument);
    Check(absl::StartsWith(fwserve::ParamOf(with.status()), field));
    CheckError(with.status(), 400);
    return;
  }
  Check(*with == *without + chat_template.generation_prompt);
}

// Two non-empty stop strings cut from `text` (empty when it is shorter than 2 bytes):
// its bytes at a place its first byte picks, and from its middle.
std::vector<std::string> StopStrings(absl::string_view text) {
  if (text.size() < 2) return {};
  const size_t at = static_cast<uint8_t>(text[0]) % text.size();
  return {std::string(text.substr(at, 1 + static_cast<uint8_t>(text[1]) % 6)),
          std::string(text.substr(text.size() / 2, 3))};
}

// StopFilter over `text` pushed in the pieces `cuts` gives: the output is a prefix of
// the text holding no stop string; the filter stops exactly when the text holds one,
// and then the text goes on with a stop string where the output ends; otherwise the
// output is the whole text.
void CheckStopFilter(const std::vector<std::string>& stop, absl::string_view text,
                     absl::string_view cuts) {
  fwserve::StopFilter filter(stop);
  std::string out;
  size_t at = 0;
  for (size_t i = 0; at < text.size(); ++i) {
    const size_t n = i < cuts.size() ? static_cast<uint8_t>(cuts[i]) % 8 : text.size();
    const bool was_stopped = filter.stopped();
    const std::string piece = filter.Push(text.substr(at, n));
    if (was_stopped) Check(piece.empty());
    out += piece;
    at += std::min(n, text.size() - at);
  }
  const bool stopped = filter.stopped();
  const std::string rest = filter.Finish();
  if (stopped) Check(rest.empty());
  out += rest;
  Check(absl::StartsWith(text, out));
  bool holds_stop = false;
  bool stop_follows = false;
  for (const std::string& s : stop) {
    Check(out.find(s) == std::string::npos);
    holds_stop = holds_stop || text.find(s) != absl::string_view::npos;
    stop_follows = stop_follows || absl::StartsWith(text.substr(out.size()), s);
  }
  Check(stopped == holds_stop);
  if (stopped) {
    Check(stop_follows);
  } else {
    Check(out == text);
  }
}

// The route label is "<method> <route>", the route one of a fixed set.
void CheckRouteLabel(const std::string& method, const fwserve::RequestTarget& target) {
  static const std::set<std::string> kRoutes = {"/",
                                                "/health",
                                                "/ready",
                                                "/v1/models",
                                                "/v1/models/{model}",
                                                "/v1/completions",
                                                "/v1/chat/completions",
                                                "/v1/responses",
                                                "/v1/responses/{id}",
                                                "/v1/conversations",
                                                "/v1/conversations/{id}",
                                                "/fwserve/v1/sessions",
                                                "/fwserve/v1/sessions/import",
                                                "/fwserve/v1/sessions/{id}",
                                                "/fwserve/v1/sessions/{id}/fork",
                                                "/fwserve/v1/sessions/{id}/export",
                                                "(other)"};
  const std::string label = fwserve::RouteLabel(method, target);
  Check(absl::StartsWith(label, method + " "));
  Check(kRoutes.count(label.substr(method.size() + 1)) == 1);
}

// The router's pure steps on one target: the split is of the target, and the label set
// is bounded.
void CheckTarget(absl::string_view raw, const std::string& method) {
  const fwserve::RequestTarget target = fwserve::SplitTarget(raw);
  Check(target.path.find('?') == std::string::npos);
  Check(absl::StartsWith(raw, target.path));
  Check(target.path.size() <= 1 || target.path.back() != '/');
  if (raw.find('?') != absl::string_view::npos) Check(absl::EndsWith(raw, "?" + target.query));
  size_t segment_bytes = 0;
  for (const std::string& part : target.parts) {
    Check(!part.empty() && part.find('/') == std::string::npos);
    segment_bytes += part.size();
  }
  Check(segment_bytes <= target.path.size());
  CheckRouteLabel(method, target);
  // Decoding never grows a key or value.
  size_t decoded = 0;
  for (const auto& [key, value] : fwserve::ParseQuery(target.query)) {
    decoded += key.size() + value.size();
  }
  Check(decoded <= target.query.size());
}

// The Authorization header as both front doors read it (tenancy's BearerKey, which
// ApiKeyAuthenticator applies): UNAUTHENTICATED (401) unless a "Bearer" key is given,
// and only the configured key names its tenant.
void CheckAuthorization(absl::string_view header) {
  static const std::unique_ptr<fwserve::Tenants> tenants = [] {
    auto t = fwserve::Tenants::FromText(
        absl::StrCat("sha256:", fwserve::Sha256Hex(kApiKey), " tenant=fuzz\n"));
    Check(t.ok());
    return std::move(*t);
  }();
  absl::StatusOr<std::string> key = fwserve::BearerKey(header);
  if (!key.ok()) {
    Check(key.status().code() == absl::StatusCode::kUnauthenticated);
    Check(fwserve::HttpStatusOf(key.status()) == 401);
    CheckError(key.status(), 401);
    return;
  }
  Check(absl::StartsWithIgnoreCase(header, "bearer "));
  Check(key->empty() || (!absl::ascii_isspace(key->front()) && !absl::ascii_isspace(key->back())));
  Check(header.find(*key) != absl::string_view::npos);
  absl::StatusOr<std::string> tenant = tenants->TenantOfKey(*key);
  Check(tenant.ok() == (*key == kApiKey));
  if (tenant.ok()) Check(*tenant == "fuzz");
  if (!tenant.ok()) Check(tenant.status().code() == absl::StatusCode::kUnauthenticated);
}

// One parsed request through what HttpServer::Impl::Handle and its handlers do before
// the core: route, authenticate, parse the body and map it for every endpoint.
void CheckRequest(const http::request<http::string_body>& request) {
  const std::string method = request.method() == http::verb::unknown
                                 ? "OTHER"
                                 : std::string(http::to_string(request.method()));
  CheckTarget(absl::string_view(request.target().data(), request.target().size()), method);
  const auto authorization = request[http::field::authorization];
  CheckAuthorization(absl::string_view(authorization.data(), authorization.size()));

  const std::string& text = request.body();
  absl::StatusOr<json> body = fwserve::ParseBody(text, /*empty_ok=*/false);
  absl::StatusOr<json> empty_ok = fwserve::ParseBody(text, /*empty_ok=*/true);
  Check(body.ok() == empty_ok.ok() || (text.empty() && empty_ok.ok()));
  if (!body.ok()) {
    Check(body.status().code() == absl::StatusCode::kInvalidArgument);
    Check(fwserve::ParamOf(body.status()).empty());
    CheckError(body.status(), 400);
    return;
  }
  Check(body->is_object());
  // The model's template: the default, and one from the body as if it were a config.
  const fwserve::ChatTemplate default_template;
  const fwserve::ChatTemplate config_template = fwserve::ChatTemplateOf(text);
  for (const fwserve::ChatTemplate* chat_template : {&default_template, &config_template}) {
    for (auto endpoint : {fwserve::OpenAiEndpoint::kCompletions, fwserve::OpenAiEndpoint::kChat,
                          fwserve::OpenAiEndpoint::kResponses}) {
      CheckGenerate(*body, endpoint, *chat_template, 256);
    }
    for (const char* field : {"messages", "input", "items"}) {
      if (const json* messages = Member(*body, field)) {
        CheckRenderChat(*messages, *chat_template, field);
      }
    }
  }
  // Stop strings: the request's own, else two cut from the body, over the prompt and
  // over the body (where the request's own stop strings occur, as JSON text).
  absl::StatusOr<fwserve::OpenAiGenerateRequest> request_params = fwserve::ParseGenerateRequest(
      *body, fwserve::OpenAiEndpoint::kCompletions, default_template, 256);
  std::vector<std::string> stop;
  if (request_params.ok()) stop = request_params->params.stop;
  if (stop.empty()) stop = StopStrings(text);
  if (request_params.ok()) CheckStopFilter(stop, request_params->params.prompt, text);
  CheckStopFilter(stop, text, text.substr(text.size() / 3));
}

}  // namespace
#endif  // FWSERVE_FUZZ_HTTP_REQUEST

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
#if defined(FWSERVE_FUZZ_SAFETENSORS)
  auto file = fwmodel::SafetensorsFile::Parse(input);
  if (file.ok()) {
    // Every accepted tensor must lie inside the buffer: touch all of its bytes.
    for (const auto& [name, view] : file->tensors()) {
      volatile float sink = 0;
      for (float f : view.ToFloat32()) sink = sink + f;
    }
  }
#elif defined(FWSERVE_FUZZ_CONFIG)
  auto config = fwmodel::ParseModelConfig(input);
  if (config.ok()) {
    // Accepted configs are valid and round-trip through the canonical form.
    if (!config->Validate().ok()) __builtin_trap();
    auto again = fwmodel::ParseModelConfig(fwmodel::ModelConfigToJson(*config));
    if (!again.ok() || !(*again == *config)) __builtin_trap();
  }
#elif defined(FWSERVE_FUZZ_UTF8)
  // Streamed output is always valid UTF-8 and equals the whole-input decode.
  fwmodel::Utf8StreamDecoder decoder;
  std::string streamed;
  for (char c : input) streamed += decoder.Push(static_cast<uint8_t>(c));
  streamed += decoder.Finish();
  if (streamed != fwmodel::DecodeBytesLossy(input)) __builtin_trap();
  if (fwmodel::DecodeBytesLossy(streamed) != streamed) __builtin_trap();
  // The server's request validator agrees with the decoder: input is valid UTF-8 exactly
  // when decoding leaves it unchanged, and the decoder's output is always valid.
  const bool valid = fwserve::FirstInvalidUtf8Offset(input) == -1;
  if (valid != (fwmodel::DecodeBytesLossy(input) == input)) __builtin_trap();
  if (fwserve::FirstInvalidUtf8Offset(streamed) != -1) __builtin_trap();
#elif defined(FWSERVE_FUZZ_API_KEYS)
  // An accepted --api-keys-file is consistent: every credential names a listed tenant,
  // tenant names are valid and unique, quotas are finite and non-negative, and the
  // table answers for each listed certificate.
  auto table = fwserve::ParseApiKeys(input);
  if (table.ok()) {
    if (table->keys.empty() && table->certificates.empty()) __builtin_trap();
    for (size_t i = 0; i < table->tenants.size(); ++i) {
      const auto& tenant = table->tenants[i];
      if (!fwserve::IsValidTenantName(tenant.name)) __builtin_trap();
      for (size_t j = 0; j < i; ++j) {
        if (table->tenants[j].name == tenant.name) __builtin_trap();
      }
      if (tenant.quota.max_sessions < 0 || tenant.quota.max_streams < 0 ||
          !(tenant.quota.tokens_per_second >= 0)) {
        __builtin_trap();
      }
    }
    for (const auto& key : table->keys) {
      if (key.tenant >= table->tenants.size()) __builtin_trap();
    }
    auto tenants = fwserve::Tenants::FromText(input);
    if (!tenants.ok()) __builtin_trap();
    for (const auto& certificate : table->certificates) {
      if (certificate.tenant >= table->tenants.size()) __builtin_trap();
      auto owner = (*tenants)->TenantOfCertificate(certificate.common_name);
      if (!owner.ok() || *owner != table->tenants[certificate.tenant].name) __builtin_trap();
    }
    if ((*tenants)->TenantOfKey("").ok()) __builtin_trap();
  }
#elif defined(FWSERVE_FUZZ_HTTP_REQUEST)
  // Raw bytes as a connection delivers them: up to kMaxRequests pipelined requests, each
  // parsed with the server's checks (a body or header limit, a malformed request, or
  // the end of the input ends the connection), then routed and mapped (CheckRequest).
  absl::string_view rest(input);
  for (int i = 0; i < kMaxRequests && !rest.empty(); ++i) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(kMaxBodyBytes);
    parser.header_limit(kMaxHeaderBytes);
    parser.eager(true);
    boost::beast::error_code ec;
    size_t used = 0;
    // No more bytes: the client closed the connection, which async_read reports so.
    auto end_of_input = [&] {
      if (parser.got_some()) parser.put_eof(ec);
      if (!ec && !parser.is_done()) ec = http::error::partial_message;
    };
    while (!parser.is_done() && !ec) {
      if (used == rest.size()) {
        end_of_input();
        break;
      }
      const size_t n = parser.put(boost::asio::buffer(rest.data() + used, rest.size() - used), ec);
      used += n;
      if (ec == http::error::need_more) {
        ec = {};
        if (n == 0) end_of_input();  // more than the rest of the input is needed
      }
    }
    // The server's answers to parse errors (Connection::OnRead) are well-formed.
    if (ec == http::error::body_limit) CheckError(absl::InvalidArgumentError("too large"), 413);
    if (ec == http::error::header_limit) CheckError(absl::InvalidArgumentError("headers"), 431);
    if (ec || !parser.is_done()) break;
    CheckRequest(parser.get());
    rest.remove_prefix(used);
  }
  // The same checks on the raw bytes, whatever Beast made of them.
  CheckAuthorization(input);
  CheckTarget(input, "GET");
  CheckError(fwserve::FieldError(input, input),
             size > 0 ? 400 + static_cast<uint8_t>(input[0]) % 200 : 400);
  CheckError(absl::Status(static_cast<absl::StatusCode>(size % 17), input), 500);
  {
    const json raw = input;  // invalid UTF-8 is replaced, valid text kept
    const json back = json::parse(CheckedDump(raw), nullptr, false);
    if (IsUtf8(input)) Check(back == input);
  }
  CheckStopFilter(StopStrings(input), input, absl::string_view(input).substr(size / 2));
#else
#error "define one FWSERVE_FUZZ_* target"
#endif
  return 0;
}
