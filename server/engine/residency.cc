#include "server/engine/residency.h"

namespace fwserve {

std::string ChooseSessionToRelease(const ResidentSessions& resident,
                                   const std::function<bool(const std::string& id)>& releasable) {
  absl::flat_hash_map<std::string, int64_t> held;
  for (const auto& [id, r] : resident) ++held[r.tenant];
  std::string victim;
  int64_t victim_held = -1;
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [id, r] : resident) {
    if (r.in_use) continue;
    const int64_t tenant_held = held[r.tenant];
    if (tenant_held < victim_held || (tenant_held == victim_held && r.last_used >= oldest)) {
      continue;
    }
    if (!releasable(id)) continue;
    victim = id;
    victim_held = tenant_held;
    oldest = r.last_used;
  }
  return victim;
}

}  // namespace fwserve
