// fwctl score [--model M] [--session ID] [--json] TEXT... | -
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/io.h"

namespace fwctl {
namespace {

namespace v1 = fwserve::v1;

struct ScoreOptions {
  std::string model;
  std::string session;
  bool json = false;
  std::vector<std::string> text;  // words, or "-" for stdin
};

int RunScore(const Command& command, const ScoreOptions& options, const GlobalOptions& global) {
  v1::ScoreRequest request;
  request.set_model(options.model);
  request.set_session_id(options.session);
  if (options.text.size() == 1 && options.text[0] == "-") {
    auto text = ReadFile("-");
    if (!text.ok()) return LocalError(std::string(text.status().message()));
    request.set_text(*text);
  } else {
    request.set_text(absl::StrJoin(options.text, " "));
  }
  if (request.text().empty()) return UsageError(command.label(), "a TEXT to score is required");
  auto response = GetClient(global).Score(request);
  if (!response.ok()) return RpcError(response.status());
  if (options.json) {
    WriteOut(ToJson(*response) + "\n");
    return kExitOk;
  }
  // From a fresh state the first token has no prediction: log-probs are right-aligned.
  const int offset = response->token_ids_size() - response->logprobs_size();
  std::printf("%6s %6s %10s  %s\n", "#", "id", "logprob", "token");
  for (int i = 0; i < response->token_ids_size(); ++i) {
    const int64_t id = response->token_ids(i);
    std::string logprob =
        i < offset ? "-" : absl::StrFormat("%.4f", response->logprobs(i - offset));
    std::printf("%6d %6lld %10s  %s\n", i, static_cast<long long>(id), logprob.c_str(),
                ShowByteToken(id).c_str());
  }
  std::printf("total_logprob %.4f over %d scored tokens\nperplexity %.4f\n",
              response->total_logprob(), response->logprobs_size(), response->perplexity());
  return kExitOk;
}

}  // namespace

void AddScoreCommand(CLI::App& program, const GlobalOptions& global) {
  Command& command = AddCommand(
      program, "score", "per-token log-probabilities of a text", "TEXT... | -",
      "Prints each token (id, byte, natural-log probability given everything before it), "
      "then the total log-probability and the perplexity. From a fresh state the first "
      "token has no prediction ('-'); with --session the text is scored as a continuation "
      "of that session, which is left unchanged.");
  auto options = std::make_shared<ScoreOptions>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddText(command, "session", "ID", "score as a continuation of this session", &options->session);
  AddSwitch(command, "json", kJsonHelp, &options->json);
  AddWords(command, "TEXT", &options->text);
  command.run = [&command, options, &global] { return RunScore(command, *options, global); };
}

}  // namespace fwctl
