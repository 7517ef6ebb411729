// Export blobs authenticated with the deployment's key (--session-key-file): an
// HMAC-SHA-256 over the whole blob, appended as a trailer. Replicas of one deployment
// share the key; a blob changed in any byte, or sealed with another key, is refused
// before it is parsed. Torch-free.
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace fwserve {

class SessionSealer {
 public:
  // Reads the key from `path`: the file's bytes with trailing whitespace removed, at
  // least 32 bytes (e.g. `head -c 32 /dev/urandom | base64`). Errors name the flag.
  static absl::StatusOr<std::unique_ptr<SessionSealer>> FromKeyFile(const std::string& path);
  // `key`: at least 32 bytes.
  static absl::StatusOr<std::unique_ptr<SessionSealer>> FromKey(std::string key);

  // blob + trailer.
  std::string Seal(std::string blob) const;
  // The blob without its trailer. INVALID_ARGUMENT (naming the `blob` field) if it
  // carries no trailer or the trailer does not match.
  absl::StatusOr<std::string> Open(std::string sealed) const;

  // True if `blob` ends with a seal trailer (whether or not it verifies).
  static bool LooksSealed(absl::string_view blob);

 private:
  explicit SessionSealer(std::string key) : key_(std::move(key)) {}
  std::string Mac(absl::string_view data) const;

  const std::string key_;
};

}  // namespace fwserve
