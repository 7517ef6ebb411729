#include "server/base/cpu_count.h"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace fwserve {
namespace {

std::optional<std::string> ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

// The cgroup v2 path of this process ("0::/system.slice/x.service"), or "" at the root.
std::string OwnCgroupPath() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "0::")) return line.substr(3);
  }
  return "";
}

// The tightest CPU quota on this process's cgroup and its ancestors, if any.
std::optional<int32_t> CgroupQuotaCpus() {
  std::string path = OwnCgroupPath();
  std::optional<int32_t> tightest;
  while (true) {
    const std::string file = absl::StrCat("/sys/fs/cgroup", path, "/cpu.max");
    if (auto line = ReadFirstLine(file)) {
      if (auto cpus = CpusOfCgroupQuota(*line)) {
        tightest = tightest ? std::min(*tightest, *cpus) : *cpus;
      }
    }
    if (path.empty() || path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == std::string::npos || slash == 0 ? "" : path.substr(0, slash);
  }
  return tightest;
}

}  // namespace

std::optional<int32_t> CpusOfCgroupQuota(const std::string& cpu_max) {
  std::vector<std::string> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  if (fields.size() != 2 || fields[0] == "max") return std::nullopt;
  int64_t quota = 0, period = 0;
  if (!absl::SimpleAtoi(fields[0], &quota) || !absl::SimpleAtoi(fields[1], &period) || quota <= 0 ||
      period <= 0) {
    return std::nullopt;
  }
  const int64_t cpus = quota / period + (quota % period != 0 ? 1 : 0);
  return static_cast<int32_t>(std::clamp<int64_t>(cpus, 1, INT32_MAX));
}

int32_t UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int32_t cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    // A core is the set of CPUs that share it: its hardware threads' list is the same
    // string for each of them (core_id alone repeats across dies on some machines).
    std::set<std::string> physical;
    int32_t cpus = 0;
    bool topology_known = true;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &set)) continue;
      ++cpus;
      const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu", cpu, "/topology/");
      auto siblings = ReadFirstLine(dir + "core_cpus_list");
      if (!siblings) siblings = ReadFirstLine(dir + "thread_siblings_list");
      if (!siblings) {
        topology_known = false;
        continue;
      }
      physical.insert(*siblings);
    }
    cores = topology_known && !physical.empty() ? static_cast<int32_t>(physical.size()) : cpus;
  }
  if (cores <= 0) cores = static_cast<int32_t>(std::thread::hardware_concurrency());
  if (auto quota = CgroupQuotaCpus()) cores = std::min(cores, *quota);
  return std::max(1, cores);
}

int32_t ResolveComputeThreads(int32_t requested) {
  if (requested > 0) return requested;
  int32_t from_env = 0;
  const char* env = std::getenv("OMP_NUM_THREADS");
  // A list ("4,2": nested levels) gives the outermost level's count, as OpenMP reads it.
  if (env != nullptr &&
      absl::SimpleAtoi(absl::string_view(env).substr(0, absl::string_view(env).find(',')),
                       &from_env) &&
      from_env > 0) {
    return from_env;
  }
  return UsableCores();
}

}  // namespace fwserve
