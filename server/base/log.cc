#include "server/base/log.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fwserve {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "INFO";
}

bool IsHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

}  // namespace

std::string SafeLogText(absl::string_view message) {
  std::string out;
  out.reserve(std::min(message.size(), kMaxLogMessageBytes) + 16);
  size_t i = 0;
  while (i < message.size() && out.size() < kMaxLogMessageBytes) {
    // A run of exactly 32 lowercase hex digits is a session id or a lease token.
    if (IsHex(message[i]) && (i == 0 || !IsHex(message[i - 1]))) {
      size_t end = i;
      while (end < message.size() && IsHex(message[end])) ++end;
      if (end - i == 32) {
        absl::StrAppend(&out, message.substr(i, 8), "...");
        i = end;
        continue;
      }
    }
    const unsigned char c = static_cast<unsigned char>(message[i]);
    if (c < 0x20 || c == 0x7f || c == '\\') {
      absl::StrAppend(&out, c == '\\' ? "\\\\" : absl::StrFormat("\\x%02x", c));
    } else {
      out += static_cast<char>(c);
    }
    ++i;
  }
  if (i < message.size()) absl::StrAppend(&out, "...(", message.size() - i, " more bytes)");
  return out;
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(absl::string_view text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warning")
    *level = LogLevel::kWarning;
  else if (text == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void Log(LogLevel level, absl::string_view message) {
  if (!LogEnabled(level)) return;
  const std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   LevelName(level), " ", SafeLogText(message), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace fwserve
