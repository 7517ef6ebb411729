#include "common/load_time_env.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace fwserve {
namespace {

// Instruction-set levels of OpenBLAS's x86-64 cores (names as openblas_get_corename()
// and OPENBLAS_CORETYPE spell them, OpenBLAS 0.3.21 driver/others/dynamic.c).
enum Level { kUnknown = -1, kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };

Level CoreLevel(std::string_view core) {
  for (const char* name : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (core == name) return kAvx512;
  }
  for (const char* name : {"Haswell", "Zen", "Excavator"}) {
    if (core == name) return kAvx2;
  }
  for (const char* name : {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller"}) {
    if (core == name) return kAvx;
  }
  for (const char* name :
       {"Prescott", "Katmai", "Coppermine", "Northwood", "Banias", "Core2", "Penryn", "Dunnington",
        "Nehalem", "Atom", "Opteron", "Opteron_SSE3", "Barcelona", "Bobcat", "Nano"}) {
    if (core == name) return kSse;
  }
  return kUnknown;
}

Level CpuLevel(const CpuFeatures& cpu) {
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512dq && cpu.avx512cd) {
    return kAvx512;
  }
  if (cpu.avx2 && cpu.fma) return kAvx2;
  if (cpu.avx) return kAvx;
  return kSse;
}

const char* CoreFor(Level level) {
  switch (level) {
    case kAvx512:
      return "SkylakeX";
    case kAvx2:
      return "Haswell";
    case kAvx:
      return "Sandybridge";
    default:
      return nullptr;
  }
}

const char* LevelName(Level level) {
  switch (level) {
    case kAvx512:
      return "AVX-512";
    case kAvx2:
      return "AVX2";
    case kAvx:
      return "AVX";
    default:
      return "SSE";
  }
}

// openblas_get_corename() of the OpenBLAS in this process; empty when it has none.
std::string LoadedOpenBlasCore() {
  using CoreName = char* (*)();
  auto core_name = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (core_name == nullptr) return "";
  const char* name = core_name();
  return name == nullptr ? "" : name;
}

constexpr char kDetectedVar[] = "FWSERVE_OPENBLAS_CORE_DETECTED";
constexpr char kTestVar[] = "FWSERVE_OPENBLAS_CORETYPE_IS_DETECTED";

}  // namespace

CpuFeatures DetectCpuFeatures() {
  __builtin_cpu_init();
  CpuFeatures cpu;
  cpu.avx = __builtin_cpu_supports("avx");
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.fma = __builtin_cpu_supports("fma");
  cpu.avx512f = __builtin_cpu_supports("avx512f");
  cpu.avx512bw = __builtin_cpu_supports("avx512bw");
  cpu.avx512vl = __builtin_cpu_supports("avx512vl");
  cpu.avx512dq = __builtin_cpu_supports("avx512dq");
  cpu.avx512cd = __builtin_cpu_supports("avx512cd");
  return cpu;
}

std::optional<std::string> BetterOpenBlasCore(std::string_view detected, const CpuFeatures& cpu) {
  const Level have = CoreLevel(detected);
  const Level can = CpuLevel(cpu);
  if (have == kUnknown || have >= can) return std::nullopt;
  const char* core = CoreFor(can);
  if (core == nullptr) return std::nullopt;
  return std::string(core);
}

void ReexecWithLoadTimeEnv(char** argv, const LoadTimeEnvOptions& options) {
  bool changed = false;
  if (options.passive_openmp_waits && std::getenv("OMP_WAIT_POLICY") == nullptr) {
    changed = setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0) == 0;
  }
  const char* test = std::getenv(kTestVar);
  const bool user_chose = std::getenv("OPENBLAS_CORETYPE") != nullptr &&
                          (test == nullptr || std::strcmp(test, "1") != 0);
  if (options.fix_openblas_core && !user_chose) {
    const std::string detected = LoadedOpenBlasCore();
    if (auto better = BetterOpenBlasCore(detected, DetectCpuFeatures())) {
      if (setenv("OPENBLAS_CORETYPE", better->c_str(), /*overwrite=*/1) == 0 &&
          setenv(kDetectedVar, detected.c_str(), /*overwrite=*/1) == 0) {
        unsetenv(kTestVar);
        changed = true;
      }
    }
  }
  if (changed) execv("/proc/self/exe", argv);
  // Nothing to set, or the exec failed (no /proc): go on with what the libraries chose.
}

std::optional<std::string> LoadTimeEnvNote() {
  const char* detected = std::getenv(kDetectedVar);
  if (detected == nullptr) return std::nullopt;
  const std::string was = detected;
  unsetenv(kDetectedVar);  // not inherited by child processes
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  const std::string running = LoadedOpenBlasCore();
  return "OpenBLAS detected this " + std::string(LevelName(CpuLevel(DetectCpuFeatures()))) +
         " CPU as core " + was + "; set OPENBLAS_CORETYPE=" + (set == nullptr ? "" : set) +
         " at start, running core " + (running.empty() ? "(unknown)" : running) +
         " (set OPENBLAS_CORETYPE to choose another)";
}

}  // namespace fwserve
