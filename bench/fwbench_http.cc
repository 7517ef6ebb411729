#include "bench/fwbench_http.h"

#include <limits>
#include <utility>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace fwbench {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

absl::StatusOr<Endpoints> Resolve(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat("'", host_port, "' is not HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  net::io_context io;
  tcp::resolver resolver(io);
  beast::error_code ec;
  Endpoints endpoints = resolver.resolve(host, host_port.substr(colon + 1), ec);
  if (ec || endpoints.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port, ": ", ec.message()));
  }
  return endpoints;
}

void SseParser::Feed(absl::string_view bytes,
                     const std::function<void(absl::string_view)>& on_data) {
  auto handle_line = [&](absl::string_view line) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {
      if (has_data_) on_data(data_);
      data_.clear();
      has_data_ = false;
      return;
    }
    if (!absl::ConsumePrefix(&line, "data:")) return;  // event:, id:, retry:, comments
    absl::ConsumePrefix(&line, " ");
    if (has_data_) data_.push_back('\n');
    data_.append(line.data(), line.size());
    has_data_ = true;
  };
  size_t start = 0;
  while (start < bytes.size()) {
    const size_t newline = bytes.find('\n', start);
    if (newline == absl::string_view::npos) {
      pending_.append(bytes.data() + start, bytes.size() - start);
      return;
    }
    if (pending_.empty()) {
      handle_line(bytes.substr(start, newline - start));
    } else {
      pending_.append(bytes.data() + start, newline - start);
      handle_line(pending_);
      pending_.clear();
    }
    start = newline + 1;
  }
}

namespace {

// SAX handler behind ChunkFields::Parse: follows the path of containers to pick out
// choices[0].text, usage.completion_tokens and error.code / error.type.
class ChunkSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit ChunkSax(ChunkFields* out) : out_(out) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t v) override {
    if (Here() == kUsage && key_ == "completion_tokens") out_->completion_tokens = v;
    return true;
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (Here() == kUsage && key_ == "completion_tokens") {
      out_->completion_tokens = static_cast<int64_t>(v);
    }
    return true;
  }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t& v) override {
    const Where here = Here();
    if (here == kChoice0 && key_ == "text") out_->text_bytes += static_cast<int64_t>(v.size());
    if (here == kError && (key_ == "code" || (key_ == "type" && error_code_from_type_))) {
      out_->error_code = v;
      error_code_from_type_ = key_ == "type";
    }
    return true;
  }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    const Where parent = Here();
    Where next = kOther;
    if (stack_.empty()) {
      next = kTop;
    } else if (parent == kTop && key_ == "usage") {
      next = kUsage;
    } else if (parent == kTop && key_ == "error") {
      next = kError;
      out_->is_error = true;
      out_->error_code = "unknown";
    } else if (parent == kChoices) {
      next = choices_seen_++ == 0 ? kChoice0 : kOther;
    }
    stack_.push_back(next);
    return true;
  }
  bool key(string_t& k) override {
    key_ = k;
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    stack_.push_back(Here() == kTop && key_ == "choices" ? kChoices : kOther);
    return true;
  }
  bool end_array() override {
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  enum Where { kOther, kTop, kChoices, kChoice0, kUsage, kError };
  Where Here() const { return stack_.empty() ? kOther : stack_.back(); }

  ChunkFields* const out_;
  std::vector<Where> stack_;
  std::string key_;  // the last key read (meaningful for values directly in an object)
  int choices_seen_ = 0;
  bool error_code_from_type_ = true;  // a later "code" replaces a "type"
};

}  // namespace

bool ChunkFields::Parse(absl::string_view json) {
  *this = ChunkFields();
  ChunkSax sax(this);
  return nlohmann::json::sax_parse(json.begin(), json.end(), &sax);
}

HttpConnection::HttpConnection(net::io_context& io, Endpoints endpoints, std::string host)
    : stream_(io), endpoints_(std::move(endpoints)), host_(std::move(host)) {}

