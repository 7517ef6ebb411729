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
#include "server/transport/http/openai_api.h"
#include "server/transport/http/playground.h"

namespace fwserve {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

constexpr char kResponsePrefix[] = "resp_";
constexpr char kConversationPrefix[] = "conv_";
// CORS: the request headers allowed when a preflight names none, and the answer's
// headers a page may read (the retry hints of a 429/503 and the export's metadata).
constexpr char kCorsAllowHeaders[] = "Authorization, Content-Type";
constexpr char kCorsExposeHeaders[] =
    "Retry-After, retry-after-ms, X-Fwserve-Model, X-Fwserve-Tokens";

// Whether `value` is a comma-separated list of header names (RFC 9110 tokens), at most
// 2 KiB: what a preflight's Access-Control-Request-Headers may be echoed as.
bool IsHeaderList(absl::string_view value) {
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

int64_t UnixSeconds(absl::Time t) { return absl::ToUnixSeconds(t); }
int64_t NowSeconds() { return absl::ToUnixSeconds(absl::Now()); }

json SessionJson(const SessionRecord& r) {
  return json{{"id", r.id},
              {"object", "fwserve.session"},
              {"model", r.model},
              {"tokens", r.tokens},
              {"state_bytes", r.state_bytes},
              {"created", UnixSeconds(r.created)},
              {"created_unix_ms", absl::ToUnixMillis(r.created)},
              {"last_used_unix_ms", absl::ToUnixMillis(r.last_used)},
              {"busy", r.busy},
              {"resident", r.resident},
              {"stored", r.stored}};
}

json ConversationJson(const SessionRecord& r) {
  return json{{"id", kConversationPrefix + r.id},
              {"object", "conversation"},
              {"created_at", UnixSeconds(r.created)},
              {"metadata", json::object()},
              {"fwserve_session", SessionJson(r)}};
}

// The session id a prefixed id names ("resp_<id>" / "conv_<id>"); nullopt if `id` lacks
// the prefix.
std::optional<std::string> Unprefixed(absl::string_view id, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&id, prefix) || id.empty()) return std::nullopt;
  return std::string(id);
}

// Client-supplied names in log lines: at most this many bytes.
std::string Capped(absl::string_view s) {
  return s.size() <= 128 ? std::string(s) : absl::StrCat(s.substr(0, 128), "...");
}

std::string ChunkFrame(absl::string_view data) {
  char size[24];
  std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
  return absl::StrCat(size, data, "\r\n");
}

std::string SseData(const json& value) { return absl::StrCat("data: ", Dump(value), "\n\n"); }

// Token i of `chunk` as the logprobs show it: the bytes it stands for (a byte-level
// token's byte, a world-vocabulary token's piece), as text and as byte values.
std::string TokenBytesAt(const GenerateChunk& chunk, size_t i) {
  if (i < chunk.token_bytes.size()) return chunk.token_bytes[i];
  const int64_t id = chunk.token_ids[i];
  return id >= 0 && id < 256 ? std::string(1, static_cast<char>(id)) : std::string();
}
json ByteValues(const std::string& bytes) {
  json out = json::array();
  for (unsigned char b : bytes) out.push_back(b);
  return out;
}

// A model lookup's error as OpenAI words it: an unknown model is 404 "model_not_found".
absl::Status ModelError(const absl::Status& error, absl::string_view name) {
  if (error.code() != absl::StatusCode::kNotFound) return error;
  return WithErrorCode(
      WithParam(absl::NotFoundError(
                    absl::StrCat("the model '", Capped(name), "' does not exist (GET /v1/models)")),
                "model"),
      "model_not_found");
}

// The one message of the response on `session_id`: its id is derived from the session,
// like the response's, so that GET /v1/responses/{id} names it as the POST did.
std::string ResponseMessageId(const std::string& session_id) { return "msg_" + session_id; }

// The OpenAI response object of the response on `session_id` ("resp_<session>"), built
// the same way by POST /v1/responses (`request`: what it asked for) and by GET
// /v1/responses/{id} (`request` null: the request's parameters are not kept, and are
// null). A "completed" or "incomplete" response has one assistant message with `text`,
// whose status is the response's. Fields that do not change the output are echoed as
// the request sent them (docs/http.md, "Field policy").
json ResponseJson(const std::string& session_id, int64_t created_at, const std::string& status,
                  const std::string& model, const std::string& text, const json& usage,
                  const OpenAiGenerateRequest* request) {
  json output = json::array();
  if (status == "completed" || status == "incomplete") {
    output.push_back({{"type", "message"},
                      {"id", ResponseMessageId(session_id)},
                      {"status", status},
                      {"role", "assistant"},
                      {"content", json::array({{{"type", "output_text"},
                                                {"text", text},
                                                {"annotations", json::array()},
                                                {"logprobs", json::array()}}})}});
  }
  json r = {
      {"id", kResponsePrefix + session_id},
      {"object", "response"},
      {"created_at", created_at},
      {"status", status},
      {"error", nullptr},
      {"incomplete_details", nullptr},
      {"instructions", request == nullptr || request->instructions.empty()
                           ? json(nullptr)
                           : json(request->instructions)},
      {"max_output_tokens", request != nullptr ? json(request->params.max_tokens) : json(nullptr)},
      {"model", model},
      {"output", output},
      {"parallel_tool_calls", request != nullptr && request->parallel_tool_calls.is_boolean()
                                  ? request->parallel_tool_calls
                                  : json(false)},
      {"previous_response_id", request == nullptr || request->previous_response_id.empty()
                                   ? json(nullptr)
                                   : json(request->previous_response_id)},
      {"store", request == nullptr || request->store},
      {"temperature",
       request != nullptr ? json(EchoFloat(request->params.sampling.temperature)) : json(nullptr)},
      {"top_p",
       request != nullptr ? json(EchoFloat(request->params.sampling.top_p)) : json(nullptr)},
      {"service_tier", request != nullptr && !request->service_tier.is_null()
                           ? request->service_tier
                           : json("default")},
      {"user", request != nullptr ? request->user : json(nullptr)},
      {"prompt_cache_key", request != nullptr ? request->prompt_cache_key : json(nullptr)},
      {"safety_identifier", request != nullptr ? request->safety_identifier : json(nullptr)},
      {"text", {{"format", {{"type", "text"}}}}},
      {"tool_choice", "none"},
      {"tools", json::array()},
      {"truncation", "disabled"},
      {"usage", usage},
      {"metadata",
       request != nullptr && request->metadata.is_object() ? request->metadata : json::object()}};
  if (request != nullptr && !request->conversation.empty()) {
    r["conversation"] = {{"id", kConversationPrefix + session_id}};
  }
  return r;
}

}  // namespace

