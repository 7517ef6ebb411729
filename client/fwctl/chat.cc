// fwctl chat [--model M] [--session ID] [--prefix TEXT] [--suffix TEXT] [sampling options]
#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

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
  SamplingOptions sampling;
};

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
  const bool interactive = isatty(STDIN_FILENO);
  std::fprintf(stderr,
               "fwctl chat: session %s (model %s, %lld tokens). Enter a line to send it; "
               "Ctrl-C stops a reply, Ctrl-D ends.\n",
               session_id.c_str(), info.model().c_str(), static_cast<long long>(info.tokens()));
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
    request.set_prompt(line + suffix);
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
      "lines from stdin: each line (plus --suffix) is appended to the session and a reply "
      "of up to --max-tokens (default 200) tokens is streamed to stdout. Ctrl-C during a "
      "reply stops that reply only (the session keeps what was streamed); Ctrl-C at the "
      "prompt exits 130; end of input (Ctrl-D) exits 0. Both print the command that "
      "resumes the session.");
  auto options = std::make_shared<ChatOptions>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddText(command, "session", "ID", "resume this session instead of creating one",
          &options->session);
  AddText(command, "prefix", "TEXT", "text prefilled into the new session (C escapes understood)",
          &options->prefix);
  AddText(command, "suffix", "TEXT", "appended to each input line before it is sent (default \\n)",
          &options->suffix);
  AddSamplingOptions(command, 200, &options->sampling);
  command.run = [&command, options, &global] { return RunChat(command, *options, global); };
}

}  // namespace fwctl
