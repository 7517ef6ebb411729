// Process log: one line per event on stderr, "<RFC3339 time> <LEVEL> <message>".
// Thread-safe (a line is written with one call).
#pragma once

#include "absl/strings/string_view.h"

namespace fwserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below `level` are dropped. Default: kInfo.
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warning", "error"; false if unknown.
bool ParseLogLevel(absl::string_view text, LogLevel* level);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, absl::string_view message);

}  // namespace fwserve
