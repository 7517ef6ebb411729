#include "models/base/file_util.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace fwmodel {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for reading"));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return buffer.str();
}

absl::Status WriteFileAtomic(const std::string& path, const std::string& contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr)
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const bool written = std::fwrite(contents.data(), 1, contents.size(), f) == contents.size();
  const bool flushed = std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  const bool closed = std::fclose(f) == 0;
  if (!written || !flushed || !closed) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat(path, ": write failed (disk full?)"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat(path, ": rename failed"));
  }
  return absl::OkStatus();
}

absl::Status MakeDirectories(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create directory"));
  return absl::OkStatus();
}

}  // namespace fwmodel
