// The HTTP API (server/transport/http) on a real in-process server (tests/integration/
// harness.h, HTTP on a free loopback port), driven by a small Boost.Beast client: every
// endpoint, SSE streams, errors, API keys, CORS, a client that disconnects mid-stream,
// and stop strings stripped across chunk edges.
#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "models/base/config.h"
#include "server/tenancy/tenants.h"
#include "server/transport/http/openai_api.h"
#include "tests/common/redis_server.h"
#include "tests/integration/harness.h"
#include "tests/integration/http_client.h"

namespace fwtest {
namespace {

// GET /v1/responses/{id} until the store's indexing is done (503 before), at most 10 s.
Reply GetIndexed(int port, const std::string& target,
                 const std::map<std::string, std::string>& headers = {}) {
  Reply r;
  for (int i = 0; i < 500; ++i) {
    r = Get(port, target, headers);
    if (r.status != 503) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return r;
}

class HttpTest : public ::testing::Test {
 protected:
  static fwserve::CoreOptions Options() {
    fwserve::CoreOptions options;
    options.model_dirs = {ModelDir()};
    return options;
  }
  void StartServer(fwserve::HttpServerOptions http = {}, fwserve::CoreOptions options = Options(),
                   bool expose_metrics = false) {
    server_ = Harness::Start(std::move(options), {}, expose_metrics, http);
    ASSERT_NE(server_, nullptr);
    port_ = server_->http_port();
  }
  void SetUp() override {
    if (!ManualStart()) StartServer();
  }
  virtual bool ManualStart() const { return false; }

  // Greedy text of a throwaway completion.
  std::string Greedy(const std::string& prompt, int max_tokens) {
    Reply r = Post(port_, "/v1/completions",
                   {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json()["choices"][0]["text"];
  }
  json CreateSession(const std::string& prefix) {
    Reply r = Post(port_, "/fwserve/v1/sessions", {{"prefix", prefix}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json();
  }
  int64_t SessionTokens(const std::string& id) {
    Reply r = Get(port_, "/fwserve/v1/sessions/" + id);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json()["tokens"];
  }

  std::unique_ptr<Harness> server_;
  int port_ = 0;
};

TEST_F(HttpTest, HealthReadyAndModels) {
  EXPECT_EQ(Get(port_, "/health").status, 200);
  EXPECT_EQ(Get(port_, "/ready").status, 200);
  Reply models = Get(port_, "/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  json body = models.Json();
  EXPECT_EQ(body["object"], "list");
  ASSERT_EQ(body["data"].size(), 1u);
  EXPECT_EQ(body["data"][0]["id"], "aft-shakespeare");
  EXPECT_EQ(body["data"][0]["object"], "model");
  EXPECT_EQ(body["data"][0]["owned_by"], "fwserve");
  EXPECT_TRUE(body["data"][0].contains("created"));
  EXPECT_EQ(Get(port_, "/v1/models/aft-shakespeare").status, 200);
  ExpectOpenAiError(Get(port_, "/v1/models/nope"), 404, "");
  ExpectOpenAiError(Get(port_, "/nowhere"), 404, "");
}

TEST_F(HttpTest, CompletionMatchesGrpcGreedy) {
  Reply r = Post(
      port_, "/v1/completions",
      {{"model", "aft-shakespeare"}, {"prompt", "ROMEO:"}, {"max_tokens", 24}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  json body = r.Json();
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 24);
  EXPECT_EQ(body["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(body["usage"]["total_tokens"], 30);
  auto grpc = server_->client().Generate(GreedyRequest("ROMEO:", 24));
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ(body["choices"][0]["text"], grpc->text);
}

TEST_F(HttpTest, StreamedCompletionEqualsUnary) {
  const std::string expected = Greedy("JULIET:", 30);
  Reply r = Post(port_, "/v1/completions",
                 {{"prompt", "JULIET:"},
                  {"max_tokens", 30},
                  {"temperature", 0},
                  {"stream", true},
                  {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  Sse sse = ParseSse(r.body);
  ASSERT_GE(sse.data.size(), 3u);
  EXPECT_EQ(sse.data.back(), "[DONE]");
  EXPECT_EQ(StreamedText(sse, false), expected);
  json usage_chunk = json::parse(sse.data[sse.data.size() - 2]);
  EXPECT_TRUE(usage_chunk["choices"].empty());
  EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 30);
  json last = json::parse(sse.data[sse.data.size() - 3]);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
}

TEST_F(HttpTest, ChatUsesTheTemplateAndSessionKeepsTheTurn) {
  json session = CreateSession("");
  const std::string id = session["id"];
  Reply r = Post(port_, "/v1/chat/completions",
                 {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                  {"max_tokens", 5},
                  {"temperature", 0},
                  {"session_id", id}});
  ASSERT_EQ(r.status, 200) << r.body;
  json body = r.Json();
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  const std::string prompt = "USER:\nHi\n\nASSISTANT:\n";
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(SessionTokens(id), static_cast<int64_t>(prompt.size()) + 5);
  // The same text as a completion of the rendered prompt.
  EXPECT_EQ(body["choices"][0]["message"]["content"], Greedy(prompt, 5));
  // The next turn: only the new messages; cached_tokens = the session before it.
  Reply next = Post(port_, "/v1/chat/completions",
                    {{"messages", {{{"role", "user"}, {"content", "More"}}}},
                     {"max_tokens", 3},
                     {"session_id", id}});
  ASSERT_EQ(next.status, 200) << next.body;
  EXPECT_EQ(next.Json()["usage"]["prompt_tokens_details"]["cached_tokens"], prompt.size() + 5);
}

TEST_F(HttpTest, ChatStreamsWithRoleFirstAndUsageLast) {
  Reply r = Post(port_, "/v1/chat/completions",
                 {{"messages",
                   {{{"role", "system"}, {"content", "Be brief."}},
                    {{"role", "user"},
                     {"content",
                      [] {
                        json parts = json::array();
                        parts.push_back({{"type", "text"}, {"text", "Hi"}});
                        return parts;
                      }()}}}},
                  {"max_completion_tokens", 12},
                  {"temperature", 0},
                  {"stream", true},
                  {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  Sse sse = ParseSse(r.body);
  ASSERT_GE(sse.data.size(), 4u);
  json first = json::parse(sse.data[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(sse.data.back(), "[DONE]");
  json usage = json::parse(sse.data[sse.data.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
  EXPECT_EQ(StreamedText(sse, true), Greedy("SYSTEM:\nBe brief.\n\nUSER:\nHi\n\nASSISTANT:\n", 12));
}

TEST_F(HttpTest, StopStringIsStrippedAcrossChunksAndKeptInTheSession) {
  const std::string prompt = "KING:";
  const std::string full = Greedy(prompt, 40);
  ASSERT_GE(full.size(), 20u);
  const std::string stop = full.substr(10, 3);
  const std::string expected = full.substr(0, full.find(stop));
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "unary");
    const std::string id = CreateSession(prompt)["id"];
    Reply r = Post(port_, "/v1/chat/completions",
                   {{"messages", json::array()}, {"max_tokens", 40}, {"temperature", 0}});
    ExpectOpenAiError(r, 400, "messages");  // an empty turn
    r = Post(port_, "/v1/completions",
             {{"prompt", ""},
              {"session_id", id},
              {"max_tokens", 40},
              {"temperature", 0},
              {"stop", {stop, "\x01never"}},
              {"stream", stream}});
    ASSERT_EQ(r.status, 200) << r.body;
    std::string text;
    if (stream) {
      Sse sse = ParseSse(r.body);
      text = StreamedText(sse, false);
      // Every delta is stop-free: the partial match was held back.
      for (const std::string& d : sse.data) {
        if (d != "[DONE]") {
          EXPECT_EQ(d.find(stop), std::string::npos);
        }
      }
      EXPECT_EQ(json::parse(sse.data[sse.data.size() - 2])["choices"][0]["finish_reason"], "stop");
    } else {
      text = r.Json()["choices"][0]["text"];
      EXPECT_EQ(r.Json()["choices"][0]["finish_reason"], "stop");
    }
    EXPECT_EQ(text, expected);
    // The session holds the stop string.
    EXPECT_EQ(SessionTokens(id),
              static_cast<int64_t>(prompt.size() + expected.size() + stop.size()));
  }
}

// A model's config.json template reaches the renderer the way the server passes it: parsed,
// re-serialised (ModelDescription::config_json), then read by ChatTemplateOf.
TEST(ChatTemplateTest, ConfigTemplateRendersChat) {
  auto config = fwmodel::ParseModelConfig(
      R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2,
          "chat_template": {"message": "[{role}] {content}\n", "generation_prompt": "[ASSISTANT] "}})");
  ASSERT_TRUE(config.ok()) << config.status();
  const fwserve::ChatTemplate chat_template =
      fwserve::ChatTemplateOf(fwmodel::ModelConfigToJson(*config));
  auto rendered =
      fwserve::RenderChat(nlohmann::json::parse(R"([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hail"}])"),
                          chat_template, "messages");
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ(*rendered, "[SYSTEM] Be brief.\n[USER] Hail\n[ASSISTANT] ");
  // No template in the config: the documented default.
  auto plain = fwmodel::ParseModelConfig(
      R"({"format_version": 1, "architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 2})");
  ASSERT_TRUE(plain.ok());
  auto by_default =
      fwserve::RenderChat(nlohmann::json::parse(R"([{"role": "user", "content": "Hail"}])"),
                          fwserve::ChatTemplateOf(fwmodel::ModelConfigToJson(*plain)), "messages");
  ASSERT_TRUE(by_default.ok());
  EXPECT_EQ(*by_default, "USER:\nHail\n\nASSISTANT:\n");
  // RWKV's G1 template, with the capitalised {Role}.
  const fwserve::ChatTemplate g1{"{Role}: {content}\n\n", "Assistant:", {"\n\n"}};
  auto g1_rendered =
      fwserve::RenderChat(nlohmann::json::parse(R"([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hail"},
                                {"role": "assistant", "content": "Hi."},
                                {"role": "user", "content": "Again"}])"),
                          g1, "messages");
  ASSERT_TRUE(g1_rendered.ok()) << g1_rendered.status();
  EXPECT_EQ(*g1_rendered,
            "System: Be brief.\n\nUser: Hail\n\nAssistant: Hi.\n\nUser: Again\n\nAssistant:");
}

TEST(StopFilterTest, HoldsBackPartialMatches) {
  fwserve::StopFilter filter({"END", "xy"});
  EXPECT_EQ(filter.Push("abcE"), "abc");
  EXPECT_EQ(filter.Push("N"), "");
  EXPECT_EQ(filter.Push("d x"), "ENd ");
  EXPECT_EQ(filter.Push("z"), "xz");
  EXPECT_EQ(filter.Push("fooEN"), "foo");
  EXPECT_EQ(filter.Push("Dtail"), "");
  EXPECT_TRUE(filter.stopped());
  EXPECT_EQ(filter.Finish(), "");
  fwserve::StopFilter open({"END"});
  EXPECT_EQ(open.Push("xE"), "x");
  EXPECT_EQ(open.Finish(), "E");
}

TEST_F(HttpTest, LogprobsAndSeed) {
  json request = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                  {"max_tokens", 6},
                  {"temperature", 1},
                  {"seed", 7},
                  {"logprobs", true}};
  Reply a = Post(port_, "/v1/chat/completions", request);
  Reply b = Post(port_, "/v1/chat/completions", request);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(a.Json()["choices"][0]["message"]["content"],
            b.Json()["choices"][0]["message"]["content"]);
  const json body = a.Json();
  const json& content = body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 6u);
  for (const json& t : content) EXPECT_LE(t["logprob"].get<double>(), 0.0);
  ExpectOpenAiError(
      Post(port_, "/v1/chat/completions",
           {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"top_logprobs", 3}}),
      400, "top_logprobs");
}

TEST_F(HttpTest, ErrorsNameTheField) {
  HttpClient client(port_);
  Reply bad = client.Send(http::verb::post, "/v1/chat/completions", "{not json");
  ExpectOpenAiError(bad, 400, "");
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  ExpectOpenAiError(
      Post(port_, "/v1/chat/completions", {{"messages", messages}, {"temperature", "hot"}}), 400,
      "temperature");
  ExpectOpenAiError(Post(port_, "/v1/chat/completions", {{"messages", "Hi"}}), 400, "messages");
  ExpectOpenAiError(Post(port_, "/v1/chat/completions", {{"messages", messages}, {"n", 0}}), 400,
                    "n");
  ExpectOpenAiError(
      Post(port_, "/v1/chat/completions", {{"messages", messages}, {"frequency_penalty", 2.5}}),
      400, "frequency_penalty");
  ExpectOpenAiError(
      Post(port_, "/v1/chat/completions", {{"messages", messages}, {"bogus_field", 1}}), 400,
      "bogus_field");
  ExpectOpenAiError(Post(port_, "/v1/completions", {{"prompt", "x"}, {"max_tokens", -1}}), 400,
                    "max_tokens");
  ExpectOpenAiError(Post(port_, "/v1/completions", {{"max_tokens", 1}}), 400, "prompt");
  Reply unknown = Post(port_, "/v1/chat/completions", {{"messages", messages}, {"model", "nope"}});
  ExpectOpenAiError(unknown, 404, "");
  // A value the core refuses: 400 with its message.
  Reply hot = Post(port_, "/v1/completions", {{"prompt", "x"}, {"temperature", 1000}});
  ExpectOpenAiError(hot, 400, "");
  EXPECT_NE(hot.Json()["error"]["message"].get<std::string>().find("temperature"),
            std::string::npos);
  ExpectOpenAiError(Post(port_, "/v1/completions",
                         {{"prompt", "x"}, {"session_id", "00000000000000000000000000000000"}}),
                    404, "");
  ExpectOpenAiError(Get(port_, "/v1/responses/resp_00000000000000000000000000000000"), 404, "");
}

TEST_F(HttpTest, OversizedBodyIs413AndTheConnectionAnswers) {
  HttpClient client(port_);
  const std::string body = absl::StrCat("{\"prompt\": \"", std::string(5 << 20, 'a'), "\"}");
  Reply r = client.Send(http::verb::post, "/v1/completions", body);
  ExpectOpenAiError(r, 413, "");
  EXPECT_EQ(Get(port_, "/health").status, 200);
}

TEST_F(HttpTest, DeeplyNestedBodyIsAnErrorNotACrash) {
  // Quoting the value in the error once recursed per level and overflowed the stack
  // (found by the http_request fuzz target's deep_nesting seed).
  const size_t depth = size_t{1} << 20;
  const std::string body =
      absl::StrCat("{\"prompt\": ", std::string(depth, '['), std::string(depth, ']'), "}");
  HttpClient client(port_);
  Reply r = client.Send(http::verb::post, "/v1/completions", body);
  ExpectOpenAiError(r, 400, "prompt");
  EXPECT_NE(r.Json()["error"]["message"].get<std::string>().find("[[[..."), std::string::npos)
      << r.body;
  EXPECT_EQ(Get(port_, "/health").status, 200);
}

TEST(OpenAiApiTest, RouteLabelsAreTemplates) {
  auto label = [](const std::string& method, const std::string& target) {
    return fwserve::RouteLabel(method, fwserve::SplitTarget(target));
  };
  EXPECT_EQ(label("POST", "/v1/chat/completions/"), "POST /v1/chat/completions");
  EXPECT_EQ(label("GET", "/v1/models/some-model"), "GET /v1/models/{model}");
  EXPECT_EQ(label("GET", "/v1//responses/resp_1?x=y"), "GET /v1/responses/{id}");
  EXPECT_EQ(label("GET", "/fwserve/v1/sessions/abc/export"),
            "GET /fwserve/v1/sessions/{id}/export");
  EXPECT_EQ(label("POST", "/fwserve/v1/sessions/import?model=m"),
            "POST /fwserve/v1/sessions/import");
  EXPECT_EQ(label("GET", "/health"), "GET /health");
  EXPECT_EQ(label("GET", "/"), "GET /");  // the playground
  for (const char* other :
       {"/index.html", "/fwserve/anything", "/v1/models/a/b", "/v1", "/healthz"}) {
    EXPECT_EQ(label("GET", other), "GET (other)") << other;
  }
}

// Route labels on a live server: the client's path never becomes a label value.
class MetricsHttpTest : public HttpTest {
 protected:
  bool ManualStart() const override { return true; }
};

TEST_F(MetricsHttpTest, RouteLabelsNeverHoldThePath) {
  StartServer({}, Options(), /*expose_metrics=*/true);
  EXPECT_EQ(Get(port_, "/v1/models/no-such-model-1").status, 404);
  EXPECT_EQ(Get(port_, "/fwserve/unknown-path-2").status, 404);
  EXPECT_EQ(Get(port_, "/v1/unknown-path-3/x").status, 404);
  EXPECT_EQ(Get(port_, "/health").status, 200);
  Reply scrape = Get(server_->metrics_port(), "/metrics");
  ASSERT_EQ(scrape.status, 200);
  EXPECT_NE(scrape.body.find("rpc=\"GET /v1/models/{model}\""), std::string::npos);
  EXPECT_NE(scrape.body.find("rpc=\"GET /health\""), std::string::npos);
  for (const char* path : {"no-such-model-1", "unknown-path-2", "unknown-path-3"}) {
    EXPECT_EQ(scrape.body.find(path), std::string::npos) << path;
  }
}

TEST_F(HttpTest, KeepAliveServesSeveralRequests) {
  HttpClient client(port_);
  for (int i = 0; i < 3; ++i) {
    Reply r = client.Send(http::verb::post, "/v1/completions",
                          json{{"prompt", "A"}, {"max_tokens", 2}, {"stream", i == 1}}.dump());
    EXPECT_EQ(r.status, 200) << r.body;
  }
  EXPECT_EQ(client.Send(http::verb::get, "/health").status, 200);
}

TEST_F(HttpTest, SessionsApi) {
  json a = CreateSession("To be");
  EXPECT_EQ(a["tokens"], 5);
  const std::string id = a["id"];
  CreateSession("or not");
  Reply page = Get(port_, "/fwserve/v1/sessions?page_size=1");
  ASSERT_EQ(page.status, 200) << page.body;
  EXPECT_EQ(page.Json()["data"].size(), 1u);
  const std::string token = page.Json()["next_page_token"];
  ASSERT_FALSE(token.empty());
  Reply rest = Get(port_, "/fwserve/v1/sessions?page_size=10&page_token=" + token);
  ASSERT_EQ(rest.status, 200) << rest.body;
  EXPECT_EQ(rest.Json()["data"].size(), 1u);
  ExpectOpenAiError(Get(port_, "/fwserve/v1/sessions?page_size=-1"), 400, "page_size");

  Reply fork = Post(port_, "/fwserve/v1/sessions/" + id + "/fork", json::object());
  ASSERT_EQ(fork.status, 200) << fork.body;
  EXPECT_NE(fork.Json()["id"], id);
  EXPECT_EQ(fork.Json()["tokens"], 5);

  Reply blob = Get(port_, "/fwserve/v1/sessions/" + id + "/export");
  ASSERT_EQ(blob.status, 200);
  EXPECT_EQ(blob.headers["content-type"], "application/octet-stream");
  EXPECT_EQ(blob.headers["x-fwserve-tokens"], "5");
  Reply imported =
      HttpClient(port_).Send(http::verb::post, "/fwserve/v1/sessions/import", blob.body,
                             {{"Content-Type", "application/octet-stream"}});
  ASSERT_EQ(imported.status, 200) << imported.body;
  EXPECT_EQ(imported.Json()["tokens"], 5);
  // The imported state continues like the original.
  const std::string imported_id = imported.Json()["id"];
  json next = {{"prompt", ","}, {"max_tokens", 8}, {"temperature", 0}};
  next["session_id"] = id;
  Reply from_original = Post(port_, "/v1/completions", next);
  next["session_id"] = imported_id;
  Reply from_import = Post(port_, "/v1/completions", next);
  EXPECT_EQ(from_original.Json()["choices"][0]["text"], from_import.Json()["choices"][0]["text"]);

  EXPECT_EQ(Delete(port_, "/fwserve/v1/sessions/" + id).status, 200);
  ExpectOpenAiError(Get(port_, "/fwserve/v1/sessions/" + id), 404, "");
}

TEST_F(HttpTest, ResponsesContinueByPreviousResponseId) {
  Reply first = Post(port_, "/v1/responses",
                     {{"input", "Hello"}, {"max_output_tokens", 6}, {"temperature", 0}});
  ASSERT_EQ(first.status, 200) << first.body;
  json r1 = first.Json();
  EXPECT_EQ(r1["object"], "response");
  const std::string id1 = r1["id"];
  ASSERT_EQ(id1.rfind("resp_", 0), 0u);
  EXPECT_EQ(r1["output"][0]["content"][0]["type"], "output_text");
  EXPECT_EQ(r1["usage"]["input_tokens_details"]["cached_tokens"], 0);
  const int64_t tokens1 = SessionTokens(id1.substr(5));
  EXPECT_EQ(tokens1, r1["usage"]["total_tokens"].get<int64_t>());

  Reply second = Post(port_, "/v1/responses",
                      {{"input", "Again"},
                       {"max_output_tokens", 4},
                       {"previous_response_id", id1},
                       {"temperature", 0}});
  ASSERT_EQ(second.status, 200) << second.body;
  json r2 = second.Json();
  EXPECT_NE(r2["id"], id1);
  EXPECT_EQ(r2["previous_response_id"], id1);
  EXPECT_EQ(r2["usage"]["input_tokens_details"]["cached_tokens"], tokens1);
  // The earlier response is unchanged: branching from it again gives the same text.
  EXPECT_EQ(SessionTokens(id1.substr(5)), tokens1);
  Reply again = Post(port_, "/v1/responses",
                     {{"input", "Again"},
                      {"max_output_tokens", 4},
                      {"previous_response_id", id1},
                      {"temperature", 0}});
  EXPECT_EQ(again.Json()["output"][0]["content"][0]["text"], r2["output"][0]["content"][0]["text"]);

  // store:false leaves nothing behind.
  Reply unstored = Post(
      port_, "/v1/responses",
      {{"input", "x"}, {"max_output_tokens", 2}, {"store", false}, {"previous_response_id", id1}});
  ASSERT_EQ(unstored.status, 200) << unstored.body;
  ExpectOpenAiError(Get(port_, "/v1/responses/" + unstored.Json()["id"].get<std::string>()), 404,
                    "");

  Reply got = Get(port_, "/v1/responses/" + id1);
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(got.Json()["fwserve_session"]["tokens"], tokens1);
  EXPECT_EQ(Delete(port_, "/v1/responses/" + id1).status, 200);
  ExpectOpenAiError(Get(port_, "/v1/responses/" + id1), 404, "");
  ExpectOpenAiError(
      Post(port_, "/v1/responses", {{"input", "x"}, {"previous_response_id", "nope"}}), 400,
      "previous_response_id");
  ExpectOpenAiError(Post(port_, "/v1/responses", {{"input", "x"}, {"tools", {{{"type", "x"}}}}}),
                    400, "tools[0].type");
}

TEST_F(HttpTest, GetResponseReturnsTheTextThePostReturned) {
  Reply first = Post(port_, "/v1/responses",
                     {{"input", "Hello"}, {"max_output_tokens", 12}, {"temperature", 0}});
  ASSERT_EQ(first.status, 200) << first.body;
  const json r1 = first.Json();
  const std::string id1 = r1["id"];
  const std::string text1 = OutputText(r1);
  ASSERT_FALSE(text1.empty());
  Reply got1 = Get(port_, "/v1/responses/" + id1);
  ASSERT_EQ(got1.status, 200) << got1.body;
  const json g1 = got1.Json();
  EXPECT_EQ(g1["id"], id1);
  EXPECT_EQ(g1["object"], "response");
  EXPECT_EQ(g1["status"], "completed");
  EXPECT_EQ(g1["model"], r1["model"]);
  ASSERT_EQ(g1["output"].size(), 1u);
  // The same message as the POST's: its id, role and text.
  EXPECT_EQ(g1["output"][0]["id"], r1["output"][0]["id"]);
  EXPECT_EQ(g1["output"][0]["type"], "message");
  EXPECT_EQ(g1["output"][0]["role"], "assistant");
  EXPECT_EQ(g1["output"][0]["status"], "completed");
  EXPECT_EQ(g1["output"][0]["content"][0]["type"], "output_text");
  EXPECT_EQ(g1["output"][0]["content"][0]["annotations"], json::array());
  EXPECT_EQ(OutputText(g1), text1);
  EXPECT_EQ(g1["fwserve_output_truncated"], false);
  EXPECT_TRUE(g1["usage"].is_null());

  // A continuation's GET has its own text only; the earlier response keeps its own.
  Reply second = Post(port_, "/v1/responses",
                      {{"input", "Again"},
                       {"max_output_tokens", 7},
                       {"previous_response_id", id1},
                       {"temperature", 0}});
  ASSERT_EQ(second.status, 200) << second.body;
  const std::string id2 = second.Json()["id"];
  const std::string text2 = OutputText(second.Json());
  Reply got2 = Get(port_, "/v1/responses/" + id2);
  ASSERT_EQ(got2.status, 200) << got2.body;
  EXPECT_EQ(OutputText(got2.Json()), text2);
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + id1).Json()), text1);

  // Streamed: the GET has the deltas' text.
  Reply streamed = Post(port_, "/v1/responses",
                        {{"input", "Once more"},
                         {"max_output_tokens", 9},
                         {"previous_response_id", id1},
                         {"temperature", 0},
                         {"stream", true}});
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const std::string text3 = StreamedResponseText(streamed.body);
  ASSERT_FALSE(text3.empty());
  Sse sse = ParseSse(streamed.body);
  const json completed = json::parse(sse.data.back());
  const std::string id3 = completed["response"]["id"];
  EXPECT_NE(id3, id1);
  Reply got3 = Get(port_, "/v1/responses/" + id3);
  ASSERT_EQ(got3.status, 200) << got3.body;
  EXPECT_EQ(OutputText(got3.Json()), text3);
  EXPECT_EQ(got3.Json()["output"][0]["id"], completed["response"]["output"][0]["id"]);

  // A conversation's response names the conversation's session: its latest turn.
  Reply conversation = Post(port_, "/v1/conversations", json::object());
  ASSERT_EQ(conversation.status, 200) << conversation.body;
  const std::string conv = conversation.Json()["id"];
  Reply turn = Post(port_, "/v1/responses",
                    {{"input", "Hi"}, {"conversation", conv}, {"max_output_tokens", 5}});
  ASSERT_EQ(turn.status, 200) << turn.body;
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + turn.Json()["id"].get<std::string>()).Json()),
            OutputText(turn.Json()));

  // A fork and an export/import carry the output along; a new session has none.
  const std::string session1 = id1.substr(5);
  Reply fork = Post(port_, "/fwserve/v1/sessions/" + session1 + "/fork", json::object());
  ASSERT_EQ(fork.status, 200) << fork.body;
  EXPECT_EQ(
      OutputText(Get(port_, "/v1/responses/resp_" + fork.Json()["id"].get<std::string>()).Json()),
      text1);
  Reply blob = Get(port_, "/fwserve/v1/sessions/" + session1 + "/export");
  ASSERT_EQ(blob.status, 200);
  Reply imported =
      HttpClient(port_).Send(http::verb::post, "/fwserve/v1/sessions/import", blob.body,
                             {{"Content-Type", "application/octet-stream"}});
  ASSERT_EQ(imported.status, 200) << imported.body;
  EXPECT_EQ(
      OutputText(
          Get(port_, "/v1/responses/resp_" + imported.Json()["id"].get<std::string>()).Json()),
      text1);
  const std::string fresh = CreateSession("Hi")["id"];
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/resp_" + fresh).Json()), "");

  // Deleted: gone.
  EXPECT_EQ(Delete(port_, "/v1/responses/" + id1).status, 200);
  ExpectOpenAiError(Get(port_, "/v1/responses/" + id1), 404, "");
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + id2).Json()), text2);
}

