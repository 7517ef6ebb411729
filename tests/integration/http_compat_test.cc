// The HTTP API as OpenAI's SDKs use it (issue 40; docs/http.md): Responses input items
// as the API defines them (our own output sent back, item_reference, message ids),
// chat messages as the API returns them, usage by OpenAI's rule, CORS preflights with
// an SDK's headers, the field policy (one case per row of its table), and the smaller
// protocol points (max-tokens precedence, random ids, incomplete items, float echo,
// model_not_found, HEAD, 405 with Allow, Expect: 100-continue). A real in-process
// server (tests/integration/harness.h) driven over HTTP.
#include <gtest/gtest.h>
#include <poll.h>

#include <boost/asio/read_until.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/transport/http/openai_api.h"
#include "tests/integration/harness.h"
#include "tests/integration/http_client.h"

namespace fwtest {
namespace {

class HttpCompatTest : public ::testing::Test {
 protected:
  static fwserve::CoreOptions Options() {
    fwserve::CoreOptions options;
    options.model_dirs = {ModelDir()};
    return options;
  }
  void SetUp() override { StartServer(); }
  void StartServer(fwserve::HttpServerOptions http = {}) {
    server_ = Harness::Start(Options(), {}, false, http);
    ASSERT_NE(server_, nullptr);
    port_ = server_->http_port();
  }
  json PostOk(const std::string& target, const json& body) {
    Reply r = Post(port_, target, body);
    EXPECT_EQ(r.status, 200) << target << " " << body.dump() << " -> " << r.body;
    return r.Json();
  }
  // The greedy text of `input` as a new response of at most `max` tokens.
  std::string ResponseText(const json& input, int max) {
    json r =
        PostOk("/v1/responses", {{"input", input}, {"max_output_tokens", max}, {"temperature", 0}});
    return r.is_object() && r.contains("output") ? OutputText(r) : "<error>";
  }
  std::string ChatText(const json& messages, int max) {
    json r = PostOk("/v1/chat/completions",
                    {{"messages", messages}, {"max_tokens", max}, {"temperature", 0}});
    return r.is_object() && r.contains("choices") ? r["choices"][0]["message"]["content"]
                                                  : "<error>";
  }
  // A streamed request's events (the JSON chunks, without [DONE]).
  std::vector<json> StreamEvents(const std::string& target, const json& body) {
    Reply r = Post(port_, target, body);
    EXPECT_EQ(r.status, 200) << r.body;
    std::vector<json> events;
    for (const std::string& d : ParseSse(r.body).data) {
      if (d != "[DONE]") events.push_back(json::parse(d));
    }
    return events;
  }
  int64_t SessionTokens(const std::string& id) {
    Reply r = Get(port_, "/fwserve/v1/sessions/" + id);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json().value("tokens", int64_t{-1});
  }

