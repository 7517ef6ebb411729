// Completions, chat completions and responses: GenerateJob (one generation, streamed or
// not, its endpoint's protocol an EndpointProtocol) and the routes that start it; the
// Responses route first picks the session to generate on.
#include "server/transport/http/http_api.h"

namespace fwserve {

namespace {

// One generation of any OpenAI endpoint, streamed or not; what the endpoint does its own
// way (parameters, ids, bodies, events) is `protocol_`'s. The engine calls OnStart
// (inside StartGenerate, on the strand), OnChunk and OnFinish; everything they carry is
// posted to the connection's strand, where all the job's state lives.
class GenerateJob : public GenerateObserver, public std::enable_shared_from_this<GenerateJob> {
 public:
  // `protocols`: one per choice (request.params.choices of them; one for responses).
  GenerateJob(HttpApi* server, std::shared_ptr<HttpExchange> conn,
              std::vector<std::unique_ptr<EndpointProtocol>> protocols,
              OpenAiGenerateRequest request)
      : server_(server), conn_(std::move(conn)), request_(std::move(request)) {
    for (size_t i = 0; i < protocols.size(); ++i) {
      protocols[i]->set_choice(static_cast<int32_t>(i), i + 1 == protocols.size());
      choices_.push_back(Choice{std::move(protocols[i]), StopFilter(request_.params.stop), "", {}});
    }
    protocol_ = choices_.front().protocol.get();
  }

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
    params.model = request_.model;
    protocol_->AdjustParams(request_, &params);
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
      std::string opening;
      for (Choice& c : choices_) opening += c.protocol->StreamOpening(request_);
      if (!opening.empty()) conn_->StreamWrite(opening, nullptr);
    }
  }

  void OnStart(std::shared_ptr<GenerateControl> control) override { control_ = std::move(control); }

  void OnChunk(GenerateChunk chunk) override {
    conn_->RunOnStrand([self = shared_from_this(), chunk = std::move(chunk)]() mutable {
      self->HandleChunk(std::move(chunk));
    });
  }

  void OnFinish(absl::Status status, GenerateSummary summary) override {
    std::shared_ptr<GenerateJob> self = std::move(self_);
    conn_->RunOnStrand([self, status, summary = std::move(summary)]() mutable {
      self->HandleFinish(status, std::move(summary));
    });
    server_->StreamFinished();
  }

 private:
  void ClientGone() {
    gone_->store(true);
    if (control_ != nullptr && !finished_) control_->Cancel();
  }

  void HandleChunk(GenerateChunk chunk) {
    if (finished_) return;
    if (chunk.choice_index < 0 || static_cast<size_t>(chunk.choice_index) >= choices_.size()) {
      control_->WriteDone(false);  // not this request's: cannot happen
      return;
    }
    Choice& c = choices_[static_cast<size_t>(chunk.choice_index)];
    const std::string text = c.filter.Push(chunk.text);
    if (request_.logprobs) {
      GenerateChunk& tokens = c.tokens;
      for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
        tokens.token_ids.push_back(chunk.token_ids[i]);
        tokens.logprobs.push_back(i < chunk.logprobs.size() ? chunk.logprobs[i] : 0.0f);
        tokens.token_bytes.push_back(TokenBytesAt(chunk, i));
        if (i < chunk.top_logprobs.size()) tokens.top_logprobs.push_back(chunk.top_logprobs[i]);
      }
    }
    c.text += text;
    if (!request_.stream || (text.empty() && !request_.logprobs)) {
      control_->WriteDone(!conn_->client_gone());
      return;
    }
    std::string events = c.protocol->StreamDelta(request_, text, &chunk);
    if (events.empty()) {  // held back (a tool call's text before its name is known)
      control_->WriteDone(!conn_->client_gone());
      return;
    }
    conn_->StreamWrite(std::move(events), [self = shared_from_this()](bool ok) {
      if (!self->finished_) self->control_->WriteDone(ok);
    });
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
      conn_->EndStream(protocol_->StreamError(ErrorJson(status, HttpStatusOf(status))),
                       status.code());
      return;
    }
    // Each choice's outcome and body; several choices' bodies are one answer with
    // every choice (the usage, of them all, is the same in each).
    const json usage = protocol_->Usage(summary);
    json out;
    std::string events;
    for (size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = choices_[i];
      // How this choice ended: its own entry when there are several, else the summary's.
      const GenerateSummary::ChoiceEnd* end =
          i < summary.choices.size() ? &summary.choices[i] : nullptr;
      std::string tail = c.filter.Push(end != nullptr ? end->trailing_text : summary.trailing_text);
      tail += c.filter.Finish();
      c.text += tail;
      GenerateOutcome outcome;
      outcome.text = c.text;
      outcome.reason = end != nullptr ? end->reason : summary.reason;
      outcome.stopped = c.filter.stopped();
      outcome.usage = usage;
      outcome.tokens = std::move(c.tokens);
      json body = c.protocol->Body(request_, outcome);
      if (i == 0) {
        out = body;
      } else {
        out["choices"].push_back(body["choices"][0]);
      }
      if (request_.stream) {
        if (!tail.empty()) events += c.protocol->StreamDelta(request_, tail, nullptr);
        events += c.protocol->StreamClosing(request_, outcome, body);
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
                                    conn->RunOnStrand([answer] { answer(); });
                                  });
  }

  void DropOwnedSession() {
    if (!session_owned_) return;
    session_owned_ = false;
    server_->core_->DeleteSession(conn_->caller(), request_.params.session_id,
                                  [](absl::StatusOr<bool>) {});
  }

  // One choice's answer: its protocol (which renders it as its index), its stop
  // filter, its text so far and, when logprobs are asked, its tokens.
  struct Choice {
    std::unique_ptr<EndpointProtocol> protocol;
    StopFilter filter;
    std::string text;
    GenerateChunk tokens;
  };

  HttpApi* const server_;
  const std::shared_ptr<HttpExchange> conn_;
  // Strand-confined, like everything below but gone_.
  OpenAiGenerateRequest request_;
  std::vector<Choice> choices_;  // one per choice, in index order
  EndpointProtocol* protocol_;   // choice 0's: parameters, usage, errors
  bool session_owned_ = false;
  // Set before StartGenerate; released by OnFinish: the core holds the job as a raw
  // observer until then.
  std::shared_ptr<GenerateJob> self_;
  const std::shared_ptr<std::atomic<bool>> gone_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<GenerateControl> control_;
  bool finished_ = false;
};