void HttpConnection::Connect(std::function<void(const std::string&)> on_done) {
  handlers_ = Handlers{nullptr, nullptr, std::move(on_done)};
  in_flight_ = true;
  stream_.async_connect(endpoints_,
                        [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
                          if (ec) return self->Done(absl::StrCat("connect: ", ec.message()));
                          beast::error_code ignored;
                          self->stream_.socket().set_option(tcp::no_delay(true), ignored);
                          self->Done("");
                        });
}

void HttpConnection::Request(http::verb method, const std::string& target, std::string body,
                             Handlers handlers) {
  handlers_ = std::move(handlers);
  in_flight_ = true;
  header_reported_ = false;
  request_ = {};
  request_.method(method);
  request_.target(target);
  request_.version(11);
  request_.set(http::field::host, host_);
  request_.set(http::field::user_agent, "fwbench");
  if (!body.empty()) {
    request_.set(http::field::content_type, "application/json");
    request_.body() = std::move(body);
  }
  request_.prepare_payload();
  if (stream_.socket().is_open()) return Send();
  stream_.async_connect(endpoints_,
                        [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
                          if (ec) return self->Done(absl::StrCat("connect: ", ec.message()));
                          beast::error_code ignored;
                          self->stream_.socket().set_option(tcp::no_delay(true), ignored);
                          self->Send();
                        });
}

void HttpConnection::Send() {
  http::async_write(stream_, request_, [self = shared_from_this()](beast::error_code ec, size_t) {
    if (ec) {
      self->stream_.close();
      return self->Done(absl::StrCat("write: ", ec.message()));
    }
    self->parser_.emplace();
    self->parser_->body_limit((std::numeric_limits<std::uint64_t>::max)());
    self->ReadSome();
  });
}

void HttpConnection::ReadSome() {
  http::async_read_some(
      stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec) {
          self->stream_.close();
          return self->Done(ec == net::error::operation_aborted
                                ? std::string("closed by the client")
                                : absl::StrCat("read: ", ec.message()));
        }
        // A handler may Close() the connection; then the request ends here.
        auto closed = [&] { return !self->stream_.socket().is_open(); };
        if (!self->header_reported_ && self->parser_->is_header_done()) {
          self->header_reported_ = true;
          if (self->handlers_.on_header)
            self->handlers_.on_header(static_cast<int>(self->parser_->get().result_int()));
          if (closed()) return self->Done("closed by the client");
        }
        std::string& body = self->parser_->get().body();
        if (!body.empty()) {
          if (self->handlers_.on_body) self->handlers_.on_body(body);
          body.clear();
          if (closed()) return self->Done("closed by the client");
        }
        if (self->parser_->is_done()) {
          if (!self->parser_->keep_alive()) self->stream_.close();
          return self->Done("");
        }
        self->ReadSome();
      });
}

void HttpConnection::Close() {
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
}

void HttpConnection::Done(const std::string& error) {
  in_flight_ = false;
  Handlers handlers = std::move(handlers_);
  handlers_ = Handlers();
  if (handlers.on_done) handlers.on_done(error);
}

absl::StatusOr<HttpReply> HttpCall(const Endpoints& endpoints, const std::string& host,
                                   http::verb method, const std::string& target,
                                   const std::string& body, absl::Duration timeout) {
  const auto method_name = http::to_string(method);
  const std::string what = absl::StrCat(absl::string_view(method_name.data(), method_name.size()),
                                        " ", target, " on ", host);
  net::io_context io;
  auto connection = std::make_shared<HttpConnection>(io, endpoints, host);
  HttpReply reply;
  std::optional<std::string> error;
  HttpConnection::Handlers handlers;
  handlers.on_header = [&](int status) { reply.status = status; };
  handlers.on_body = [&](absl::string_view bytes) {
    reply.body.append(bytes.data(), bytes.size());
  };
  handlers.on_done = [&](const std::string& e) { error = e; };
  connection->Request(method, target, body, std::move(handlers));
  io.run_for(absl::ToChronoNanoseconds(timeout));
  if (!error.has_value()) {
    connection->Close();
    io.restart();
    io.run();
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no reply within ", absl::FormatDuration(timeout)));
  }
  if (!error->empty()) {
    return absl::UnavailableError(absl::StrCat(what, ": ", *error));
  }
  connection->Close();
  return reply;
}

}  // namespace fwbench