  std::unique_ptr<Harness> server_;
  int port_ = 0;
};

// Item 1: our own response.output sent back as input, an item_reference to it, and the
// message with its id (what SDKs send with store off) all give the text of the same
// history sent as plain messages.
TEST_F(HttpCompatTest, ResponsesInputItemsAsTheApiDefinesThem) {
  json first = PostOk("/v1/responses",
                      {{"input", "Good morrow"}, {"max_output_tokens", 8}, {"temperature", 0}});
  ASSERT_TRUE(first.contains("output"));
  const json item = first["output"][0];
  const std::string reply = OutputText(first);
  const std::string item_id = item["id"];
  ASSERT_TRUE(absl::StartsWith(item_id, "msg_"));
  const json user1 = {{"role", "user"}, {"content", "Good morrow"}};
  const json user2 = {{"type", "message"},
                      {"role", "user"},
                      {"content", {{{"type", "input_text"}, {"text", "And then?"}}}}};
  const std::string expected =
      ResponseText(json::array({user1, {{"role", "assistant"}, {"content", reply}}, user2}), 8);

  // Our own output item (id, type, status, output_text with annotations and logprobs).
  EXPECT_EQ(ResponseText(json::array({user1, item, user2}), 8), expected);
  // item_reference, with and without its type.
  EXPECT_EQ(
      ResponseText(json::array({user1, {{"type", "item_reference"}, {"id", item_id}}, user2}), 8),
      expected);
  EXPECT_EQ(ResponseText(json::array({user1, {{"id", item_id}}, user2}), 8), expected);
  // The message with its id and status, as the AI SDK sends it with store: false.
  const json with_id = {
      {"role", "assistant"},
      {"id", item_id},
      {"status", "completed"},
      {"content", {{{"type", "output_text"}, {"text", reply}, {"annotations", json::array()}}}}};
  EXPECT_EQ(ResponseText(json::array({user1, with_id, user2}), 8), expected);

  // A reference to nothing is 404 naming the item; other item types are 400.
  for (const char* missing : {"msg_00000000000000000000000000000000", "rs_123"}) {
    ExpectOpenAiError(
        Post(port_, "/v1/responses",
             {{"input", json::array({user1, {{"type", "item_reference"}, {"id", missing}}})}}),
        404, "input[1].id");
  }
  ExpectOpenAiError(Post(port_, "/v1/responses",
                         {{"input", json::array({user1,
                                                 {{"type", "function_call"},
                                                  {"name", "f"},
                                                  {"arguments", "{}"},
                                                  {"call_id", "c"}}})}}),
                    400, "input[1].type");
  ExpectOpenAiError(
      Post(port_, "/v1/responses",
           {{"input", json::array({{{"role", "user"}, {"content", "x"}, {"refusal", nullptr}}})}}),
      400, "input[0].refusal");
  // Conversation items are input items: our own output item is one; a reference (to
  // nothing a new conversation could hold) is 404.
  Reply conversation = Post(port_, "/v1/conversations", {{"items", json::array({user1, item})}});
  EXPECT_EQ(conversation.status, 200) << conversation.body;
  ExpectOpenAiError(Post(port_, "/v1/conversations",
                         {{"items", json::array({{{"type", "item_reference"}, {"id", item_id}}})}}),
                    404, "items[0].id");
  // A reference to a deleted response is not found (another tenant's: AuthHttpTest).
  ASSERT_EQ(Delete(port_, "/v1/responses/" + first["id"].get<std::string>()).status, 200);
  ExpectOpenAiError(
      Post(port_, "/v1/responses",
           {{"input", json::array({user1, {{"type", "item_reference"}, {"id", item_id}}})}}),
      404, "input[1].id");
}

// Item 2: the official client's push-back pattern, and the message keys of the chat API.
TEST_F(HttpCompatTest, ChatMessagesAsTheApiReturnsThem) {
  const json user1 = {{"role", "user"}, {"content", "Good morrow"}};
  const json user2 = {{"role", "user"}, {"content", "And then?"}};
  json first = PostOk("/v1/chat/completions",
                      {{"messages", json::array({user1})}, {"max_tokens", 8}, {"temperature", 0}});
  const json message = first["choices"][0]["message"];
  EXPECT_TRUE(message.contains("refusal") && message["refusal"].is_null()) << message;
  const std::string reply = message["content"];
  const std::string expected =
      ChatText(json::array({user1, {{"role", "assistant"}, {"content", reply}}, user2}), 6);
  EXPECT_EQ(ChatText(json::array({user1, message, user2}), 6), expected);
  json assistant = {{"role", "assistant"},     {"content", reply},
                    {"refusal", nullptr},      {"annotations", json::array()},
                    {"audio", nullptr},        {"tool_calls", json::array()},
                    {"function_call", nullptr}};
  EXPECT_EQ(ChatText(json::array({user1, assistant, user2}), 6), expected);
  // A refusal stands for the content it replaced.
  EXPECT_EQ(ChatText(json::array({user1,
                                  {{"role", "assistant"}, {"content", nullptr}, {"refusal", reply}},
                                  user2}),
                     6),
            expected);
  // `name` tells participants apart: it joins the role in the rendered prompt.
  const json named = json::array({{{"role", "user"}, {"name", "Romeo"}, {"content", "Hi"}}});
  json with_name =
      PostOk("/v1/chat/completions", {{"messages", named}, {"max_tokens", 4}, {"temperature", 0}});
  const std::string rendered = "USER (Romeo):\nHi\n\nASSISTANT:\n";
  EXPECT_EQ(with_name["usage"]["prompt_tokens"], rendered.size());
  json completion =
      PostOk("/v1/completions", {{"prompt", rendered}, {"max_tokens", 4}, {"temperature", 0}});
  EXPECT_EQ(with_name["choices"][0]["message"]["content"], completion["choices"][0]["text"]);
  // developer is a role of the API.
  EXPECT_NE(ChatText(json::array({{{"role", "developer"}, {"content", "Be brief"}}, user1}), 2),
            "<error>");

  auto refused = [&](const json& messages, const std::string& param) {
    ExpectOpenAiError(Post(port_, "/v1/chat/completions", {{"messages", messages}}), 400, param);
  };
  refused(json::array({{{"role", "robot"}, {"content", "x"}}}), "messages[0].role");
  refused(json::array({{{"role", "tool"}, {"content", "x"}, {"tool_call_id", "c"}}}),
          "messages[0].role");
  refused(json::array({{{"role", "user"}, {"name", "a b"}, {"content", "x"}}}), "messages[0].name");
  refused(json::array({user1,
                       {{"role", "assistant"},
                        {"content", "x"},
                        {"tool_calls", {{{"id", "c"}, {"type", "function"}}}}}}),
          "messages[1].tool_calls");
  refused(json::array({user1, {{"role", "assistant"}, {"content", "x"}, {"audio", {{"id", "a"}}}}}),
          "messages[1].audio");
  refused(json::array({{{"role", "user"}, {"content", "x"}, {"refusal", nullptr}}}),
          "messages[0].refusal");
}

// Item 3: input tokens count the cached ones; total = input + output.
TEST_F(HttpCompatTest, UsageFollowsOpenAisRule) {
  auto check = [](const json& usage, const char* in, const char* out, const char* details,
                  int64_t cached) {
    EXPECT_EQ(usage[details]["cached_tokens"], cached) << usage;
    EXPECT_GE(usage[in].get<int64_t>(), cached) << usage;
    EXPECT_EQ(usage["total_tokens"].get<int64_t>(),
              usage[in].get<int64_t>() + usage[out].get<int64_t>())
        << usage;
  };
  // Chat on a session: the second turn's cached tokens are the first turn's session.
  Reply created = Post(port_, "/fwserve/v1/sessions", json::object());
  const std::string sid = created.Json()["id"];
  const json turn = {{"role", "user"}, {"content", "Hi"}};
  json c1 = PostOk("/v1/chat/completions",
                   {{"messages", {turn}}, {"max_tokens", 5}, {"session_id", sid}});
  const int64_t after1 = SessionTokens(sid);
  check(c1["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details", 0);
  EXPECT_EQ(c1["usage"]["total_tokens"], after1);
  json c2 = PostOk("/v1/chat/completions",
                   {{"messages", {turn}}, {"max_tokens", 5}, {"session_id", sid}});
  check(c2["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details", after1);
  // The whole state the answer came from: what the session now holds.
  EXPECT_EQ(c2["usage"]["total_tokens"], SessionTokens(sid));
  // Completions on the same session.
  const int64_t before = SessionTokens(sid);
  json k =
      PostOk("/v1/completions", {{"prompt", "ROMEO:"}, {"max_tokens", 3}, {"session_id", sid}});
  check(k["usage"], "prompt_tokens", "completion_tokens", "prompt_tokens_details", before);
  EXPECT_EQ(k["usage"]["prompt_tokens"], before + 6);
  // Responses continued by previous_response_id.
  json r1 = PostOk("/v1/responses", {{"input", "Hello"}, {"max_output_tokens", 6}});
  check(r1["usage"], "input_tokens", "output_tokens", "input_tokens_details", 0);
  const int64_t total1 = r1["usage"]["total_tokens"];
  json r2 =
      PostOk("/v1/responses",
             {{"input", "Again"}, {"max_output_tokens", 4}, {"previous_response_id", r1["id"]}});
  check(r2["usage"], "input_tokens", "output_tokens", "input_tokens_details", total1);
  EXPECT_EQ(r2["usage"]["total_tokens"], SessionTokens(r2["id"].get<std::string>().substr(5)));
  // Streamed chat's usage chunk says the same.
  const int64_t before_stream = SessionTokens(sid);
  Reply streamed = Post(port_, "/v1/chat/completions",
                        {{"messages", {turn}},
                         {"max_tokens", 2},
                         {"session_id", sid},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}});
  Sse sse = ParseSse(streamed.body);
  ASSERT_GE(sse.data.size(), 2u);
  check(json::parse(sse.data[sse.data.size() - 2])["usage"], "prompt_tokens", "completion_tokens",
        "prompt_tokens_details", before_stream);
}

// Item 4: a preflight may ask for the SDKs' own headers; the retry hints are readable.
TEST_F(HttpCompatTest, CorsPreflightAllowsTheRequestedHeaders) {
  fwserve::HttpServerOptions http;
  http.cors_origins = {"http://app.example"};
  StartServer(http);
  const std::string asked =
      "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
      "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
      "x-stainless-runtime-version,x-stainless-timeout";
  Reply preflight = HttpClient(port_).Send(http::verb::options, "/v1/chat/completions", "",
                                           {{"Origin", "http://app.example"},
                                            {"Access-Control-Request-Method", "POST"},
                                            {"Access-Control-Request-Headers", asked}});
  EXPECT_EQ(preflight.status, 204);
  EXPECT_EQ(preflight.headers["access-control-allow-origin"], "http://app.example");
  EXPECT_EQ(preflight.headers["access-control-allow-headers"], asked);
  // Without a list (or with one that is not a header list) the fixed one.
  Reply plain = HttpClient(port_).Send(
      http::verb::options, "/v1/responses", "",
      {{"Origin", "http://app.example"}, {"Access-Control-Request-Headers", "x-a;x-b"}});
  EXPECT_EQ(plain.headers["access-control-allow-headers"], "Authorization, Content-Type");
  Reply answer = Get(port_, "/v1/models", {{"Origin", "http://app.example"}});
  for (const char* exposed : {"Retry-After", "retry-after-ms"}) {
    EXPECT_NE(answer.headers["access-control-expose-headers"].find(exposed), std::string::npos)
        << answer.headers["access-control-expose-headers"];
  }
  EXPECT_EQ(Get(port_, "/v1/models", {{"Origin", "http://other.example"}})
                .headers.count("access-control-allow-origin"),
            0u);
}

// Item 5: the field policy (docs/http.md, "Field policy"), one case per row: accepted,
// and echoed where OpenAI echoes it.
TEST_F(HttpCompatTest, FieldPolicyAcceptsAndEchoes) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  struct Row {
    const char* endpoint;  // "chat" or "responses"
    json fields;
    // Answer key (JSON pointer) -> the value echoed; empty = accepted only.
    std::map<std::string, json> echo;
  };
  const std::vector<Row> rows = {
      {"chat", {{"service_tier", "auto"}}, {{"/service_tier", "default"}}},
      {"chat", {{"service_tier", "flex"}}, {{"/service_tier", "flex"}}},
      {"responses", {{"service_tier", "priority"}}, {{"/service_tier", "priority"}}},
      {"chat", {{"modalities", {"text"}}}, {}},
      {"chat", {{"store", true}}, {}},
      {"chat", {{"stream_options", {{"include_obfuscation", false}}}, {"stream", true}}, {}},
      {"responses", {{"stream_options", {{"include_obfuscation", true}}}, {"stream", true}}, {}},
      {"chat", {{"user", "u-1"}}, {}},
      {"responses", {{"user", "u-1"}}, {{"/user", "u-1"}}},
      {"chat", {{"metadata", {{"k", "v"}}}}, {}},
      {"responses", {{"metadata", {{"k", "v"}}}}, {{"/metadata", {{"k", "v"}}}}},
      {"chat", {{"prompt_cache_key", "conv-7"}}, {}},
      {"responses", {{"prompt_cache_key", "conv-7"}}, {{"/prompt_cache_key", "conv-7"}}},
      {"chat", {{"safety_identifier", "h-1"}}, {}},
      {"responses", {{"safety_identifier", "h-1"}}, {{"/safety_identifier", "h-1"}}},
      {"chat", {{"parallel_tool_calls", true}}, {}},
      {"responses", {{"parallel_tool_calls", true}}, {{"/parallel_tool_calls", true}}},
  };
  for (const Row& row : rows) {
    const bool chat = std::string(row.endpoint) == "chat";
    json body = row.fields;
    body["max_tokens"] = 2;
    if (!chat) body.erase("max_tokens"), body["max_output_tokens"] = 2, body["input"] = "Hi";
    if (chat) body["messages"] = messages;
    Reply r = Post(port_, chat ? "/v1/chat/completions" : "/v1/responses", body);
    ASSERT_EQ(r.status, 200) << body.dump() << " -> " << r.body;
    if (body.value("stream", false)) continue;
    json answer = r.Json();
    for (const auto& [pointer, value] : row.echo) {
      EXPECT_EQ(answer[json::json_pointer(pointer)], value) << body.dump() << " -> " << r.body;
    }
  }
}

// Item 5: fields that would change output we cannot honour stay a 400 naming the field.
TEST_F(HttpCompatTest, FieldPolicyRefusesWhatWouldChangeTheOutput) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  const std::vector<std::pair<json, std::string>> chat_rows = {
      {{{"modalities", {"text", "audio"}}}, "modalities"},
      {{{"service_tier", "turbo"}}, "service_tier"},
      {{{"stream_options", {{"include_obfuscation", "yes"}}}, {"stream", true}},
       "stream_options.include_obfuscation"},
      {{{"n", 17}}, "n"},
      {{{"best_of", 2}}, "best_of"},
      {{{"response_format", {{"type", "grammar"}}}}, "response_format.type"},
      {{{"response_format",
         {{"type", "json_schema"},
          {"json_schema",
           {{"name", "x"}, {"schema", {{"type", "object"}, {"not", json::object()}}}}}}}},
       "response_format.json_schema.schema"},
      {{{"tools", {{{"type", "function"}}}}}, "tools[0].function"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
        {"tool_choice", "auto"}},
       "tool_choice"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
        {"tool_choice", {{"type", "function"}, {"function", {{"name", "g"}}}}}},
       "tool_choice"},
      {{{"top_logprobs", 21}, {"logprobs", true}}, "top_logprobs"},
      {{{"logit_bias", {{"1", 500}}}}, "logit_bias"},
      {{{"logit_bias", {{"one", 5}}}}, "logit_bias"},
      {{{"logit_bias", {{"1", "5"}}}}, "logit_bias.1"},
      {{{"presence_penalty", 3}}, "presence_penalty"},
      {{{"frequency_penalty", -2.5}}, "frequency_penalty"},
      {{{"audio", {{"voice", "x"}}}}, "audio"},
      {{{"reasoning_effort", "high"}}, "reasoning_effort"},
  };
  for (const auto& [fields, param] : chat_rows) {
    json body = fields;
    body["messages"] = messages;
    ExpectOpenAiError(Post(port_, "/v1/chat/completions", body), 400, param);
  }
  ExpectOpenAiError(
      Post(port_, "/v1/responses", {{"input", "x"}, {"text", {{"format", {{"type", "grammar"}}}}}}),
      400, "text.format.type");
  // Tool calls are chat's: a forced one on responses is refused naming tool_choice.
  ExpectOpenAiError(Post(port_, "/v1/responses",
                         {{"input", "x"},
                          {"tools", {{{"type", "function"}, {"name", "f"}}}},
                          {"tool_choice", "required"}}),
                    400, "tool_choice");
  ExpectOpenAiError(Post(port_, "/v1/responses", {{"input", "x"}, {"truncation", "auto"}}), 400,
                    "truncation");
}

