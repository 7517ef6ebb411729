// The RWKV "world" tokenizer (BlinkDL's rwkv_vocab_v20230424.txt, 65,529 tokens), as
// BlinkDL's reference TRIE_TOKENIZER computes it: greedy longest match over the UTF-8
// bytes of the text, on a trie of the vocabulary. Id 0 is end of text (it has no bytes);
// byte b alone is id b + 1. Torch-free.
//
// Thread-safety: immutable after Parse; Encode and the accessors may run concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace fwmodel {

class WorldTokenizer {
 public:
  // The vocabulary file's name in a model directory.
  static constexpr const char* kFileName = "rwkv_vocab_v20230424.txt";
  static constexpr int64_t kEndOfText = 0;

  // Parses the vocabulary text strictly: each line is `<id> <literal> <length>`, the
  // literal a Python str ('...' or "...", UTF-8 encoded) or bytes (b'...') literal with
  // Python's escapes, whose byte length must equal <length>; ids are 1, 2, ... in order,
  // byte strings distinct, and every single byte is a token. Errors name the line.
  static absl::StatusOr<WorldTokenizer> Parse(std::string_view text);
  // Reads `dir`/rwkv_vocab_v20230424.txt. Errors name the file, never `dir`.
  static absl::StatusOr<WorldTokenizer> LoadFromDirectory(const std::string& dir);

  // Greedy longest match; never fails (every byte is a token).
  std::vector<int64_t> Encode(std::string_view text) const;
  // The bytes of token `id`; empty for end of text and ids outside the vocabulary.
  std::string_view TokenBytes(int64_t id) const;
  // The concatenated bytes of `ids` (not necessarily valid UTF-8).
  std::string DecodeBytes(const std::vector<int64_t>& ids) const;
  // Largest token id (65,529 for rwkv_vocab_v20230424.txt).
  int64_t max_id() const { return static_cast<int64_t>(tokens_.size()) - 1; }

 private:
  WorldTokenizer() = default;
  // tokens_[id]: the bytes of id (tokens_[0] empty).
  std::vector<std::string> tokens_;
  // Trie: edge (node << 8 | byte) -> child node; node 0 is the root.
  absl::flat_hash_map<uint64_t, int32_t> edges_;
  // token_of_[node]: the id ending at node, or 0.
  std::vector<int32_t> token_of_;
};

}  // namespace fwmodel