TEST_F(HttpTest, ResponsesStreamEvents) {
  Reply r = Post(port_, "/v1/responses",
                 {{"input", {{{"role", "user"}, {"content", "Hi"}}}},
                  {"instructions", "Answer."},
                  {"max_output_tokens", 8},
                  {"temperature", 0},
                  {"stream", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  Sse sse = ParseSse(r.body);
  ASSERT_EQ(sse.events.size(), sse.data.size());
  ASSERT_GE(sse.events.size(), 6u);
  EXPECT_EQ(sse.events.front(), "response.created");
  EXPECT_TRUE(sse.events.back() == "response.completed" ||
              sse.events.back() == "response.incomplete");
  std::string deltas, done_text;
  for (size_t i = 0; i < sse.data.size(); ++i) {
    json event = json::parse(sse.data[i]);
    EXPECT_EQ(event["sequence_number"], i);
    EXPECT_EQ(event["type"], sse.events[i]);
    if (sse.events[i] == "response.output_text.delta") deltas += event["delta"];
    if (sse.events[i] == "response.output_text.done") done_text = event["text"];
  }
  EXPECT_EQ(deltas, done_text);
  EXPECT_EQ(deltas, Greedy("SYSTEM:\nAnswer.\n\nUSER:\nHi\n\nASSISTANT:\n", 8));
}

TEST_F(HttpTest, Conversations) {
  Reply created =
      Post(port_, "/v1/conversations", {{"items", {{{"role", "user"}, {"content", "Hi"}}}}});
  ASSERT_EQ(created.status, 200) << created.body;
  const std::string id = created.Json()["id"];
  ASSERT_EQ(id.rfind("conv_", 0), 0u);
  EXPECT_EQ(created.Json()["object"], "conversation");
  const int64_t before = SessionTokens(id.substr(5));
  EXPECT_EQ(before, static_cast<int64_t>(std::string("USER:\nHi\n\n").size()));
  Reply turn = Post(port_, "/v1/responses",
                    {{"input", "More"}, {"conversation", id}, {"max_output_tokens", 3}});
  ASSERT_EQ(turn.status, 200) << turn.body;
  EXPECT_EQ(turn.Json()["usage"]["input_tokens_details"]["cached_tokens"], before);
  EXPECT_EQ(turn.Json()["conversation"]["id"], id);
  EXPECT_GT(SessionTokens(id.substr(5)), before);
  EXPECT_EQ(Get(port_, "/v1/conversations/" + id).status, 200);
  EXPECT_EQ(Delete(port_, "/v1/conversations/" + id).status, 200);
  ExpectOpenAiError(Get(port_, "/v1/conversations/" + id), 404, "");
}

// The engine's decode steps are slowed so that a stream lasts long enough to be cut.
class SlowHttpTest : public HttpTest {
 protected:
  bool ManualStart() const override { return true; }
  void SetUp() override {
    fwserve::CoreOptions options = Options();
    options.engine.before_decode_step_for_testing = [](const std::function<bool()>& ending) {
      if (!ending()) std::this_thread::sleep_for(std::chrono::milliseconds(4));
    };
    StartServer({}, options);
  }
};

TEST_F(SlowHttpTest, DisconnectMidStreamCancelsAndTheSessionHoldsWhatWasSent) {
  const std::string prompt = "HAMLET:";
  const std::string id = CreateSession(prompt)["id"];
  {
    HttpClient client(port_);
    client.Write(http::verb::post, "/v1/completions",
                 json{{"prompt", ""},
                      {"session_id", id},
                      {"max_tokens", 1000},
                      {"temperature", 0},
                      {"stream", true}}
                     .dump());
    std::string seen = client.ReadStreamUntil(
        [](const std::string& body) { return ParseSse(body).data.size() >= 4; });
    // The session is busy while the stream runs: a second request gets 409, and so does
    // reading its last output (which takes the session's lease briefly).
    ExpectOpenAiError(Post(port_, "/v1/completions", {{"prompt", "x"}, {"session_id", id}}), 409,
                      "");
    ExpectOpenAiError(Get(port_, "/v1/responses/resp_" + id), 409, "");
    client.Close();
  }
  // The stream is cancelled well before its 1000 tokens.
  int64_t tokens = 0;
  for (int i = 0; i < 200; ++i) {
    Reply r = Get(port_, "/fwserve/v1/sessions/" + id);
    if (r.status == 200 && !r.Json()["busy"].get<bool>()) {
      tokens = r.Json()["tokens"];
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int64_t generated = tokens - static_cast<int64_t>(prompt.size());
  ASSERT_GE(generated, 3);
  EXPECT_LT(generated, 500);
  // What the session holds is exactly the greedy continuation's first `generated`
  // tokens: continuing it gives the reference's next tokens.
  const std::string reference = Greedy(prompt, static_cast<int>(generated) + 6);
  // Its last output is what the client was sent before it went away.
  Reply output = Get(port_, "/v1/responses/resp_" + id);
  ASSERT_EQ(output.status, 200) << output.body;
  EXPECT_EQ(OutputText(output.Json()), reference.substr(0, static_cast<size_t>(generated)));
  Reply next = Post(port_, "/v1/completions",
                    {{"prompt", ""}, {"session_id", id}, {"max_tokens", 6}, {"temperature", 0}});
  ASSERT_EQ(next.status, 200) << next.body;
  EXPECT_EQ(next.Json()["choices"][0]["text"], reference.substr(static_cast<size_t>(generated)));
}

// A stateless client replaying its whole history each turn (the AI SDK's and
// LangChain's pattern): the server kept each turn's conversation, so the next turn
// starts from its state and prefills only the new messages. The replies and their
// logprobs equal a full prefill's (a server with --prefix-reuse-entries 0), and the
// usage counts the kept tokens as cached.
TEST_F(HttpTest, AReplayedChatHistoryContinuesFromTheKeptConversationExactly) {
  fwserve::CoreOptions off = Options();
  off.prefix_reuse_entries = 0;
  std::unique_ptr<Harness> reference = Harness::Start(off, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(reference, nullptr);
  json messages = json::array({{{"role", "user"}, {"content", "Hi"}}});
  int64_t kept = 0;  // tokens of the conversation the reuse server kept last turn
  for (int turn = 0; turn < 3; ++turn) {
    json request = {
        {"messages", messages}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", true}};
    Reply got = Post(port_, "/v1/chat/completions", request);
    Reply want = Post(reference->http_port(), "/v1/chat/completions", request);
    ASSERT_EQ(got.status, 200) << got.body;
    ASSERT_EQ(want.status, 200) << want.body;
    const json g = got.Json(), w = want.Json();
    const std::string reply = g["choices"][0]["message"]["content"];
    EXPECT_EQ(reply, w["choices"][0]["message"]["content"]) << "turn " << turn;
    const json& gl = g["choices"][0]["logprobs"]["content"];
    const json& wl = w["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(gl.size(), wl.size());
    for (size_t i = 0; i < gl.size(); ++i) {
      EXPECT_NEAR(gl[i]["logprob"].get<double>(), wl[i]["logprob"].get<double>(), 1e-5)
          << "turn " << turn << ", token " << i;
    }
    // The same usage as a full prefill, with the kept tokens counted as cached.
    EXPECT_EQ(g["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"]);
    EXPECT_EQ(g["usage"]["total_tokens"], w["usage"]["total_tokens"]);
    EXPECT_EQ(w["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    EXPECT_EQ(g["usage"]["prompt_tokens_details"]["cached_tokens"], kept) << "turn " << turn;
    kept =
        g["usage"]["prompt_tokens"].get<int64_t>() + g["usage"]["completion_tokens"].get<int64_t>();
    messages.push_back({{"role", "assistant"}, {"content", reply}});
    messages.push_back({{"role", "user"}, {"content", absl::StrCat("And ", turn)}});
  }
}

// Evicted (or never kept) conversations fall back to a full prefill, with the same reply.
TEST_F(HttpTest, AnEvictedConversationFallsBackToAFullPrefill) {
  fwserve::CoreOptions one = Options();
  one.prefix_reuse_entries = 1;
  std::unique_ptr<Harness> server = Harness::Start(one, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(server, nullptr);
  auto chat = [&](const json& messages) {
    Reply r = Post(server->http_port(), "/v1/chat/completions",
                   {{"messages", messages}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json();
  };
  const json a = chat({{{"role", "user"}, {"content", "Hi"}}});
  const json b = chat({{{"role", "user"}, {"content", "Other"}}});  // evicts a's
  // b's conversation is kept: its replay is a hit (and then the one kept).
  json b_replay = {{{"role", "user"}, {"content", "Other"}},
                   {{"role", "assistant"}, {"content", b["choices"][0]["message"]["content"]}},
                   {{"role", "user"}, {"content", "More"}}};
  EXPECT_GT(chat(b_replay)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  json replay = {{{"role", "user"}, {"content", "Hi"}},
                 {{"role", "assistant"}, {"content", a["choices"][0]["message"]["content"]}},
                 {{"role", "user"}, {"content", "More"}}};
  const json missed = chat(replay);
  EXPECT_EQ(missed["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // And the miss gave what a full prefill gives.
  std::string prompt = "USER:\nHi\n\nASSISTANT:\n";
  prompt += a["choices"][0]["message"]["content"].get<std::string>();
  prompt += "\n\nUSER:\nMore\n\nASSISTANT:\n";
  Reply full = Post(server->http_port(), "/v1/completions",
                    {{"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_EQ(full.status, 200) << full.body;
  EXPECT_EQ(missed["choices"][0]["message"]["content"], full.Json()["choices"][0]["text"]);
}

// The Responses API replayed without previous_response_id (the AI SDK's pattern, store
// on or off): each stored response's conversation is found by the next replay, which
// forks it and prefills only the new input; the text equals a full prefill's. A store:
// false response uses what is kept but keeps nothing and cannot be fetched.
TEST_F(HttpTest, AReplayedResponsesInputContinuesFromTheStoredResponse) {
  fwserve::CoreOptions off = Options();
  off.prefix_reuse_entries = 0;
  std::unique_ptr<Harness> reference = Harness::Start(off, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(reference, nullptr);
  auto respond = [](int port, const json& input, bool store) {
    Reply r =
        Post(port, "/v1/responses",
             {{"input", input}, {"max_output_tokens", 6}, {"temperature", 0}, {"store", store}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json();
  };
  const json first = respond(port_, "Hi", true);
  const std::string reply = OutputText(first);
  json replay = json::array({{{"role", "user"}, {"content", "Hi"}},
                             {{"role", "assistant"}, {"content", reply}},
                             {{"role", "user"}, {"content", "More"}}});
  for (bool store : {false, true}) {
    const json got = respond(port_, replay, store);
    const json want = respond(reference->http_port(), replay, store);
    EXPECT_EQ(OutputText(got), OutputText(want)) << "store " << store;
    EXPECT_EQ(got["usage"]["input_tokens"], want["usage"]["input_tokens"]);
    EXPECT_EQ(got["usage"]["input_tokens_details"]["cached_tokens"], first["usage"]["total_tokens"])
        << "store " << store;
    const std::string id = got["id"];
    EXPECT_EQ(GetIndexed(port_, "/v1/responses/" + id).status, store ? 200 : 404);
  }
  // The first response is still the caller's, whole.
  Reply again = GetIndexed(port_, "/v1/responses/" + first["id"].get<std::string>());
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(OutputText(again.Json()), reply);
  // Deleted, it is no start point: a full prefill, the same text.
  ASSERT_EQ(Delete(port_, "/v1/responses/" + first["id"].get<std::string>()).status, 200);
  const json after = respond(port_, replay, false);
  EXPECT_EQ(after["usage"]["input_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(OutputText(after), OutputText(respond(reference->http_port(), replay, false)));
}

// A model whose chat template names an end-of-turn marker (RWKV's G1: "\n\n"): a chat
// or response without `stop` ends its reply before it; a request's own `stop` replaces
// it. Here the shipped model with the marker "e", which its greedy reply reaches.
TEST_F(HttpTest, AChatEndsAtTheTemplatesEndOfTurnMarker) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("fwserve-template-stop-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::copy(ModelDir(), dir);
  json config = json::parse(std::ifstream(dir / "config.json"));
  config["chat_template"] = {{"message", "{role}:\n{content}\n\n"},
                             {"generation_prompt", "ASSISTANT:\n"},
                             {"stop", {"e"}}};
  std::ofstream(dir / "config.json") << config.dump();
  fwserve::CoreOptions options = Options();
  options.model_dirs = {dir.string()};
  std::unique_ptr<Harness> server =
      Harness::Start(options, {}, false, fwserve::HttpServerOptions{});
  ASSERT_NE(server, nullptr);
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  auto chat = [&](int port, json extra) {
    json request = {{"messages", messages}, {"max_tokens", 40}, {"temperature", 0}};
    request.update(extra);
    Reply r = Post(port, "/v1/chat/completions", request);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json();
  };
  const std::string full = chat(port_, json::object())["choices"][0]["message"]["content"];
  const size_t marker = full.find('e');
  ASSERT_NE(marker, std::string::npos) << full;  // the reply reaches the marker
  const json ended = chat(server->http_port(), json::object());
  EXPECT_EQ(ended["choices"][0]["message"]["content"], full.substr(0, marker));
  EXPECT_EQ(ended["choices"][0]["finish_reason"], "stop");
  // The request's own stop replaces the template's.
  const json own = chat(server->http_port(), {{"stop", {"zzz"}}});
  EXPECT_EQ(own["choices"][0]["message"]["content"], full);
  Reply response = Post(server->http_port(), "/v1/responses",
                        {{"input", "Hi"}, {"max_output_tokens", 40}, {"temperature", 0}});
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(OutputText(response.Json()), full.substr(0, marker));
  server.reset();
  std::filesystem::remove_all(dir);
}

class AuthHttpTest : public HttpTest {
 protected:
  bool ManualStart() const override { return true; }
  void SetUp() override {
    auto tenants = fwserve::Tenants::FromText(
        absl::StrCat("sha256:", fwserve::Sha256Hex("key-a"), " tenant=alpha\n",
                     "sha256:", fwserve::Sha256Hex("key-b"), " tenant=beta\n"));
    ASSERT_TRUE(tenants.ok()) << tenants.status();
    tenants_ = std::move(*tenants);
    authenticator_ = std::make_unique<fwserve::ApiKeyAuthenticator>(tenants_.get(), nullptr);
    fwserve::HttpServerOptions http;
    http.authenticator = authenticator_.get();
    http.cors_origins = {"http://ui.example"};
    fwserve::CoreOptions options = Options();
    options.tenants = tenants_.get();
    StartServer(http, options);
  }
  std::unique_ptr<fwserve::Tenants> tenants_;
  std::unique_ptr<fwserve::ApiKeyAuthenticator> authenticator_;
};

// A kept conversation is its tenant's: another tenant replaying the same history
// prefills it in full.
TEST_F(AuthHttpTest, KeptConversationsNeverCrossTenants) {
  auto chat = [&](const std::string& key, const json& messages) {
    Reply r = Post(port_, "/v1/chat/completions",
                   {{"messages", messages}, {"max_tokens", 4}, {"temperature", 0}},
                   {{"Authorization", "Bearer " + key}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.Json();
  };
  const json first = chat("key-a", {{{"role", "user"}, {"content", "Secret"}}});
  json replay = {{{"role", "user"}, {"content", "Secret"}},
                 {{"role", "assistant"}, {"content", first["choices"][0]["message"]["content"]}},
                 {{"role", "user"}, {"content", "More"}}};
  EXPECT_EQ(chat("key-b", replay)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_GT(chat("key-a", replay)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

TEST_F(AuthHttpTest, BearerKeysAndCors) {
  EXPECT_EQ(Get(port_, "/health").status, 200);  // probes stay open
  ExpectOpenAiError(Get(port_, "/v1/models"), 401, "");
  ExpectOpenAiError(Get(port_, "/v1/models", {{"Authorization", "Bearer wrong"}}), 401, "");
  ExpectOpenAiError(Get(port_, "/v1/models", {{"Authorization", "Basic a2V5LWE="}}), 401, "");
  Reply ok = Get(port_, "/v1/models",
                 {{"Authorization", "Bearer key-a"}, {"Origin", "http://ui.example"}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.headers["access-control-allow-origin"], "http://ui.example");
  Reply other = Get(port_, "/v1/models",
                    {{"Authorization", "Bearer key-a"}, {"Origin", "http://evil.example"}});
  EXPECT_EQ(other.headers.count("access-control-allow-origin"), 0u);
  Reply preflight = HttpClient(port_).Send(http::verb::options, "/v1/chat/completions", "",
                                           {{"Origin", "http://ui.example"}});
  EXPECT_EQ(preflight.status, 204);
  EXPECT_EQ(preflight.headers["access-control-allow-origin"], "http://ui.example");
  EXPECT_NE(preflight.headers["access-control-allow-headers"].find("Authorization"),
            std::string::npos);
  // A session belongs to its tenant.
  Reply created =
      Post(port_, "/fwserve/v1/sessions", {{"prefix", "a"}}, {{"Authorization", "Bearer key-a"}});
  EXPECT_EQ(created.status, 200) << created.body;
}

TEST_F(AuthHttpTest, AResponseIsItsTenants) {
  const std::map<std::string, std::string> alpha = {{"Authorization", "Bearer key-a"}};
  const std::map<std::string, std::string> beta = {{"Authorization", "Bearer key-b"}};
  Reply posted = Post(port_, "/v1/responses", {{"input", "Hi"}, {"max_output_tokens", 5}}, alpha);
  ASSERT_EQ(posted.status, 200) << posted.body;
  const std::string id = posted.Json()["id"];
  Reply own = Get(port_, "/v1/responses/" + id, alpha);
  ASSERT_EQ(own.status, 200) << own.body;
  EXPECT_EQ(OutputText(own.Json()), OutputText(posted.Json()));
  // To another tenant it does not exist: not readable, not deletable.
  ExpectOpenAiError(Get(port_, "/v1/responses/" + id, beta), 404, "");
  ExpectOpenAiError(HttpClient(port_).Send(http::verb::delete_, "/v1/responses/" + id, "", beta),
                    404, "");
  ExpectOpenAiError(Get(port_, "/v1/responses/" + id), 401, "");
  EXPECT_EQ(Get(port_, "/v1/responses/" + id, alpha).status, 200);
  // Nor can its message be referenced as an input item (its own tenant can).
  const json reference = {
      {"input", json::array({{{"role", "user"}, {"content", "Hi"}},
                             {{"type", "item_reference"}, {"id", posted.Json()["output"][0]["id"]}},
                             {{"role", "user"}, {"content", "And?"}}})},
      {"max_output_tokens", 2}};
  ExpectOpenAiError(Post(port_, "/v1/responses", reference, beta), 404, "input[1].id");
  EXPECT_EQ(Post(port_, "/v1/responses", reference, alpha).status, 200);
}

// Over a dir: store: a response's text survives a restart, and reading it does not make
// its session resident.
TEST_F(HttpTest, GetResponseAfterARestartWithADirStore) {
  fwserve::CoreOptions options = Options();
  options.session_store = "dir:" + MakeTempDir("http-responses");
  server_.reset();
  StartServer({}, options);
  Reply posted = Post(port_, "/v1/responses",
                      {{"input", "Hello"}, {"max_output_tokens", 10}, {"temperature", 0}});
  ASSERT_EQ(posted.status, 200) << posted.body;
  const std::string id = posted.Json()["id"];
  const std::string text = OutputText(posted.Json());
  Reply streamed = Post(port_, "/v1/responses",
                        {{"input", "More"},
                         {"max_output_tokens", 6},
                         {"previous_response_id", id},
                         {"stream", true}});
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const std::string streamed_text = StreamedResponseText(streamed.body);
  const std::string streamed_id =
      json::parse(ParseSse(streamed.body).data.back())["response"]["id"];

  server_.reset();
  StartServer({}, options);
  Reply got = GetIndexed(port_, "/v1/responses/" + id);
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(OutputText(got.Json()), text);
  EXPECT_EQ(got.Json()["fwserve_session"]["resident"], false);
  Reply got_streamed = GetIndexed(port_, "/v1/responses/" + streamed_id);
  ASSERT_EQ(got_streamed.status, 200) << got_streamed.body;
  EXPECT_EQ(OutputText(got_streamed.Json()), streamed_text);
  // Continuing it after the restart works, and its own output replaces nothing else's.
  Reply next = Post(port_, "/v1/responses",
                    {{"input", "And?"}, {"max_output_tokens", 4}, {"previous_response_id", id}});
  ASSERT_EQ(next.status, 200) << next.body;
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + next.Json()["id"].get<std::string>()).Json()),
            OutputText(next.Json()));
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + id).Json()), text);
}

// Two replicas (HTTP on both) on one real redis-server.
class RedisHttpTest : public HttpTest {
 protected:
  bool ManualStart() const override { return true; }
  void SetUp() override {
    auto redis = fwserve::RedisServer::Start();
    ASSERT_TRUE(redis.ok()) << redis.status();
    redis_ = std::move(*redis);
    fwserve::CoreOptions options = Options();
    options.session_store = redis_->spec();
    StartServer({}, options);
    other_ = Harness::Start(options, {}, false, fwserve::HttpServerOptions{});
    ASSERT_NE(other_, nullptr);
  }
  // The servers stop before redis-server does.
  void TearDown() override {
    other_.reset();
    server_.reset();
  }
  std::unique_ptr<fwserve::RedisServer> redis_;
  std::unique_ptr<Harness> other_;
};

TEST_F(RedisHttpTest, GetResponseOnAnotherReplica) {
  const int other = other_->http_port();
  Reply posted = Post(port_, "/v1/responses",
                      {{"input", "Hello"}, {"max_output_tokens", 10}, {"temperature", 0}});
  ASSERT_EQ(posted.status, 200) << posted.body;
  const std::string id = posted.Json()["id"];
  Reply got = Get(other, "/v1/responses/" + id);
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(OutputText(got.Json()), OutputText(posted.Json()));
  // A continuation made on the other replica is read back on the first.
  Reply next = Post(other, "/v1/responses",
                    {{"input", "And?"}, {"max_output_tokens", 4}, {"previous_response_id", id}});
  ASSERT_EQ(next.status, 200) << next.body;
  Reply next_here = Get(port_, "/v1/responses/" + next.Json()["id"].get<std::string>());
  ASSERT_EQ(next_here.status, 200) << next_here.body;
  EXPECT_EQ(OutputText(next_here.Json()), OutputText(next.Json()));
  EXPECT_EQ(OutputText(Get(port_, "/v1/responses/" + id).Json()), OutputText(posted.Json()));
  // A conversation turn on one replica replaces the text the other one reads (its
  // cached copy is stale and reloaded).
  Reply conversation = Post(port_, "/v1/conversations", json::object());
  ASSERT_EQ(conversation.status, 200) << conversation.body;
  const std::string conv = conversation.Json()["id"];
  for (int turn = 0; turn < 2; ++turn) {
    Reply said = Post(turn == 0 ? port_ : other, "/v1/responses",
                      {{"input", turn == 0 ? "Hi" : "Bye"},
                       {"conversation", conv},
                       {"max_output_tokens", 5 + turn}});
    ASSERT_EQ(said.status, 200) << said.body;
    Reply read = Get(turn == 0 ? other : port_, "/v1/responses/resp_" + conv.substr(5));
    ASSERT_EQ(read.status, 200) << read.body;
    EXPECT_EQ(OutputText(read.Json()), OutputText(said.Json())) << "turn " << turn;
  }
}

TEST_F(HttpTest, ShutdownAnswers503OnOpenConnections) {
  HttpClient client(port_);
  EXPECT_EQ(client.Send(http::verb::get, "/ready").status, 200);
  server_->http().BeginShutdown();
  // (The answer closes the connection: no new requests during a drain.)
  EXPECT_EQ(client.Send(http::verb::get, "/ready").status, 503);
  server_->Shutdown();
}

}  // namespace
}  // namespace fwtest
