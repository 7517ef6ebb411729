#include "server/sessions/session_labels.h"

#include <cstdint>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

constexpr char kId[] = "x-session-id";
constexpr char kModel[] = "x-model";
constexpr char kTenant[] = "x-tenant";
constexpr char kCreatedMs[] = "x-created-ms";
constexpr char kLastUsedMs[] = "x-last-used-ms";
constexpr char kLastOutput[] = "x-last-output";
constexpr char kLastOutputTruncated[] = "x-last-output-truncated";

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
  std::map<std::string, std::string> out = {
      {kId, labels.id},
      {kModel, labels.model},
      {kTenant, labels.tenant},
      {kCreatedMs, absl::StrCat(absl::ToUnixMillis(labels.created))},
      {kLastUsedMs, absl::StrCat(absl::ToUnixMillis(labels.last_used))}};
  AddLastOutputLabels(labels.last_output, &out);
  return out;
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
  auto last_output = ParseLastOutputLabels(metadata);
  if (!last_output.ok()) return last_output.status();
  labels.created = *created;
  labels.last_used = *last_used;
  labels.last_output = std::move(*last_output);
  return labels;
}

void AddLastOutputLabels(const LastOutput& output, std::map<std::string, std::string>* labels) {
  if (!output.text.empty()) (*labels)[kLastOutput] = absl::Base64Escape(output.text);
  if (output.truncated) (*labels)[kLastOutputTruncated] = "1";
}

absl::StatusOr<LastOutput> ParseLastOutputLabels(
    const std::map<std::string, std::string>& metadata) {
  LastOutput output;
  if (auto it = metadata.find(kLastOutput); it != metadata.end()) {
    std::string text;
    if (!absl::Base64Unescape(it->second, &text)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", kLastOutput, " is malformed"));
    }
    output.Append(text);
  }
  if (auto it = metadata.find(kLastOutputTruncated); it != metadata.end()) {
    if (it->second != "1") {
      return absl::InvalidArgumentError(
          absl::StrCat("label ", kLastOutputTruncated, " is malformed"));
    }
    output.truncated = true;
  }
  return output;
}

}  // namespace fwserve
