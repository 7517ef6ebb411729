// Completions, chat completions and responses: GenerateJob (one generation, streamed or
// not) and the routes that start it.
#include "server/transport/http/http_internal.h"

namespace fwserve {

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

}  // namespace fwserve
