#include "common/cli_util.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace fwserve {
namespace {

struct GroupedHelpSpec {
  std::string intro;
  std::vector<FlagGroup> groups;
  std::string main_file;
};

GroupedHelpSpec* grouped_help = nullptr;  // set by SetGroupedHelp, never freed

// The source tree this file was compiled in, as __FILE__ names it ("/src/fwserve/").
std::string SourceRoot() {
  const std::string file = __FILE__;
  const std::string self = "common/cli_util.cc";
  if (!absl::EndsWith(file, self)) return "";
  return file.substr(0, file.size() - self.size());
}

// absl's help names each flag's file as the compiler saw it, an absolute build path:
// name it relative to the source tree instead.
std::string RelativeToSource(absl::string_view filename) {
  static const std::string root = SourceRoot();
  if (!root.empty() && absl::StartsWith(filename, root)) filename.remove_prefix(root.size());
  return std::string(filename);
}

// `text` wrapped to `width` columns, each line indented by `indent` spaces.
std::string Wrap(absl::string_view text, size_t indent, size_t width) {
  std::string out;
  std::string line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line.append(word.data(), word.size());
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

std::string DescribeFlag(const absl::CommandLineFlag& flag) {
  std::string name = absl::StrReplaceAll(flag.Name(), {{"_", "-"}});
  std::string value = flag.DefaultValue();
  if (flag.IsOfType<std::string>() || flag.IsOfType<std::vector<std::string>>()) {
    value = "\"" + value + "\"";
  }
  return "  --" + name + "  (default " + value + ")\n" + Wrap(flag.Help(), 6, 88);
}

bool IsHelpFlag(const char* arg) {
  for (const char* help : {"--help", "-help", "-h", "--helpshort", "-helpshort"}) {
    if (std::strcmp(arg, help) == 0) return true;
  }
  return false;
}

}  // namespace

void SetGroupedHelp(std::string intro, std::vector<FlagGroup> groups, std::string main_file) {
  delete grouped_help;
  grouped_help = new GroupedHelpSpec{std::move(intro), std::move(groups), std::move(main_file)};
}

std::string GroupedHelp() {
  if (grouped_help == nullptr) return "";
  std::string out = grouped_help->intro + "\n";
  std::vector<const absl::CommandLineFlag*> own;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && absl::EndsWith(flag->Filename(), grouped_help->main_file)) {
      own.push_back(flag);
    }
  }
  std::set<std::string> shown;
  auto section = [&](const std::string& title, const std::vector<std::string>& names) {
    std::string body;
    for (const std::string& name : names) {
      auto found = std::find_if(own.begin(), own.end(),
                                [&](const absl::CommandLineFlag* f) { return f->Name() == name; });
      if (found == own.end() || !shown.insert(name).second) continue;
      body += DescribeFlag(**found);
    }
    if (!body.empty()) out += "\n" + title + ":\n" + body;
  };
  for (const FlagGroup& group : grouped_help->groups) section(group.title, group.flags);
  std::vector<std::string> rest;
  for (const absl::CommandLineFlag* flag : own) {
    if (shown.count(std::string(flag->Name())) == 0) rest.emplace_back(flag->Name());
  }
  std::sort(rest.begin(), rest.end());
  section("Other", rest);
  out +=
      "\nFlags take --name=value or --name value; --helpfull lists every flag, the "
      "libraries' too.\n";
  return out;
}

std::vector<std::string> ParseFlagsAllowingDashes(int argc, char** argv) {
  absl::FlagsUsageConfig config;
  config.normalize_filename = RelativeToSource;
  absl::SetFlagsUsageConfig(config);
  if (grouped_help != nullptr) {
    for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
      if (IsHelpFlag(argv[i])) {
        std::fputs(GroupedHelp().c_str(), stdout);
        std::exit(0);
      }
    }
  }
  std::vector<std::string> storage(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& arg = storage[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  std::vector<char*> pointers;
  for (std::string& s : storage) pointers.push_back(s.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(positional.begin(), positional.end());
}

std::string QuotedCommandLine(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) out += ' ';
    const std::string arg = argv[i];
    if (!arg.empty() && arg.find_first_of(" \t\"'\\$`!*?;&|<>()") == std::string::npos) {
      out += arg;
    } else {
      out += '\'';
      for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

}  // namespace fwserve
