// The help texts: `fwctl --help` lists the commands and the global options,
// `fwctl COMMAND --help` a command's synopsis, details and options; both end with the
// exit codes. Option lines are "  --name VALUE" in 28 columns, then the help wrapped at
// 100 columns.
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/fwctl/cli.h"

namespace fwctl {
namespace {

constexpr size_t kOptionColumn = 28;
constexpr size_t kOptionWidth = 100;
constexpr size_t kCommandColumn = 18;
constexpr size_t kDetailsWidth = 88;

const char kExitCodes[] =
    "Exit codes:\n"
    "  0    success\n"
    "  1    the server answered an error (its gRPC code, e.g. NOT_FOUND, UNAVAILABLE,\n"
    "       is printed on stderr), or a local file could not be read or written\n"
    "  2    usage error\n"
    "  3    health: the server is NOT_SERVING\n"
    "  130  interrupted (Ctrl-C)\n";

const CLI::App& Program(const CLI::App& app) {
  const CLI::App* program = &app;
  while (program->get_parent() != nullptr) program = program->get_parent();
  return *program;
}

// The named options of `app`, in the order they were added.
std::string FormatOptions(const CLI::App& app) {
  std::string text;
  for (const CLI::Option* option :
       app.get_options([](const CLI::Option* o) { return !o->get_positional(); })) {
    std::string left = "  --" + option->get_lnames().front();
    if (option->get_items_expected_max() > 0) absl::StrAppend(&left, " ", option->get_type_name());
    if (left.size() < kOptionColumn) {
      left.resize(kOptionColumn, ' ');
    } else {
      left += "\n" + std::string(kOptionColumn, ' ');
    }
    const bool repeatable = option->get_items_expected_max() > 1;
    std::istringstream words(option->get_description() + (repeatable ? " (repeatable)" : ""));
    std::string word;
    size_t column = kOptionColumn;
    bool first = true;
    while (words >> word) {
      if (!first && column + 1 + word.size() > kOptionWidth) {
        left += "\n" + std::string(kOptionColumn, ' ');
        column = kOptionColumn;
      } else if (!first) {
        left += " ";
        ++column;
      }
      left += word;
      column += word.size();
      first = false;
    }
    absl::StrAppend(&text, left, "\n");
  }
  return text;
}

// Wraps `text` at kDetailsWidth columns, keeping its line breaks.
std::string Wrap(const std::string& text) {
  std::string out;
  std::istringstream paragraphs(text);
  std::string paragraph;
  while (std::getline(paragraphs, paragraph)) {
    std::istringstream words(paragraph);
    std::string word;
    size_t column = 0;
    while (words >> word) {
      if (column > 0 && column + 1 + word.size() > kDetailsWidth) {
        out += "\n";
        column = 0;
      } else if (column > 0) {
        out += " ";
        ++column;
      }
      out += word;
      column += word.size();
    }
    out += "\n";
  }
  return out;
}

// Every command, groups expanded, in the order they were added.
std::vector<const Command*> Commands(const CLI::App& program) {
  std::vector<const Command*> commands;
  for (const CLI::App* app : program.get_subcommands({})) {
    if (const auto* command = dynamic_cast<const Command*>(app)) {
      commands.push_back(command);
    } else if (!app->get_group().empty()) {  // a group; the hidden `help` has none
      for (const CLI::App* member : app->get_subcommands({})) {
        if (const auto* command = dynamic_cast<const Command*>(member)) {
          commands.push_back(command);
        }
      }
    }
  }
  return commands;
}

std::string ProgramHelp(const CLI::App& program) {
  std::string text = absl::StrCat("fwctl: ", program.get_description(),
                                  "\n\nUsage: fwctl [GLOBAL OPTIONS] COMMAND [OPTIONS] [ARGS]"
                                  "\n\nCommands:\n");
  for (const Command* command : Commands(program)) {
    std::string left = "  " + command->path();
    left.resize(kCommandColumn, ' ');
    absl::StrAppend(&text, left, command->get_description(), "\n");
  }
  absl::StrAppend(&text, "\nGlobal options (before or after the command):\n",
                  FormatOptions(program), "\n", kExitCodes,
                  "\nRun 'fwctl COMMAND --help' for a command's options and arguments.\n"
                  "Options may be spelled --name VALUE or --name=VALUE; '--' ends the options.\n");
  return text;
}

std::string CommandHelp(const Command& command) {
  std::string text = absl::StrCat("Usage: fwctl ", command.path(), " [OPTIONS]",
                                  command.synopsis().empty() ? "" : " ", command.synopsis(), "\n\n",
                                  Wrap(command.details()), "\n");
  const std::string options = FormatOptions(command);
  if (!options.empty()) absl::StrAppend(&text, "Options:\n", options, "\n");
  absl::StrAppend(&text, "Global options:\n", FormatOptions(Program(command)), "\n", kExitCodes);
  return text;
}

}  // namespace

std::string HelpFormatter::make_help(const CLI::App* app, std::string /*name*/,
                                     CLI::AppFormatMode /*mode*/) const {
  if (const auto* command = dynamic_cast<const Command*>(app)) return CommandHelp(*command);
  return ProgramHelp(Program(*app));
}

}  // namespace fwctl
