// A small synchronous HTTP/1.1 client (Boost.Beast) and SSE helpers for the HTTP API's
// integration tests (http_test.cc, http_compat_test.cc). Header-only; test code.
#pragma once

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace fwtest {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

inline std::string ModelDir() {
  return std::string(FWSERVE_SOURCE_DIR) + "/models/pretrained/aft-shakespeare";
}

struct Reply {
  int status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lowercase names
  json Json() const { return json::parse(body, nullptr, false); }
};

// One HTTP/1.1 connection (keep-alive), synchronous.
class HttpClient {
 public:
  explicit HttpClient(int port) : socket_(ioc_) {
    tcp::resolver resolver(ioc_);
    net::connect(socket_, resolver.resolve("127.0.0.1", std::to_string(port)));
  }

  Reply Send(http::verb method, const std::string& target, const std::string& body = "",
             const std::map<std::string, std::string>& headers = {}) {
    Write(method, target, body, headers);
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    if (method == http::verb::head) parser.skip(true);  // no body follows, whatever its length
    beast::error_code ec;
    http::read(socket_, buffer_, parser, ec);
    Reply out;
    if (ec) {
      out.status = -1;
      out.body = ec.message();
      return out;
    }
    out.status = parser.get().result_int();
    out.body = parser.get().body();
    for (const auto& field : parser.get()) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(c));
      out.headers[name] = std::string(field.value());
    }
    return out;
  }

  void Write(http::verb method, const std::string& target, const std::string& body,
             const std::map<std::string, std::string>& headers = {}) {
    http::request<http::string_body> req{method, target, 11};
    req.set(http::field::host, "127.0.0.1");
    if (!body.empty()) req.set(http::field::content_type, "application/json");
    for (const auto& [name, value] : headers) req.set(name, value);
    req.body() = body;
    req.prepare_payload();
    http::write(socket_, req);
  }

  // Reads a streamed response until `enough(body so far)` or the end; returns the body.
  std::string ReadStreamUntil(const std::function<bool(const std::string&)>& enough) {
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    beast::error_code ec;
    http::read_header(socket_, buffer_, parser, ec);
    while (!ec && !parser.is_done() && !enough(parser.get().body())) {
      http::read_some(socket_, buffer_, parser, ec);
    }
    return parser.get().body();
  }

  void Close() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

inline Reply Get(int port, const std::string& target,
                 const std::map<std::string, std::string>& headers = {}) {
  return HttpClient(port).Send(http::verb::get, target, "", headers);
}
inline Reply Post(int port, const std::string& target, const json& body,
                  const std::map<std::string, std::string>& headers = {}) {
  return HttpClient(port).Send(http::verb::post, target, body.dump(), headers);
}
inline Reply Delete(int port, const std::string& target) {
  return HttpClient(port).Send(http::verb::delete_, target);
}

// SSE: the data payloads of a stream, in order (and the event names, if any).
struct Sse {
  std::vector<std::string> data;
  std::vector<std::string> events;
};
inline Sse ParseSse(const std::string& body) {
  Sse out;
  for (absl::string_view block : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    for (absl::string_view line : absl::StrSplit(block, '\n')) {
      if (absl::ConsumePrefix(&line, "data: ")) out.data.emplace_back(line);
      if (absl::ConsumePrefix(&line, "event: ")) out.events.emplace_back(line);
    }
  }
  return out;
}

// The text of chat/completions chunks.
inline std::string StreamedText(const Sse& sse, bool chat) {
  std::string text;
  for (const std::string& d : sse.data) {
    if (d == "[DONE]") continue;
    json chunk = json::parse(d);
    if (!chunk.contains("choices") || chunk["choices"].empty()) continue;
    const json& choice = chunk["choices"][0];
    if (chat) {
      if (choice["delta"].contains("content")) text += choice["delta"]["content"];
    } else {
      text += choice["text"].get<std::string>();
    }
  }
  return text;
}

inline void ExpectOpenAiError(const Reply& reply, int status, const std::string& param) {
  EXPECT_EQ(reply.status, status) << reply.body;
  json body = reply.Json();
  ASSERT_TRUE(body.contains("error")) << reply.body;
  for (const char* key : {"message", "type", "param", "code"}) {
    EXPECT_TRUE(body["error"].contains(key)) << key << " missing: " << reply.body;
  }
  if (!param.empty()) {
    EXPECT_EQ(body["error"]["param"], param) << reply.body;
  }
}

// The text of a response object's one message.
inline std::string OutputText(const json& response) {
  return response["output"][0]["content"][0]["text"].get<std::string>();
}

// The concatenated deltas of a streamed response, checked against its
// response.output_text.done event.
inline std::string StreamedResponseText(const std::string& body) {
  Sse sse = ParseSse(body);
  std::string deltas, done_text;
  for (size_t i = 0; i < sse.data.size() && i < sse.events.size(); ++i) {
    json event = json::parse(sse.data[i]);
    if (sse.events[i] == "response.output_text.delta") deltas += event["delta"];
    if (sse.events[i] == "response.output_text.done") done_text = event["text"];
  }
  EXPECT_EQ(deltas, done_text);
  return deltas;
}

}  // namespace fwtest
