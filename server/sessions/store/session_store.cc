#include "server/sessions/store/session_store.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/sessions/store/dir_session_store.h"
#include "server/sessions/store/redis_session_store.h"

namespace fwserve {

absl::StatusOr<std::unique_ptr<SessionStore>> OpenSessionStore(const std::string& spec,
                                                               const SessionStoreOptions& options) {
  if (spec == "memory") return std::unique_ptr<SessionStore>();
  if (absl::StartsWith(spec, "dir:")) {
    auto store = DirectorySessionStore::Open(spec.substr(4));
    if (!store.ok()) return store.status();
    return std::unique_ptr<SessionStore>(std::move(*store));
  }
  if (absl::StartsWith(spec, "redis://")) {
    auto address = ParseRedisSpec(spec);
    if (!address.ok()) return address.status();
    auto store = RedisSessionStore::Open(*address, options);
    if (!store.ok()) return store.status();
    // Connects now. A failure is not fatal: the store logs it and reconnects by itself,
    // and requests get UNAVAILABLE meanwhile.
    (void)(*store)->Ping();
    return std::unique_ptr<SessionStore>(std::move(*store));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--session-store must be 'memory', 'dir:PATH' or 'redis://HOST:PORT[/DB]', got '",
      spec.substr(0, 200), "'"));
}

}  // namespace fwserve
