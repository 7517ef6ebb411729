#include "models/base/blas_check.h"

#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fwmodel {
namespace {

bool IsOptimised(const std::string& path) {
  return path.find("openblas") != std::string::npos || path.find("mkl") != std::string::npos ||
         path.find("blis") != std::string::npos || path.find("atlas") != std::string::npos;
}

constexpr char kWarning[] =
    "WARNING: LibTorch is using the reference BLAS (%s); matrix products run about 20x "
    "slower. Install libopenblas0-openmp (scripts/install-deps.sh does) and restart.";

std::string Format(const std::string& path) {
  std::string text = kWarning;
  text.replace(text.find("%s"), 2, path);
  return text;
}

}  // namespace

std::optional<std::string> SlowBlasWarning(const std::string& maps,
                                           const std::optional<std::string>& alternative_target) {
  std::istringstream lines(maps);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (path.find("libblas.so") == std::string::npos) continue;
    if (IsOptimised(path)) return std::nullopt;
    return Format(path);
  }
  // Not mapped (static or lazy load): ask the Debian alternatives link instead.
  if (alternative_target.has_value() && !IsOptimised(*alternative_target)) {
    return Format(*alternative_target);
  }
  return std::nullopt;
}

std::optional<std::string> SlowBlasWarning() {
  std::ifstream file("/proc/self/maps");
  std::ostringstream maps;
  maps << file.rdbuf();
  std::error_code ec;
  const auto target = std::filesystem::canonical("/usr/lib/x86_64-linux-gnu/libblas.so.3", ec);
  return SlowBlasWarning(maps.str(),
                         ec ? std::nullopt : std::optional<std::string>(target.string()));
}

bool SetOpenBlasThreads(int threads) {
  using SetThreads = void (*)(int);
  auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return false;
  set(threads);
  return true;
}

}  // namespace fwmodel
