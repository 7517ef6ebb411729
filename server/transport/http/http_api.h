// The HTTP server's route handlers without the socket: the OpenAI endpoints (completions,
// chat and responses, http_generate.cc, each endpoint's protocol an EndpointProtocol),
// stored responses, conversations and the session API (http_sessions.cc). They see a
// request as an HttpExchange, which the socket side (http_internal.h, Boost.Beast,
// http_server.cc) implements; these files include no Beast. Internal to the HTTP
// transport: it brings the server's helpers into namespace fwserve.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/base/session_id.h"
#include "server/transport/http/endpoint_protocol.h"
#include "server/transport/http/http_server.h"
#include "server/transport/http/openai_api.h"
#include "server/transport/http/openai_responses.h"

namespace fwserve {
namespace http_internal {

using json = nlohmann::json;

inline int64_t UnixSeconds(absl::Time t) { return absl::ToUnixSeconds(t); }
inline int64_t NowSeconds() { return absl::ToUnixSeconds(absl::Now()); }

inline json SessionJson(const SessionRecord& r) {
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

inline json ConversationJson(const SessionRecord& r) {
  return json{{"id", kConversationPrefix + r.id},
              {"object", "conversation"},
              {"created_at", UnixSeconds(r.created)},
              {"metadata", json::object()},
              {"fwserve_session", SessionJson(r)}};
}

// The session id a prefixed id names ("resp_<id>" / "conv_<id>"); nullopt if `id` lacks
// the prefix.
inline std::optional<std::string> Unprefixed(absl::string_view id, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&id, prefix) || id.empty()) return std::nullopt;
  return std::string(id);
}

// Client-supplied names in log lines: at most this many bytes.
inline std::string Capped(absl::string_view s) {
  return s.size() <= 128 ? std::string(s) : absl::StrCat(s.substr(0, 128), "...");
}

inline std::string ChunkFrame(absl::string_view data) {
  char size[24];
  std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
  return absl::StrCat(size, data, "\r\n");
}

// A model lookup's error as OpenAI words it: an unknown model is 404 "model_not_found".
inline absl::Status ModelError(const absl::Status& error, absl::string_view name) {
  if (error.code() != absl::StatusCode::kNotFound) return error;
  return WithErrorCode(
      WithParam(absl::NotFoundError(
                    absl::StrCat("the model '", Capped(name), "' does not exist (GET /v1/models)")),
                "model"),
      "model_not_found");
}

}  // namespace http_internal

using namespace http_internal;  // NOLINT: internal header of one library

// A request's method as the route handlers tell them apart (HEAD is served as GET).
enum class HttpMethod { kGet, kPost, kDelete, kOther };

// One request on one connection, as a route handler sees it. Implemented by the socket
// side's Connection (http_internal.h). Each request is answered exactly once: one Reply*,
// or BeginStream, any StreamWrites, then EndStream.
// Thread-safety: the request's fields, set_* and the streaming calls run on the
// connection's strand (RunOnStrand gets there from any thread); the Reply* calls and
// client_gone may be called from any thread.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;

  virtual const std::string& body() const = 0;
  virtual HttpMethod method() const = 0;
  // Who is asking (authenticated before routing).
  virtual const Caller& caller() const = 0;
  // The route and the model, for the access log and the metrics' labels.
  virtual void set_route(std::string route) = 0;
  virtual void set_model(const std::string& model) = 0;
  // The client went away while the request is served (polled by the core as
  // is_cancelled), and what to run on the strand when it does.
  virtual bool client_gone() const = 0;
  virtual void set_on_client_gone(std::function<void()> fn) = 0;
  // Runs `fn` on the connection's strand.
  virtual void RunOnStrand(std::function<void()> fn) = 0;

  // Answers with a JSON body; with the OpenAI error body (and the retry headers of a
  // retry delay) for `error`; with bytes (application/octet-stream) and extra headers.
  virtual void ReplyJson(int status, json body, absl::StatusCode code = absl::StatusCode::kOk) = 0;
  virtual void ReplyError(const absl::Status& error) = 0;
  virtual void ReplyBinary(std::string body,
                           std::vector<std::pair<std::string, std::string>> headers) = 0;

  // A chunked text/event-stream answer: its header, each chunk (`done(ok)` once written;
  // may be null), and the last chunk.
  virtual void BeginStream() = 0;
  virtual void StreamWrite(absl::string_view data, std::function<void(bool)> done) = 0;
  virtual void EndStream(absl::string_view data, absl::StatusCode code) = 0;
};

// The route handlers and what they share: the options, the core, the metrics, and the
// count of streams the core has accepted (a graceful stop waits for them). Thread-safe;
// each handler answers through its exchange exactly once.
class HttpApi {
 public:
  HttpApi(const HttpServerOptions& options, Core* core)
      : options_(options), core_(core), metrics_(Metrics::OrNull(options.metrics)) {}

  // Stream accounting: accepted by the core until OnFinish.
  void StreamAccepted() {
    absl::MutexLock lock(&mu_);
    ++streams_in_engine_;
  }
  void StreamFinished() {
    absl::MutexLock lock(&mu_);
    --streams_in_engine_;
  }

  // Completions and chat: one GenerateJob with `endpoint`'s protocol.
  void Generate(const std::shared_ptr<HttpExchange>& conn, OpenAiEndpoint endpoint);
  // POST /v1/responses: resolves the input's item_references, then StartResponse.
  void CreateResponse(const std::shared_ptr<HttpExchange>& conn);
  // Responses: resolves the input's item_references from the `index`th on (the texts
  // found so far in `texts`), one session read at a time, then StartResponse.
  void ResolveItemReferences(const std::shared_ptr<HttpExchange>& conn,
                             OpenAiGenerateRequest request, const ChatTemplate& chat_template,
                             const std::string& model, size_t index,
                             std::shared_ptr<ItemTexts> texts);
  // Responses: picks the session (a fork of previous_response_id, the conversation's,
  // or a new one) and generates on it.
  void StartResponse(const std::shared_ptr<HttpExchange>& conn, OpenAiGenerateRequest request,
                     const std::string& model_name);
  void GetResponse(const std::shared_ptr<HttpExchange>& conn, const std::string& id, bool remove);
  void CreateConversation(const std::shared_ptr<HttpExchange>& conn);
  void Conversation(const std::shared_ptr<HttpExchange>& conn, const std::string& id, bool remove);
  void Sessions(const std::shared_ptr<HttpExchange>& conn, const std::vector<std::string>& parts,
                const std::string& query);

  const HttpServerOptions options_;
  Core* const core_;
  Metrics* const metrics_;  // never null
  absl::Mutex mu_;
  int64_t streams_in_engine_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fwserve
