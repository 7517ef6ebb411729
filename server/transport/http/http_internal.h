// The HTTP server's socket side (Boost.Beast): the listener, the connections and the
// routing, included by http_server.cc alone. The route handlers (http_api.h) see a
// connection as an HttpExchange and include no Beast.
#pragma once

#include "server/transport/http/http_api.h"
#include "server/transport/http/http_server.h"

#include <algorithm>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/base/session_id.h"
#include "server/transport/http/endpoint_protocol.h"
#include "server/transport/http/openai_api.h"
#include "server/transport/http/openai_responses.h"
#include "server/transport/http/playground.h"

namespace fwserve {
namespace http_internal {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

// CORS: the request headers allowed when a preflight names none, and the answer's
// headers a page may read (the retry hints of a 429/503 and the export's metadata).
constexpr char kCorsAllowHeaders[] = "Authorization, Content-Type";
constexpr char kCorsExposeHeaders[] =
    "Retry-After, retry-after-ms, X-Fwserve-Model, X-Fwserve-Tokens";

// Whether `value` is a comma-separated list of header names (RFC 9110 tokens), at most
// 2 KiB: what a preflight's Access-Control-Request-Headers may be echoed as.
inline bool IsHeaderList(absl::string_view value) {
  if (value.empty() || value.size() > 2048) return false;
  return std::all_of(value.begin(), value.end(), [](char c) {
    return absl::ascii_isalnum(c) ||
           absl::string_view("!#$%&'*+-.^_`|~, ").find(c) != absl::string_view::npos;
  });
}

// Bytes a connection may read ahead (pipelined requests) while a request is served.
constexpr size_t kMaxReadAhead = 64 << 10;
// After a 413, the rest of the body is read and dropped (so that the client sees the
// answer instead of a reset), up to this many bytes.
constexpr size_t kMaxDiscardBytes = size_t{64} << 20;

}  // namespace http_internal
using namespace http_internal;  // NOLINT: internal header of one library

class Connection;

class HttpServer::Impl : public HttpApi {
 public:
  Impl(const HttpServerOptions& options, Core* core)
      : HttpApi(options, core), acceptor_(ioc_), work_(net::make_work_guard(ioc_)) {}

  absl::Status Listen();
  void Accept();
  void BeginShutdown();
  void Stop(absl::Duration grace);

  // Routing (on the connection's strand).
  void Handle(const std::shared_ptr<Connection>& conn);

  void AddConnection(uint64_t id, std::weak_ptr<Connection> conn) {
    absl::MutexLock lock(&mu_);
    connections_[id] = std::move(conn);
  }
  void RemoveConnection(uint64_t id) {
    absl::MutexLock lock(&mu_);
    connections_.erase(id);
  }

  // Declared before ioc_: handlers destroyed with the io_context release connections,
  // which unregister themselves here.
  std::map<uint64_t, std::weak_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  net::executor_work_guard<net::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
  int port_ = 0;
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint64_t> next_id_{1};