// logit_bias (issue 51): +100 on a token all but forces it at any temperature, -100 on the
// greedy choice all but bans it, on chat and completions; an id outside the vocabulary is
// a 400 naming it, and nothing is generated.
TEST_F(HttpCompatTest, LogitBiasSteersTheSampler) {
  const json messages = {{{"role", "user"}, {"content", "ROMEO:"}}};
  json forced = PostOk("/v1/chat/completions", {{"messages", messages},
                                                {"max_tokens", 8},
                                                {"temperature", 1.0},
                                                {"seed", 3},
                                                {"logit_bias", {{"65", 100}}}});
  EXPECT_EQ(forced["choices"][0]["message"]["content"], "AAAAAAAA") << forced.dump();
  json completion = PostOk(
      "/v1/completions",
      {{"prompt", "ROMEO:"}, {"max_tokens", 4}, {"temperature", 0}, {"logit_bias", {{"66", 100}}}});
  EXPECT_EQ(completion["choices"][0]["text"], "BBBB") << completion.dump();
  // The greedy first byte, then the same request with that byte banned.
  const std::string greedy = ChatText(messages, 1);
  ASSERT_EQ(greedy.size(), 1u) << greedy;
  const std::string banned_id = std::to_string(static_cast<unsigned char>(greedy[0]));
  json banned = PostOk("/v1/chat/completions", {{"messages", messages},
                                                {"max_tokens", 1},
                                                {"temperature", 0},
                                                {"logit_bias", {{banned_id, -100}}}});
  const std::string other = banned["choices"][0]["message"]["content"];
  EXPECT_FALSE(other.empty());
  EXPECT_NE(other, greedy);
  Reply outside =
      Post(port_, "/v1/chat/completions", {{"messages", messages}, {"logit_bias", {{"300", 1}}}});
  EXPECT_EQ(outside.status, 400) << outside.body;
  EXPECT_NE(outside.body.find("logit_bias: token id 300 is outside the model's vocabulary"),
            std::string::npos)
      << outside.body;
}

