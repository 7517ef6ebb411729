#include "common/cli_util.h"

#include <cstring>

#include "absl/flags/parse.h"

namespace fwserve {

std::vector<std::string> ParseFlagsAllowingDashes(int argc, char** argv) {
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
