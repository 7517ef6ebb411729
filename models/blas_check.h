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

}  // namespace fwmodel