// top_logprobs: each token's alternatives are the model's most likely tokens, most likely
// first; at temperature 0 the sampled token is the first of them with the same logprob.
TEST_F(HttpCompatTest, TopLogprobsListTheMostLikelyTokens) {
  const json messages = {{{"role", "user"}, {"content", "ROMEO:"}}};
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    json body = {{"messages", messages}, {"max_tokens", 6},   {"temperature", 0},
                 {"logprobs", true},     {"top_logprobs", 5}, {"stream", stream}};
    std::vector<json> entries;
    if (stream) {
      for (const json& event : StreamEvents("/v1/chat/completions", body)) {
        const json& choices = event["choices"];
        if (choices.empty() || choices[0]["logprobs"].is_null()) continue;
        for (const json& e : choices[0]["logprobs"]["content"]) entries.push_back(e);
      }
    } else {
      json reply = PostOk("/v1/chat/completions", body);
      for (const json& e : reply["choices"][0]["logprobs"]["content"]) entries.push_back(e);
    }
    ASSERT_EQ(entries.size(), 6u);
    for (const json& e : entries) {
      const json& top = e["top_logprobs"];
      ASSERT_EQ(top.size(), 5u) << e.dump();
      EXPECT_EQ(top[0]["token"], e["token"]) << e.dump();
      EXPECT_NEAR(top[0]["logprob"].get<double>(), e["logprob"].get<double>(), 1e-6);
      double total = 0;
      for (size_t i = 0; i < top.size(); ++i) {
        total += std::exp(top[i]["logprob"].get<double>());
        if (i > 0) {
          EXPECT_LE(top[i]["logprob"].get<double>(), top[i - 1]["logprob"].get<double>());
        }
        EXPECT_EQ(top[i]["bytes"].size(), 1u);  // a byte-level model
      }
      EXPECT_LE(total, 1.0 + 1e-5);
    }
  }
  // The legacy completions form: logprobs = n.
  json completion =
      PostOk("/v1/completions",
             {{"prompt", "ROMEO:"}, {"max_tokens", 3}, {"temperature", 0}, {"logprobs", 3}});
  const json& legacy = completion["choices"][0]["logprobs"];
  ASSERT_EQ(legacy["top_logprobs"].size(), 3u) << legacy.dump();
  for (size_t i = 0; i < 3; ++i) {
    const json& entry = legacy["top_logprobs"][i];
    EXPECT_GE(entry.size(), 1u);
    EXPECT_LE(entry.size(), 3u);
    const std::string token = legacy["tokens"][i];
    ASSERT_TRUE(entry.contains(token)) << entry.dump();
    EXPECT_NEAR(entry[token].get<double>(), legacy["token_logprobs"][i].get<double>(), 1e-6);
  }
  Reply too_many = Post(port_, "/v1/chat/completions",
                        {{"messages", messages}, {"logprobs", true}, {"top_logprobs", 21}});
  EXPECT_EQ(too_many.status, 400);
  EXPECT_NE(too_many.body.find("top_logprobs"), std::string::npos) << too_many.body;
  Reply without =
      Post(port_, "/v1/chat/completions", {{"messages", messages}, {"top_logprobs", 2}});
  EXPECT_EQ(without.status, 400);
  EXPECT_NE(without.body.find("needs 'logprobs'"), std::string::npos) << without.body;
}

