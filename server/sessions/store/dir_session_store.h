// The dir:PATH backend: one file per session, PATH/<id>.fwstate.
//
// Crash safety: a write goes to a temporary file (a name no other writer can pick),
// which is fsync'ed, renamed over the session's file, and then the directory is
// fsync'ed; a reader sees the old blob or the new one, never a mix. Temporary files
// left by a crash are removed at open. Files are mode 0600 and the directory 0700.
// The directory is locked (flock on PATH/.lock) for the life of the store, so a second
// server on the same directory fails at start instead of both deleting each other's
// files.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/sessions/store/session_store.h"

namespace fwserve {

class DirectorySessionStore : public SessionStore {
 public:
  // Creates PATH if needed, takes the lock, removes stale temporary files.
  // FAILED_PRECONDITION if another process holds the lock.
  static absl::StatusOr<std::unique_ptr<DirectorySessionStore>> Open(const std::string& path);
  ~DirectorySessionStore() override;

  std::string Describe() const override { return "dir:" + path_; }
  absl::Status Put(const std::string& id, const std::string& blob) override;
  absl::StatusOr<std::string> Get(const std::string& id) override;
  absl::Status Delete(const std::string& id) override;
  absl::Status ForEachId(const std::function<bool(const std::string& id)>& visit) override;

  // The file that holds session `id` (for tests and operators).
  std::string FilePath(const std::string& id) const;
  // Temporary files removed by Open.
  int stale_temporaries_removed() const { return stale_removed_; }

 private:
  DirectorySessionStore(std::string path, int dir_fd, int lock_fd)
      : path_(std::move(path)), dir_fd_(dir_fd), lock_fd_(lock_fd) {}
  absl::Status SyncDirectory(const std::string& what);

  const std::string path_;
  const int dir_fd_;
  const int lock_fd_;
  int stale_removed_ = 0;
};

}  // namespace fwserve
