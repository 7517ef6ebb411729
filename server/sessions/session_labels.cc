#include "server/sessions/session_labels.h"

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

constexpr char kId[] = "x-session-id";
constexpr char kModel[] = "x-model";
constexpr char kTenant[] = "x-tenant";
constexpr char kCreatedMs[] = "x-created-ms";
constexpr char kLastUsedMs[] = "x-last-used-ms";

absl::StatusOr<absl::Time> MillisLabel(const std::map<std::string, std::string>& metadata,
                                       const char* key) {
  auto it = metadata.find(key);
  int64_t millis = 0;
  if (it == metadata.end() || !absl::SimpleAtoi(it->second, &millis)) {
    return absl::InvalidArgumentError(absl::StrCat("label ", key, " is missing or malformed"));
  }
  return absl::FromUnixMillis(millis);
}

}  // namespace

std::map<std::string, std::string> ToStoredLabels(const StoredSessionLabels& labels) {
  return {{kId, labels.id},
          {kModel, labels.model},
          {kTenant, labels.tenant},
          {kCreatedMs, absl::StrCat(absl::ToUnixMillis(labels.created))},
          {kLastUsedMs, absl::StrCat(absl::ToUnixMillis(labels.last_used))}};
}

absl::StatusOr<StoredSessionLabels> ParseStoredLabels(
    const std::map<std::string, std::string>& metadata) {
  StoredSessionLabels labels;
  auto id = metadata.find(kId);
  if (id == metadata.end() || id->second.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("label ", kId, " is missing"));
  }
  labels.id = id->second;
  if (auto model = metadata.find(kModel); model != metadata.end()) labels.model = model->second;
  if (auto tenant = metadata.find(kTenant); tenant != metadata.end()) {
    labels.tenant = tenant->second;
  }
  auto created = MillisLabel(metadata, kCreatedMs);
  if (!created.ok()) return created.status();
  auto last_used = MillisLabel(metadata, kLastUsedMs);
  if (!last_used.ok()) return last_used.status();
  labels.created = *created;
  labels.last_used = *last_used;
  return labels;
}

}  // namespace fwserve