// Issue 51: `seed` stays deterministic with the whole sampling surface: a constrained
// reply with logit_bias, both penalties and top_logprobs at temperature 1 is the same
// for the same seed (whole and streamed), and parses.
// OpenAI's `n` (issue 51): the choices are forks of one reading of the prompt. Whole and
// streamed answers agree choice by choice, a seed repeats every choice, choice 0 is what
// n = 1 gives, the prompt is counted once (usage and the prefill metric), and the bad
// cases are 400s naming the field.
TEST(HttpChoicesTest, SeveralChoicesReadThePromptOnce) {
  fwserve::CoreOptions options;
  options.model_dirs = {ModelDir()};
  auto server = Harness::Start(options, {}, /*expose_metrics=*/true, fwserve::HttpServerOptions{});
  ASSERT_NE(server, nullptr);
  const int port = server->http_port();
  // fwserve_prompt_tokens_total, summed over its series.
  auto prompt_tokens_metric = [&] {
    Reply r = Get(server->metrics_port(), "/metrics");
    double total = 0;
    for (absl::string_view line : absl::StrSplit(r.body, '\n')) {
      if (!absl::StartsWith(line, "fwserve_prompt_tokens_total")) continue;
      double v = 0;
      EXPECT_TRUE(absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) << line;
      total += v;
    }
    return total;
  };
  const std::string prompt =
      "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n";
  const json body = {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 1.0},
                     {"seed", 7},        {"n", 4},           {"logprobs", 1}};
  const double before = prompt_tokens_metric();
  Reply whole = Post(port, "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json reply = whole.Json();
  const double after = prompt_tokens_metric();
  ASSERT_EQ(reply["choices"].size(), 4u) << reply.dump();
  const int64_t prompt_count = reply["usage"]["prompt_tokens"];
  EXPECT_GE(prompt_count, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(after - before, static_cast<double>(prompt_count)) << "the prompt was read once";
  std::set<std::string> texts;
  int64_t completion = 0;
  for (size_t i = 0; i < 4; ++i) {
    const json& c = reply["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(c["logprobs"]["tokens"].size(), 12u);
    texts.insert(c["text"].get<std::string>());
    completion += static_cast<int64_t>(c["logprobs"]["tokens"].size());
  }
  EXPECT_GE(texts.size(), 2u) << "each choice samples on its own";
  EXPECT_EQ(reply["usage"]["completion_tokens"], completion);
  EXPECT_EQ(reply["usage"]["total_tokens"], prompt_count + completion);

  // The same seed: the same choices; choice 0 is the n = 1 answer.
  Reply again = Post(port, "/v1/completions", body);
  ASSERT_EQ(again.status, 200) << again.body;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(again.Json()["choices"][i]["text"], reply["choices"][i]["text"]) << i;
  }
  json single = body;
  single["n"] = 1;
  Reply one = Post(port, "/v1/completions", single);
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(one.Json()["choices"][0]["text"], reply["choices"][0]["text"]);

  // Streamed chat: every chunk names its choice, each choice ends with its finish_reason,
  // the usage comes once, and the texts are the whole answer's.
  const json messages = {{{"role", "user"}, {"content", "Speak, ROMEO."}}};
  json chat = {
      {"messages", messages}, {"max_tokens", 10}, {"temperature", 1.0}, {"seed", 3}, {"n", 3}};
  Reply chat_whole = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_whole.status, 200) << chat_whole.body;
  chat["stream"] = true;
  chat["stream_options"] = {{"include_usage", true}};
  Reply streamed = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  std::vector<std::string> deltas(3);
  std::vector<int> finishes(3, 0);
  int usages = 0, dones = 0;
  for (const std::string& d : ParseSse(streamed.body).data) {
    if (d == "[DONE]") {
      ++dones;
      continue;
    }
    const json event = json::parse(d);
    if (event["choices"].empty()) {
      ++usages;
      EXPECT_EQ(event["usage"], chat_whole.Json()["usage"]);
      continue;
    }
    const json& c = event["choices"][0];
    const size_t index = c["index"];
    ASSERT_LT(index, 3u);
    if (c["delta"].contains("content") && c["delta"]["content"].is_string()) {
      deltas[index] += c["delta"]["content"].get<std::string>();
    }
    if (!c["finish_reason"].is_null()) ++finishes[index];
  }
  EXPECT_EQ(usages, 1);
  EXPECT_EQ(dones, 1);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(finishes[i], 1) << i;
    EXPECT_EQ(deltas[i], chat_whole.Json()["choices"][i]["message"]["content"]) << i;
  }

  // Refused, naming the field.
  auto refused = [&](json request, const std::string& param) {
    Reply r = Post(port, "/v1/chat/completions", request);
    EXPECT_EQ(r.status, 400) << request.dump() << " -> " << r.body;
    EXPECT_NE(r.body.find(param), std::string::npos) << r.body;
  };
  refused({{"messages", messages}, {"n", 0}}, "'n'");
  refused({{"messages", messages}, {"n", 17}}, "'n'");
  refused({{"messages", messages}, {"best_of", 2}}, "best_of");
  const std::string sid = Post(port, "/fwserve/v1/sessions", json::object()).Json()["id"];
  refused({{"messages", messages}, {"n", 2}, {"session_id", sid}}, "n:");
}

