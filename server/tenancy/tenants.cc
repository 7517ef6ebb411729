#include "server/tenancy/tenants.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cmath>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace fwserve {
namespace {

// Longest accepted file, bytes: far above any real key file, and keeps a mistaken
// --api-keys-file (a model, a log) from being read whole.
constexpr size_t kMaxFileBytes = 4 << 20;

std::array<uint8_t, 32> Sha256(absl::string_view data) {
  std::array<uint8_t, 32> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest.data());
  return digest;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

absl::Status LineError(size_t line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
}

// A field value quoted for an error message: printable, at most 40 bytes.
std::string Shown(absl::string_view value) {
  std::string out;
  for (char c : value.substr(0, 40)) {
    out += absl::ascii_isprint(static_cast<unsigned char>(c)) ? c : '?';
  }
  if (value.size() > 40) out += "...";
  return out;
}

}  // namespace

std::string Sha256Hex(absl::string_view data) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t byte : Sha256(data)) {
    out += kDigits[byte >> 4];
    out += kDigits[byte & 15];
  }
  return out;
}

bool IsValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::StatusOr<ApiKeysTable> ParseApiKeys(absl::string_view text) {
  if (text.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the file is ", text.size(), " bytes, more than ", kMaxFileBytes));
  }
  ApiKeysTable table;
  // Whether each tenant's quota was given explicitly on some line.
  std::vector<bool> quota_given;
  size_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r\f\v"), absl::SkipEmpty());
    if (fields.empty()) continue;
    const absl::string_view credential = fields[0];
    std::optional<std::array<uint8_t, 32>> key_hash;
    std::string common_name;
    if (absl::StartsWith(credential, "sha256:")) {
      const absl::string_view hex = credential.substr(7);
      if (hex.size() != 64) {
        return LineError(line_number, absl::StrCat("sha256: wants 64 hex digits, got ", hex.size(),
                                                   " characters"));
      }
      std::array<uint8_t, 32> bytes{};
      for (size_t i = 0; i < 32; ++i) {
        const int high = HexValue(hex[2 * i]), low = HexValue(hex[2 * i + 1]);
        if (high < 0 || low < 0) return LineError(line_number, "sha256: has a non-hex digit");
        bytes[i] = static_cast<uint8_t>(high * 16 + low);
      }
      key_hash = bytes;
    } else if (absl::StartsWith(credential, "x509-cn:")) {
      common_name = std::string(credential.substr(8));
      if (common_name.empty() || common_name.size() > 256) {
        return LineError(line_number, "x509-cn: wants a common name of 1 to 256 bytes");
      }
    } else {
      return LineError(line_number,
                       absl::StrCat("a line starts with sha256:<hex> or x509-cn:<name>, got '",
                                    Shown(credential.substr(0, 8)), "...'"));
    }
    std::string tenant;
    TenantQuota quota;
    bool has_quota = false;
    for (size_t i = 1; i < fields.size(); ++i) {
      const size_t eq = fields[i].find('=');
      if (eq == absl::string_view::npos) {
        return LineError(line_number,
                         absl::StrCat("expected key=value, got '", Shown(fields[i]), "'"));
      }
      const absl::string_view key = fields[i].substr(0, eq);
      const absl::string_view value = fields[i].substr(eq + 1);
      if (key == "tenant") {
        if (!tenant.empty()) return LineError(line_number, "tenant= is given twice");
        if (!IsValidTenantName(value)) {
          return LineError(line_number, absl::StrCat("tenant '", Shown(value),
                                                     "' is not 1 to 64 of [A-Za-z0-9_.-]"));
        }
        tenant = std::string(value);
      } else if (key == "max_sessions" || key == "max_streams") {
        int64_t n = 0;
        if (!absl::SimpleAtoi(value, &n) || n < 0) {
          return LineError(line_number,
                           absl::StrCat(key, " must be an integer >= 0, got '", Shown(value), "'"));
        }
        (key == "max_sessions" ? quota.max_sessions : quota.max_streams) = n;
        has_quota = true;
      } else if (key == "tokens_per_second") {
        double x = 0;
        if (!absl::SimpleAtod(value, &x) || !std::isfinite(x) || x < 0) {
          return LineError(
              line_number,
              absl::StrCat("tokens_per_second must be a number >= 0, got '", Shown(value), "'"));
        }
        quota.tokens_per_second = x;
        has_quota = true;
      } else {
        return LineError(line_number, absl::StrCat("unknown field '", Shown(key), "'"));
      }
    }
    if (tenant.empty()) return LineError(line_number, "tenant= is missing");
    size_t index = 0;
    while (index < table.tenants.size() && table.tenants[index].name != tenant) ++index;
    if (index == table.tenants.size()) {
      table.tenants.push_back({tenant, quota});
      quota_given.push_back(has_quota);
    } else if (has_quota) {
      if (quota_given[index] && !(table.tenants[index].quota == quota)) {
        return LineError(line_number, absl::StrCat("tenant '", tenant,
                                                   "' has different quotas on another line"));
      }
      table.tenants[index].quota = quota;
      quota_given[index] = true;
    }
    if (key_hash.has_value()) {
      for (const ApiKeysTable::Key& existing : table.keys) {
        if (existing.sha256 == *key_hash) {
          return LineError(line_number, "this key hash is already listed on an earlier line");
        }
      }
      table.keys.push_back({*key_hash, index});
    } else {
      for (const ApiKeysTable::Certificate& existing : table.certificates) {
        if (existing.common_name == common_name) {
          return LineError(line_number, "this x509-cn is already listed on an earlier line");
        }
      }
      table.certificates.push_back({common_name, index});
    }
  }
  if (table.keys.empty() && table.certificates.empty()) {
    return absl::InvalidArgumentError("no credential in the file (every caller would be refused)");
  }
  return table;
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::Load(const std::string& path) {
  std::unique_ptr<Tenants> tenants(new Tenants(path));
  if (absl::Status loaded = tenants->Reload(); !loaded.ok()) return loaded;
  return tenants;
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::FromText(absl::string_view text) {
  auto table = ParseApiKeys(text);
  if (!table.ok()) return table.status();
  std::unique_ptr<Tenants> tenants(new Tenants(""));
  tenants->table_ = std::make_shared<const ApiKeysTable>(std::move(*table));
  return tenants;
}

absl::Status Tenants::Reload() {
  if (path_.empty()) return absl::OkStatus();
  std::ifstream in(path_, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--api-keys-file: cannot read ", path_));
  std::string text;
  text.resize(kMaxFileBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  auto table = ParseApiKeys(text);
  if (!table.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--api-keys-file ", path_, ": ", table.status().message()));
  }
  absl::MutexLock lock(&mu_);
  table_ = std::make_shared<const ApiKeysTable>(std::move(*table));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Tenants::TenantOfKey(absl::string_view key) const {
  const std::shared_ptr<const ApiKeysTable> table = this->table();
  const std::array<uint8_t, 32> presented = Sha256(key);
  // Every entry is compared, in constant time, whatever matches.
  size_t match = table->tenants.size();
  for (const ApiKeysTable::Key& entry : table->keys) {
    const bool equal = CRYPTO_memcmp(entry.sha256.data(), presented.data(), 32) == 0;
    match = equal ? entry.tenant : match;
  }
  if (key.empty() || match == table->tenants.size()) {
    return absl::UnauthenticatedError("the API key is not valid");
  }
  return table->tenants[match].name;
}

absl::StatusOr<std::string> Tenants::TenantOfCertificate(absl::string_view common_name) const {
  const std::shared_ptr<const ApiKeysTable> table = this->table();
  for (const ApiKeysTable::Certificate& entry : table->certificates) {
    if (entry.common_name == common_name) return table->tenants[entry.tenant].name;
  }
  return absl::UnauthenticatedError("the client certificate is not mapped to a tenant");
}

std::optional<TenantQuota> Tenants::QuotaOf(absl::string_view tenant) const {
  const std::shared_ptr<const ApiKeysTable> table = this->table();
  for (const ApiKeysTable::Tenant& t : table->tenants) {
    if (t.name == tenant) return t.quota;
  }
  return std::nullopt;
}

std::vector<std::string> Tenants::Names() const {
  const std::shared_ptr<const ApiKeysTable> table = this->table();
  std::vector<std::string> names;
  for (const ApiKeysTable::Tenant& t : table->tenants) names.push_back(t.name);
  return names;
}

}  // namespace fwserve
