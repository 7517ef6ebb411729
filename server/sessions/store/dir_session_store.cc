#include "server/sessions/store/dir_session_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/rand.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/base/session_id.h"

namespace fwserve {
namespace {

constexpr char kSuffix[] = ".fwstate";
constexpr char kTempPrefix[] = ".tmp-";
constexpr char kLockName[] = ".lock";

std::string Errno() { return std::strerror(errno); }

absl::Status NotASessionId(const std::string& id) {
  return absl::InvalidArgumentError(absl::StrCat("not a session id: '", id.substr(0, 64), "'"));
}

// 64 random bits: unique across processes even when every container's server is pid 1.
std::string RandomSuffix() {
  unsigned char bytes[8];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) std::abort();
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(Errno());
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirectorySessionStore>> DirectorySessionStore::Open(
    const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("--session-store dir: needs a path");
  // mkdir -p, the last component 0700.
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos == path.size() || path[pos] == '/') {
      const std::string prefix = path.substr(0, pos);
      if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
        return absl::InvalidArgumentError(
            absl::StrCat("--session-store dir:", path, ": cannot create ", prefix, ": ", Errno()));
      }
    }
  }
  if (::chmod(path.c_str(), 0700) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-store dir:", path, ": cannot chmod 0700: ", Errno()));
  }
  const int dir_fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-store dir:", path, ": cannot open: ", Errno()));
  }
  const std::string lock_path = path + "/" + kLockName;
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) {
    ::close(dir_fd);
    return absl::InvalidArgumentError(
        absl::StrCat("--session-store dir:", path, ": cannot open ", lock_path, ": ", Errno()));
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const std::string why = errno == EWOULDBLOCK ? "another fwserve process is using it" : Errno();
    ::close(lock_fd);
    ::close(dir_fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "--session-store dir:", path, ": ", why, " (lock ", lock_path,
        "); give each server its own directory, or use a shared store for several replicas"));
  }
  auto store =
      std::unique_ptr<DirectorySessionStore>(new DirectorySessionStore(path, dir_fd, lock_fd));
  // Temporary files of a crashed writer: never renamed, so never a session's state.
  if (DIR* dir = ::opendir(path.c_str())) {
    while (dirent* entry = ::readdir(dir)) {
      if (absl::StartsWith(entry->d_name, kTempPrefix) &&
          ::unlinkat(dir_fd, entry->d_name, 0) == 0) {
        ++store->stale_removed_;
      }
    }
    ::closedir(dir);
  }
  if (store->stale_removed_ > 0) {
    if (absl::Status synced = store->SyncDirectory("stale temporaries"); !synced.ok()) {
      return synced;
    }
  }
  return store;
}

DirectorySessionStore::~DirectorySessionStore() {
  ::close(lock_fd_);  // releases the flock
  ::close(dir_fd_);
}

std::string DirectorySessionStore::FilePath(const std::string& id) const {
  return path_ + "/" + id + kSuffix;
}

absl::Status DirectorySessionStore::SyncDirectory(const std::string& what) {
  if (::fsync(dir_fd_) != 0) {
    return absl::UnavailableError(
        absl::StrCat(Describe(), ": fsync of the directory after ", what, " failed: ", Errno()));
  }
  return absl::OkStatus();
}

absl::Status DirectorySessionStore::Put(const std::string& id, const std::string& blob) {
  if (!IsWellFormedSessionId(id)) return NotASessionId(id);
  const std::string temp = absl::StrCat(kTempPrefix, id, "-", RandomSuffix());
  const std::string target = absl::StrCat(id, kSuffix);
  const int fd = ::openat(dir_fd_, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(Describe(), ": cannot create a file for session ", id, ": ", Errno()));
  }
  absl::Status status = WriteAll(fd, blob);
  if (status.ok() && ::fsync(fd) != 0) status = absl::UnavailableError(Errno());
  if (::close(fd) != 0 && status.ok()) status = absl::UnavailableError(Errno());
  if (status.ok() && ::renameat(dir_fd_, temp.c_str(), dir_fd_, target.c_str()) != 0) {
    status = absl::UnavailableError(Errno());
  }
  if (!status.ok()) {
    ::unlinkat(dir_fd_, temp.c_str(), 0);
    return absl::UnavailableError(
        absl::StrCat(Describe(), ": writing session ", id, " failed: ", status.message()));
  }
  return SyncDirectory(absl::StrCat("writing session ", id));
}

absl::StatusOr<std::string> DirectorySessionStore::Get(const std::string& id) {
  if (!IsWellFormedSessionId(id)) return NotASessionId(id);
  const std::string name = absl::StrCat(id, kSuffix);
  const int fd = ::openat(dir_fd_, name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat(Describe(), ": no session ", id));
    }
    return absl::UnavailableError(
        absl::StrCat(Describe(), ": cannot open session ", id, ": ", Errno()));
  }
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = Errno();
      ::close(fd);
      return absl::UnavailableError(
          absl::StrCat(Describe(), ": reading session ", id, " failed: ", why));
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

absl::Status DirectorySessionStore::Delete(const std::string& id) {
  if (!IsWellFormedSessionId(id)) return NotASessionId(id);
  const std::string name = absl::StrCat(id, kSuffix);
  if (::unlinkat(dir_fd_, name.c_str(), 0) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat(Describe(), ": deleting session ", id, " failed: ", Errno()));
  }
  return SyncDirectory(absl::StrCat("deleting session ", id));
}

absl::Status DirectorySessionStore::ForEachId(
    const std::function<bool(const std::string& id)>& visit) {
  DIR* dir = ::opendir(path_.c_str());
  if (dir == nullptr) {
    return absl::UnavailableError(absl::StrCat(Describe(), ": cannot list: ", Errno()));
  }
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (!absl::EndsWith(name, kSuffix)) continue;
    const std::string id = name.substr(0, name.size() - (sizeof(kSuffix) - 1));
    if (!IsWellFormedSessionId(id)) continue;
    if (!visit(id)) break;
  }
  ::closedir(dir);
  return absl::OkStatus();
}

}  // namespace fwserve
