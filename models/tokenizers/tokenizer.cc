#include "models/tokenizers/tokenizer.h"

namespace fwmodel {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Sequence length implied by a lead byte, or 0 if the byte cannot start a character.
int LeadLength(uint8_t b) {
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

// Whether `b` may follow `lead` as the continuation byte at `position` (1-based).
bool ValidContinuation(uint8_t lead, size_t position, uint8_t b) {
  if (position == 1) {
    switch (lead) {
      case 0xE0:
        return b >= 0xA0 && b <= 0xBF;
      case 0xED:
        return b >= 0x80 && b <= 0x9F;
      case 0xF0:
        return b >= 0x90 && b <= 0xBF;
      case 0xF4:
        return b >= 0x80 && b <= 0x8F;
      default:
        break;
    }
  }
  return b >= 0x80 && b <= 0xBF;
}

}  // namespace

std::vector<int64_t> EncodeBytes(std::string_view text) {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

std::string Utf8StreamDecoder::Push(int64_t token) {
  std::string out;
  if (token < 0 || token > 255) {
    out = Finish();
    out += kReplacement;
    return out;
  }
  const uint8_t b = static_cast<uint8_t>(token);
  if (!pending_.empty()) {
    if (ValidContinuation(static_cast<uint8_t>(pending_[0]), pending_.size(), b)) {
      pending_.push_back(static_cast<char>(b));
      if (static_cast<int>(pending_.size()) == needed_) {
        out.swap(pending_);
        needed_ = 0;
      }
      return out;
    }
    // The held bytes are a maximal subpart: one replacement, then reconsider `b`.
    out = kReplacement;
    pending_.clear();
    needed_ = 0;
  }
  const int length = LeadLength(b);
  if (length == 1) {
    out.push_back(static_cast<char>(b));
  } else if (length == 0) {
    out += kReplacement;
  } else {
    pending_.push_back(static_cast<char>(b));
    needed_ = length;
  }
  return out;
}

std::string Utf8StreamDecoder::PushBytes(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += Push(static_cast<uint8_t>(c));
  return out;
}

std::string Utf8StreamDecoder::Finish() {
  if (pending_.empty()) return "";
  pending_.clear();
  needed_ = 0;
  return kReplacement;
}

std::string DecodeBytesLossy(std::string_view bytes) {
  Utf8StreamDecoder decoder;
  std::string out;
  for (char c : bytes) out += decoder.Push(static_cast<uint8_t>(c));
  out += decoder.Finish();
  return out;
}

}  // namespace fwmodel