class Connection;

class HttpServer::Impl {
 public:
  Impl(const HttpServerOptions& options, Core* core)
      : options_(options),
        core_(core),
        metrics_(Metrics::OrNull(options.metrics)),
        acceptor_(ioc_),
        work_(net::make_work_guard(ioc_)) {}

  absl::Status Listen();
  void Accept();
  void BeginShutdown();
  void Stop(absl::Duration grace);

  // Routing (on the connection's strand).
  void Handle(const std::shared_ptr<Connection>& conn);

  // Stream accounting: accepted by the core until OnFinish.
  void StreamAccepted() {
    absl::MutexLock lock(&mu_);
    ++streams_in_engine_;
  }
  void StreamFinished() {
    absl::MutexLock lock(&mu_);
    --streams_in_engine_;
  }
  void AddConnection(uint64_t id, std::weak_ptr<Connection> conn) {
    absl::MutexLock lock(&mu_);
    connections_[id] = std::move(conn);
  }
  void RemoveConnection(uint64_t id) {
    absl::MutexLock lock(&mu_);
    connections_.erase(id);
  }

  const HttpServerOptions options_;
  Core* const core_;
  Metrics* const metrics_;  // never null
  // Declared before ioc_: handlers destroyed with the io_context release connections,
  // which unregister themselves here.
  absl::Mutex mu_;
  int64_t streams_in_engine_ ABSL_GUARDED_BY(mu_) = 0;
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
  // Route handlers; each answers through conn->Reply... exactly once.
  void Models(const std::shared_ptr<Connection>& conn);
  void Generate(const std::shared_ptr<Connection>& conn, OpenAiEndpoint endpoint);
  // Responses: resolves the input's item_references from the `index`th on (the texts
  // found so far in `texts`), one session read at a time, then StartResponse.
  void ResolveItemReferences(const std::shared_ptr<Connection>& conn, OpenAiGenerateRequest request,
                             const ChatTemplate& chat_template, const std::string& model,
                             size_t index, std::shared_ptr<ItemTexts> texts);
  // Responses: picks the session (a fork of previous_response_id, the conversation's,
  // or a new one) and generates on it.
  void StartResponse(const std::shared_ptr<Connection>& conn, OpenAiGenerateRequest request,
                     const std::string& model_name);
  void GetResponse(const std::shared_ptr<Connection>& conn, const std::string& id, bool remove);
  void CreateConversation(const std::shared_ptr<Connection>& conn);
  void Conversation(const std::shared_ptr<Connection>& conn, const std::string& id, bool remove);
  void Sessions(const std::shared_ptr<Connection>& conn, const std::vector<std::string>& parts,
                const std::string& query);
};

// One TCP connection. Everything but Post/Close runs on its strand.
class Connection : public std::enable_shared_from_this<Connection> {
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
  // Closes the socket (from any thread): pending operations fail.
  void Close() {
    Post([](Connection& c) { c.CloseSocket(); });
  }

  // --- the request being served (strand) ---
  const http::request<http::string_body>& request() const { return request_; }
  const Caller& caller() const { return caller_; }
  // The request's method, HEAD read as GET (set_head_only).
  http::verb method() const { return head_only_ ? http::verb::get : request_.method(); }
  // The answer goes without its body (HEAD).
  void set_head_only() { head_only_ = true; }
  void set_caller(Caller caller) { caller_ = std::move(caller); }
  void set_route(std::string route) { route_ = std::move(route); }
  void set_model(const std::string& model) { model_ = Capped(model); }
  // Thread-safe (polled by the core as is_cancelled).
  bool client_gone() const { return client_gone_.load(); }
  // Called (on the strand) when the client goes away while the request is served.
  void set_on_client_gone(std::function<void()> fn) { on_client_gone_ = std::move(fn); }

