// How many compute threads this process should run: what the server's --threads 0 and
// --prefill-threads 0 resolve to. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fwserve {

// The physical cores among the CPUs in the calling thread's affinity mask (taskset, a
// cpuset; call it before pinning threads, e.g. from main),
// capped by a cgroup v2 CPU quota (`cpu.max`, e.g. a Kubernetes CPU limit, rounded up),
// at least 1. Two hyperthreads of one core count once: the decode step's GEMMs gain
// nothing from the second.
//
// Why not LibTorch's own default: it counts cores through cpuinfo, which on some
// virtual machines reports 1 where Linux shows 2 cores (this project's 2-vCPU CI
// machine: at::get_num_threads() = 1), and it ignores a CPU quota.
int32_t UsableCores();

// The thread count `requested` (>= 0) stands for: itself when > 0; else OMP_NUM_THREADS
// when it is set to a positive integer (the user's choice, which LibTorch reads too; of a
// list such as "4,2", the first);
// else UsableCores().
int32_t ResolveComputeThreads(int32_t requested);

// Exposed for tests. Parses a cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"): the
// CPUs the quota allows, rounded up; nullopt for "max" or a malformed line.
std::optional<int32_t> CpusOfCgroupQuota(const std::string& cpu_max);

}  // namespace fwserve
