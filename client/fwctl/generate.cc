// fwctl generate [OPTIONS] [PROMPT... | -]
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/io.h"
#include "client/fwctl/stream.h"

namespace fwctl {
namespace {

namespace v1 = fwserve::v1;

struct GenerateOptions {
  std::string model;
  std::string session;
  SamplingOptions sampling;
  bool logprobs = false;
  // Structured output: a JSON schema file, or any JSON object.
  std::string json_schema_file;
  bool json_object = false;
  bool json = false;
  bool quiet = false;
  std::vector<std::string> prompt;  // words, or "-" for stdin
};

// After an interrupted stream on a session: tell what the session now holds.
void ReportSessionAfterInterrupt(fwserve::Client& client, const std::string& session_id) {
  auto info = WaitUntilIdle(client, session_id);
  if (!info.ok()) {
    std::fprintf(stderr, "fwctl: session %s: %s\n", session_id.c_str(),
                 info.status().ToString().c_str());
  } else {
    std::fprintf(stderr, "fwctl: session %s holds %lld tokens%s\n", session_id.c_str(),
                 static_cast<long long>(info->tokens()), info->busy() ? " (still busy)" : "");
  }
}

int RunGenerate(const Command& command, const GenerateOptions& options,
                const GlobalOptions& global) {
  v1::GenerateRequest request;
  request.set_model(options.model);
  request.set_session_id(options.session);
  if (options.prompt.size() == 1 && options.prompt[0] == "-") {
    auto text = ReadFile("-");
    if (!text.ok()) return LocalError(std::string(text.status().message()));
    request.set_prompt(*text);
  } else {
    request.set_prompt(absl::StrJoin(options.prompt, " "));
  }
  if (request.prompt().empty() && request.session_id().empty()) {
    return UsageError(command.label(),
                      "a PROMPT is required (or --session ID to continue a session)");
  }
  FillGenerateRequest(options.sampling, &request);
  request.set_logprobs(options.logprobs);
  if (!options.json_schema_file.empty() && options.json_object) {
    return UsageError(command.label(), "--json-schema and --json-object exclude each other");
  }
  if (!options.json_schema_file.empty()) {
    // Sent as read: the server checks it and names what it does not support.
    auto schema = ReadFile(options.json_schema_file);
    if (!schema.ok()) return LocalError(std::string(schema.status().message()));
    request.mutable_response_format()->set_json_schema(*schema);
  } else if (options.json_object) {
    request.mutable_response_format()->set_json_object(true);
  }
  const bool json = options.json;
  fwserve::Client& client = GetClient(global);
  StreamOutcome outcome = StreamGenerate(client, request, json);
  if (!json && isatty(STDOUT_FILENO) && !outcome.text.empty() && outcome.text.back() != '\n') {
    WriteOut("\n");
  }
  if (outcome.interrupted) {
    std::fprintf(stderr, "%sfwctl: interrupted after %lld generated tokens\n",
                 !json && !outcome.text.empty() && outcome.text.back() != '\n' ? "\n" : "",
                 static_cast<long long>(outcome.generated));
    if (!request.session_id().empty()) ReportSessionAfterInterrupt(client, request.session_id());
    return kExitInterrupted;
  }
  if (!outcome.status.ok()) return RpcError(outcome.status);
  if (request.logprobs() && !json) PrintLogprobs(outcome);
  if (!options.quiet) {
    // Keep the summary off the text's last line when both end up on one terminal.
    if (!json && !isatty(STDOUT_FILENO) && isatty(STDERR_FILENO) && !outcome.text.empty() &&
        outcome.text.back() != '\n') {
      std::fputs("\n", stderr);
    }
    PrintSummary(outcome, global.verbose);
  }
  return kExitOk;
}

}  // namespace

void AddGenerateCommand(CLI::App& program, const GlobalOptions& global) {
  Command& command = AddCommand(
      program, "generate", "stream a generation to stdout", "[PROMPT... | -]",
      "Streams generated text to stdout as it arrives; the finish reason and token usage "
      "go to stderr. The PROMPT words are joined with spaces; '-' reads the prompt from "
      "stdin. With --session the prompt and every generated token are appended to the "
      "session (then PROMPT may be empty). --max-tokens defaults to 128 and must not "
      "exceed the server's --max-tokens.\n\nCtrl-C (SIGINT) cancels the stream: the "
      "session keeps exactly the tokens streamed so far, fwctl waits until the server "
      "has let go of the session, prints how many tokens it holds and exits 130.");
  auto options = std::make_shared<GenerateOptions>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddText(command, "session", "ID",
          "continue this session (the prompt and output are appended to it)", &options->session);
  AddSamplingOptions(command, 128, &options->sampling);
  AddSwitch(command, "logprobs", "after the text, print each token's log-probability on stderr",
            &options->logprobs);
  AddText(command, "json-schema", "FILE",
          "structured output: the reply is JSON that matches the JSON schema in FILE "
          "(docs/structured-output.md lists the keywords served)",
          &options->json_schema_file);
  AddSwitch(command, "json-object", "structured output: the reply is a JSON object",
            &options->json_object);
  AddSwitch(command, "json", "print every streamed message as one JSON line instead of the text",
            &options->json);
  AddSwitch(command, "quiet", "no finish/usage line on stderr", &options->quiet, 'q');
  AddWords(command, "PROMPT", &options->prompt);
  command.run = [&command, options, &global] { return RunGenerate(command, *options, global); };
}

}  // namespace fwctl
