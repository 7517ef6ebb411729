// The tokenizer a model's config.json names (`tokenizer`), for everything that turns
// text into token ids and back: `bytes` (token id = byte value) or `rwkv_world`
// (models/tokenizers/world_tokenizer.h, its vocabulary read from the model directory). Torch-free.
//
// Thread-safety: immutable after ForModel; copies share the vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "models/base/config.h"
#include "models/tokenizers/world_tokenizer.h"

namespace fwmodel {

class TextTokenizer {
 public:
  // The tokenizer of `config`, reading any vocabulary file from `dir`. Errors name the
  // file, never `dir`; a vocabulary with ids beyond config.vocab_size is refused.
  static absl::StatusOr<TextTokenizer> ForModel(const ModelConfig& config, const std::string& dir);

  std::vector<int64_t> Encode(std::string_view text) const;
  // The bytes token `id` stands for: one byte for `bytes` ids below 256; the world
  // vocabulary's bytes otherwise; empty for end of text and ids with no bytes.
  std::string TokenBytes(int64_t id) const;
  // The same, as a view into the vocabulary (or a static table of the 256 bytes); valid
  // while this tokenizer (or a copy) lives.
  std::string_view TokenBytesView(int64_t id) const;
  // The id that ends a generation (the world vocabulary's 0), or -1 (bytes: none).
  int64_t end_of_text() const { return world_ != nullptr ? WorldTokenizer::kEndOfText : -1; }
  const char* name() const { return world_ != nullptr ? "rwkv_world" : "bytes"; }

 private:
  std::shared_ptr<const WorldTokenizer> world_;  // null: bytes
};

}  // namespace fwmodel