  // Answers the request (from any thread).
  void ReplyJson(int status, json body, absl::StatusCode code = absl::StatusCode::kOk) {
    Post([status, body = std::move(body), code](Connection& c) {
      c.WriteReply(status, Dump(body), "application/json", {}, code, {});
    });
  }
  void ReplyError(const absl::Status& error) {
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
  void ReplyBinary(std::string body, std::vector<std::pair<std::string, std::string>> headers) {
    Post([body = std::move(body), headers = std::move(headers)](Connection& c) mutable {
      c.WriteReply(200, std::move(body), "application/octet-stream", headers, absl::StatusCode::kOk,
                   {});
    });
  }

  // --- streaming (strand) ---
  // Sends the header of a chunked text/event-stream response.
  void BeginStream() {
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
  void StreamWrite(absl::string_view data, std::function<void(bool)> done) {
    Enqueue(ChunkFrame(data), std::move(done));
  }
  // The last chunk; the connection then serves the next request or closes.
  void EndStream(absl::string_view data, absl::StatusCode code) {
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

namespace {

// One generation (completions, chat or responses), streamed or not. The engine calls
// OnStart (inside StartGenerate, on the strand), OnChunk and OnFinish; everything they
// carry is posted to the connection's strand, where all the job's state lives.
class GenerateJob : public GenerateObserver, public std::enable_shared_from_this<GenerateJob> {
 public:
  GenerateJob(HttpServer::Impl* server, std::shared_ptr<Connection> conn, OpenAiEndpoint endpoint,
              OpenAiGenerateRequest request, std::string model_name)
      : server_(server),
        conn_(std::move(conn)),
        endpoint_(endpoint),
        request_(std::move(request)),
        model_(std::move(model_name)),
        filter_(request_.params.stop),
        created_(NowSeconds()),
        id_suffix_(NewSessionId()) {}

  // For responses: the session generated on; `owned` = made for this request (deleted
  // with store:false).
  void set_session(std::string session_id, bool owned) {
    request_.params.session_id = std::move(session_id);
    session_owned_ = owned;
  }

  // For responses continuing `session_id` (previous_response_id): the engine forks it
  // and generates on the fork in one admission, stored once (or, with store:false, not
  // at all).
  void set_fork_from(std::string session_id) {
    request_.params.fork_from = std::move(session_id);
    request_.params.store = request_.store;
  }

  // For responses with neither previous_response_id nor conversation: a new session,
  // forked from the longest kept conversation the input replays when there is one
  // (docs/http.md "Replayed histories"), stored as `store` says.
  void set_new_session_reusing_prefix() {
    request_.params.prefix_reuse = GenerateParams::PrefixReuse::kCallerSession;
    request_.params.store = request_.store;
  }

  // On the strand: hands the work to the core.
  void Start() {
    GenerateParams params = request_.params;
    if (endpoint_ == OpenAiEndpoint::kResponses &&
        (!request_.params.session_id.empty() || !request_.params.fork_from.empty())) {
      params.model.clear();  // the session's model
    } else {
      params.model = request_.model;
    }
    // A stateless chat may replay a conversation the server kept: it continues from
    // there (docs/http.md "Replayed histories").
    if (endpoint_ == OpenAiEndpoint::kChat && params.session_id.empty()) {
      params.prefix_reuse = GenerateParams::PrefixReuse::kServerKept;
    }
    auto gone = gone_;
    if (conn_->client_gone()) gone->store(true);
    params.is_cancelled = [gone] { return gone->load(); };
    self_ = shared_from_this();
    conn_->set_on_client_gone([self = shared_from_this()] { self->ClientGone(); });
    absl::Status started = server_->core_->StartGenerate(conn_->caller(), std::move(params), this);
    if (!started.ok()) {
      self_.reset();
      conn_->set_on_client_gone(nullptr);
      DropOwnedSession();
      conn_->ReplyError(started);
      return;
    }
    // A fork's new session names the response (OnStart ran inside StartGenerate).
    if ((!request_.params.fork_from.empty() ||
         request_.params.prefix_reuse == GenerateParams::PrefixReuse::kCallerSession) &&
        control_ != nullptr) {
      request_.params.session_id = control_->session_id();
    }
    server_->StreamAccepted();
    if (request_.stream) {
      conn_->BeginStream();
      StreamOpening();
    }
  }

  void OnStart(std::shared_ptr<GenerateControl> control) override { control_ = std::move(control); }

  void OnChunk(GenerateChunk chunk) override {
    conn_->Post([self = shared_from_this(), chunk = std::move(chunk)](Connection&) mutable {
      self->HandleChunk(std::move(chunk));
    });
  }

  void OnFinish(absl::Status status, GenerateSummary summary) override {
    std::shared_ptr<GenerateJob> self = std::move(self_);
    conn_->Post([self, status, summary = std::move(summary)](Connection&) mutable {
      self->HandleFinish(status, std::move(summary));
    });
    server_->StreamFinished();
  }

 private:
  std::string Id() const {
    switch (endpoint_) {
      case OpenAiEndpoint::kCompletions:
        return absl::StrCat("cmpl-", id_suffix_);
      case OpenAiEndpoint::kChat:
        return absl::StrCat("chatcmpl-", id_suffix_);
      case OpenAiEndpoint::kResponses:
        break;
    }
    return kResponsePrefix + request_.params.session_id;
  }
  // Responses only.
  std::string MessageId() const { return ResponseMessageId(request_.params.session_id); }

  void ClientGone() {
    gone_->store(true);
    if (control_ != nullptr && !finished_) control_->Cancel();
  }

  json Logprobs(const GenerateChunk& chunk) const {
    if (endpoint_ == OpenAiEndpoint::kCompletions) {
      json tokens = json::array(), values = json::array();
      for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
        tokens.push_back(TokenBytesAt(chunk, i));
        values.push_back(i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f);
      }
      return json{{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", nullptr}};
    }
    json content = json::array();
    for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
      const std::string bytes = TokenBytesAt(chunk, i);
      content.push_back({{"token", bytes},
                         {"logprob", i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f},
                         {"bytes", ByteValues(bytes)},
                         {"top_logprobs", json::array()}});
    }
    return json{{"content", content}};
  }

  json ResponseObject(const std::string& status, const std::string& text, const json& usage) const {
    return ResponseJson(request_.params.session_id, created_, status, model_, text, usage,
                        &request_);
  }

  // Responses streaming: one event.
  std::string Event(const char* type, json data) {
    data["type"] = type;
    data["sequence_number"] = sequence_number_++;
    return absl::StrCat("event: ", type, "\n", SseData(data));
  }

  json Chunk(json choice_delta, const json& logprobs) const {
    json choice = {{"index", 0}, {"logprobs", logprobs}, {"finish_reason", nullptr}};
    if (endpoint_ == OpenAiEndpoint::kChat) {
      choice["delta"] = std::move(choice_delta);
    } else {
      choice["text"] = std::move(choice_delta);
    }
    json chunk = {{"id", Id()},
                  {"object", endpoint_ == OpenAiEndpoint::kChat ? "chat.completion.chunk"
                                                                : "text_completion"},
                  {"created", created_},
                  {"model", model_},
                  {"choices", json::array({choice})}};
    if (endpoint_ == OpenAiEndpoint::kChat) chunk["service_tier"] = ServiceTier();
    if (request_.include_usage) chunk["usage"] = nullptr;
    return chunk;
  }

  // Chat's echo of service_tier: the tier asked for ("auto" as "default").
  json ServiceTier() const {
    return request_.service_tier.is_null() ? json("default") : request_.service_tier;
  }

  // The first events of a stream (before any text).
  void StreamOpening() {
    std::string data;
    if (endpoint_ == OpenAiEndpoint::kChat) {
      data = SseData(Chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
    } else if (endpoint_ == OpenAiEndpoint::kResponses) {
      json in_progress = ResponseObject("in_progress", "", nullptr);
      data = Event("response.created", {{"response", in_progress}});
      data += Event("response.in_progress", {{"response", in_progress}});
      data += Event("response.output_item.added", {{"output_index", 0},
                                                   {"item",
                                                    {{"type", "message"},
                                                     {"id", MessageId()},
                                                     {"status", "in_progress"},
                                                     {"role", "assistant"},
                                                     {"content", json::array()}}}});
      data += Event(
          "response.content_part.added",
          {{"item_id", MessageId()},
           {"output_index", 0},
           {"content_index", 0},
           {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}});
    }
    if (!data.empty()) conn_->StreamWrite(data, nullptr);
  }

  // A text delta as the endpoint's event.
  std::string DeltaEvent(const std::string& text, const GenerateChunk* chunk) {
    const json logprobs = request_.logprobs && chunk != nullptr ? Logprobs(*chunk) : json(nullptr);
    switch (endpoint_) {
      case OpenAiEndpoint::kChat:
        return SseData(Chunk({{"content", text}}, logprobs));
      case OpenAiEndpoint::kCompletions:
        return SseData(Chunk(text, logprobs));
      case OpenAiEndpoint::kResponses:
        break;
    }
    return Event("response.output_text.delta", {{"item_id", MessageId()},
                                                {"output_index", 0},
                                                {"content_index", 0},
                                                {"delta", text},
                                                {"logprobs", json::array()}});
  }

  void HandleChunk(GenerateChunk chunk) {
    if (finished_) return;
    const std::string text = filter_.Push(chunk.text);
    if (request_.logprobs) {
      for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
        token_ids_.push_back(chunk.token_ids[i]);
        logprobs_.push_back(i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f);
        token_bytes_.push_back(TokenBytesAt(chunk, i));
      }
    }
    if (!request_.stream || (text.empty() && !request_.logprobs)) {
      text_ += text;
      control_->WriteDone(!conn_->client_gone());
      return;
    }
    text_ += text;
    conn_->StreamWrite(DeltaEvent(text, &chunk), [self = shared_from_this()](bool ok) {
      if (!self->finished_) self->control_->WriteDone(ok);
    });
  }

  // OpenAI's rule: the input counts the cached tokens (the state the session held
  // before the request) and the new ones; the total is input plus output.
  json Usage(const GenerateSummary& s) const {
    const int64_t cached =
        std::max<int64_t>(0, s.session_tokens - s.prompt_tokens - s.generated_tokens);
    const int64_t input = cached + s.prompt_tokens;
    if (endpoint_ == OpenAiEndpoint::kResponses) {
      return {{"input_tokens", input},
              {"input_tokens_details", {{"cached_tokens", cached}}},
              {"output_tokens", s.generated_tokens},
              {"output_tokens_details", {{"reasoning_tokens", 0}}},
              {"total_tokens", input + s.generated_tokens}};
    }
    return {{"prompt_tokens", input},
            {"completion_tokens", s.generated_tokens},
            {"total_tokens", input + s.generated_tokens},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  void HandleFinish(absl::Status status, GenerateSummary summary) {
    finished_ = true;
    conn_->set_on_client_gone(nullptr);
    if (status.ok() && summary.reason == FinishReason::kCancelled && conn_->client_gone()) {
      status = absl::CancelledError("the client went away");
    }
    if (!status.ok()) {
      DropOwnedSession();
      if (!request_.stream) {
        conn_->ReplyError(status);
        return;
      }
      const int http_status = HttpStatusOf(status);
      json error = ErrorJson(status, http_status);
      std::string event;
      if (endpoint_ == OpenAiEndpoint::kResponses) {
        json e = error["error"];
        event =
            Event("error", {{"code", e["code"]}, {"message", e["message"]}, {"param", e["param"]}});
      } else {
        event = SseData(error);
      }
      conn_->EndStream(event, status.code());
      return;
    }
    std::string tail = filter_.Push(summary.trailing_text);
    tail += filter_.Finish();
    text_ += tail;
    const char* finish_reason = filter_.stopped() ? "stop" : FinishReasonName(summary.reason);
    const json usage = Usage(summary);
    json out;
    if (endpoint_ == OpenAiEndpoint::kResponses) {
      const bool incomplete = summary.reason == FinishReason::kLength && !filter_.stopped();
      out = ResponseObject(incomplete ? "incomplete" : "completed", text_, usage);
      if (incomplete) out["incomplete_details"] = {{"reason", "max_output_tokens"}};
    } else {
      json choice = {{"index", 0}, {"finish_reason", finish_reason}};
      json logprobs = nullptr;
      if (request_.logprobs) {
        GenerateChunk all;
        all.token_ids = token_ids_;
        all.logprobs = logprobs_;
        all.token_bytes = token_bytes_;
        logprobs = Logprobs(all);
      }
      choice["logprobs"] = logprobs;
      if (endpoint_ == OpenAiEndpoint::kChat) {
        choice["message"] = {{"role", "assistant"},
                             {"content", text_},
                             {"refusal", nullptr},
                             {"annotations", json::array()}};
      } else {
        choice["text"] = text_;
      }
      out = {{"id", Id()},
             {"object", endpoint_ == OpenAiEndpoint::kChat ? "chat.completion" : "text_completion"},
             {"created", created_},
             {"model", model_},
             {"choices", json::array({choice})},
             {"usage", usage}};
      if (endpoint_ == OpenAiEndpoint::kChat) out["service_tier"] = ServiceTier();
      if (!request_.params.session_id.empty()) out["session_id"] = request_.params.session_id;
    }
    std::string events;
    if (request_.stream) {
      if (!tail.empty()) events += DeltaEvent(tail, nullptr);
      if (endpoint_ == OpenAiEndpoint::kResponses) {
        events += Event("response.output_text.done", {{"item_id", MessageId()},
                                                      {"output_index", 0},
                                                      {"content_index", 0},
                                                      {"text", text_},
                                                      {"logprobs", json::array()}});
        const json& item = out["output"][0];
        events += Event("response.content_part.done", {{"item_id", MessageId()},
                                                       {"output_index", 0},
                                                       {"content_index", 0},
                                                       {"part", item["content"][0]}});
        events += Event("response.output_item.done", {{"output_index", 0}, {"item", item}});
        events += Event(out["status"] == "completed" ? "response.completed" : "response.incomplete",
                        {{"response", out}});
      } else {
        json last = Chunk(endpoint_ == OpenAiEndpoint::kChat ? json::object() : json(""), nullptr);
        last["choices"][0]["finish_reason"] = finish_reason;
        events += SseData(last);
        if (request_.include_usage) {
          json usage_chunk = Chunk(nullptr, nullptr);
          usage_chunk["choices"] = json::array();
          usage_chunk["usage"] = usage;
          events += SseData(usage_chunk);
        }
        events += "data: [DONE]\n\n";
      }
    }
    auto answer = [self = shared_from_this(), out = std::move(out), events = std::move(events)] {
      if (self->request_.stream) {
        self->conn_->EndStream(events, absl::StatusCode::kOk);
      } else {
        self->conn_->ReplyJson(200, out);
      }
    };
    if (request_.store || !session_owned_) {
      answer();
      return;
    }
    // store: false: the session is gone before the client hears of the response.
    session_owned_ = false;
    server_->core_->DeleteSession(conn_->caller(), request_.params.session_id,
                                  [conn = conn_, answer](absl::StatusOr<bool>) {
                                    conn->Post([answer](Connection&) { answer(); });
                                  });
  }

  void DropOwnedSession() {
    if (!session_owned_) return;
    session_owned_ = false;
    server_->core_->DeleteSession(conn_->caller(), request_.params.session_id,
                                  [](absl::StatusOr<bool>) {});
  }

  HttpServer::Impl* const server_;
  const std::shared_ptr<Connection> conn_;
  const OpenAiEndpoint endpoint_;
  OpenAiGenerateRequest request_;
  const std::string model_;
  StopFilter filter_;
  const int64_t created_;
  // 128 random bits: completion ids are unique across restarts and replicas.
  const std::string id_suffix_;
  bool session_owned_ = false;
  // Set before StartGenerate; released by OnFinish: the core holds the job as a raw
  // observer until then.
  std::shared_ptr<GenerateJob> self_;
  const std::shared_ptr<std::atomic<bool>> gone_ = std::make_shared<std::atomic<bool>>(false);
  // Strand-confined.
  std::shared_ptr<GenerateControl> control_;
  bool finished_ = false;
  std::string text_;
  std::vector<int64_t> token_ids_;
  std::vector<float> logprobs_;
  std::vector<std::string> token_bytes_;
  int64_t sequence_number_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Routing

void HttpServer::Impl::Handle(const std::shared_ptr<Connection>& conn) {
  const auto& req = conn->request();
  const RequestTarget target =
      SplitTarget(absl::string_view(req.target().data(), req.target().size()));
  const std::string& path = target.path;
  const std::vector<std::string>& parts = target.parts;
  const http::verb method = req.method();
  // Unknown methods are one label value (metrics cardinality).
  const std::string method_name =
      method == http::verb::unknown ? "OTHER" : std::string(http::to_string(method));
  conn->set_route(RouteLabel(method_name, target));

  if (method == http::verb::options) {  // the CORS preflight, on any path
    conn->Post(
        [](Connection& c) { c.WriteReply(204, "", "text/plain", {}, absl::StatusCode::kOk, {}); });
    return;
  }
  const Route* route = MatchRoute(target);
  if (route == nullptr) {
    conn->ReplyError(
        absl::NotFoundError(absl::StrCat("no route ", method_name, " ", Capped(path))));
    return;
  }
  if (!RouteAllows(*route, method_name)) {
    conn->ReplyMethodNotAllowed(method_name, route->label, AllowHeader(*route));
    return;
  }
  // HEAD is GET without the body (Connection::WriteReply drops it).
  if (method == http::verb::head) conn->set_head_only();
  switch (route->id) {
    case RouteId::kPlayground:
      // The playground is static and open: the page asks for an API key itself when
      // the server has keys, and sends it only to this origin.
      conn->Post([](Connection& c) {
        c.WriteReply(200, std::string(PlaygroundHtml()), "text/html; charset=utf-8",
                     {{"Cache-Control", "no-cache"},
                      {"X-Content-Type-Options", "nosniff"},
                      {"Content-Security-Policy",
                       "default-src 'none'; script-src 'unsafe-inline'; style-src "
                       "'unsafe-inline'; connect-src 'self'; img-src 'self' data: blob:; "
                       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"}},
                     absl::StatusCode::kOk, {});
      });
      return;
    case RouteId::kHealth:
      conn->ReplyJson(200, {{"status", "ok"}});
      return;
    case RouteId::kReady:
      if (shutting_down_.load()) {
        conn->ReplyJson(503, {{"status", "shutting_down"}}, absl::StatusCode::kUnavailable);
      } else if (absl::Status ready = core_->Readiness(); !ready.ok()) {
        conn->ReplyJson(503, {{"status", "starting"}, {"reason", std::string(ready.message())}},
                        ready.code());
      } else {
        conn->ReplyJson(200, {{"status", "ready"}, {"models", core_->ListModels().size()}});
      }
      return;
    default:
      break;
  }
  // The API: /v1/... and /fwserve/v1/...
  if (shutting_down_.load()) {
    conn->ReplyError(absl::UnavailableError("the server is shutting down"));
    return;
  }
  if (options_.authenticator != nullptr) {
    CallCredentials credentials;
    if (auto header = req.find(http::field::authorization); header != req.end()) {
      credentials.metadata.emplace("authorization",
                                   std::string(header->value().data(), header->value().size()));
    }
    const absl::StatusOr<std::string> tenant = options_.authenticator->Authenticate(credentials);
    if (!tenant.ok()) return conn->ReplyError(tenant.status());
    conn->set_caller(Caller{*tenant});
  }
  const bool del = method == http::verb::delete_;
  switch (route->id) {
    case RouteId::kModels:
      return Models(conn);
    case RouteId::kModel: {
      auto d = core_->DescribeModel(parts[2]);
      if (!d.ok()) return conn->ReplyError(ModelError(d.status(), parts[2]));
      return conn->ReplyJson(
          200, {{"id", d->name}, {"object", "model"}, {"created", 0}, {"owned_by", "fwserve"}});
    }
    case RouteId::kCompletions:
      return Generate(conn, OpenAiEndpoint::kCompletions);
    case RouteId::kChatCompletions:
      return Generate(conn, OpenAiEndpoint::kChat);
    case RouteId::kResponses:
      return Generate(conn, OpenAiEndpoint::kResponses);
    case RouteId::kResponse:
      return GetResponse(conn, parts[2], del);
    case RouteId::kConversations:
      return CreateConversation(conn);
    case RouteId::kConversation:
      return Conversation(conn, parts[2], del);
    default:
      return Sessions(conn, parts, target.query);
  }
}

void HttpServer::Impl::Models(const std::shared_ptr<Connection>& conn) {
  json data = json::array();
  for (const ModelDescription& d : core_->ListModels()) {
    data.push_back({{"id", d.name},
                    {"object", "model"},
                    {"created", 0},
                    {"owned_by", "fwserve"},
                    {"fwserve",
                     {{"default", d.is_default},
                      {"architecture", d.architecture},
                      {"parameters", d.parameters},
                      {"state_bytes_per_session", d.state_bytes_per_session},
                      {"vocab_size", d.vocab_size}}}});
  }
  conn->ReplyJson(200, {{"object", "list"}, {"data", data}});
}

void HttpServer::Impl::Generate(const std::shared_ptr<Connection>& conn, OpenAiEndpoint endpoint) {
  absl::StatusOr<json> body = ParseBody(conn->request().body(), false);
  if (!body.ok()) return conn->ReplyError(body.status());
  // The model decides the chat template; an unknown one is 404 before anything else.
  std::string model_field;
  if (auto m = body->find("model"); m != body->end() && m->is_string()) {
    model_field = m->get<std::string>();
  }
  absl::StatusOr<ModelDescription> model = core_->DescribeModel(model_field);
  if (!model.ok()) return conn->ReplyError(ModelError(model.status(), model_field));
  conn->set_model(model->name);
  const ChatTemplate chat_template = ChatTemplateOf(model->config_json);
  absl::StatusOr<OpenAiGenerateRequest> request =
      ParseGenerateRequest(*body, endpoint, chat_template, options_.default_max_tokens);
  if (!request.ok()) return conn->ReplyError(request.status());
  if (endpoint != OpenAiEndpoint::kResponses) {
    auto job =
        std::make_shared<GenerateJob>(this, conn, endpoint, std::move(*request), model->name);
    job->Start();
    return;
  }
  if (request->item_references.empty()) {
    return StartResponse(conn, std::move(*request), model->name);
  }
  ResolveItemReferences(conn, std::move(*request), chat_template, model->name, 0,
                        std::make_shared<ItemTexts>());
}

void HttpServer::Impl::ResolveItemReferences(const std::shared_ptr<Connection>& conn,
                                             OpenAiGenerateRequest request,
                                             const ChatTemplate& chat_template,
                                             const std::string& model, size_t index,
                                             std::shared_ptr<ItemTexts> texts) {
  // An id that names no message is left out of `texts`: the rendering answers 404
  // naming its item.
  while (index < request.item_references.size() &&
         !Unprefixed(request.item_references[index], "msg_").has_value()) {
    ++index;
  }
  if (index == request.item_references.size()) {
    absl::StatusOr<std::string> prompt =
        RenderResponsesInput(request.input, request.instructions, chat_template, texts.get());
    if (!prompt.ok()) return conn->ReplyError(prompt.status());
    request.params.prompt = std::move(*prompt);
    return StartResponse(conn, std::move(request), model);
  }
  // The message "msg_<session>" is the last output of that session (its response's
  // text, as GET /v1/responses/{id} returns it).
  const std::string id = request.item_references[index];
  core_->GetSessionOutput(conn->caller(), *Unprefixed(id, "msg_"),
                          [this, conn, request = std::move(request), chat_template, model, index,
                           texts, id](absl::StatusOr<SessionOutput> r) mutable {
                            if (!r.ok() && r.status().code() != absl::StatusCode::kNotFound) {
                              return conn->ReplyError(r.status());
                            }
                            if (r.ok()) (*texts)[id] = r->output.text;
                            conn->Post([this, request = std::move(request), chat_template, model,
                                        index, texts](Connection& c) mutable {
                              ResolveItemReferences(c.shared_from_this(), std::move(request),
                                                    chat_template, model, index + 1, texts);
                            });
                          });
}

void HttpServer::Impl::StartResponse(const std::shared_ptr<Connection>& conn,
                                     OpenAiGenerateRequest request, const std::string& model_name) {
  // Responses: the session to generate on.
  const std::string previous = request.previous_response_id;
  const std::string conversation = request.conversation;
  auto job = std::make_shared<GenerateJob>(this, conn, OpenAiEndpoint::kResponses,
                                           std::move(request), model_name);
  auto start_on = [conn, job](absl::StatusOr<SessionRecord> session, bool owned) {
    if (!session.ok()) return conn->ReplyError(session.status());
    conn->Post([job, id = session->id, owned](Connection&) {
      job->set_session(id, owned);
      job->Start();
    });
  };
  if (!previous.empty()) {
    std::optional<std::string> id = Unprefixed(previous, kResponsePrefix);
    if (!id.has_value()) {
      return conn->ReplyError(FieldError("previous_response_id",
                                         absl::StrCat("'previous_response_id' must be 'resp_...', "
                                                      "got '",
                                                      Capped(previous), "'")));
    }
    job->set_fork_from(*id);
    job->Start();
  } else if (!conversation.empty()) {
    std::optional<std::string> id = Unprefixed(conversation, kConversationPrefix);
    SessionRecord record;
    record.id = id.value_or(conversation);
    start_on(record, false);
  } else {
    job->set_new_session_reusing_prefix();
    job->Start();
  }
}

void HttpServer::Impl::GetResponse(const std::shared_ptr<Connection>& conn, const std::string& id,
                                   bool remove) {
  std::optional<std::string> session = Unprefixed(id, kResponsePrefix);
  if (!session.has_value()) {
    return conn->ReplyError(absl::NotFoundError(absl::StrCat("no response '", Capped(id), "'")));
  }
  if (remove) {
    core_->DeleteSession(conn->caller(), *session, [conn, id](absl::StatusOr<bool> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      conn->ReplyJson(200, {{"id", id}, {"object", "response.deleted"}, {"deleted", true}});
    });
    return;
  }
  // The session keeps the text its last Generate produced (what the POST answered); the
  // request's parameters, its usage and why it ended are not kept.
  core_->GetSessionOutput(conn->caller(), *session, [conn](absl::StatusOr<SessionOutput> r) {
    if (!r.ok()) return conn->ReplyError(r.status());
    json out = ResponseJson(r->session.id, UnixSeconds(r->session.created), "completed",
                            r->session.model, r->output.text, nullptr, nullptr);
    out["fwserve_output_truncated"] = r->output.truncated;
    out["fwserve_session"] = SessionJson(r->session);
    conn->ReplyJson(200, out);
  });
}

void HttpServer::Impl::CreateConversation(const std::shared_ptr<Connection>& conn) {
  absl::StatusOr<json> body = ParseBody(conn->request().body(), true);
  if (!body.ok()) return conn->ReplyError(body.status());
  std::string model_name;
  const json* items = nullptr;
  for (auto it = body->begin(); it != body->end(); ++it) {
    if (it.value().is_null()) continue;
    if (it.key() == "model" && it.value().is_string()) {
      model_name = it.value().get<std::string>();
    } else if (it.key() == "items") {
      items = &it.value();
    } else if (it.key() == "metadata" && it.value().is_object()) {
    } else {
      return conn->ReplyError(FieldError(
          it.key(), absl::StrCat("unknown or malformed field '", Capped(it.key()), "'")));
    }
  }
  absl::StatusOr<ModelDescription> model = core_->DescribeModel(model_name);
  if (!model.ok()) return conn->ReplyError(ModelError(model.status(), model_name));
  conn->set_model(model->name);
  std::string prefix;
  // Items as in a response's input; a new conversation has nothing to reference.
  const ItemTexts no_references;
  if (items != nullptr && !(items->is_array() && items->empty())) {
    absl::StatusOr<std::string> rendered =
        RenderChat(*items, ChatTemplateOf(model->config_json), "items", false,
                   MessageList::kResponses, &no_references);
    if (!rendered.ok()) return conn->ReplyError(rendered.status());
    prefix = std::move(*rendered);
  }
  core_->CreateSession(
      conn->caller(), model->name, std::move(prefix),
      [conn](absl::StatusOr<SessionRecord> r) {
        if (!r.ok()) return conn->ReplyError(r.status());
        conn->ReplyJson(200, ConversationJson(*r));
      },
      [conn] { return conn->client_gone(); });
}

void HttpServer::Impl::Conversation(const std::shared_ptr<Connection>& conn, const std::string& id,
                                    bool remove) {
  const std::string session = Unprefixed(id, kConversationPrefix).value_or(id);
  if (remove) {
    core_->DeleteSession(conn->caller(), session, [conn, id](absl::StatusOr<bool> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      conn->ReplyJson(200, {{"id", id}, {"object", "conversation.deleted"}, {"deleted", true}});
    });
    return;
  }
  core_->GetSession(conn->caller(), session, [conn](absl::StatusOr<SessionRecord> r) {
    if (!r.ok()) return conn->ReplyError(r.status());
    conn->ReplyJson(200, ConversationJson(*r));
  });
}

void HttpServer::Impl::Sessions(const std::shared_ptr<Connection>& conn,
                                const std::vector<std::string>& parts, const std::string& query) {
  const http::verb method = conn->method();
  std::map<std::string, std::string> params = ParseQuery(query);
  auto session_reply = [conn](absl::StatusOr<SessionRecord> r) {
    if (!r.ok()) return conn->ReplyError(r.status());
    conn->ReplyJson(200, SessionJson(*r));
  };
  const Caller& caller = conn->caller();
  if (parts.size() == 3 && method == http::verb::post) {  // create
    absl::StatusOr<json> body = ParseBody(conn->request().body(), true);
    if (!body.ok()) return conn->ReplyError(body.status());
    std::string model, prefix;
    for (auto it = body->begin(); it != body->end(); ++it) {
      if (it.value().is_null()) continue;
      if ((it.key() != "model" && it.key() != "prefix") || !it.value().is_string()) {
        return conn->ReplyError(
            FieldError(it.key(), absl::StrCat("'", Capped(it.key()),
                                              "': expected 'model' and 'prefix', "
                                              "both strings")));
      }
      (it.key() == "model" ? model : prefix) = it.value().get<std::string>();
    }
    conn->set_model(model);
    core_->CreateSession(caller, model, std::move(prefix), session_reply,
                         [conn] { return conn->client_gone(); });
    return;
  }
  if (parts.size() == 3 && method == http::verb::get) {  // list
    ListSessionsParams list;
    list.model = params["model"];
    list.page_token = params["page_token"];
    if (!params["page_size"].empty() && !absl::SimpleAtoi(params["page_size"], &list.page_size)) {
      return conn->ReplyError(FieldError("page_size", "'page_size' must be an integer"));
    }
    if (list.page_size < 0) {
      return conn->ReplyError(FieldError(
          "page_size", absl::StrCat("'page_size' must not be negative, got ", list.page_size)));
    }
    if (!list.model.empty()) {
      if (auto m = core_->DescribeModel(list.model); !m.ok()) return conn->ReplyError(m.status());
    }
    core_->ListSessions(caller, std::move(list), [conn](absl::StatusOr<SessionList> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      json data = json::array();
      for (const SessionRecord& s : r->sessions) data.push_back(SessionJson(s));
      conn->ReplyJson(200, {{"object", "list"},
                            {"data", data},
                            {"next_page_token", r->next_page_token},
                            {"has_more", !r->next_page_token.empty()}});
    });
    return;
  }
  if (parts.size() == 4 && parts[3] == "import" && method == http::verb::post) {
    conn->set_model(params["model"]);
    core_->ImportSession(caller, params["model"], conn->request().body(), session_reply);
    return;
  }
  if (parts.size() == 4 && method == http::verb::get) {
    core_->GetSession(caller, parts[3], session_reply);
    return;
  }
  if (parts.size() == 4 && method == http::verb::delete_) {
    core_->DeleteSession(caller, parts[3], [conn, id = parts[3]](absl::StatusOr<bool> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      conn->ReplyJson(200, {{"id", id}, {"object", "fwserve.session.deleted"}, {"deleted", true}});
    });
    return;
  }
  if (parts.size() == 5 && parts[4] == "fork" && method == http::verb::post) {
    core_->ForkSession(caller, parts[3], session_reply);
    return;
  }
  if (parts.size() == 5 && parts[4] == "export" && method == http::verb::get) {
    core_->ExportSession(caller, parts[3], [conn](absl::StatusOr<ExportResult> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      conn->ReplyBinary(std::move(r->blob), {{"X-Fwserve-Model", r->model},
                                             {"X-Fwserve-Tokens", std::to_string(r->tokens)}});
    });
    return;
  }
  conn->set_route("(other)");
  conn->ReplyError(absl::NotFoundError("no such sessions route"));
}

// ---------------------------------------------------------------------------------------
// Lifecycle

absl::Status HttpServer::Impl::Listen() {
  const std::string& listen = options_.listen;
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-listen must be HOST:PORT, got '", Capped(listen), "'"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  beast::error_code ec;
  const net::ip::address address = net::ip::make_address(host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-listen: '", Capped(host), "' is not an IP address"));
  }
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("--http-listen: cannot listen on '", Capped(listen), "': ", ec.message()));
  }
  port_ = acceptor_.local_endpoint().port();
  return absl::OkStatus();
}

void HttpServer::Impl::Accept() {
  acceptor_.async_accept(net::make_strand(ioc_), [this](beast::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
      Log(LogLevel::kWarning, absl::StrCat("http accept: ", ec.message()));
    } else {
      // SSE chunks are small writes: without TCP_NODELAY each stream's first chunk waits
      // for the client's delayed ACK of the headers (about 40 ms).
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Connection>(std::move(socket), this)->Run();
    }
    Accept();
  });
}

void HttpServer::Impl::BeginShutdown() {
  if (shutting_down_.exchange(true)) return;
  net::post(ioc_, [this] {
    beast::error_code ignored;
    acceptor_.close(ignored);
  });
}

void HttpServer::Impl::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  BeginShutdown();
  auto no_streams = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return streams_in_engine_ == 0; };
  std::vector<std::shared_ptr<Connection>> open;
  {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&no_streams), grace);
    for (auto& [id, weak] : connections_) {
      if (auto c = weak.lock()) open.push_back(std::move(c));
    }
  }
  // Every connection closes: writes in flight fail, so the core ends those streams.
  for (auto& c : open) c->Close();
  open.clear();
  {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&no_streams), absl::Seconds(30))) {
      Log(LogLevel::kError, "http: streams still open in the core after 30 s");
    }
  }
  work_.reset();
  ioc_.stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(absl::ZeroDuration()); }

int HttpServer::port() const { return impl_->port_; }

void HttpServer::BeginShutdown() { impl_->BeginShutdown(); }

void HttpServer::Stop(absl::Duration grace) { impl_->Stop(grace); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Core* core) {
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("http threads must be >= 1, got ", options.threads));
  }
  if (options.max_body_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-max-body-bytes must be >= 1, got ", options.max_body_bytes));
  }
  if (options.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--http-idle-timeout must be > 0, got ",
                                                   absl::FormatDuration(options.idle_timeout)));
  }
  auto impl = std::make_unique<Impl>(options, core);
  if (absl::Status listening = impl->Listen(); !listening.ok()) return listening;
  impl->Accept();
  for (int i = 0; i < options.threads; ++i) {
    impl->threads_.emplace_back([ioc = &impl->ioc_] { ioc->run(); });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace fwserve
