// libFuzzer targets for the parsers that read untrusted bytes. Built with clang
// -fsanitize=fuzzer they fuzz; built normally (tests/fuzz/regression_main.cc) they
// replay the seed corpora under tests/fuzz/corpus as ctest regression tests.
//
// Selected with FWSERVE_FUZZ_TARGET at compile time: safetensors, config, utf8, api_keys.
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "server/tenancy/tenants.h"
#include "server/base/utf8.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
#if defined(FWSERVE_FUZZ_SAFETENSORS)
  auto file = fwmodel::SafetensorsFile::Parse(input);
  if (file.ok()) {
    // Every accepted tensor must lie inside the buffer: touch all of its bytes.
    for (const auto& [name, view] : file->tensors()) {
      volatile float sink = 0;
      for (float f : view.ToFloat32()) sink = sink + f;
    }
  }
#elif defined(FWSERVE_FUZZ_CONFIG)
  auto config = fwmodel::ParseModelConfig(input);
  if (config.ok()) {
    // Accepted configs are valid and round-trip through the canonical form.
    if (!config->Validate().ok()) __builtin_trap();
    auto again = fwmodel::ParseModelConfig(fwmodel::ModelConfigToJson(*config));
    if (!again.ok() || !(*again == *config)) __builtin_trap();
  }
#elif defined(FWSERVE_FUZZ_UTF8)
  // Streamed output is always valid UTF-8 and equals the whole-input decode.
  fwmodel::Utf8StreamDecoder decoder;
  std::string streamed;
  for (char c : input) streamed += decoder.Push(static_cast<uint8_t>(c));
  streamed += decoder.Finish();
  if (streamed != fwmodel::DecodeBytesLossy(input)) __builtin_trap();
  if (fwmodel::DecodeBytesLossy(streamed) != streamed) __builtin_trap();
  // The server's request validator agrees with the decoder: input is valid UTF-8 exactly
  // when decoding leaves it unchanged, and the decoder's output is always valid.
  const bool valid = fwserve::FirstInvalidUtf8Offset(input) == -1;
  if (valid != (fwmodel::DecodeBytesLossy(input) == input)) __builtin_trap();
  if (fwserve::FirstInvalidUtf8Offset(streamed) != -1) __builtin_trap();
#elif defined(FWSERVE_FUZZ_API_KEYS)
  // An accepted --api-keys-file is consistent: every credential names a listed tenant,
  // tenant names are valid and unique, quotas are finite and non-negative, and the
  // table answers for each listed certificate.
  auto table = fwserve::ParseApiKeys(input);
  if (table.ok()) {
    if (table->keys.empty() && table->certificates.empty()) __builtin_trap();
    for (size_t i = 0; i < table->tenants.size(); ++i) {
      const auto& tenant = table->tenants[i];
      if (!fwserve::IsValidTenantName(tenant.name)) __builtin_trap();
      for (size_t j = 0; j < i; ++j) {
        if (table->tenants[j].name == tenant.name) __builtin_trap();
      }
      if (tenant.quota.max_sessions < 0 || tenant.quota.max_streams < 0 ||
          !(tenant.quota.tokens_per_second >= 0)) {
        __builtin_trap();
      }
    }
    for (const auto& key : table->keys) {
      if (key.tenant >= table->tenants.size()) __builtin_trap();
    }
    auto tenants = fwserve::Tenants::FromText(input);
    if (!tenants.ok()) __builtin_trap();
    for (const auto& certificate : table->certificates) {
      if (certificate.tenant >= table->tenants.size()) __builtin_trap();
      auto owner = (*tenants)->TenantOfCertificate(certificate.common_name);
      if (!owner.ok() || *owner != table->tenants[certificate.tenant].name) __builtin_trap();
    }
    if ((*tenants)->TenantOfKey("").ok()) __builtin_trap();
  }
#else
#error "define one FWSERVE_FUZZ_* target"
#endif
  return 0;
}
