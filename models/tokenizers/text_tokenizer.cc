#include "models/tokenizers/text_tokenizer.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "models/base/file_util.h"
#include "models/tokenizers/tokenizer.h"

namespace fwmodel {

absl::StatusOr<TextTokenizer> TextTokenizer::ForModel(const ModelConfig& config,
                                                      const std::string& dir) {
  TextTokenizer t;
  if (config.tokenizer == "bytes") return t;
  if (config.tokenizer == "sentencepiece") {
    const char* file = SentencePieceTokenizer::kFileName;
    auto model = ReadFile(dir + "/" + file);
    if (!model.ok()) {
      return absl::Status(model.status().code(),
                          absl::StrCat("cannot read ", file, " in the model directory"));
    }
    std::string error;
    std::shared_ptr<const SentencePieceTokenizer> sp =
        SentencePieceTokenizer::LoadFromSerialized(*model, file, &error);
    if (sp == nullptr) return absl::InvalidArgumentError(error);
    if (sp->piece_count() > config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": its ", sp->piece_count(),
                                                     " pieces do not fit the model's vocab_size ",
                                                     config.vocab_size));
    }
    t.sentencepiece_ = std::move(sp);
    t.end_of_text_ = config.eos_token_id;
    t.begin_of_text_ = config.bos_token_id;
    return t;
  }
  if (config.tokenizer != "rwkv_world") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: tokenizer \"", config.tokenizer, "\" is not supported"));
  }
  auto world = WorldTokenizer::LoadFromDirectory(dir);
  if (!world.ok()) return world.status();
  if (world->max_id() >= config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(WorldTokenizer::kFileName, ": token ids up to ", world->max_id(),
                     " do not fit the model's vocab_size ", config.vocab_size));
  }
  t.world_ = std::make_shared<const WorldTokenizer>(std::move(*world));
  t.end_of_text_ = WorldTokenizer::kEndOfText;
  return t;
}

std::vector<int64_t> TextTokenizer::Encode(std::string_view text) const {
  if (world_ != nullptr) return world_->Encode(text);
  if (sentencepiece_ != nullptr) return sentencepiece_->Encode(text);
  return EncodeBytes(text);
}

std::string TextTokenizer::TokenBytes(int64_t id) const { return std::string(TokenBytesView(id)); }

std::string_view TextTokenizer::TokenBytesView(int64_t id) const {
  if (world_ != nullptr) return world_->TokenBytes(id);
  if (sentencepiece_ != nullptr) return sentencepiece_->TokenBytes(id);
  if (id < 0 || id > 255) return {};
  static const std::array<char, 256> kBytes = [] {
    std::array<char, 256> bytes{};
    for (int b = 0; b < 256; ++b) bytes[b] = static_cast<char>(b);
    return bytes;
  }();
  return std::string_view(&kBytes[static_cast<size_t>(id)], 1);
}

std::string_view TextTokenizer::TokenBytesAtStart(int64_t id, bool* at_text_start) const {
  if (sentencepiece_ != nullptr) return sentencepiece_->TokenBytesAtStart(id, at_text_start);
  const std::string_view bytes = TokenBytesView(id);
  if (!bytes.empty()) *at_text_start = false;
  return bytes;
}

}  // namespace fwmodel
