// Process log: one line per event on stderr, "<RFC3339 time> <LEVEL> <message>".
// Thread-safe. Log() never waits for stderr: it formats the line and hands it to one
// writer thread (started by the first line), so a slow or stalled reader of stderr
// (a full pipe, a blocked terminal) cannot stall the engine loop or a gRPC thread that
// logs a request. While more than kMaxPendingLogBytes wait, new lines are dropped and
// counted, and the count is written as a line of its own once the writer catches up.
// Lines are written in the order Log() was called; FlushLog() waits until every line
// handed over is written, and exit() waits for them up to 5 s.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace fwserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below `level` are dropped. Default: kInfo.
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warning", "error"; false if unknown.
bool ParseLogLevel(absl::string_view text, LogLevel* level);
bool LogEnabled(LogLevel level);
// Hands one line to the writer: the message through SafeLogText.
void Log(LogLevel level, absl::string_view message);
// Blocks until every line logged before the call is written to stderr (or dropped).
void FlushLog();
// Lines dropped so far because the writer was kMaxPendingLogBytes behind.
int64_t DroppedLogLines();

// Bytes of formatted lines that may wait for the writer; beyond it lines are dropped.
inline constexpr size_t kMaxPendingLogBytes = size_t{4} << 20;

// Longest message of one log line, bytes (the rest is counted, not written).
inline constexpr size_t kMaxLogMessageBytes = 4096;
// What a log line shows of `message`: control bytes and backslashes escaped (\xNN, \\),
// so client-supplied text cannot forge or split lines; at most kMaxLogMessageBytes; and
// every run of exactly 32 lowercase hex digits (session ids and lease tokens, which are
// capabilities) cut to its first 8 digits and "...".
std::string SafeLogText(absl::string_view message);

}  // namespace fwserve
