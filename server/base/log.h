// Process log: one line per event on stderr, "<RFC3339 time> <LEVEL> <message>".
// Thread-safe (a line is written with one call).
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace fwserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below `level` are dropped. Default: kInfo.
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warning", "error"; false if unknown.
bool ParseLogLevel(absl::string_view text, LogLevel* level);
bool LogEnabled(LogLevel level);
// Writes one line to stderr: the message through SafeLogText.
void Log(LogLevel level, absl::string_view message);

// Longest message of one log line, bytes (the rest is counted, not written).
inline constexpr size_t kMaxLogMessageBytes = 4096;
// What a log line shows of `message`: control bytes and backslashes escaped (\xNN, \\),
// so client-supplied text cannot forge or split lines; at most kMaxLogMessageBytes; and
// every run of exactly 32 lowercase hex digits (session ids and lease tokens, which are
// capabilities) cut to its first 8 digits and "...".
std::string SafeLogText(absl::string_view message);

}  // namespace fwserve
