// Scratch directories for tests, torch-free.
#pragma once

#include <string>

namespace fwtest {

// A fresh directory "fwserve-TAG-PID-N" under $TEST_TMPDIR, else /tmp, removed with
// everything in it when the test process exits (kept when FWSERVE_KEEP_TEST_DIRS is
// set, to look at after a failure). Thread-safe.
std::string MakeTempDir(const std::string& tag);

}  // namespace fwtest
