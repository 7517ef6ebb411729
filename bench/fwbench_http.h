// fwbench's HTTP side: a small HTTP/1.1 client on Boost.Beast for driving fwserve's
// OpenAI-compatible API (docs/http.md) with server-sent events. Three pieces:
//   - SseParser: splits a byte stream into SSE events' data payloads, incrementally;
//   - ChunkFields: the few fields of a completions stream chunk that fwbench needs,
//     read with nlohmann's SAX interface (no DOM is built);
//   - HttpConnection: one keep-alive connection on an io_context, asynchronous, one
//     request at a time, delivering the body as it arrives;
// and HttpCall, a blocking one-shot request (set-up, discovery, clean-up).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/verb.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fwbench {

using Endpoints = boost::asio::ip::tcp::resolver::results_type;

// "HOST:PORT" resolved to TCP endpoints (blocking). Fails on a missing port or an
// unresolvable host.
absl::StatusOr<Endpoints> Resolve(const std::string& host_port);

// Incremental parser of a text/event-stream body. Feed() takes the body in pieces of any
// size and calls on_data once per complete event that has data lines, with the event's
// data (several data lines joined by '\n'). Lines end with "\n" or "\r\n"; "event:",
// "id:", "retry:" and comment lines are ignored. Bytes of an unfinished event are kept
// for the next Feed().
class SseParser {
 public:
  void Feed(absl::string_view bytes, const std::function<void(absl::string_view)>& on_data);
  void Reset() {
    pending_.clear();
    data_.clear();
    has_data_ = false;
  }

 private:
  std::string pending_;  // the unfinished line
  std::string data_;     // the current event's data so far
  bool has_data_ = false;
};

// What fwbench reads from one chunk of a streamed /v1/completions response (and of an
// error event): the UTF-8 bytes of choices[0].text, usage.completion_tokens when the
// chunk carries a usage object, and an error's code (or type). Parse() returns false
// for text that is not one JSON value.
struct ChunkFields {
  int64_t text_bytes = 0;
  int64_t completion_tokens = -1;  // -1: no usage in this chunk
  bool is_error = false;
  std::string error_code;  // error.code, else error.type, else "unknown"

  bool Parse(absl::string_view json);
};

// One HTTP/1.1 keep-alive connection to `endpoints`, used from the io_context's thread
// only (not thread-safe). Request() connects first when the connection is not open
// (the first request, or after the server or Close() closed it), sends the request and
// reads the response: on_header(status) once its header is in, on_body(bytes) for each
// piece of the (de-chunked) body as it is read, then on_done(error) exactly once:
// empty error = the whole response was read. Handlers run on the io_context's thread;
// one request at a time (Request() while one is in flight is a contract violation).
// Close() aborts the request in flight (its on_done gets an error) and closes the
// socket; a later Request() reconnects.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  struct Handlers {
    std::function<void(int status)> on_header;
    std::function<void(absl::string_view bytes)> on_body;
    std::function<void(const std::string& error)> on_done;
  };

  HttpConnection(boost::asio::io_context& io, Endpoints endpoints, std::string host);

  // Opens the connection now (no request); on_done as for Request().
  void Connect(std::function<void(const std::string& error)> on_done);
  void Request(boost::beast::http::verb method, const std::string& target, std::string body,
               Handlers handlers);
  void Close();
  bool in_flight() const { return in_flight_; }

 private:
  void Send();
  void ReadSome();
  void Done(const std::string& error);

  boost::beast::tcp_stream stream_;
  const Endpoints endpoints_;
  const std::string host_;
  boost::beast::flat_buffer buffer_;
  boost::beast::http::request<boost::beast::http::string_body> request_;
  std::optional<boost::beast::http::response_parser<boost::beast::http::string_body>> parser_;
  Handlers handlers_;
  bool in_flight_ = false;
  bool header_reported_ = false;
  uint64_t generation_ = 0;  // bumped by Close(): stale completions are ignored
};

struct HttpReply {
  int status = 0;
  std::string body;
};

// One blocking request on a fresh connection (closed afterwards), with a JSON body when
// `body` is not empty. Transport failures are UNAVAILABLE; any HTTP status is a reply.
absl::StatusOr<HttpReply> HttpCall(const Endpoints& endpoints, const std::string& host,
                                   boost::beast::http::verb method, const std::string& target,
                                   const std::string& body = "",
                                   absl::Duration timeout = absl::Seconds(60));

}  // namespace fwbench