TEST_F(HttpCompatTest, ASeedGivesTheSameConstrainedReplyWithEveryOption) {
  const json schema = {{"type", "object"},
                       {"properties",
                        {{"line", {{"type", "string"}, {"maxLength", 20}}},
                         {"act", {{"type", "integer"}, {"minimum", 1}, {"maximum", 5}}}}},
                       {"required", {"line", "act"}},
                       {"additionalProperties", false}};
  json body = {{"messages", {{{"role", "user"}, {"content", "ROMEO:"}}}},
               {"temperature", 1.0},
               {"seed", 12},
               {"max_tokens", 200},
               {"logit_bias", {{"101", 2.5}}},
               {"presence_penalty", 0.5},
               {"frequency_penalty", 0.3},
               {"logprobs", true},
               {"top_logprobs", 3},
               {"response_format",
                {{"type", "json_schema"}, {"json_schema", {{"name", "l"}, {"schema", schema}}}}}};
  const json first = PostOk("/v1/chat/completions", body);
  const json second = PostOk("/v1/chat/completions", body);
  const std::string text = first["choices"][0]["message"]["content"];
  EXPECT_EQ(second["choices"][0]["message"]["content"], text);
  EXPECT_EQ(first["choices"][0]["logprobs"], second["choices"][0]["logprobs"]);
  EXPECT_EQ(first["choices"][0]["finish_reason"], "stop") << text;
  const json reply = json::parse(text, nullptr, false);
  ASSERT_TRUE(reply.is_object()) << text;
  EXPECT_GE(reply["act"].get<int>(), 1);
  EXPECT_LE(reply["act"].get<int>(), 5);
  body["stream"] = true;
  std::string streamed;
  for (const json& event : StreamEvents("/v1/chat/completions", body)) {
    const json& choices = event["choices"];
    if (!choices.empty() && choices[0]["delta"].contains("content") &&
        choices[0]["delta"]["content"].is_string()) {
      streamed += choices[0]["delta"]["content"].get<std::string>();
    }
  }
  EXPECT_EQ(streamed, text);
}