 private:
  void Models(const std::shared_ptr<Connection>& conn);
};

// One TCP connection. Everything but Post/Close runs on its strand.
class Connection : public HttpExchange, public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, HttpServer::Impl* server)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        server_(server),
        id_(server->next_id_.fetch_add(1)) {}
  ~Connection() { server_->RemoveConnection(id_); }

  void Run() {
    server_->AddConnection(id_, weak_from_this());
    Post([](Connection& c) { c.DoRead(); });
  }

  // Runs `fn` on the strand (from any thread).
  void Post(std::function<void(Connection&)> fn) {
    net::post(socket_.get_executor(),
              [self = shared_from_this(), fn = std::move(fn)] { fn(*self); });
  }
  // HttpExchange (http_api.h has the contracts).
  void RunOnStrand(std::function<void()> fn) override {
    Post([fn = std::move(fn)](Connection&) { fn(); });
  }
  // Closes the socket (from any thread): pending operations fail.
  void Close() {
    Post([](Connection& c) { c.CloseSocket(); });
  }

  // --- the request being served (strand) ---
  const http::request<http::string_body>& request() const { return request_; }
  const std::string& body() const override { return request_.body(); }
  const Caller& caller() const override { return caller_; }
  // The request's method, HEAD read as GET (set_head_only).
  http::verb verb() const { return head_only_ ? http::verb::get : request_.method(); }
  HttpMethod method() const override {
    switch (verb()) {
      case http::verb::get:
        return HttpMethod::kGet;
      case http::verb::post:
        return HttpMethod::kPost;
      case http::verb::delete_:
        return HttpMethod::kDelete;
      default:
        return HttpMethod::kOther;
    }
  }
  // The answer goes without its body (HEAD).
  void set_head_only() { head_only_ = true; }
  void set_caller(Caller caller) { caller_ = std::move(caller); }
  void set_route(std::string route) override { route_ = std::move(route); }
  void set_model(const std::string& model) override { model_ = Capped(model); }
  // Thread-safe (polled by the core as is_cancelled).
  bool client_gone() const override { return client_gone_.load(); }
  // Called (on the strand) when the client goes away while the request is served.
  void set_on_client_gone(std::function<void()> fn) override { on_client_gone_ = std::move(fn); }

  // Answers the request (from any thread).
  void ReplyJson(int status, json body, absl::StatusCode code = absl::StatusCode::kOk) override {
    Post([status, body = std::move(body), code](Connection& c) {
      c.WriteReply(status, Dump(body), "application/json", {}, code, {});
    });
  }
  void ReplyError(const absl::Status& error) override {
    const int status = HttpStatusOf(error);
    std::vector<std::pair<std::string, std::string>> headers;
    // The retry hint (server/base/retry_delay.h): Retry-After in whole seconds (HTTP),
    // retry-after-ms exactly (read by OpenAI's clients); 1 s on a 429 without one.
    if (const std::optional<absl::Duration> delay = RetryDelayOf(error); delay.has_value()) {
      headers.emplace_back("Retry-After",
                           absl::StrCat(std::max<int64_t>(
                               1, absl::ToInt64Seconds(absl::Ceil(*delay, absl::Seconds(1))))));
      headers.emplace_back("retry-after-ms", absl::StrCat(absl::ToInt64Milliseconds(*delay)));
    } else if (status == 429) {
      headers.emplace_back("Retry-After", "1");
    }
    Post([status, body = Dump(ErrorJson(error, status)), error, headers](Connection& c) {
      c.WriteReply(status, body, "application/json", headers, error.code(), error.message());
    });
  }
  // 405 for a method `route` does not serve, with the Allow header (`allow`).
  void ReplyMethodNotAllowed(const std::string& method, const std::string& route,
                             std::string allow) {
    const absl::Status error = absl::UnimplementedError(
        absl::StrCat("method ", method, " is not allowed on ", route, " (allowed: ", allow, ")"));
    Post([error, allow = std::move(allow)](Connection& c) {
      c.WriteReply(405, Dump(ErrorJson(error, 405)), "application/json", {{"Allow", allow}},
                   error.code(), error.message());
    });
  }
  void ReplyBinary(std::string body,
                   std::vector<std::pair<std::string, std::string>> headers) override {
    Post([body = std::move(body), headers = std::move(headers)](Connection& c) mutable {
      c.WriteReply(200, std::move(body), "application/octet-stream", headers, absl::StatusCode::kOk,
                   {});
    });
  }

  // --- streaming (strand) ---
  // Sends the header of a chunked text/event-stream response.
  void BeginStream() override {
    streaming_ = true;
    std::string header =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"
        "Transfer-Encoding: chunked\r\n";
    for (const auto& [name, value] : CorsHeaders())
      absl::StrAppend(&header, name, ": ", value, "\r\n");
    if (!keep_alive_) header += "Connection: close\r\n";
    header += "\r\n";
    Enqueue(std::move(header), nullptr);
  }
  // Sends `data` as one chunk; `done(ok)` when written.
  void StreamWrite(absl::string_view data, std::function<void(bool)> done) override {
    Enqueue(ChunkFrame(data), std::move(done));
  }
  // The last chunk; the connection then serves the next request or closes.
  void EndStream(absl::string_view data, absl::StatusCode code) override {
    std::string bytes = data.empty() ? "" : ChunkFrame(data);
    bytes += "0\r\n\r\n";
    Finished(200, code, {});
    Enqueue(std::move(bytes), [self = shared_from_this()](bool ok) {
      self->streaming_ = false;
      if (ok && self->keep_alive_ && !self->client_gone_) {
        self->NextRequest();
      } else {
        self->CloseSocket();
      }
    });
  }

 private:
  void DoRead() {
    if (closed_) return;
    replied_ = false;
    start_ = absl::Now();
    parser_.emplace();
    parser_->body_limit(static_cast<uint64_t>(server_->options_.max_body_bytes));
    parser_->header_limit(static_cast<uint32_t>(server_->options_.max_header_bytes));
    ArmTimer();
    http::async_read_header(
        socket_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  // The header is read: a client that sent `Expect: 100-continue` waits for our
  // "100 Continue" before it sends the body.
  void OnHeader(beast::error_code ec) {
    if (ec || parser_->is_done()) return OnRead(ec);
    // Never to an HTTP/1.0 client (RFC 9110, 10.1.1).
    if (parser_->get().version() < 11 ||
        !beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      return ReadBody();
    }
    static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    net::async_write(socket_, net::buffer(kContinue),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       if (ec) return self->CloseSocket();
                       self->ReadBody();
                     });
  }
  void ReadBody() {
    http::async_read(
        socket_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    DisarmTimer();
    if (ec == http::error::body_limit) {
      keep_alive_ = false;
      route_ = "payload_too_large";
      discard_after_reply_ = true;
      WriteError(413,
                 absl::InvalidArgumentError(
                     absl::StrCat("the request body is larger than --http-max-body-bytes (",
                                  server_->options_.max_body_bytes, " bytes)")),
                 absl::StatusCode::kInvalidArgument);
      return;
    }
    if (ec == http::error::header_limit) {
      keep_alive_ = false;
      route_ = "headers_too_large";
      WriteError(431, absl::InvalidArgumentError("the request headers are too large"),
                 absl::StatusCode::kInvalidArgument);
      return;
    }
    if (ec) {
      if (ec != http::error::end_of_stream && ec != net::error::eof &&
          ec != net::error::operation_aborted && ec != net::error::connection_reset &&
          buffer_.size() > 0) {
        keep_alive_ = false;
        route_ = "bad_request";
        WriteError(400, absl::InvalidArgumentError("malformed HTTP request"),
                   absl::StatusCode::kInvalidArgument);
        return;
      }
      CloseSocket();
      return;
    }
    request_ = parser_->release();
    keep_alive_ = request_.keep_alive() && !server_->shutting_down_.load();
    origin_ = std::string(request_[http::field::origin]);
    cors_request_headers_ = request_.method() == http::verb::options
                                ? std::string(request_[http::field::access_control_request_headers])
                                : std::string();
    head_only_ = false;
    start_ = absl::Now();
    route_ = "other";
    model_.clear();
    caller_ = Caller{};
    client_gone_ = false;
    on_client_gone_ = nullptr;
    StartMonitor();
    server_->Handle(shared_from_this());
  }

  // While a request is served, a read notices the client going away (and keeps any
  // pipelined bytes for the next request).
  void StartMonitor() {
    if (monitoring_ || buffer_.size() >= kMaxReadAhead) return;
    monitoring_ = true;
    socket_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec,
                                                                               size_t n) {
      self->monitoring_ = false;
      if (!ec) {
        self->buffer_.commit(n);
        if (self->resume_after_monitor_) {
          self->resume_after_monitor_ = false;
          self->DoRead();
        } else {
          self->StartMonitor();
        }
        return;
      }
      if (ec == net::error::operation_aborted && self->resume_after_monitor_ && !self->closed_) {
        self->resume_after_monitor_ = false;
        self->DoRead();
        return;
      }
      self->client_gone_ = true;
      if (self->on_client_gone_) {
        auto fn = std::move(self->on_client_gone_);
        self->on_client_gone_ = nullptr;
        fn();
      }
    });
  }

  // After an answer: the next request (the monitor read is stopped first).
  void NextRequest() {
    on_client_gone_ = nullptr;
    if (monitoring_) {
      resume_after_monitor_ = true;
      beast::error_code ignored;
      socket_.cancel(ignored);
    } else {
      DoRead();
    }
  }

  std::vector<std::pair<std::string, std::string>> CorsHeaders() const {
    std::vector<std::pair<std::string, std::string>> out;
    const auto& origins = server_->options_.cors_origins;
    if (origins.empty() || origin_.empty()) return out;
    bool any = false, listed = false;
    for (const std::string& o : origins) {
      any |= o == "*";
      listed |= o == origin_;
    }
    if (!any && !listed) return out;
    out.emplace_back("Access-Control-Allow-Origin", any ? "*" : origin_);
    if (!any) out.emplace_back("Vary", "Origin");
    out.emplace_back("Access-Control-Allow-Methods", "GET, HEAD, POST, DELETE, OPTIONS");
    // A preflight is allowed the headers it asks for (the SDKs send their own, e.g.
    // x-stainless-*): the API key, not a header list, is what guards the API.
    out.emplace_back("Access-Control-Allow-Headers", IsHeaderList(cors_request_headers_)
                                                         ? cors_request_headers_
                                                         : std::string(kCorsAllowHeaders));
    out.emplace_back("Access-Control-Expose-Headers", kCorsExposeHeaders);
    out.emplace_back("Access-Control-Max-Age", "600");
    return out;
  }

 public:
  void WriteError(int status, const absl::Status& error, absl::StatusCode code) {
    WriteReply(status, Dump(ErrorJson(error, status)), "application/json", {}, code,
               error.message());
  }

  // Strand only: writes a complete answer.
  void WriteReply(int status, std::string body, const char* content_type,
                  const std::vector<std::pair<std::string, std::string>>& headers,
                  absl::StatusCode code, absl::string_view error) {
    if (closed_ || replied_) return;
    replied_ = true;
    auto res =
        std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), 11);
    res->set(http::field::server, "fwserve");
    if (!body.empty() || status != 204) res->set(http::field::content_type, content_type);
    for (const auto& [name, value] : headers) res->set(name, value);
    for (const auto& [name, value] : CorsHeaders()) res->set(name, value);
    res->body() = std::move(body);
    res->keep_alive(keep_alive_ && !server_->shutting_down_.load());
    res->prepare_payload();
    if (head_only_) res->body().clear();  // Content-Length stays the GET's
    Finished(status, code, error);
    ArmTimer();
    http::async_write(socket_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        self->DisarmTimer();
                        if (ec) return self->CloseSocket();
                        if (self->discard_after_reply_) return self->Discard();
                        if (!res->keep_alive() || self->client_gone_) return self->CloseSocket();
                        self->NextRequest();
                      });
  }

 private:
  // The metric and the log line of the request.
  void Finished(int status, absl::StatusCode code, absl::string_view error) {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    server_->metrics_->ObserveRequest(route_, model_, static_cast<int>(code), seconds);
    server_->metrics_->ObserveTenantRequest(caller_.tenant, route_, static_cast<int>(code));
    // Probes answer every few seconds per checker: their successes only at debug level.
    const bool probe = route_ == "GET /health" || route_ == "GET /ready";
    const LogLevel level = status >= 400 ? LogLevel::kWarning
                           : probe       ? LogLevel::kDebug
                                         : LogLevel::kInfo;
    if (LogEnabled(level)) {
      Log(level, absl::StrCat("http request route=\"", route_,
                              "\" tenant=", caller_.tenant.empty() ? "-" : caller_.tenant,
                              " model=", model_.empty() ? "-" : model_, " status=", status,
                              " latency_ms=", static_cast<int64_t>(seconds * 1000),
                              error.empty() ? "" : absl::StrCat(" error=\"", error, "\"")));
    }
  }

  // After a 413: half-close, then read and drop what the client still sends.
  void Discard() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    discard_buffer_.resize(64 << 10);
    ArmTimer(absl::Seconds(5));
    ReadAndDrop();
  }
  void ReadAndDrop() {
    socket_.async_read_some(net::buffer(discard_buffer_),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->discarded_ += n;
                              if (ec || self->discarded_ > kMaxDiscardBytes) {
                                return self->CloseSocket();
                              }
                              self->ReadAndDrop();
                            });
  }

  void Enqueue(std::string bytes, std::function<void(bool)> done) {
    queue_.push_back({std::move(bytes), std::move(done)});
    if (!writing_) WriteNext();
  }
  void WriteNext() {
    if (queue_.empty()) return;
    writing_ = true;
    if (closed_) {
      // Fail every queued write in order.
      auto pending = std::move(queue_.front());
      queue_.pop_front();
      writing_ = false;
      if (pending.done) pending.done(false);
      WriteNext();
      return;
    }
    ArmTimer();
    net::async_write(socket_, net::buffer(queue_.front().bytes),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->DisarmTimer();
                       auto pending = std::move(self->queue_.front());
                       self->queue_.pop_front();
                       self->writing_ = false;
                       if (ec) self->CloseSocket();
                       if (pending.done) pending.done(!ec);
                       self->WriteNext();
                     });
  }

  void ArmTimer(absl::Duration timeout = absl::ZeroDuration()) {
    if (timeout == absl::ZeroDuration()) timeout = server_->options_.idle_timeout;
    const uint64_t generation = ++timer_generation_;
    timer_.expires_after(absl::ToChronoMilliseconds(timeout));
    timer_.async_wait([self = shared_from_this(), generation](beast::error_code ec) {
      if (!ec && generation == self->timer_generation_) self->CloseSocket();
    });
  }
  void DisarmTimer() {
    ++timer_generation_;
    timer_.cancel();
  }

 public:
  void CloseSocket() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  struct PendingWrite {
    std::string bytes;
    std::function<void(bool)> done;
  };

  tcp::socket socket_;
  net::steady_timer timer_;
  HttpServer::Impl* const server_;
  const uint64_t id_;
  // Strand-confined state (never touched from another thread).
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> request_;
  std::string origin_;
  // Access-Control-Request-Headers of a preflight (empty otherwise).
  std::string cors_request_headers_;
  bool head_only_ = false;
  bool keep_alive_ = false;
  bool replied_ = false;
  bool closed_ = false;
  bool streaming_ = false;
  bool monitoring_ = false;
  bool resume_after_monitor_ = false;
  std::atomic<bool> client_gone_{false};
  bool discard_after_reply_ = false;
  size_t discarded_ = 0;
  std::vector<char> discard_buffer_;
  std::function<void()> on_client_gone_;
  std::deque<PendingWrite> queue_;
  bool writing_ = false;
  uint64_t timer_generation_ = 0;
  Caller caller_;
  std::string route_;
  std::string model_;
  absl::Time start_;

  friend class HttpServer::Impl;
};

}  // namespace fwserve
