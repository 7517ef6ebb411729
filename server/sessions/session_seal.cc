#include "server/sessions/session_seal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <fstream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

// The trailer: this magic, then the 32-byte HMAC-SHA-256 of everything before it.
constexpr absl::string_view kMagic = "FWSHMAC1";
constexpr size_t kMacBytes = 32;
constexpr size_t kTrailerBytes = 8 + kMacBytes;
constexpr size_t kMinKeyBytes = 32;

}  // namespace

absl::StatusOr<std::unique_ptr<SessionSealer>> SessionSealer::FromKeyFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--session-key-file: cannot read ", path));
  std::string key((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!key.empty() && absl::ascii_isspace(static_cast<unsigned char>(key.back()))) {
    key.pop_back();
  }
  auto sealer = FromKey(std::move(key));
  if (!sealer.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-key-file ", path, ": ", sealer.status().message()));
  }
  return sealer;
}

absl::StatusOr<std::unique_ptr<SessionSealer>> SessionSealer::FromKey(std::string key) {
  if (key.size() < kMinKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the key is ", key.size(),
                                                   " bytes; it must be at least ", kMinKeyBytes,
                                                   " (e.g. head -c 32 /dev/urandom | base64)"));
  }
  return std::unique_ptr<SessionSealer>(new SessionSealer(std::move(key)));
}

std::string SessionSealer::Mac(absl::string_view data) const {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac, &length);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

std::string SessionSealer::Seal(std::string blob) const {
  const std::string mac = Mac(blob);
  blob.append(kMagic.data(), kMagic.size());
  blob.append(mac);
  return blob;
}

bool SessionSealer::LooksSealed(absl::string_view blob) {
  return blob.size() >= kTrailerBytes &&
         blob.substr(blob.size() - kTrailerBytes, kMagic.size()) == kMagic;
}

absl::StatusOr<std::string> SessionSealer::Open(std::string sealed) const {
  if (!LooksSealed(sealed)) {
    return absl::InvalidArgumentError(
        "blob: it is not signed by this deployment (no signature trailer); only blobs "
        "exported by a server with the same --session-key-file are accepted");
  }
  const absl::string_view body(sealed.data(), sealed.size() - kTrailerBytes);
  const std::string expected = Mac(body);
  if (CRYPTO_memcmp(expected.data(), sealed.data() + sealed.size() - kMacBytes, kMacBytes) != 0) {
    return absl::InvalidArgumentError(
        "blob: its signature does not match (changed after export, or exported by a "
        "deployment with another --session-key-file)");
  }
  sealed.resize(body.size());
  return sealed;
}

}  // namespace fwserve
