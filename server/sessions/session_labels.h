// The labels a stored session's blob carries beside its state (the x-* metadata of the
// state codec), written once here and read back once here: by the engine when it
// stores, exports, loads or imports a session, by the core when it indexes a dir: store
// at start-up. Torch-free.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/api/session_record.h"

namespace fwserve {

struct StoredSessionLabels {
  std::string id;
  std::string model;
  std::string tenant;  // empty on an open server
  absl::Time created;
  absl::Time last_used;
  LastOutput last_output = {};  // empty: no label
};

// The metadata entries for `labels` (x-session-id, x-model, x-tenant, x-created-ms,
// x-last-used-ms; times at millisecond precision), and the last output's labels
// (AddLastOutputLabels).
std::map<std::string, std::string> ToStoredLabels(const StoredSessionLabels& labels);

// Reads the labels back from a blob's metadata. INVALID_ARGUMENT naming the first
// missing or malformed label (ParseLastOutputLabels included).
absl::StatusOr<StoredSessionLabels> ParseStoredLabels(
    const std::map<std::string, std::string>& metadata);

// Adds `output` to `labels`: x-last-output (the text, standard base64: label values
// must be plain strings) unless the text is empty, and x-last-output-truncated ("1")
// only when it is truncated. Stored blobs and exports carry them alike.
void AddLastOutputLabels(const LastOutput& output, std::map<std::string, std::string>* labels);

// The last output a blob's metadata carries: empty when it has no x-last-output (blobs
// written before the label existed). A text over LastOutput::kMaxBytes (a blob of a
// build with a larger bound) is cut to it and marked truncated. INVALID_ARGUMENT naming
// the label when x-last-output is not base64 or x-last-output-truncated is not "1".
absl::StatusOr<LastOutput> ParseLastOutputLabels(
    const std::map<std::string, std::string>& metadata);

}  // namespace fwserve
