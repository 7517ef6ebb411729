// The process log never waits for stderr (server/base/log.h): with nobody reading
// stderr, Log() keeps returning, drops what does not fit and says how much it dropped
// once stderr is read again; FlushLog() then writes every kept line, in order.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/base/log.h"

namespace fwserve {
namespace {

// Points the process's stderr at a pipe for the test's lifetime; the pipe is read only
// when the test says so.
class StderrPipe {
 public:
  StderrPipe() {
    EXPECT_EQ(pipe(fds_), 0);
    saved_stderr_ = dup(STDERR_FILENO);
    EXPECT_GE(dup2(fds_[1], STDERR_FILENO), 0);
  }
  ~StderrPipe() { (void)Finish(); }

  // Reads the pipe from now on, on a thread, until the write end is closed.
  void StartReading() {
    reader_ = std::thread([this] {
      char buffer[65536];
      while (true) {
        const ssize_t n = read(fds_[0], buffer, sizeof(buffer));
        if (n <= 0) break;
        text_.append(buffer, static_cast<size_t>(n));
      }
    });
  }

  // Gives stderr back, and returns everything that was written to the pipe.
  std::string Finish() {
    if (fds_[1] < 0) return text_;
    dup2(saved_stderr_, STDERR_FILENO);
    close(saved_stderr_);
    close(fds_[1]);
    fds_[1] = -1;
    if (!reader_.joinable()) StartReading();
    reader_.join();
    close(fds_[0]);
    return text_;
  }

 private:
  int fds_[2] = {-1, -1};
  int saved_stderr_ = -1;
  std::thread reader_;
  std::string text_;  // written by reader_ until joined
};

TEST(LogTest, AStalledStderrNeitherBlocksNorLosesTheCountOfWhatItDropped) {
  StderrPipe pipe;
  // 2x the pending limit in 1 KiB lines: a pipe (64 KiB) that nobody reads takes a
  // few dozen; a synchronous Log() would block there, and this loop would never end.
  const std::string filler(1000, 'x');
  const int lines = static_cast<int>(2 * kMaxPendingLogBytes / 1000);
  const int64_t dropped_before = DroppedLogLines();
  std::atomic<bool> returned{false};
  std::thread logger([&] {
    for (int i = 0; i < lines; ++i) Log(LogLevel::kInfo, absl::StrCat("line ", i, " ", filler));
    returned.store(true);
  });
  // A hang guard far beyond the milliseconds the loop takes: a Log() that waits for
  // stderr fails here, and the reader below then lets it finish.
  for (int i = 0; i < 6000 && !returned.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(returned.load()) << "Log() blocked on an unread stderr";
  pipe.StartReading();
  logger.join();
  const int64_t dropped = DroppedLogLines() - dropped_before;
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, lines);

  Log(LogLevel::kInfo, "after the stall");
  FlushLog();
  const std::string text = pipe.Finish();
  // Every kept line once, in order; then the count of the dropped ones; then the rest.
  int kept = 0;
  int last = -1;
  bool ordered = true;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t at = line.find(" INFO line ");
    if (at == absl::string_view::npos) continue;
    const int index = std::stoi(std::string(line.substr(at + 11)));
    ordered = ordered && index > last;
    last = index;
    ++kept;
  }
  EXPECT_TRUE(ordered);
  EXPECT_EQ(kept + dropped, lines);
  EXPECT_TRUE(absl::StrContains(
      text,
      absl::StrCat(" WARNING ", dropped, " log lines dropped: stderr was not read fast enough")))
      << text.substr(text.size() > 2000 ? text.size() - 2000 : 0);
  EXPECT_TRUE(absl::StrContains(text, " INFO after the stall\n"));
}

}  // namespace
}  // namespace fwserve
