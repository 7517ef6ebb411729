// The API-keys file, tenants, export-blob sealing and log hygiene (torch-free).
#include <gtest/gtest.h>

#include <string>

#include "server/base/log.h"
#include "server/sessions/session_seal.h"
#include "server/tenancy/tenants.h"

namespace fwserve {
namespace {

std::string KeyLine(const std::string& key, const std::string& rest) {
  return "sha256:" + Sha256Hex(key) + " " + rest + "\n";
}

TEST(ApiKeys, Sha256HexIsTheStandardDigest) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ApiKeys, ParsesTenantsQuotasCommentsAndCertificates) {
  const std::string text = "# keys of the staging deployment\n\n" +
                           KeyLine("key-a",
                                   "tenant=acme max_sessions=10 max_streams=2 "
                                   "tokens_per_second=1500.5  # primary") +
                           KeyLine("key-a2", "tenant=acme") +  // rotation: a second key
                           "x509-cn:batch.internal tenant=batch\r\n" +
                           KeyLine("key-b", "tenant=batch max_streams=4");
  auto table = ParseApiKeys(text);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->tenants.size(), 2u);
  EXPECT_EQ(table->tenants[0].name, "acme");
  EXPECT_EQ(table->tenants[0].quota.max_sessions, 10);
  EXPECT_EQ(table->tenants[0].quota.max_streams, 2);
  EXPECT_DOUBLE_EQ(table->tenants[0].quota.tokens_per_second, 1500.5);
  EXPECT_EQ(table->tenants[1].name, "batch");
  EXPECT_EQ(table->tenants[1].quota.max_streams, 4);
  EXPECT_EQ(table->keys.size(), 3u);
  ASSERT_EQ(table->certificates.size(), 1u);
  EXPECT_EQ(table->certificates[0].common_name, "batch.internal");

  auto tenants = Tenants::FromText(text);
  ASSERT_TRUE(tenants.ok());
  EXPECT_EQ(*(*tenants)->TenantOfKey("key-a"), "acme");
  EXPECT_EQ(*(*tenants)->TenantOfKey("key-a2"), "acme");
  EXPECT_EQ(*(*tenants)->TenantOfKey("key-b"), "batch");
  EXPECT_EQ((*tenants)->TenantOfKey("key-c").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*tenants)->TenantOfKey("").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(*(*tenants)->TenantOfCertificate("batch.internal"), "batch");
  EXPECT_FALSE((*tenants)->TenantOfCertificate("other").ok());
  EXPECT_EQ((*tenants)->QuotaOf("acme")->max_streams, 2);
  EXPECT_FALSE((*tenants)->QuotaOf("nobody").has_value());
}

TEST(ApiKeys, RefusesMalformedLinesNamingTheLineAndField) {
  const std::string hash = Sha256Hex("k");
  const struct {
    std::string text;
    std::string expected;
  } cases[] = {
      {"sha256:abc tenant=a\n", "line 1: sha256: wants 64 hex digits"},
      {"sha256:" + std::string(64, 'g') + " tenant=a\n", "line 1: sha256: has a non-hex digit"},
      {"\nsha256:" + hash + "\n", "line 2: tenant= is missing"},
      {"sha256:" + hash + " tenant=a tenant=b\n", "tenant= is given twice"},
      {"sha256:" + hash + " tenant=a/b\n", "tenant 'a/b' is not 1 to 64"},
      {"sha256:" + hash + " tenant=a max_streams=-1\n", "max_streams must be an integer >= 0"},
      {"sha256:" + hash + " tenant=a tokens_per_second=inf\n", "tokens_per_second must be"},
      {"sha256:" + hash + " tenant=a colour=blue\n", "unknown field 'colour'"},
      {"sha256:" + hash + " tenant=a oops\n", "expected key=value, got 'oops'"},
      {"password tenant=a\n", "a line starts with sha256:<hex> or x509-cn:<name>"},
      {"sha256:" + hash + " tenant=a\nsha256:" + hash + " tenant=b\n",
       "line 2: this key hash is already listed"},
      {"sha256:" + hash + " tenant=a max_streams=1\nsha256:" + Sha256Hex("j") +
           " tenant=a max_streams=2\n",
       "line 2: tenant 'a' has different quotas"},
      {"# nothing\n", "no credential in the file"},
  };
  for (const auto& c : cases) {
    auto table = ParseApiKeys(c.text);
    ASSERT_FALSE(table.ok()) << c.text;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(table.status().message().find(c.expected), std::string::npos)
        << table.status().message() << " (wanted: " << c.expected << ")";
    // A key hash is never echoed back.
    EXPECT_EQ(table.status().message().find(hash), std::string::npos);
  }
}

