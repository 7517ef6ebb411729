// Detects Debian's reference BLAS, which makes LibTorch about 20x slower than
// OpenBLAS. Torch-free.
#pragma once

#include <optional>
#include <string>

namespace fwmodel {

// Looks at the BLAS library mapped into this process (Linux /proc/self/maps). Returns
// a warning to print when it is the reference implementation (or when no BLAS is
// mapped yet but the reference one is what the system would load); nullopt when an
// optimised BLAS (OpenBLAS, MKL, BLIS) is in use or nothing can be told.
std::optional<std::string> SlowBlasWarning();

// The decision itself, for tests: `maps` is the text of a /proc/PID/maps file and
// `alternative_target` what the system's libblas.so.3 link resolves to (nullopt when it
// cannot be resolved). The first mapped libblas.so decides; the link only when none is.
std::optional<std::string> SlowBlasWarning(const std::string& maps,
                                           const std::optional<std::string>& alternative_target);

// Sets OpenBLAS's own thread count (openblas_set_num_threads, looked up at run time
// because Debian links the generic libblas.so.3 that OpenBLAS provides). LibTorch's
// set_num_threads does not reach it, and OpenBLAS's OpenMP workers spin between the
// small products of a decode step. False when the BLAS in use is not OpenBLAS.
bool SetOpenBlasThreads(int threads);

}  // namespace fwmodel
