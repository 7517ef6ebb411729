#include "server/base/utf8.h"

namespace fwserve {

int64_t FirstInvalidUtf8Offset(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    unsigned char low = 0x80, high = 0xBF;  // bounds of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) low = 0xA0;
      if (c == 0xED) high = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) low = 0x90;
      if (c == 0xF4) high = 0x8F;
    } else {
      return static_cast<int64_t>(i);
    }
    if (i + length > n) return static_cast<int64_t>(i);
    if (s[i + 1] < low || s[i + 1] > high) return static_cast<int64_t>(i);
    for (size_t k = 2; k < length; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return static_cast<int64_t>(i);
    }
    i += length;
  }
  return -1;
}

}  // namespace fwserve
