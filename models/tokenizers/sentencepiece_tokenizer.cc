// Kept out of unity builds and free of absl: libsentencepiece's header declares its own
// absl::string_view (std::string_view), which Debian's absl (a class of its own) makes
// ambiguous in any file that includes both.
#include "models/tokenizers/sentencepiece_tokenizer.h"

#include <fstream>
#include <sstream>

#if __has_include(<sentencepiece_processor.h>)
#define FWSERVE_HAVE_SENTENCEPIECE 1

#include <dlfcn.h>

#include <new>
#include <utility>

#include <sentencepiece_processor.h>
#endif

namespace fwmodel {

#ifdef FWSERVE_HAVE_SENTENCEPIECE

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FWSERVE_SENTENCEPIECE_NO_DEEPBIND 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define FWSERVE_SENTENCEPIECE_NO_DEEPBIND 1
#endif
#endif

namespace {

namespace spm = ::sentencepiece;

// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's stand-in for a space.
constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";

// libsentencepiece, loaded once and never unloaded. This file links nothing of it: a
// virtual member is called through the object's vtable, every other function through a
// pointer found here, and nothing else of the library may be named (the link would fail).
struct Library {
  std::string error;  // empty: loaded
  // SentencePieceProcessor::SentencePieceProcessor(), on storage of sizeof the class.
  void (*construct)(void*) = nullptr;
  // util::Status::~Status() and util::Status::error_message().
  void (*destroy_status)(void*) = nullptr;
  const char* (*status_message)(const void*) = nullptr;
};

const Library& TheLibrary() {
  static const Library* const library = [] {
    auto* lib = new Library;
    int flags = RTLD_NOW | RTLD_LOCAL;
#ifndef FWSERVE_SENTENCEPIECE_NO_DEEPBIND
    flags |= RTLD_DEEPBIND;
#endif
    void* handle = dlopen(SentencePieceTokenizer::kLibrary, flags);
    if (handle == nullptr) {
      const char* why = dlerror();
      lib->error = why != nullptr ? why : "dlopen failed";
      return lib;
    }
    auto find = [&](const char* name) {
      void* symbol = dlsym(handle, name);
      if (symbol == nullptr && lib->error.empty()) {
        lib->error = std::string(SentencePieceTokenizer::kLibrary) + " has no " + name;
      }
      return symbol;
    };
    lib->construct =
        reinterpret_cast<void (*)(void*)>(find("_ZN13sentencepiece22SentencePieceProcessorC1Ev"));
    lib->destroy_status =
        reinterpret_cast<void (*)(void*)>(find("_ZN13sentencepiece4util6StatusD1Ev"));
    lib->status_message = reinterpret_cast<const char* (*)(const void*)>(
        find("_ZNK13sentencepiece4util6Status13error_messageEv"));
    // Its LOG(INFO/WARNING/ERROR) off (LOG(FATAL) still aborts): the library writes them
    // to std::cerr, which a deep-bound library may see unconstructed (an executable's
    // copy-relocated std::cerr is the one that is constructed).
    auto set_min_log_level =
        reinterpret_cast<void (*)(int)>(find("_ZN13sentencepiece7logging14SetMinLogLevelEi"));
    if (lib->error.empty()) set_min_log_level(3);
    return lib;
  }();
  return *library;
}

// A util::Status the library returned, destroyed by the library: constructed in place
// from the call's result (no copy), never destroyed by code of this file.
class ReturnedStatus {
 public:
  template <typename Call>
  explicit ReturnedStatus(Call&& call) {
    new (&slot_.status) spm::util::Status(call());
  }
  ~ReturnedStatus() { TheLibrary().destroy_status(&slot_.status); }
  ReturnedStatus(const ReturnedStatus&) = delete;
  ReturnedStatus& operator=(const ReturnedStatus&) = delete;

  bool ok() const { return slot_.status.ok(); }
  std::string message() const {
    const char* message = TheLibrary().status_message(&slot_.status);
    return message != nullptr ? message : "";
  }

 private:
  union Slot {
    Slot() {}
    ~Slot() {}
    spm::util::Status status;
  } slot_;
};

// "<0xNN>" -> NN, or -1.
int ByteOfPiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace

// The library's processor, constructed by the library in storage of ours.
struct SentencePieceTokenizer::Processor {
  explicit Processor(const Library& lib) {
    void* storage = ::operator new(sizeof(spm::SentencePieceProcessor));
    try {
      lib.construct(storage);
    } catch (...) {
      ::operator delete(storage);
      throw;
    }
    sp = static_cast<spm::SentencePieceProcessor*>(storage);
  }
  ~Processor() {
    sp->~SentencePieceProcessor();  // virtual: the library's destructor
    ::operator delete(static_cast<void*>(sp));
  }
  Processor(const Processor&) = delete;
  Processor& operator=(const Processor&) = delete;

  // DecodeIds: the library's text of `ids` (empty on an error).
  std::string Decode(const std::vector<int>& ids) const {
    std::string text;
    ReturnedStatus status([&] { return sp->Decode(ids, &text); });
    return status.ok() ? text : std::string();
  }

