// The tokenizer a model's config.json names (`tokenizer`), for everything that turns
// text into token ids and back: `bytes` (token id = byte value), `rwkv_world`
// (models/tokenizers/world_tokenizer.h, its vocabulary read from the model directory) or
// `sentencepiece` (models/tokenizers/sentencepiece_tokenizer.h, the directory's
// tokenizer.model through libsentencepiece). Torch-free.
//
// A generated text continues its prompt: TokenBytesView is a token's bytes inside a text,
// leading space included (SentencePiece's "▁" as a space); TokenBytesAtStart is the one
// for a text that starts from nothing, dropping the leading space SentencePiece's decoder
// drops (the two differ only for sentencepiece, only at a text's start).
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
#include "models/tokenizers/sentencepiece_tokenizer.h"
#include "models/tokenizers/world_tokenizer.h"

namespace fwmodel {

class TextTokenizer {
 public:
  // The tokenizer of `config`, reading any vocabulary file from `dir`. Errors name the
  // file, never `dir`; a vocabulary with ids beyond config.vocab_size is refused.
  static absl::StatusOr<TextTokenizer> ForModel(const ModelConfig& config, const std::string& dir);

  // No BOS or EOS is added (sentencepiece: libsentencepiece's EncodeAsIds).
  std::vector<int64_t> Encode(std::string_view text) const;
  // The bytes token `id` stands for inside a text: one byte for `bytes` ids below 256;
  // the vocabulary's bytes otherwise; empty for end of text, control pieces and ids with
  // no bytes.
  std::string TokenBytes(int64_t id) const;
  // The same, as a view into the vocabulary (or a static table of the 256 bytes); valid
  // while this tokenizer (or a copy) lives. No allocation.
  std::string_view TokenBytesView(int64_t id) const;
  // The bytes of `id` when it may begin a text that starts from nothing: while
  // *at_text_start, sentencepiece drops the leading space its decoder drops; the flag
  // stays true until the text has a byte (start a text with true). The concatenation,
  // decoded by a Utf8StreamDecoder, is libsentencepiece's DecodeIds of the whole sequence
  // for valid UTF-8 (sentencepiece_tokenizer.h says where they differ).
  std::string_view TokenBytesAtStart(int64_t id, bool* at_text_start) const;
  // The id that ends a generation: the world vocabulary's 0, sentencepiece's
  // config.eos_token_id, or -1 (bytes: none).
  int64_t end_of_text() const { return end_of_text_; }
  // The id a prompt that starts a fresh state begins with: sentencepiece's
  // config.bos_token_id (its Llama/Mistral-family models were trained with it at the
  // start of every sequence, as Hugging Face's tokenizer adds it), else -1 (none: the
  // byte and world vocabularies' models were trained without one). Not added by Encode.
  int64_t begin_of_text() const { return begin_of_text_; }
  const char* name() const {
    return world_ != nullptr ? "rwkv_world" : sentencepiece_ != nullptr ? "sentencepiece" : "bytes";
  }

 private:
  std::shared_ptr<const WorldTokenizer> world_;                  // null: not rwkv_world
  std::shared_ptr<const SentencePieceTokenizer> sentencepiece_;  // null: not sentencepiece
  int64_t end_of_text_ = -1;
  int64_t begin_of_text_ = -1;
};

}  // namespace fwmodel
