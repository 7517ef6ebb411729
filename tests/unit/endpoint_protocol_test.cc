// The OpenAI endpoints' protocols (server/transport/http/endpoint_protocol.h) without a
// server: what each endpoint adjusts, names and sends, down to the paths the HTTP tests
// cannot reach on demand (a stream that fails after it opened).
#include "server/transport/http/endpoint_protocol.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "server/transport/http/openai_api.h"
#include "server/transport/http/openai_responses.h"

namespace {

using fwserve::EndpointProtocol;
using fwserve::GenerateOutcome;
using fwserve::OpenAiEndpoint;
using fwserve::OpenAiGenerateRequest;
using json = nlohmann::json;

constexpr char kSuffix[] = "0123456789abcdef0123456789abcdef";
constexpr char kSession[] = "fedcba9876543210fedcba9876543210";

std::unique_ptr<EndpointProtocol> Make(OpenAiEndpoint endpoint) {
  return fwserve::NewEndpointProtocol(endpoint, "m", 1700000000, kSuffix);
}

OpenAiGenerateRequest Parsed(OpenAiEndpoint endpoint, const json& body) {
  absl::StatusOr<OpenAiGenerateRequest> r =
      fwserve::ParseGenerateRequest(body, endpoint, fwserve::ChatTemplate{}, 64);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : OpenAiGenerateRequest{};
}

// The JSON payloads of the "data: " lines of `events`.
std::vector<json> DataOf(const std::string& events) {
  std::vector<json> out;
  size_t at = 0;
  while ((at = events.find("data: ", at)) != std::string::npos) {
    const size_t end = events.find("\n\n", at);
    out.push_back(json::parse(events.substr(at + 6, end - at - 6)));
    at = end;
  }
  return out;
}

TEST(EndpointProtocolTest, UsageCountsTheCachedStateAsInput) {
  fwserve::GenerateSummary s;
  s.prompt_tokens = 5;
  s.generated_tokens = 3;
  s.session_tokens = 20;  // 12 held before the request
  const fwserve::UsageCounts u = fwserve::CountUsage(s);
  EXPECT_EQ(u.cached, 12);
  EXPECT_EQ(u.input, 17);
  EXPECT_EQ(u.total, 20);
  EXPECT_EQ(Make(OpenAiEndpoint::kChat)->Usage(s)["prompt_tokens_details"]["cached_tokens"], 12);
  EXPECT_EQ(Make(OpenAiEndpoint::kResponses)->Usage(s)["input_tokens"], 17);
  s.session_tokens = 0;  // a throwaway stream: nothing cached
  EXPECT_EQ(Make(OpenAiEndpoint::kCompletions)->Usage(s)["prompt_tokens"], 5);
}

TEST(EndpointProtocolTest, EachEndpointAdjustsItsParams) {
  OpenAiGenerateRequest chat =
      Parsed(OpenAiEndpoint::kChat, {{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  fwserve::GenerateParams params = chat.params;
  Make(OpenAiEndpoint::kChat)->AdjustParams(chat, &params);
  EXPECT_EQ(params.prefix_reuse, fwserve::GenerateParams::PrefixReuse::kServerKept);
  params = chat.params;
  params.session_id = kSession;
  Make(OpenAiEndpoint::kChat)->AdjustParams(chat, &params);
  EXPECT_EQ(params.prefix_reuse, fwserve::GenerateParams::PrefixReuse::kOff);

  OpenAiGenerateRequest completion = Parsed(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}});
  params = completion.params;
  params.model = "m";
  Make(OpenAiEndpoint::kCompletions)->AdjustParams(completion, &params);
  EXPECT_EQ(params.model, "m");
  EXPECT_EQ(params.prefix_reuse, fwserve::GenerateParams::PrefixReuse::kOff);

  // A response on a session generates with the session's model.
  OpenAiGenerateRequest response = Parsed(OpenAiEndpoint::kResponses, {{"input", "hi"}});
  params = response.params;
  params.model = "m";
  Make(OpenAiEndpoint::kResponses)->AdjustParams(response, &params);
  EXPECT_EQ(params.model, "m");
  response.params.fork_from = kSession;
  Make(OpenAiEndpoint::kResponses)->AdjustParams(response, &params);
  EXPECT_EQ(params.model, "");
}

TEST(EndpointProtocolTest, CompletionsAndChatNameTheirObjects) {
  GenerateOutcome outcome;
  outcome.text = "ok";
  outcome.reason = fwserve::FinishReason::kLength;
  outcome.usage = json::object();
  const json completion =
      Make(OpenAiEndpoint::kCompletions)
          ->Body(Parsed(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}}), outcome);
  EXPECT_EQ(completion["id"], std::string("cmpl-") + kSuffix);
  EXPECT_EQ(completion["object"], "text_completion");
  EXPECT_EQ(completion["choices"][0]["text"], "ok");
  EXPECT_EQ(completion["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(completion.contains("service_tier"));
  outcome.stopped = true;
  const json chat = Make(OpenAiEndpoint::kChat)
                        ->Body(Parsed(OpenAiEndpoint::kChat,
                                      {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}),
                               outcome);
  EXPECT_EQ(chat["id"], std::string("chatcmpl-") + kSuffix);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "ok");
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chat["service_tier"], "default");
}

