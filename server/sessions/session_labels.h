// The labels a stored session's blob carries beside its state (the x-* metadata of the
// state codec), written once here and read back once here: by the engine when it
// stores a session, by the core when it indexes a dir: store at start-up. Torch-free.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fwserve {

struct StoredSessionLabels {
  std::string id;
  std::string model;
  std::string tenant;  // empty on an open server
  absl::Time created;
  absl::Time last_used;
};

// The metadata entries for `labels` (x-session-id, x-model, x-tenant, x-created-ms,
// x-last-used-ms; times at millisecond precision).
std::map<std::string, std::string> ToStoredLabels(const StoredSessionLabels& labels);

// Reads the labels back from a blob's metadata. INVALID_ARGUMENT naming the first
// missing or malformed label.
absl::StatusOr<StoredSessionLabels> ParseStoredLabels(
    const std::map<std::string, std::string>& metadata);

}  // namespace fwserve