// Item 6: max_completion_tokens wins over max_tokens, whatever their order.
TEST_F(HttpCompatTest, MaxCompletionTokensWinsOverMaxTokens) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  for (const auto& [a, b] : std::vector<std::pair<int, int>>{{3, 7}, {7, 3}}) {
    json r1 = PostOk("/v1/chat/completions",
                     {{"messages", messages}, {"max_tokens", a}, {"max_completion_tokens", b}});
    EXPECT_EQ(r1["usage"]["completion_tokens"], b) << a << " " << b;
    // The other key order in the body.
    json body = {{"max_completion_tokens", b}, {"messages", messages}};
    body["max_tokens"] = a;
    EXPECT_EQ(PostOk("/v1/chat/completions", body)["usage"]["completion_tokens"], b);
  }
  EXPECT_EQ(PostOk("/v1/chat/completions",
                   {{"messages", messages}, {"max_tokens", 4}})["usage"]["completion_tokens"],
            4);
}

// Item 6: completion ids are random (two servers, as replicas or a restart, never repeat
// one), with 128 bits after the prefix.
TEST_F(HttpCompatTest, IdsAreUniqueAcrossRestartsAndReplicas) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  std::set<std::string> ids;
  auto collect = [&](int port) {
    Reply chat = Post(port, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}});
    Reply completion = Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}});
    ASSERT_EQ(chat.status, 200);
    ASSERT_EQ(completion.status, 200);
    const std::string chat_id = chat.Json()["id"], completion_id = completion.Json()["id"];
    EXPECT_TRUE(absl::StartsWith(chat_id, "chatcmpl-")) << chat_id;
    EXPECT_EQ(chat_id.size(), std::string("chatcmpl-").size() + 32) << chat_id;
    EXPECT_TRUE(absl::StartsWith(completion_id, "cmpl-")) << completion_id;
    ids.insert(chat_id);
    ids.insert(completion_id);
  };
  collect(port_);
  std::unique_ptr<Harness> replica =
      Harness::Start(Options(), {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(replica, nullptr);
  collect(replica->http_port());
  replica.reset();
  StartServer();  // a restart
  collect(port_);
  EXPECT_EQ(ids.size(), 6u);
}

// Item 6: a response cut by max_output_tokens has an incomplete item; floats echo as sent.
TEST_F(HttpCompatTest, IncompleteItemStatusAndFloatEcho) {
  json cut =
      PostOk("/v1/responses",
             {{"input", "Hi"}, {"max_output_tokens", 2}, {"temperature", 0.8}, {"top_p", 0.9}});
  EXPECT_EQ(cut["status"], "incomplete");
  EXPECT_EQ(cut["output"][0]["status"], "incomplete");
  // 0.8 echoes as 0.8 (not 0.800000011920929): the JSON text is exact.
  Reply raw =
      Post(port_, "/v1/responses",
           {{"input", "Hi"}, {"max_output_tokens", 1}, {"temperature", 0.8}, {"top_p", 0.9}});
  EXPECT_NE(raw.body.find("\"temperature\":0.8,"), std::string::npos) << raw.body;
  EXPECT_NE(raw.body.find("\"top_p\":0.9,"), std::string::npos) << raw.body;
  EXPECT_EQ(fwserve::EchoFloat(0.8f), 0.8);
  EXPECT_EQ(fwserve::EchoFloat(1.0f), 1.0);
  EXPECT_EQ(fwserve::EchoFloat(0.123456789f), 0.12345679);  // 8 digits are needed here
  // Streamed: the item's done event says incomplete too.
  Reply streamed =
      Post(port_, "/v1/responses", {{"input", "Hi"}, {"max_output_tokens", 2}, {"stream", true}});
  Sse sse = ParseSse(streamed.body);
  bool seen = false;
  for (size_t i = 0; i < sse.events.size(); ++i) {
    if (sse.events[i] != "response.output_item.done") continue;
    EXPECT_EQ(json::parse(sse.data[i])["item"]["status"], "incomplete");
    seen = true;
  }
  EXPECT_TRUE(seen) << streamed.body;
  EXPECT_EQ(sse.events.back(), "response.incomplete");
}

// Item 6: an unknown model is 404 with OpenAI's code, on every route that names one.
TEST_F(HttpCompatTest, UnknownModelIsModelNotFound) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  for (const Reply& r :
       {Post(port_, "/v1/chat/completions", {{"messages", messages}, {"model", "nope"}}),
        Post(port_, "/v1/completions", {{"prompt", "x"}, {"model", "nope"}}),
        Post(port_, "/v1/responses", {{"input", "x"}, {"model", "nope"}}),
        Get(port_, "/v1/models/nope")}) {
    ExpectOpenAiError(r, 404, "model");
    EXPECT_EQ(r.Json()["error"]["code"], "model_not_found") << r.body;
  }
  // Other 404s keep their code.
  EXPECT_EQ(
      Get(port_, "/v1/responses/resp_00000000000000000000000000000000").Json()["error"]["code"],
      "not_found");
}

