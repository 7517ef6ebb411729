// fwctl chat [--model M] [--session ID] [--prefix TEXT] [--suffix TEXT] [sampling options]
#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_replace.h"

#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/interrupts.h"
#include "client/fwctl/io.h"
#include "client/fwctl/stream.h"

namespace fwctl {
namespace {

namespace v1 = fwserve::v1;

struct ChatOptions {
  std::string model;
  std::optional<std::string> session;
  std::optional<std::string> prefix;
  std::string suffix = "\\n";
  // "auto": the model's chat template when its config has one, else raw lines; "none".
  std::string chat_template = "auto";
  SamplingOptions sampling;
};

// A model's chat template (config.json's "chat_template", docs/http.md): how one user
// line becomes a turn, and where the reply ends.
struct ChatTemplate {
  std::string message;
  std::string generation_prompt;
  std::vector<std::string> stop;
};

std::optional<ChatTemplate> TemplateOf(const std::string& config_json) {
  const nlohmann::json config = nlohmann::json::parse(config_json, nullptr, false);
  if (!config.is_object()) return std::nullopt;
  auto t = config.find("chat_template");
  if (t == config.end() || !t->is_object()) return std::nullopt;
  ChatTemplate out;
  auto message = t->find("message");
  auto prompt = t->find("generation_prompt");
  if (message == t->end() || !message->is_string() || prompt == t->end() || !prompt->is_string()) {
    return std::nullopt;
  }
  out.message = message->get<std::string>();
  out.generation_prompt = prompt->get<std::string>();
  if (auto stop = t->find("stop"); stop != t->end() && stop->is_array()) {
    for (const auto& marker : *stop) {
      if (marker.is_string()) out.stop.push_back(marker.get<std::string>());
    }
  }
  return out;
}

// `line` as the user's turn, then the prompt of the reply (as the HTTP API renders it).
std::string RenderUserTurn(const ChatTemplate& t, const std::string& line) {
  return absl::StrReplaceAll(t.message,
                             {{"{role}", "USER"}, {"{Role}", "User"}, {"{content}", line}}) +
         t.generation_prompt;
}

// Reads one line from stdin (without its newline). Returns 1 with a line, 0 at EOF
// (a last unterminated line is returned first), -1 on SIGINT.
int ReadLine(std::string* line) {
  line->clear();
  for (;;) {
    pollfd fds[2] = {{STDIN_FILENO, POLLIN, 0}, {Interrupts::wake_fd(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    if (fds[1].revents & POLLIN) return -1;
    char c = 0;
    const ssize_t n = read(STDIN_FILENO, &c, 1);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return line->empty() ? 0 : 1;
    if (c == '\n') return 1;
    line->push_back(c);
  }
}

int RunChat(const Command& command, const ChatOptions& options, const GlobalOptions& global) {
  v1::GenerateRequest request;
  FillGenerateRequest(options.sampling, &request);
  if (options.session.has_value() && options.prefix.has_value()) {
    return UsageError(command.label(), "--prefix applies to a new session, not with --session");
  }
  if (options.chat_template != "auto" && options.chat_template != "none") {
    return UsageError(command.label(),
                      "--template must be auto or none, got '" + options.chat_template + "'");
  }
  fwserve::Client& client = GetClient(global);
  std::string session_id = options.session.value_or("");
  v1::SessionInfo info;
  {
    absl::StatusOr<v1::SessionInfo> session =
        session_id.empty()
            ? client.CreateSession(options.model, UnescapeC(options.prefix.value_or("")))
            : client.GetSession(session_id);
    if (!session.ok()) return RpcError(session.status());
    info = *session;
  }
  session_id = info.session_id();
  request.set_session_id(session_id);
  // With the model's template each line is a user turn and the reply ends at the
  // template's end-of-turn marker (kept in the session, as gRPC keeps stop strings).
  std::optional<ChatTemplate> chat_template;
  if (options.chat_template == "auto") {
    absl::StatusOr<v1::ModelInfo> model = client.DescribeModel(info.model());
    if (!model.ok()) return RpcError(model.status());
    chat_template = TemplateOf(model->config_json());
    if (chat_template.has_value() && request.stop_size() == 0) {
      for (const std::string& marker : chat_template->stop) request.add_stop(marker);
    }
  }
  const bool interactive = isatty(STDIN_FILENO);
  std::fprintf(stderr,
               "fwctl chat: session %s (model %s, %lld tokens%s). Enter a line to send it; "
               "Ctrl-C stops a reply, Ctrl-D ends.\n",
               session_id.c_str(), info.model().c_str(), static_cast<long long>(info.tokens()),
               chat_template.has_value() ? ", the model's chat template" : "");
  const std::string suffix = UnescapeC(options.suffix);
  // At the prompt SIGINT only wakes ReadLine (through the wake pipe), which ends the
  // chat; during a reply StreamGenerate's own handler cancels the reply.
  Interrupts::Handler at_prompt([] {});
  const auto goodbye = [&](int code) {
    std::fprintf(stderr, "fwctl chat: resume with: fwctl chat --session %s\n", session_id.c_str());
    return code;
  };
  for (;;) {
    Interrupts::DrainWakeups();
    if (interactive) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    std::string line;
    const int read = ReadLine(&line);
    if (read < 0) {
      std::fputs("\n", stderr);
      return goodbye(kExitInterrupted);
    }
    if (read == 0) return goodbye(kExitOk);
    request.set_prompt(chat_template.has_value() ? RenderUserTurn(*chat_template, line)
                                                 : line + suffix);
    StreamOutcome outcome;
    for (int attempt = 0;; ++attempt) {
      outcome = StreamGenerate(client, request, /*json_lines=*/false);
      // The session is still held by the previous (cancelled) reply for a moment.
      if (outcome.status.code() != absl::StatusCode::kAborted || attempt > 0 ||
          outcome.interrupted) {
        break;
      }
      (void)WaitUntilIdle(client, session_id);
    }
    if (!outcome.text.empty() && outcome.text.back() != '\n') WriteOut("\n");
    if (outcome.interrupted) {
      std::fprintf(stderr, "[reply interrupted after %lld tokens]\n",
                   static_cast<long long>(outcome.generated));
      (void)WaitUntilIdle(client, session_id);
      continue;
    }
    if (!outcome.status.ok()) {
      RpcError(outcome.status);
      return goodbye(kExitError);
    }
    if (global.verbose) PrintSummary(outcome, global.verbose);
  }
}

}  // namespace

void AddChatCommand(CLI::App& program, const GlobalOptions& global) {
  Command& command = AddCommand(
      program, "chat", "interactive loop on one session", "",
      "Creates a session (or resumes --session ID), prints its id on stderr, then reads "
      "lines from stdin: each line is appended to the session and a reply of up to "
      "--max-tokens (default 200) tokens is streamed to stdout. A model whose config has a "
      "chat template (RWKV's G1: 'User: ...\\n\\nAssistant:') gets each line as a user "
      "turn, and the reply ends at the template's end-of-turn marker unless --stop is "
      "given; other models get the line plus --suffix. Ctrl-C during a "
      "reply stops that reply only (the session keeps what was streamed); Ctrl-C at the "
      "prompt exits 130; end of input (Ctrl-D) exits 0. Both print the command that "
      "resumes the session.");
  auto options = std::make_shared<ChatOptions>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddText(command, "session", "ID", "resume this session instead of creating one",
          &options->session);
  AddText(command, "prefix", "TEXT", "text prefilled into the new session (C escapes understood)",
          &options->prefix);
  AddText(command, "suffix", "TEXT",
          "appended to each input line before it is sent, for a model without a chat template "
          "(default \\n)",
          &options->suffix);
  AddText(command, "template", "auto|none",
          "auto (default): the model's chat template when it has one; none: raw lines plus "
          "--suffix",
          &options->chat_template);
  AddSamplingOptions(command, 200, &options->sampling);
  command.run = [&command, options, &global] { return RunChat(command, *options, global); };
}

}  // namespace fwctl
