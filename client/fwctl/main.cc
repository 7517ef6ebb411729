// fwctl: the command-line client of fwserve (fwserve.v1 over gRPC), built on
// fwserve::Client. `fwctl --help` lists the commands, `fwctl COMMAND --help` their
// options; docs/client.md is the reference.
//
// Exit codes: 0 success; 1 the server answered an error (its gRPC code name is printed
// on stderr) or a local file could not be read or written; 2 usage error; 3 `health`
// found the server NOT_SERVING; 130 interrupted by SIGINT (Ctrl-C, interrupts.h).
//
// A usage error is reported as "fwctl[ COMMAND]: MESSAGE" and "Try 'fwctl[ COMMAND]
// --help'." on stderr. Of several, the first that applies wins: a malformed command line
// (an unknown command or option, an option without its value, --switch=VALUE), a
// command word missing ("session" alone), then --help (which prints the help, exit 0),
// then no command at all (the help, exit 2), then a bad option value, then a bad
// combination of the global options, then a surplus argument, then what the command
// itself checks.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/interrupts.h"
#include "client/fwctl/io.h"
#include "client/fwctl/options.h"

namespace fwctl {
namespace {

// The whole command line: the global options, the commands, and the hidden `help
// COMMAND`. CLI11 keeps what it cannot place (unknown options, surplus words) instead of
// throwing; Leftovers() hands them to Run, which words the errors.
class Program : public CLI::App {
 public:
  Program() : CLI::App("command-line client of fwserve (fwserve.v1 over gRPC).", "fwctl") {
    // --help is a global option like the others, so that it also works after a command.
    set_help_flag();
    formatter(std::make_shared<HelpFormatter>());
    // Inherited by every command: a repeated option keeps its last value; options and
    // words a command does not know go up to the program (global options after the
    // command; the leftovers); one command at a time.
    option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    allow_extras();
    fallthrough();
    require_subcommand(0, 1);

    AddGlobalOptions(*this, &global_);
    AddGenerateCommand(*this, global_);
    AddChatCommand(*this, global_);
    AddScoreCommand(*this, global_);
    AddSessionCommands(*this, global_);
    AddModelsCommand(*this, global_);
    AddHealthCommand(*this, global_);
    // `fwctl help WORDS...` is `fwctl WORDS... --help`: it keeps every word after it.
    help_command_ = add_subcommand("help")->group("")->prefix_command()->fallthrough(false);
    WatchCommandWords(*this);
  }

  // Parses `args` (without the program name). Throws CLI::ParseError.
  void Parse(const std::vector<std::string>& args) {
    // CLI11 2.1.2 reads "--name=" (an empty value) as "--name" with the next argument as
    // its value; "--name" "" is what fwctl means.
    std::vector<std::string> split;
    bool options_ended = false;
    for (const std::string& arg : args) {
      if (arg == "--") options_ended = true;
      if (!options_ended && absl::StartsWith(arg, "--") && arg.find('=') == arg.size() - 1 &&
          TakesValue(*this, arg.substr(0, arg.size() - 1))) {
        split.push_back(arg.substr(0, arg.size() - 1));
        split.push_back("");
      } else {
        split.push_back(arg);
      }
    }
    parse(std::vector<std::string>(split.rbegin(), split.rend()));  // CLI11 takes them reversed
  }

  GlobalOptions& global() { return global_; }

  bool help_requested() const { return count("--help") > 0; }

  // What followed `help`, when that was the command.
  std::optional<std::vector<std::string>> HelpWords() const {
    if (!help_command_->parsed()) return std::nullopt;
    return help_command_->remaining();
  }

  // The command or group the command line named (the deepest), or null.
  CLI::App* Selected() {
    CLI::App* selected = nullptr;
    for (CLI::App* app = this; app != nullptr;) {
      auto named = app->get_subcommands([](CLI::App* sub) { return sub->parsed(); });
      app = named.empty() ? nullptr : named.front();
      if (app != nullptr) selected = app;
    }
    return selected;
  }

  // How messages begin: "fwctl COMMAND" once a command is known, else "fwctl".
  std::string Label() {
    const auto* command = dynamic_cast<const Command*>(Selected());
    return command != nullptr ? command->label() : "fwctl";
  }

  // What the command line had that no command or option took, in order: unknown options
  // and surplus words, each with the command or group named before it (null for none).
  struct Leftover {
    bool option;
    std::string text;
    const CLI::App* after;
  };
  std::vector<Leftover> Leftovers() {
    std::vector<const CLI::App*> named;  // the command words given, outermost first
    for (const CLI::App* app = Selected(); app != nullptr && app != this; app = app->get_parent()) {
      named.insert(named.begin(), app);
    }
    std::vector<Leftover> leftovers;
    for (size_t i = 0; i < missing_.size(); ++i) {
      const auto& [kind, text] = missing_[i];
      if (kind == CLI::detail::Classifier::POSITIONAL_MARK) continue;  // a `--`
      const CLI::App* after = nullptr;
      for (const CLI::App* app : named) {
        auto before = leftovers_before_.find(app);
        if (before != leftovers_before_.end() && before->second <= i) after = app;
      }
      leftovers.push_back({kind != CLI::detail::Classifier::NONE, text, after});
    }
    return leftovers;
  }

