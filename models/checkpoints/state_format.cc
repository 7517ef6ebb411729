#include "models/checkpoints/state_format.h"

#include <openssl/evp.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "models/checkpoints/safetensors.h"

namespace fwmodel {

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), static_cast<size_t>(len)));
}

const char kStateFormat[] = "fwserve-state";
const char kStateVersion[] = "2";
const char kStateChecksumKey[] = "sha256";

// The checksum covers every metadata field but itself (tokens, fingerprint, labels:
// everything a reader trusts) and then the data section, so no field can be changed
// without detection. Keys are NUL-terminated; a key or value cannot hold a NUL.
std::string StateChecksum(const std::map<std::string, std::string>& metadata,
                          const std::string& data) {
  std::string covered;
  for (const auto& [key, value] : metadata) {
    if (key == kStateChecksumKey) continue;
    covered.append(key).push_back('\0');
    covered.append(value).push_back('\0');
  }
  covered.push_back('\0');
  covered += data;
  return Sha256Hex(covered);
}

std::string StateDataSection(const SafetensorsFile& file) {
  std::string data;
  for (const auto& [name, view] : file.tensors()) {
    data.append(reinterpret_cast<const char*>(view.data), view.nbytes);
  }
  return data;
}

absl::Status CheckStateFormat(const std::map<std::string, std::string>& meta) {
  auto field = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    return it == meta.end() ? "" : it->second;
  };
  if (field("format") != kStateFormat)
    return absl::InvalidArgumentError("state: not an fwserve state");
  if (field("version") != kStateVersion) {
    return absl::InvalidArgumentError(absl::StrCat("state: unsupported version '",
                                                   field("version").substr(0, 16), "' (expected ",
                                                   kStateVersion, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> PeekStateMetadata(std::string bytes) {
  auto file = SafetensorsFile::Parse(std::move(bytes));
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("state: ", file.status().message()));
  }
  if (absl::Status format = CheckStateFormat(file->metadata()); !format.ok()) return format;
  auto sum = file->metadata().find(kStateChecksumKey);
  if (sum == file->metadata().end() ||
      StateChecksum(file->metadata(), StateDataSection(*file)) != sum->second) {
    return absl::InvalidArgumentError("state: checksum mismatch (corrupted or altered)");
  }
  return file->metadata();
}

}  // namespace fwmodel