// A generate request as its endpoint parsed it, on the model it names.
struct ParsedGenerate {
  OpenAiGenerateRequest request;
  std::string model;  // the model's name, as answers show it
  ChatTemplate chat_template;
};

// The request `conn` holds, parsed for `endpoint`; nullopt once `conn` was answered
// with the error.
std::optional<ParsedGenerate> ParseGenerate(HttpApi* server,
                                            const std::shared_ptr<HttpExchange>& conn,
                                            OpenAiEndpoint endpoint) {
  absl::StatusOr<json> body = ParseBody(conn->body(), false);
  if (!body.ok()) {
    conn->ReplyError(body.status());
    return std::nullopt;
  }
  // The model decides the chat template; an unknown one is 404 before anything else.
  std::string model_field;
  if (auto m = body->find("model"); m != body->end() && m->is_string()) {
    model_field = m->get<std::string>();
  }
  absl::StatusOr<ModelDescription> model = server->core_->DescribeModel(model_field);
  if (!model.ok()) {
    conn->ReplyError(ModelError(model.status(), model_field));
    return std::nullopt;
  }
  conn->set_model(model->name);
  ParsedGenerate out;
  out.model = model->name;
  out.chat_template = ChatTemplateOf(model->config_json);
  absl::StatusOr<OpenAiGenerateRequest> request =
      ParseGenerateRequest(*body, endpoint, out.chat_template, server->options_.default_max_tokens);
  if (!request.ok()) {
    conn->ReplyError(request.status());
    return std::nullopt;
  }
  out.request = std::move(*request);
  return out;
}

}  // namespace

void HttpApi::Generate(const std::shared_ptr<HttpExchange>& conn, OpenAiEndpoint endpoint) {
  std::optional<ParsedGenerate> parsed = ParseGenerate(this, conn, endpoint);
  if (!parsed.has_value()) return;
  // One protocol per choice, with the same ids.
  const int64_t created = NowSeconds();
  const std::string id_suffix = NewSessionId();
  std::vector<std::unique_ptr<EndpointProtocol>> protocols;
  for (int32_t i = 0; i < std::max<int32_t>(1, parsed->request.params.choices); ++i) {
    protocols.push_back(NewEndpointProtocol(endpoint, parsed->model, created, id_suffix));
  }
  auto job =
      std::make_shared<GenerateJob>(this, conn, std::move(protocols), std::move(parsed->request));
  job->Start();
}

void HttpApi::CreateResponse(const std::shared_ptr<HttpExchange>& conn) {
  std::optional<ParsedGenerate> parsed = ParseGenerate(this, conn, OpenAiEndpoint::kResponses);
  if (!parsed.has_value()) return;
  if (parsed->request.item_references.empty()) {
    return StartResponse(conn, std::move(parsed->request), parsed->model);
  }
  ResolveItemReferences(conn, std::move(parsed->request), parsed->chat_template, parsed->model, 0,
                        std::make_shared<ItemTexts>());
}

void HttpApi::ResolveItemReferences(const std::shared_ptr<HttpExchange>& conn,
                                    OpenAiGenerateRequest request,
                                    const ChatTemplate& chat_template, const std::string& model,
                                    size_t index, std::shared_ptr<ItemTexts> texts) {
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
                            conn->RunOnStrand([this, conn, request = std::move(request),
                                               chat_template, model, index, texts]() mutable {
                              ResolveItemReferences(conn, std::move(request), chat_template, model,
                                                    index + 1, texts);
                            });
                          });
}

void HttpApi::StartResponse(const std::shared_ptr<HttpExchange>& conn,
                            OpenAiGenerateRequest request, const std::string& model_name) {
  // Responses: the session to generate on.
  const std::string previous = request.previous_response_id;
  const std::string conversation = request.conversation;
  std::vector<std::unique_ptr<EndpointProtocol>> protocols;
  protocols.push_back(NewResponsesProtocol(model_name, NowSeconds()));
  auto job = std::make_shared<GenerateJob>(this, conn, std::move(protocols), std::move(request));
  auto start_on = [conn, job](absl::StatusOr<SessionRecord> session, bool owned) {
    if (!session.ok()) return conn->ReplyError(session.status());
    conn->RunOnStrand([job, id = session->id, owned] {
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