// Item 6: HEAD on every GET route answers as GET without the body; a method a route
// does not serve is 405 with Allow.
TEST_F(HttpCompatTest, HeadAndMethodNotAllowed) {
  for (const char* target :
       {"/health", "/ready", "/v1/models", "/v1/models/aft-shakespeare", "/"}) {
    Reply get = Get(port_, target);
    Reply head = HttpClient(port_).Send(http::verb::head, target);
    EXPECT_EQ(head.status, get.status) << target;
    EXPECT_EQ(head.headers["content-length"], std::to_string(get.body.size())) << target;
    EXPECT_EQ(head.headers["content-type"], get.headers["content-type"]) << target;
    EXPECT_TRUE(head.body.empty()) << target;
  }
  // A HEAD answer leaves the connection usable (no body bytes were sent).
  HttpClient client(port_);
  EXPECT_EQ(client.Send(http::verb::head, "/v1/models").status, 200);
  EXPECT_EQ(client.Send(http::verb::get, "/health").status, 200);

  struct Case {
    http::verb method;
    const char* target;
    const char* allow;
  };
  for (const Case& c :
       {Case{http::verb::get, "/v1/chat/completions", "POST, OPTIONS"},
        Case{http::verb::delete_, "/v1/models", "GET, HEAD, OPTIONS"},
        Case{http::verb::post, "/v1/responses/resp_x", "GET, HEAD, DELETE, OPTIONS"},
        Case{http::verb::put, "/fwserve/v1/sessions", "GET, HEAD, POST, OPTIONS"},
        Case{http::verb::post, "/health", "GET, HEAD, OPTIONS"}}) {
    Reply r = HttpClient(port_).Send(c.method, c.target, c.method == http::verb::get ? "" : "{}");
    ExpectOpenAiError(r, 405, "");
    EXPECT_EQ(r.headers["allow"], c.allow) << c.target;
  }
  // A path of no route stays 404.
  ExpectOpenAiError(HttpClient(port_).Send(http::verb::get, "/v1/nothing"), 404, "");
}

// Item 6: `Expect: 100-continue` gets "100 Continue" before the body is sent.
TEST_F(HttpCompatTest, ExpectContinueIsAnswered) {
  net::io_context ioc;
  tcp::socket socket(ioc);
  tcp::resolver resolver(ioc);
  net::connect(socket, resolver.resolve("127.0.0.1", std::to_string(port_)));
  const std::string body = R"({"prompt": "x", "max_tokens": 1})";
  const std::string head = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Expect: 100-continue\r\nContent-Length: ",
      body.size(), "\r\n\r\n");
  net::write(socket, net::buffer(head));
  // The interim answer arrives while the body is held back.
  pollfd readable{socket.native_handle(), POLLIN, 0};
  ASSERT_EQ(poll(&readable, 1, 5000), 1) << "no interim answer within 5 s";
  std::string interim;
  net::read_until(socket, net::dynamic_buffer(interim), "\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(interim, "HTTP/1.1 100 Continue\r\n")) << interim;
  interim.erase(0, interim.find("\r\n\r\n") + 4);
  net::write(socket, net::buffer(body));
  beast::flat_buffer buffer;
  buffer.commit(net::buffer_copy(buffer.prepare(interim.size()), net::buffer(interim)));
  http::response<http::string_body> response;
  http::read(socket, buffer, response);
  EXPECT_EQ(response.result_int(), 200) << response.body();

  // Too large a body is refused at once: 413 instead of 100.
  fwserve::HttpServerOptions small;
  small.max_body_bytes = 16;
  StartServer(small);
  tcp::socket second(ioc);
  net::connect(second, resolver.resolve("127.0.0.1", std::to_string(port_)));
  net::write(second,
             net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      "Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n")));
  beast::flat_buffer buffer2;
  http::response<http::string_body> refused;
  http::read(second, buffer2, refused);
  EXPECT_EQ(refused.result_int(), 413);
}

}  // namespace
}  // namespace fwtest
