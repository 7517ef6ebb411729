// Input checks shared by the core's entry points. Torch-free.
#pragma once

#include <cstdint>
#include <string_view>

namespace fwserve {

// Offset of the first byte that is not part of a well-formed UTF-8 sequence (Unicode
// 15, table 3-7: no overlongs, no surrogates, nothing above U+10FFFF), or -1.
int64_t FirstInvalidUtf8Offset(std::string_view text);

}  // namespace fwserve
