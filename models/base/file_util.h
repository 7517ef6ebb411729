// Whole-file I/O with absl::Status errors. Torch-free.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace fwmodel {

// Reads a whole file. NotFound when it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `contents` to `path` atomically: a temporary file in the same directory,
// flushed, then renamed over `path`. Readers never see a partial file.
absl::Status WriteFileAtomic(const std::string& path, const std::string& contents);

// Creates a directory and its parents if they do not exist.
absl::Status MakeDirectories(const std::string& path);

}  // namespace fwmodel
