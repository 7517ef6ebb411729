#include "server/core/session_store.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/core/dir_session_store.h"

namespace fwserve {

absl::StatusOr<std::unique_ptr<SessionStore>> OpenSessionStore(const std::string& spec) {
  if (spec == "memory") return std::unique_ptr<SessionStore>();
  if (absl::StartsWith(spec, "dir:")) {
    auto store = DirectorySessionStore::Open(spec.substr(4));
    if (!store.ok()) return store.status();
    return std::unique_ptr<SessionStore>(std::move(*store));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--session-store must be 'memory' or 'dir:PATH', got '", spec.substr(0, 200), "'"));
}

}  // namespace fwserve
