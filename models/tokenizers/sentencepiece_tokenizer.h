// A SentencePiece model (`tokenizer.model` in the model directory), encoded by Debian's
// libsentencepiece (0.1.97: libsentencepiece0, headers in libsentencepiece-dev) exactly as
// its SentencePieceProcessor::EncodeAsIds does, with a table of the bytes each token stands
// for, made at load. Torch-free, and free of absl and of libsentencepiece's headers (see
// below), so that any file may include it.
//
// The library is loaded at the first Load, with dlopen(RTLD_LOCAL | RTLD_DEEPBIND), never
// linked: Debian's libsentencepiece.so.0 carries its own protobuf-lite 3.14 and its own
// stand-in absl flags (FLAGS_help, FLAGS_version, ...), every symbol exported. Linked into
// a process that also has Debian's libprotobuf 3.21 (gRPC) and absl flags, as fwserve has,
// the two copies interpose on each other: protobuf aborts at the first model load
// ("compiled against version 3.14.0 ... not compatible with the installed version
// (3.21.12)") or crashes, and absl::ParseCommandLine hangs on the interposed FLAGS_help.
// Loaded locally and bound deep, its references stay inside it and nothing else sees its
// symbols. So nothing else in the process may link libsentencepiece (a test's reference
// encoder runs in another process). Under AddressSanitizer, which refuses RTLD_DEEPBIND,
// it is loaded without it (the sanitized build runs no SentencePiece model).
//
// Token bytes (TokenBytes): the bytes a token adds to a text that already has some: a
// byte-fallback piece <0xNN> is that byte; a normal piece (also user-defined and unused
// ones) is its text with every U+2581 (▁, SentencePiece's stand-in for a space) as a
// space; control pieces (<s>, </s>, <pad>) are empty; the unknown piece is the model's
// unknown surface (" ⁇ " unless the trainer set another), what DecodeIds gives for it. So
// a multi-byte character that fell back to bytes is spread over several tokens, each one
// byte of it: a streaming decoder (models/tokenizers/tokenizer.h) assembles it.
//
// The leading space: SentencePiece's normalizer turns spaces into ▁ and, with
// add_dummy_prefix (the default), puts one before the text; its decoder drops the ▁ that
// begins the first piece of the text (with remove_extra_whitespaces, the default too, each
// ▁ that begins a piece while the text is still empty). TokenBytesAtStart follows that
// rule for a text that starts from nothing: the bytes of each token, through a
// Utf8StreamDecoder, give DecodeIds' text of the whole sequence (up to the bytes of
// invalid UTF-8, which DecodeIds replaces by one U+FFFD each and the stream decoder by one
// per maximal subpart; a model's denormalizer, rare, is not applied). TokenBytes is the
// rule for a text that continues one: a generation after its prompt gets the bytes
// DecodeIds(prompt + generated) adds to DecodeIds(prompt), the leading space included.
//
// Thread-safety: immutable after Load; Encode and the accessors may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fwmodel {

class SentencePieceTokenizer {
 public:
  // The model file's name in a model directory.
  static constexpr const char* kFileName = "tokenizer.model";
  // The library loaded (by SONAME, through the loader's search path).
  static constexpr const char* kLibrary = "libsentencepiece.so.0";

  // Reads `dir`/tokenizer.model. Null with *error set when the file cannot be read, is
  // not a SentencePiece model, or the library cannot be loaded; errors name
  // tokenizer.model, never `dir`.
  static std::unique_ptr<SentencePieceTokenizer> LoadFromDirectory(const std::string& dir,
                                                                   std::string* error);
  // The same from the file's contents (`name` is what errors call it).
  static std::unique_ptr<SentencePieceTokenizer> LoadFromSerialized(std::string_view model,
                                                                    const std::string& name,
                                                                    std::string* error);
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  // SentencePieceProcessor::EncodeAsIds: no BOS or EOS added. Invalid UTF-8 is the
  // library's to handle; empty only for an empty text (or an internal library error).
  std::vector<int64_t> Encode(std::string_view text) const;
  // The token's bytes inside a text (see above): a view into a table made at load, no
  // allocation; empty for ids outside the vocabulary.
  std::string_view TokenBytes(int64_t id) const {
    if (id < 0 || id >= piece_count()) return {};
    const size_t i = static_cast<size_t>(id);
    return std::string_view(bytes_.data() + offsets_[i], offsets_[i + 1] - offsets_[i]);
  }
  // The token's bytes when it may begin a text that starts from nothing: while
  // *at_text_start, the leading space DecodeIds drops is dropped, and *at_text_start
  // stays true until the text has a byte. Start a text with *at_text_start = true.
  std::string_view TokenBytesAtStart(int64_t id, bool* at_text_start) const;

  // Pieces in the model (ids 0 .. piece_count() - 1).
  int64_t piece_count() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  // The model's special ids, -1 when it has none.
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t unk_id() const { return unk_id_; }
  // Whether the model's decoder drops a text's leading space (add_dummy_prefix or
  // remove_extra_whitespaces), found by decoding at load.
  bool drops_leading_space() const { return drops_leading_space_; }

 private:
  struct Processor;
  SentencePieceTokenizer() = default;

  std::unique_ptr<Processor> processor_;
  // Token id's bytes: bytes_[offsets_[id], offsets_[id + 1]).
  std::string bytes_;
  std::vector<uint32_t> offsets_;
  // Per id: whether the piece begins with ▁ (its bytes with a space) and is not a byte,
  // control or unknown piece: the ones whose leading space DecodeIds may drop.
  std::vector<bool> leading_space_;
  int64_t bos_id_ = -1;
  int64_t eos_id_ = -1;
  int64_t unk_id_ = -1;
  bool drops_leading_space_ = false;
  // With remove_extra_whitespaces, a piece of ▁ alone at the start leaves the text empty
  // and the next piece's leading space is dropped too.
  bool drops_every_leading_space_ = false;
};

}  // namespace fwmodel
