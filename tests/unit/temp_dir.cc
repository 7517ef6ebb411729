#include "tests/unit/temp_dir.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <vector>

namespace fwtest {
namespace {

// The directories MakeTempDir made, removed when the test process exits (unless
// FWSERVE_KEEP_TEST_DIRS is set, to look at them after a failure).
class TempDirs {
 public:
  ~TempDirs() {
    if (std::getenv("FWSERVE_KEEP_TEST_DIRS") != nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::filesystem::path& dir : dirs_) {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  }
  void Add(const std::filesystem::path& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(dir);
  }

 private:
  std::mutex mu_;
  std::vector<std::filesystem::path> dirs_;
};

}  // namespace

std::string MakeTempDir(const std::string& tag) {
  static TempDirs made;
  static std::atomic<int> counter{0};
  const char* base = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir = std::filesystem::path(base != nullptr ? base : "/tmp") /
                              ("fwserve-" + tag + "-" + std::to_string(getpid()) + "-" +
                               std::to_string(counter.fetch_add(1)));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  made.Add(dir);
  return dir.string();
}

}  // namespace fwtest