TEST(ApiKeys, ReloadSwapsTheTableAndKeepsItOnError) {
  const std::string path = ::testing::TempDir() + "/api_keys_reload";
  const auto write = [&](const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  write(KeyLine("old", "tenant=acme"));
  auto tenants = Tenants::Load(path);
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  EXPECT_TRUE((*tenants)->TenantOfKey("old").ok());
  write(KeyLine("new", "tenant=acme"));
  ASSERT_TRUE((*tenants)->Reload().ok());
  EXPECT_FALSE((*tenants)->TenantOfKey("old").ok());
  EXPECT_TRUE((*tenants)->TenantOfKey("new").ok());
  write("sha256:broken tenant=acme\n");
  absl::Status broken = (*tenants)->Reload();
  EXPECT_EQ(broken.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(broken.message().find("line 1"), std::string::npos) << broken;
  EXPECT_TRUE((*tenants)->TenantOfKey("new").ok()) << "a bad file must not replace a good one";
}

TEST(SessionSealer, EverySingleByteChangeIsRefused) {
  auto sealer = SessionSealer::FromKey(std::string(32, 'k'));
  ASSERT_TRUE(sealer.ok());
  std::string blob;
  for (int i = 0; i < 200; ++i) blob += static_cast<char>(i * 7);
  const std::string sealed = (*sealer)->Seal(blob);
  ASSERT_EQ(*(*sealer)->Open(sealed), blob);
  for (size_t i = 0; i < sealed.size(); ++i) {
    for (uint8_t flip : {0x01, 0x80, 0xff}) {
      std::string changed = sealed;
      changed[i] = static_cast<char>(changed[i] ^ flip);
      auto opened = (*sealer)->Open(changed);
      ASSERT_FALSE(opened.ok()) << "byte " << i << " xor " << int{flip};
      EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(opened.status().message().rfind("blob: ", 0), 0u);
    }
  }
  // Truncated or extended, or unsigned: refused.
  EXPECT_FALSE((*sealer)->Open(sealed.substr(0, sealed.size() - 1)).ok());
  EXPECT_FALSE((*sealer)->Open(sealed + "x").ok());
  EXPECT_FALSE((*sealer)->Open(blob).ok());
  EXPECT_FALSE((*sealer)->Open("").ok());
}

TEST(SessionSealer, ABlobOfAnotherDeploymentIsRefused) {
  auto ours = SessionSealer::FromKey(std::string(32, 'a'));
  auto theirs = SessionSealer::FromKey(std::string(32, 'b'));
  ASSERT_TRUE(ours.ok() && theirs.ok());
  const std::string sealed = (*theirs)->Seal("state bytes");
  EXPECT_TRUE(SessionSealer::LooksSealed(sealed));
  auto opened = (*ours)->Open(sealed);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("does not match"), std::string::npos);
  EXPECT_EQ(SessionSealer::FromKey("short").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LogHygiene, ControlBytesAreEscapedIdsShortenedLinesCapped) {
  EXPECT_EQ(SafeLogText("model=a\nINFO forged"), "model=a\\x0aINFO forged");
  EXPECT_EQ(SafeLogText("back\\slash\x7f"), "back\\\\slash\\x7f");
  EXPECT_EQ(SafeLogText("session=0123456789abcdef0123456789abcdef status=OK"),
            "session=01234567... status=OK");
  // Not exactly 32 hex digits: left alone (fingerprints, numbers).
  const std::string fingerprint(64, 'a');
  EXPECT_EQ(SafeLogText(fingerprint), fingerprint);
  EXPECT_EQ(SafeLogText("12345"), "12345");
  const std::string huge(60 << 20, 'x');
  const std::string capped = SafeLogText(huge);
  EXPECT_LT(capped.size(), kMaxLogMessageBytes + 64);
  EXPECT_NE(capped.find("more bytes)"), std::string::npos);
}

}  // namespace
}  // namespace fwserve
