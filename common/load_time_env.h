// Environment variables that libraries read when they are loaded, before main: set at
// the start of a binary by executing it again, once. Torch-free and BLAS-free (OpenBLAS
// is looked up at run time).
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from the CPU when it is
// loaded. Debian 12's OpenBLAS 0.3.21 does not know every CPU newer than it and may fall
// back to an old core: "Prescott" (SSE3) on an Intel Xeon of family 6 model 207 with
// AVX-512, where the AVX-512 kernels ("SkylakeX") run the 2048² sgemm about 5x faster
// (docs/benchmarks.md, "OpenBLAS core"). OPENBLAS_CORETYPE names the core instead; the
// library reads it only at load.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace fwserve {

// The instruction-set extensions of this CPU that OpenBLAS's x86-64 cores need, as
// usable by this process (the OS saves their registers).
struct CpuFeatures {
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512cd = false;
};

// This CPU's features (cpuid through the compiler's __builtin_cpu_supports).
CpuFeatures DetectCpuFeatures();

// The OPENBLAS_CORETYPE to run with when `detected` (openblas_get_corename()) is one of
// OpenBLAS's x86-64 cores and uses fewer of the CPU's extensions than the best core the
// CPU can run: "SkylakeX" (AVX-512 F, BW, VL, DQ, CD), "Haswell" (AVX2 and FMA) or
// "Sandybridge" (AVX). nullopt when the detection matches the CPU (e.g. "Zen" or
// "Haswell" on an AVX2 CPU, "Cooperlake" on an AVX-512 one), when the CPU has no AVX,
// and for a name it does not know. Pure: for tests.
std::optional<std::string> BetterOpenBlasCore(std::string_view detected, const CpuFeatures& cpu);

// What a binary sets at its start.
struct LoadTimeEnvOptions {
  // OMP_WAIT_POLICY=PASSIVE when unset: libgomp's workers then sleep between parallel
  // regions instead of spinning (fwserve; docs/serving.md, "OpenMP threads").
  bool passive_openmp_waits = false;
  // OPENBLAS_CORETYPE=BetterOpenBlasCore(...) when unset and the loaded OpenBLAS chose
  // a weaker core than the CPU runs.
  bool fix_openblas_core = true;
};

// Call first in main, before any thread starts. When a variable of `options` is to be
// set, sets it and executes /proc/self/exe again with the same arguments (same pid);
// returns only when nothing was to be set or the exec failed. A variable the user set
// always wins. FWSERVE_OPENBLAS_CORETYPE_IS_DETECTED=1 (for tests) takes
// OPENBLAS_CORETYPE as what OpenBLAS detected rather than as the user's choice, so that
// a test can load the slow core and see it replaced.
void ReexecWithLoadTimeEnv(char** argv, const LoadTimeEnvOptions& options);

// After ReexecWithLoadTimeEnv: the line to log when it changed the OpenBLAS core
// (detected core, the one set, the one now running); nullopt when it did not. Once.
std::optional<std::string> LoadTimeEnvNote();

}  // namespace fwserve
