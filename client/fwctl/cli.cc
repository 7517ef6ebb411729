#include "client/fwctl/cli.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"

namespace fwctl {

Command::Command(CLI::App& parent, const std::string& name, const std::string& summary,
                 std::string synopsis, std::string details)
    : CLI::App(summary, name, &parent),
      synopsis_(std::move(synopsis)),
      details_(std::move(details)) {}

std::string Command::path() const {
  std::vector<std::string> words;
  for (const CLI::App* app = this; app->get_parent() != nullptr; app = app->get_parent()) {
    words.insert(words.begin(), app->get_name());
  }
  return absl::StrJoin(words, " ");
}

Command& AddCommand(CLI::App& parent, const std::string& name, const std::string& summary,
                    const std::string& synopsis, const std::string& details) {
  // The constructor copies the parent's settings (fallthrough of unknown options and
  // surplus words to the program, extras kept for main's messages, the formatter, the
  // option defaults); add_subcommand makes it a child.
  auto command = std::make_shared<Command>(parent, name, summary, synopsis, details);
  return static_cast<Command&>(*parent.add_subcommand(std::move(command)));
}

CLI::App& AddGroup(CLI::App& parent, const std::string& name, const std::string& summary) {
  return *parent.add_subcommand(name, summary)->require_subcommand(0, 1);
}

// ----------------------------------------------------------------------------------
// Options.

namespace {

// "-v,--verbose", and "--max-tokens,--max_tokens" for a name with dashes.
std::string OptionNames(const std::string& name, char short_name = '\0') {
  std::string names =
      short_name != '\0' ? std::string("-") + short_name + ",--" + name : "--" + name;
  std::string underscored = name;
  for (char& c : underscored) {
    if (c == '-') c = '_';
  }
  if (underscored != name) names += ",--" + underscored;
  return names;
}

// An option with one value. `assign` parses the text into its destination, or returns
// false: the parse fails with "--NAME: expected EXPECTED, got 'TEXT'". Given twice, the
// last value is the one parsed (the program's option default, TakeLast).
CLI::Option* AddValue(CLI::App& app, const std::string& name, const std::string& value_name,
                      const std::string& help, const std::string& expected,
                      std::function<bool(const std::string&)> assign) {
  const std::string flag = "--" + name;
  CLI::callback_t callback = [flag, expected, assign](const CLI::results_t& results) {
    const std::string& text = results.back();
    if (!assign(text)) {
      throw CLI::ValidationError(flag, "expected " + expected + ", got '" + text + "'");
    }
    return true;
  };
  return app.add_option(OptionNames(name), std::move(callback), help)->type_name(value_name);
}

// Sets *out only for an integer in [min, max].
bool ParseInteger(const std::string& text, int64_t min, int64_t max, int64_t* out) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < min || value > max) return false;
  *out = value;
  return true;
}

std::string IntegerRange(int64_t min, int64_t max) {
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

}  // namespace

CLI::Option* AddSwitch(CLI::App& app, const std::string& name, const std::string& help, bool* out,
                       char short_name) {
  return app.add_flag(OptionNames(name, short_name), *out, help)->disable_flag_override();
}

CLI::Option* AddText(CLI::App& app, const std::string& name, const std::string& value_name,
                     const std::string& help, std::string* out) {
  return AddValue(app, name, value_name, help, "", [out](const std::string& text) {
    *out = text;
    return true;
  });
}

CLI::Option* AddText(CLI::App& app, const std::string& name, const std::string& value_name,
                     const std::string& help, std::optional<std::string>* out) {
  return AddValue(app, name, value_name, help, "", [out](const std::string& text) {
    *out = text;
    return true;
  });
}