  spm::SentencePieceProcessor* sp = nullptr;
};

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::LoadFromSerialized(
    std::string_view model, const std::string& name, std::string* error) {
  const Library& lib = TheLibrary();
  if (!lib.error.empty()) {
    *error = name + ": the SentencePiece library cannot be loaded: " + lib.error;
    return nullptr;
  }
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer);
  t->processor_ = std::make_unique<Processor>(lib);
  spm::SentencePieceProcessor& sp = *t->processor_->sp;
  // From the bytes, not the path: the library's messages never name a directory.
  ReturnedStatus loaded([&] { return sp.LoadFromSerializedProto(model); });
  if (!loaded.ok()) {
    std::string why = loaded.message();
    if (why.find("ParseFromArray") != std::string::npos) why = "it does not parse";
    while (!why.empty() && why.back() == ' ') why.pop_back();
    *error = name + ": not a valid SentencePiece model (" + why + ")";
    return nullptr;
  }
  const int pieces = sp.GetPieceSize();
  if (pieces <= 0) {
    *error = name + ": the SentencePiece model has no pieces";
    return nullptr;
  }
  t->bos_id_ = sp.bos_id();
  t->eos_id_ = sp.eos_id();
  t->unk_id_ = sp.unk_id();
  t->offsets_.reserve(static_cast<size_t>(pieces) + 1);
  t->leading_space_.assign(static_cast<size_t>(pieces), false);
  t->offsets_.push_back(0);
  for (int id = 0; id < pieces; ++id) {
    if (sp.IsControl(id)) {
      // <s>, </s>, <pad>: no bytes.
    } else if (sp.IsUnknown(id)) {
      t->bytes_ += t->processor_->Decode({id});  // the unknown surface
    } else if (sp.IsByte(id)) {
      const int byte = ByteOfPiece(sp.IdToPiece(id));
      if (byte < 0) {
        *error = name + ": byte piece " + std::to_string(id) + " is not <0xNN>";
        return nullptr;
      }
      t->bytes_.push_back(static_cast<char>(byte));
    } else {
      std::string_view piece = sp.IdToPiece(id);
      t->leading_space_[static_cast<size_t>(id)] =
          piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol;
      for (size_t at = piece.find(kSpaceSymbol); at != std::string_view::npos;
           at = piece.find(kSpaceSymbol)) {
        t->bytes_.append(piece.substr(0, at)).push_back(' ');
        piece.remove_prefix(at + kSpaceSymbol.size());
      }
      t->bytes_.append(piece);
    }
    if (t->bytes_.size() > UINT32_MAX) {
      *error = name + ": the pieces' text is too large";
      return nullptr;
    }
    t->offsets_.push_back(static_cast<uint32_t>(t->bytes_.size()));
  }
  // Whether DecodeIds drops a text's leading space: decode a piece that begins with one
  // (and, with a piece of ▁ alone, whether the next piece's is dropped too).
  int spaced = -1, bare = -1;
  for (int id = 0; id < pieces; ++id) {
    if (!t->leading_space_[static_cast<size_t>(id)]) continue;
    if (t->TokenBytes(id) == " ") {
      if (bare < 0) bare = id;
    } else if (spaced < 0) {
      spaced = id;
    }
  }
  if (spaced >= 0) {
    const std::string_view bytes = t->TokenBytes(spaced);
    t->drops_leading_space_ = t->processor_->Decode({spaced}) == bytes.substr(1);
    if (t->drops_leading_space_ && bare >= 0) {
      t->drops_every_leading_space_ = t->processor_->Decode({bare, spaced}) == bytes.substr(1);
    }
  } else if (bare >= 0) {
    t->drops_leading_space_ = t->processor_->Decode({bare}).empty();
  }
  return t;
}

std::vector<int64_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  // Encode fills `ids` with the library's operator new, bound inside the library: the
  // same as everyone's (libstdc++'s) unless an executable replaces operator new, which
  // nothing in fwserve does.
  std::vector<int> ids;
  ReturnedStatus status([&] { return processor_->sp->Encode(text, &ids); });
  if (!status.ok()) return {};
  return std::vector<int64_t>(ids.begin(), ids.end());
}

#else  // !FWSERVE_HAVE_SENTENCEPIECE

struct SentencePieceTokenizer::Processor {};

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::LoadFromSerialized(
    std::string_view, const std::string& name, std::string* error) {
  *error = name + ": fwserve was built without SentencePiece (libsentencepiece-dev)";
  return nullptr;
}

std::vector<int64_t> SentencePieceTokenizer::Encode(std::string_view) const { return {}; }

#endif  // FWSERVE_HAVE_SENTENCEPIECE

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::LoadFromDirectory(
    const std::string& dir, std::string* error) {
  std::ifstream in(dir + "/" + kFileName, std::ios::binary);
  if (!in) {
    *error = std::string("cannot read ") + kFileName + " in the model directory";
    return nullptr;
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    *error = std::string("cannot read ") + kFileName + " in the model directory";
    return nullptr;
  }
  return LoadFromSerialized(contents.str(), kFileName, error);
}

std::string_view SentencePieceTokenizer::TokenBytesAtStart(int64_t id, bool* at_text_start) const {
  std::string_view bytes = TokenBytes(id);
  if (!*at_text_start) return bytes;
  if (drops_leading_space_ && !bytes.empty() && leading_space_[static_cast<size_t>(id)]) {
    bytes.remove_prefix(1);
    // A piece of ▁ alone: the text is still empty, and only remove_extra_whitespaces
    // drops the next piece's space as well.
    *at_text_start = bytes.empty() && drops_every_leading_space_;
    return bytes;
  }
  *at_text_start = bytes.empty();
  return bytes;
}

}  // namespace fwmodel
