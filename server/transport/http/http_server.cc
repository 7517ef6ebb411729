#include "server/transport/http/http_internal.h"

namespace fwserve {

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
      return CreateResponse(conn);
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
