// Shared command-line plumbing of the binaries (fwserve, fwmodel, fwtrain, fwbench).
#pragma once

#include <string>
#include <vector>

namespace fwserve {

// Parses absl flags after accepting GNU-style spellings: "--max-tokens" is read as
// "--max_tokens". Returns the positional arguments (argv[0] first).
std::vector<std::string> ParseFlagsAllowingDashes(int argc, char** argv);

// The command line as one shell-quoted string (for run records).
std::string QuotedCommandLine(int argc, char** argv);

}  // namespace fwserve
