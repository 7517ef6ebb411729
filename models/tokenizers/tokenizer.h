// The `bytes` tokenizer (token id = byte value of the UTF-8 text) and an incremental
// UTF-8 decoder for streaming generated tokens back to text. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fwmodel {

// Token id = byte value. Encode never fails: any byte string is a valid input.
std::vector<int64_t> EncodeBytes(std::string_view text);

// Turns a stream of byte tokens into valid UTF-8 text, piece by piece.
//
// Contract: the concatenation of every Push() result and the final Finish() equals
// the whole byte stream decoded with U+FFFD substitution of maximal subparts
// (Unicode 15, section 3.9, "U+FFFD Substitution of Maximal Subparts"). A multi-byte
// character is never split across two results: bytes of an incomplete character are
// held back until the character completes or is proven invalid.
// Not thread-safe; one decoder per stream.
class Utf8StreamDecoder {
 public:
  // Feeds one byte (token ids >= 256 are not bytes and decode as U+FFFD).
  // Returns the text that became complete.
  std::string Push(int64_t token);
  // Feeds the bytes of one multi-byte token (the world tokenizer's TokenBytes), byte by
  // byte as Push does: the result never ends inside a character, whatever the token
  // boundaries. Returns the text that became complete.
  std::string PushBytes(std::string_view bytes);
  // Push and PushBytes, appending the text to `*out` (no temporary; an ASCII byte with
  // nothing held back is one push_back).
  void Append(int64_t token, std::string* out) {
    if (pending_.empty() && token >= 0 && token < 0x80) {
      out->push_back(static_cast<char>(token));
      return;
    }
    out->append(Push(token));
  }
  void AppendBytes(std::string_view bytes, std::string* out) {
    for (char c : bytes) Append(static_cast<uint8_t>(c), out);
  }
  // Flushes a trailing incomplete sequence as U+FFFD. The decoder is reset.
  std::string Finish();
  // Bytes held back waiting for the rest of a character (0 to 3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::string pending_;
  int needed_ = 0;  // total length of the character being assembled
};

// Decodes a complete byte string the same way (for tests and tools).
std::string DecodeBytesLossy(std::string_view bytes);

}  // namespace fwmodel