TEST(EndpointProtocolTest, ChatStreamOpensWithTheRoleAndEndsWithDone) {
  std::unique_ptr<EndpointProtocol> p = Make(OpenAiEndpoint::kChat);
  const OpenAiGenerateRequest request =
      Parsed(OpenAiEndpoint::kChat, {{"stream", true},
                                     {"stream_options", {{"include_usage", true}}},
                                     {"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  const std::vector<json> opening = DataOf(p->StreamOpening(request));
  ASSERT_EQ(opening.size(), 1u);
  EXPECT_EQ(opening[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(opening[0]["object"], "chat.completion.chunk");
  EXPECT_TRUE(opening[0]["usage"].is_null() && opening[0].contains("usage"));
  GenerateOutcome outcome;
  outcome.usage = {{"total_tokens", 3}};
  const std::string closing = p->StreamClosing(request, outcome, json::object());
  const std::vector<json> chunks = DataOf(closing.substr(0, closing.rfind("data: [DONE]")));
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(chunks[1]["choices"], json::array());
  EXPECT_EQ(chunks[1]["usage"]["total_tokens"], 3);
  EXPECT_EQ(closing.substr(closing.size() - 14), "data: [DONE]\n\n");
  // Completions open with nothing.
  EXPECT_EQ(Make(OpenAiEndpoint::kCompletions)
                ->StreamOpening(Parsed(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}})),
            "");
}

// A stream that fails after it opened ends with the error in the endpoint's shape.
TEST(EndpointProtocolTest, StreamErrorsTakeTheEndpointsShape) {
  const json error = fwserve::ErrorJson(absl::AbortedError("busy"), 409);
  for (OpenAiEndpoint endpoint : {OpenAiEndpoint::kCompletions, OpenAiEndpoint::kChat}) {
    EXPECT_EQ(Make(endpoint)->StreamError(error), "data: " + fwserve::Dump(error) + "\n\n");
  }
  std::unique_ptr<EndpointProtocol> p = Make(OpenAiEndpoint::kResponses);
  OpenAiGenerateRequest request = Parsed(OpenAiEndpoint::kResponses, {{"input", "hi"}});
  request.params.session_id = kSession;
  const std::string opening = p->StreamOpening(request);  // sequence numbers 0..3
  const std::string event = p->StreamError(error);
  ASSERT_EQ(event.rfind("event: error\ndata: ", 0), 0u) << event;
  const std::vector<json> data = DataOf(event);
  ASSERT_EQ(data.size(), 1u);
  EXPECT_EQ(data[0], json({{"type", "error"},
                           {"sequence_number", 4},
                           {"code", "session_busy"},
                           {"message", "busy"},
                           {"param", nullptr}}));
}

TEST(EndpointProtocolTest, ResponseEventsAreNumberedAndNameTheSession) {
  std::unique_ptr<EndpointProtocol> p = Make(OpenAiEndpoint::kResponses);
  OpenAiGenerateRequest request = Parsed(OpenAiEndpoint::kResponses, {{"input", "hi"}});
  request.params.session_id = kSession;
  std::string events = p->StreamOpening(request);
  events += p->StreamDelta(request, "Hel", nullptr);
  GenerateOutcome outcome;
  outcome.text = "Hello";
  outcome.reason = fwserve::FinishReason::kLength;  // max_output_tokens reached
  outcome.usage = json::object();
  const json body = p->Body(request, outcome);
  EXPECT_EQ(body["id"], std::string(fwserve::kResponsePrefix) + kSession);
  EXPECT_EQ(body["status"], "incomplete");
  EXPECT_EQ(body["incomplete_details"]["reason"], "max_output_tokens");
  events += p->StreamClosing(request, outcome, body);
  const std::vector<json> data = DataOf(events);
  ASSERT_EQ(data.size(), 9u);
  for (size_t i = 0; i < data.size(); ++i) EXPECT_EQ(data[i]["sequence_number"], i);
  EXPECT_EQ(data[0]["type"], "response.created");
  EXPECT_EQ(data[4]["type"], "response.output_text.delta");
  EXPECT_EQ(data[4]["item_id"], fwserve::ResponseMessageId(kSession));
  EXPECT_EQ(data[5]["text"], "Hello");
  EXPECT_EQ(data[8]["type"], "response.incomplete");
  EXPECT_EQ(data[8]["response"], body);
}

// Each endpoint parses only its own fields; the shared ones read alike.
TEST(EndpointProtocolTest, EndpointsParseTheirOwnFields) {
  const json stop = {{"input", "hi"}, {"stop", "x"}};
  absl::StatusOr<OpenAiGenerateRequest> r =
      fwserve::ParseGenerateRequest(stop, OpenAiEndpoint::kResponses, fwserve::ChatTemplate{}, 64);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(fwserve::ParamOf(r.status()), "stop");
  r = fwserve::ParseGenerateRequest({{"prompt", "hi"}, {"max_completion_tokens", 3}},
                                    OpenAiEndpoint::kCompletions, fwserve::ChatTemplate{}, 64);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(fwserve::ParamOf(r.status()), "max_completion_tokens");
  const OpenAiGenerateRequest chat =
      Parsed(OpenAiEndpoint::kChat, {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                     {"max_tokens", 9},
                                     {"max_completion_tokens", 4},
                                     {"seed", 7},
                                     {"user", "u"}});
  EXPECT_EQ(chat.params.max_tokens, 4);
  EXPECT_FALSE(chat.params.random_seed);
  EXPECT_EQ(chat.user, "u");
  EXPECT_EQ(Parsed(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}}).params.max_tokens, 16);
  EXPECT_EQ(Parsed(OpenAiEndpoint::kResponses, {{"input", "hi"}}).params.max_tokens, 64);
}

}  // namespace
