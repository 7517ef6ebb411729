// CPU time the benchmarks read of their own process (torch-free, header-only).
#pragma once

#include <sys/resource.h>

namespace fwbench {

// User + system CPU seconds this process has used so far, all threads together.
inline double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

}  // namespace fwbench