 private:
  // Whether `name` ("--prefix") is an option with a value of `app` or of a command in it.
  static bool TakesValue(const CLI::App& app, const std::string& name) {
    const CLI::Option* option = app.get_option_no_throw(name);
    if (option != nullptr) return option->get_items_expected_max() > 0;
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (TakesValue(*sub, name)) return true;
    }
    return false;
  }

  // Notes, for each command word, how many leftovers came before it.
  void WatchCommandWords(CLI::App& app) {
    for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      sub->preparse_callback([this, sub](size_t) { leftovers_before_[sub] = missing_.size(); });
      WatchCommandWords(*sub);
    }
  }

  GlobalOptions global_;
  CLI::App* help_command_ = nullptr;
  std::map<const CLI::App*, size_t> leftovers_before_;
};

// CLI11's message, in fwctl's words where CLI11 2.1.2's differ.
std::string Describe(const CLI::ParseError& error) {
  const std::string message = error.what();
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&error) != nullptr) {
    std::string option = message.substr(0, message.find_first_of(": "));
    if (!absl::StartsWith(option, "-")) option = "--" + option;  // as typed, less the dashes
    if (absl::EndsWith(message, " missing")) return option + " needs a value";
    if (absl::EndsWith(message, "disallowed flag override")) return option + " takes no value";
  }
  return message;
}

std::string CommandList(const CLI::App& group) {
  std::vector<std::string> names;
  for (const CLI::App* command : group.get_subcommands({})) {
    names.push_back(group.get_name() + " " + command->get_name());
  }
  return absl::StrJoin(names, ", ");
}

// Parses `args` (without the program name) and runs the command; returns the exit code.
int Run(const std::vector<std::string>& args) {
  Program program;
  // A bad option value waits until the command line has been read to the end: errors
  // about its form come first, and --help, which does not need the values.
  std::string value_error;
  try {
    program.Parse(args);
  } catch (const CLI::ValidationError& error) {
    value_error = error.what();
  } catch (const CLI::ConversionError& error) {
    value_error = error.what();
  } catch (const CLI::ParseError& error) {
    return UsageError(program.Label(), Describe(error));
  }

  if (auto words = program.HelpWords(); words.has_value()) {
    words->push_back("--help");
    return Run(*words);
  }
  std::optional<std::string> surplus;
  for (const Program::Leftover& leftover : program.Leftovers()) {
    const auto* command = dynamic_cast<const Command*>(leftover.after);
    const std::string group =
        leftover.after != nullptr && command == nullptr ? leftover.after->get_name() : "";
    if (leftover.option) {
      return UsageError(
          command != nullptr ? command->label() : "fwctl",
          "unknown option '" + leftover.text + "'" +
              (group.empty() ? "" : " (after an incomplete command '" + group + "')"));
    }
    if (command == nullptr) {
      return UsageError(
          "fwctl", "unknown command '" + (group.empty() ? "" : group + " ") + leftover.text + "'");
    }
    if (!surplus.has_value()) surplus = leftover.text;
  }
  CLI::App* selected = program.Selected();
  Command* command = dynamic_cast<Command*>(selected);
  if (selected != nullptr && command == nullptr && !program.help_requested()) {
    return UsageError("fwctl", "incomplete command '" + selected->get_name() +
                                   "' (one of: " + CommandList(*selected) + ")");
  }
  if (program.help_requested() || command == nullptr) {
    // The command's help; the program's for a group or no command.
    std::fputs(program.help().c_str(), stdout);
    return program.help_requested() ? kExitOk : kExitUsage;
  }
  if (!value_error.empty()) return UsageError(command->label(), value_error);
  if (absl::Status status = ResolveClientOptions(&program.global()); !status.ok()) {
    // A file that cannot be read (--api-key-file) is a local error (exit 1), as for
    // --tls-ca; anything else about the options is a usage error (exit 2).
    if (status.code() == absl::StatusCode::kNotFound) {
      return LocalError(absl::StrCat("--api-key-file: ", status.message()));
    }
    return UsageError(command->label(), std::string(status.message()));
  }
  if (surplus.has_value()) {
    return UsageError(command->label(), "unexpected argument '" + *surplus + "'");
  }
  const int code = command->run();
  std::fflush(stdout);
  CloseClient();
  return code;
}

}  // namespace
}  // namespace fwctl

int main(int argc, char** argv) {
  fwctl::Interrupts::Start();
  return fwctl::Run(std::vector<std::string>(argv + 1, argv + argc));
}
