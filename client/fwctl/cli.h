// fwctl's command-line framework on CLI11: the exit codes, commands and command groups,
// the option kinds every command uses, and the help layout.
//
// The grammar (docs/client.md "fwctl reference"): `fwctl [GLOBAL OPTIONS] COMMAND
// [OPTIONS] [ARGS]`. Global options may also come after the command; options are spelled
// --name VALUE or --name=VALUE, and --name_with_underscores too; a repeated option keeps
// its last value unless it is repeatable; `--` ends the options. A bad value is a usage
// error that names the option and the value: "--NAME: expected WHAT, got 'VALUE'".
#ifndef FWSERVE_CLIENT_FWCTL_CLI_H_
#define FWSERVE_CLIENT_FWCTL_CLI_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace fwctl {

inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the server answered an error, or a local file failed
inline constexpr int kExitUsage = 2;
inline constexpr int kExitNotServing = 3;  // health: NOT_SERVING
inline constexpr int kExitInterrupted = 130;

// One command ("generate", or "create" in the group "session"): a CLI11 subcommand that
// also carries its help text and what running it does.
class Command : public CLI::App {
 public:
  // Use AddCommand.
  Command(CLI::App& parent, const std::string& name, const std::string& summary,
          std::string synopsis, std::string details);

  // The positional arguments, e.g. "[PROMPT... | -]"; empty when there are none.
  const std::string& synopsis() const { return synopsis_; }
  // Paragraphs for `fwctl COMMAND --help`.
  const std::string& details() const { return details_; }
  // The words that name the command, e.g. "session create".
  std::string path() const;
  // "fwctl session create": how messages about the command begin.
  std::string label() const { return "fwctl " + path(); }

  // Runs the command once the command line has parsed and the global options are valid;
  // returns the exit code. Set by the function that adds the command.
  std::function<int()> run;

 private:
  std::string synopsis_;
  std::string details_;
};

// Adds a command under `parent` (the program, or a group). `summary` is its line in
// `fwctl --help`.
Command& AddCommand(CLI::App& parent, const std::string& name, const std::string& summary,
                    const std::string& synopsis, const std::string& details);

// Adds a group of commands ("session"): a word that takes a second word, the command.
CLI::App& AddGroup(CLI::App& parent, const std::string& name, const std::string& summary);

// ----------------------------------------------------------------------------------
// Options. `name` is without dashes ("max-tokens"); `value_name` names the value in the
// help ("N"); `help` is the help line, with the default where there is one.

// A switch (--NAME); `short_name` adds -X. --NAME=VALUE is a usage error, except
// --NAME=true.
CLI::Option* AddSwitch(CLI::App& app, const std::string& name, const std::string& help, bool* out,
                       char short_name = '\0');

// A text value.
CLI::Option* AddText(CLI::App& app, const std::string& name, const std::string& value_name,
                     const std::string& help, std::string* out);
CLI::Option* AddText(CLI::App& app, const std::string& name, const std::string& value_name,
                     const std::string& help, std::optional<std::string>* out);

// A text value that may be given several times; each is kept, in order.
CLI::Option* AddRepeatableText(CLI::App& app, const std::string& name,
                               const std::string& value_name, const std::string& help,
                               std::vector<std::string>* out);

// One of `choices` ("pick_first or round_robin").
CLI::Option* AddChoice(CLI::App& app, const std::string& name, const std::string& value_name,
                       const std::string& help, const std::vector<std::string>& choices,
                       std::string* out);

// An integer in [min, max].
CLI::Option* AddInteger(CLI::App& app, const std::string& name, const std::string& value_name,
                        const std::string& help, int64_t min, int64_t max, int64_t* out);
CLI::Option* AddInteger(CLI::App& app, const std::string& name, const std::string& value_name,
                        const std::string& help, int64_t min, int64_t max,
                        std::optional<int64_t>* out);

// A non-negative 64-bit integer (a seed).
CLI::Option* AddUnsigned(CLI::App& app, const std::string& name, const std::string& value_name,
                         const std::string& help, std::optional<uint64_t>* out);

// A finite number.
CLI::Option* AddNumber(CLI::App& app, const std::string& name, const std::string& value_name,
                       const std::string& help, std::optional<float>* out);

// A positive duration (500ms, 60s, 2m); 0, inf and none mean no limit.
CLI::Option* AddDuration(CLI::App& app, const std::string& name, const std::string& value_name,
                         const std::string& help, absl::Duration* out);

// Positional arguments, verbatim. `name` is the argument's name in the synopsis.
// Every word on the command line that is not an option (or any word after `--`), in
// order.
CLI::Option* AddWords(CLI::App& command, const std::string& name, std::vector<std::string>* out);
// The first such word; a second one is left over (main reports it as unexpected).
CLI::Option* AddWord(CLI::App& command, const std::string& name, std::optional<std::string>* out);

// ----------------------------------------------------------------------------------
// Messages.

// "LABEL: MESSAGE" and "Try 'LABEL --help'." on stderr; returns kExitUsage.
int UsageError(const std::string& label, const std::string& message);

// ----------------------------------------------------------------------------------
// Help.

// Lays out `fwctl --help` (for the program and for a group) and `fwctl COMMAND --help`
// (for a Command); the global options are the program's.
class HelpFormatter : public CLI::FormatterBase {
 public:
  std::string make_help(const CLI::App* app, std::string name,
                        CLI::AppFormatMode mode) const override;
};

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_CLI_H_
