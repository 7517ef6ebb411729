// Stored responses (GET/DELETE), conversations and the session API
// (/fwserve/v1/sessions).
#include "server/transport/http/http_api.h"

namespace fwserve {

void HttpApi::GetResponse(const std::shared_ptr<HttpExchange>& conn, const std::string& id,
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

void HttpApi::CreateConversation(const std::shared_ptr<HttpExchange>& conn) {
  absl::StatusOr<json> body = ParseBody(conn->body(), true);
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

void HttpApi::Conversation(const std::shared_ptr<HttpExchange>& conn, const std::string& id,
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

void HttpApi::Sessions(const std::shared_ptr<HttpExchange>& conn,
                       const std::vector<std::string>& parts, const std::string& query) {
  const HttpMethod method = conn->method();
  std::map<std::string, std::string> params = ParseQuery(query);
  auto session_reply = [conn](absl::StatusOr<SessionRecord> r) {
    if (!r.ok()) return conn->ReplyError(r.status());
    conn->ReplyJson(200, SessionJson(*r));
  };
  const Caller& caller = conn->caller();
  if (parts.size() == 3 && method == HttpMethod::kPost) {  // create
    absl::StatusOr<json> body = ParseBody(conn->body(), true);
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
  if (parts.size() == 3 && method == HttpMethod::kGet) {  // list
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
  if (parts.size() == 4 && parts[3] == "import" && method == HttpMethod::kPost) {
    conn->set_model(params["model"]);
    core_->ImportSession(caller, params["model"], conn->body(), session_reply);
    return;
  }
  if (parts.size() == 4 && method == HttpMethod::kGet) {
    core_->GetSession(caller, parts[3], session_reply);
    return;
  }
  if (parts.size() == 4 && method == HttpMethod::kDelete) {
    core_->DeleteSession(caller, parts[3], [conn, id = parts[3]](absl::StatusOr<bool> r) {
      if (!r.ok()) return conn->ReplyError(r.status());
      conn->ReplyJson(200, {{"id", id}, {"object", "fwserve.session.deleted"}, {"deleted", true}});
    });
    return;
  }
  if (parts.size() == 5 && parts[4] == "fork" && method == HttpMethod::kPost) {
    core_->ForkSession(caller, parts[3], session_reply);
    return;
  }
  if (parts.size() == 5 && parts[4] == "export" && method == HttpMethod::kGet) {
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

}  // namespace fwserve
