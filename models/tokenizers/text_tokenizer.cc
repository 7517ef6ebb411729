#include "models/tokenizers/text_tokenizer.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "models/tokenizers/tokenizer.h"

namespace fwmodel {

absl::StatusOr<TextTokenizer> TextTokenizer::ForModel(const ModelConfig& config,
                                                      const std::string& dir) {
  TextTokenizer t;
  if (config.tokenizer == "bytes") return t;
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
  return t;
}

std::vector<int64_t> TextTokenizer::Encode(std::string_view text) const {
  return world_ != nullptr ? world_->Encode(text) : EncodeBytes(text);
}

std::string TextTokenizer::TokenBytes(int64_t id) const { return std::string(TokenBytesView(id)); }

std::string_view TextTokenizer::TokenBytesView(int64_t id) const {
  if (world_ != nullptr) return world_->TokenBytes(id);
  if (id < 0 || id > 255) return {};
  static const std::array<char, 256> kBytes = [] {
    std::array<char, 256> bytes{};
    for (int b = 0; b < 256; ++b) bytes[b] = static_cast<char>(b);
    return bytes;
  }();
  return std::string_view(&kBytes[static_cast<size_t>(id)], 1);
}

}  // namespace fwmodel
