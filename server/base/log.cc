#include "server/base/log.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
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

// One log line: "<RFC3339 time> <LEVEL> <text>\n"; `text` is written as given.
std::string FormatLine(LogLevel level, absl::string_view text) {
  return absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
                      " ", LevelName(level), " ", text, "\n");
}

// The writer thread and the lines waiting for it. One per process, created by the first
// line and never destroyed (a thread blocked in fwrite at exit must not find its queue
// gone); exit() first waits up to 5 s for the lines handed over to be written.
class LogWriter {
 public:
  static LogWriter& Get() {
    static LogWriter* const writer = [] {
      auto* created = new LogWriter();
      // At exit a stalled stderr may delay the process, not hang it.
      std::atexit([] { (void)Get().Flush(absl::Seconds(5)); });
      return created;
    }();
    return *writer;
  }

  void Append(std::string line) {
    absl::MutexLock lock(&mu_);
    if (pending_bytes_ + line.size() > kMaxPendingLogBytes) {
      ++dropped_;
      ++dropped_unreported_;
      return;
    }
    pending_bytes_ += line.size();
    lines_.push_back(std::move(line));
    ++appended_;
  }

  // False if `timeout` passed first.
  bool Flush(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const uint64_t target = appended_;
    auto written = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return written_ >= target && dropped_unreported_ == 0;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&written), timeout);
  }

  int64_t dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }

 private:
  LogWriter() {
    std::thread([this] { Run(); }).detach();
  }

  void Run() {
    // Signals are for the threads that wait for them (fwserve's sigwait), never this one.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::deque<std::string> batch;
    while (true) {
      int64_t dropped_report = 0;
      {
        absl::MutexLock lock(&mu_);
        auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !lines_.empty() || dropped_unreported_ > 0;
        };
        mu_.Await(absl::Condition(&has_work));
        batch.swap(lines_);
        dropped_report = dropped_unreported_;
      }
      std::string out;
      for (const std::string& line : batch) out += line;
      if (dropped_report > 0) {
        out += FormatLine(
            LogLevel::kWarning,
            absl::StrCat(dropped_report, " log lines dropped: stderr was not read fast enough"));
      }
      std::fwrite(out.data(), 1, out.size(), stderr);
      std::fflush(stderr);
      absl::MutexLock lock(&mu_);
      for (const std::string& line : batch) pending_bytes_ -= line.size();
      written_ += batch.size();
      dropped_unreported_ -= dropped_report;
      batch.clear();
    }
  }

  absl::Mutex mu_;
  std::deque<std::string> lines_ ABSL_GUARDED_BY(mu_);
  size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of lines_ and the batch being written
  uint64_t appended_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_unreported_ ABSL_GUARDED_BY(mu_) = 0;
};

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
  LogWriter::Get().Append(FormatLine(level, SafeLogText(message)));
}

void FlushLog() { (void)LogWriter::Get().Flush(absl::InfiniteDuration()); }

int64_t DroppedLogLines() { return LogWriter::Get().dropped(); }

}  // namespace fwserve