CLI::Option* AddRepeatableText(CLI::App& app, const std::string& name,
                               const std::string& value_name, const std::string& help,
                               std::vector<std::string>* out) {
  CLI::callback_t callback = [out](const CLI::results_t& results) {
    out->insert(out->end(), results.begin(), results.end());
    return true;
  };
  // One value per occurrence; every occurrence is kept.
  return app.add_option(OptionNames(name), std::move(callback), help)
      ->type_name(value_name)
      ->expected(1, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

CLI::Option* AddChoice(CLI::App& app, const std::string& name, const std::string& value_name,
                       const std::string& help, const std::vector<std::string>& choices,
                       std::string* out) {
  return AddValue(app, name, value_name, help, absl::StrJoin(choices, " or "),
                  [choices, out](const std::string& text) {
                    for (const std::string& choice : choices) {
                      if (text == choice) {
                        *out = text;
                        return true;
                      }
                    }
                    return false;
                  });
}

CLI::Option* AddInteger(CLI::App& app, const std::string& name, const std::string& value_name,
                        const std::string& help, int64_t min, int64_t max, int64_t* out) {
  return AddValue(
      app, name, value_name, help, IntegerRange(min, max),
      [min, max, out](const std::string& text) { return ParseInteger(text, min, max, out); });
}

CLI::Option* AddInteger(CLI::App& app, const std::string& name, const std::string& value_name,
                        const std::string& help, int64_t min, int64_t max,
                        std::optional<int64_t>* out) {
  return AddValue(app, name, value_name, help, IntegerRange(min, max),
                  [min, max, out](const std::string& text) {
                    int64_t value = 0;
                    if (!ParseInteger(text, min, max, &value)) return false;
                    *out = value;
                    return true;
                  });
}

CLI::Option* AddUnsigned(CLI::App& app, const std::string& name, const std::string& value_name,
                         const std::string& help, std::optional<uint64_t>* out) {
  return AddValue(app, name, value_name, help, "a non-negative integer",
                  [out](const std::string& text) {
                    uint64_t value = 0;
                    if (!absl::SimpleAtoi(text, &value)) return false;
                    *out = value;
                    return true;
                  });
}

CLI::Option* AddNumber(CLI::App& app, const std::string& name, const std::string& value_name,
                       const std::string& help, std::optional<float>* out) {
  return AddValue(app, name, value_name, help, "a number", [out](const std::string& text) {
    float value = 0;
    if (!absl::SimpleAtof(text, &value) || !std::isfinite(value)) return false;
    *out = value;
    return true;
  });
}

CLI::Option* AddDuration(CLI::App& app, const std::string& name, const std::string& value_name,
                         const std::string& help, absl::Duration* out) {
  return AddValue(app, name, value_name, help, "a duration such as 500ms, 60s or 2m",
                  [out](const std::string& text) {
                    if (text == "0" || text == "inf" || text == "none") {
                      *out = absl::InfiniteDuration();
                      return true;
                    }
                    absl::Duration value;
                    if (!absl::ParseDuration(text, &value) || value <= absl::ZeroDuration()) {
                      return false;
                    }
                    *out = value;
                    return true;
                  });
}

CLI::Option* AddWords(CLI::App& command, const std::string& name, std::vector<std::string>* out) {
  CLI::callback_t callback = [out](const CLI::results_t& results) {
    *out = results;
    return true;
  };
  // A positional takes words while it has fewer than its minimum, or while it "allows
  // extra args"; the latter would also split a word such as "[a,b]" into a and b, so
  // the minimum is made unreachable instead.
  return command.add_option(name, std::move(callback))
      ->expected(CLI::detail::expected_max_vector_size, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

CLI::Option* AddWord(CLI::App& command, const std::string& name, std::optional<std::string>* out) {
  CLI::callback_t callback = [out](const CLI::results_t& results) {
    *out = results.front();
    return true;
  };
  return command.add_option(name, std::move(callback));
}

// ----------------------------------------------------------------------------------
// Messages.

int UsageError(const std::string& label, const std::string& message) {
  std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", label.c_str(), message.c_str(), label.c_str());
  return kExitUsage;
}

}  // namespace fwctl
