// Shared command-line plumbing of the binaries (fwserve, fwmodel, fwtrain, fwbench).
#pragma once

#include <string>
#include <vector>

namespace fwserve {

// Parses absl flags after accepting GNU-style spellings: "--max-tokens" is read as
// "--max_tokens". Returns the positional arguments (argv[0] first). With SetGroupedHelp
// called before, --help (-h, -help, --helpshort) prints that help and exits 0. absl's
// other help flags (--helpfull) name the files of flags relative to the source tree.
std::vector<std::string> ParseFlagsAllowingDashes(int argc, char** argv);

// A titled group of the flags in `--help` (names as defined, "max_tokens").
struct FlagGroup {
  std::string title;
  std::vector<std::string> flags;
};

// Makes --help print `intro`, then the flags defined in the source file whose path
// ends with `main_file` ("server/fwserve.cc") in `groups`, in their order, each with
// its default and help, spelled with dashes; that file's flags in no group follow under
// "Other". Call before ParseFlagsAllowingDashes; not thread-safe.
void SetGroupedHelp(std::string intro, std::vector<FlagGroup> groups, std::string main_file);

// The text SetGroupedHelp's --help prints.
std::string GroupedHelp();

// The command line as one shell-quoted string (for run records).
std::string QuotedCommandLine(int argc, char** argv);

}  // namespace fwserve
