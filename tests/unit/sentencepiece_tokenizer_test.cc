// SentencePiece models (models/tokenizers/sentencepiece_tokenizer.h) against
// libsentencepiece itself: small BPE models with byte fallback trained on
// tinyshakespeare by SentencePieceTrainer, and the reference ids and texts of
// SentencePieceProcessor's EncodeAsIds and DecodeIds, all from
// fwserve_sentencepiece_reference (tests/unit/sentencepiece_reference.cc), run as a
// process of its own: this process must not link libsentencepiece. It links what
// fwserve has that clashes with the library (libprotobuf, absl flags) and uses both after
// the library was loaded.
#include "models/tokenizers/sentencepiece_tokenizer.h"

#include <dlfcn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <gtest/gtest.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "models/base/config.h"
#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"
#include "server/engine/stream_task.h"
#include "tests/unit/temp_dir.h"

ABSL_FLAG(int, sentencepiece_test_flag, 1, "parsed after libsentencepiece was loaded");

namespace fwmodel {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void WriteAll(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

// Runs the reference tool; its output and errors go to `dir`/reference.log.
void RunReference(const std::string& dir, const std::vector<std::string>& args) {
  std::string command = "'" FWSERVE_SENTENCEPIECE_REFERENCE "'";
  for (const std::string& arg : args) command += " '" + arg + "'";
  command += " >>'" + dir + "/reference.log' 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n"
                                                             << ReadAll(dir + "/reference.log");
}

// A length-prefixed text ("LENGTH\n" then the bytes) from `in`.
std::string ReadText(std::istream& in) {
  size_t length = 0;
  in >> length;
  in.get();  // the newline
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  return text;
}

struct Reference {
  std::vector<int64_t> ids;  // EncodeAsIds
  std::string decoded;       // DecodeIds(ids)
};

// A model trained in its own directory, as a model directory holds it (tokenizer.model).
class Model {
 public:
  // `options`: trainer flags beyond the corpus, the vocabulary and byte fallback.
  Model(const std::string& tag, const std::string& options) : dir_(fwtest::MakeTempDir(tag)) {
    // A few KB of Shakespeare, and a line with accents so that some non-ASCII characters
    // are pieces while the rest of Unicode falls back to bytes.
    std::string corpus = ReadAll(FWSERVE_SOURCE_DIR "/models/data/tinyshakespeare.txt");
    corpus.resize(std::min<size_t>(corpus.size(), 8000));
    for (int i = 0; i < 20; ++i) corpus += "\nCafé, élève, déjà vu: l'été à la française.\n";
    WriteAll(dir_ + "/corpus.txt", corpus);
    RunReference(dir_, {"train", "--input=" + dir_ + "/corpus.txt --model_prefix=" + dir_ +
                                     "/tokenizer --model_type=bpe --vocab_size=400 "
                                     "--byte_fallback=true --num_threads=1 --minloglevel=1 " +
                                     options});
    std::string error;
    tokenizer_ = SentencePieceTokenizer::LoadFromDirectory(dir_, &error);
    EXPECT_NE(tokenizer_, nullptr) << error;
  }

  const std::string& dir() const { return dir_; }
  const SentencePieceTokenizer& tokenizer() const { return *tokenizer_; }

  // EncodeAsIds and DecodeIds of each text.
  std::vector<Reference> Encode(const std::vector<std::string>& texts) const {
    std::string in;
    for (const std::string& text : texts) in += text + '\0';
    WriteAll(dir_ + "/texts.bin", in);
    RunReference(dir_,
                 {"encode", dir_ + "/tokenizer.model", dir_ + "/texts.bin", dir_ + "/encoded.bin"});
    std::ifstream out(dir_ + "/encoded.bin", std::ios::binary);
    std::vector<Reference> references(texts.size());
    for (Reference& r : references) {
      size_t n = 0;
      out >> n;
      r.ids.resize(n);
      for (int64_t& id : r.ids) out >> id;
      r.decoded = ReadText(out);
    }
    EXPECT_TRUE(out.good());
    return references;
  }

  // DecodeIds of each sequence.
  std::vector<std::string> Decode(const std::vector<std::vector<int64_t>>& sequences) const {
    std::string in;
    for (const auto& ids : sequences) {
      in += std::to_string(ids.size());
      for (int64_t id : ids) in += " " + std::to_string(id);
      in += "\n";
    }
    WriteAll(dir_ + "/ids.txt", in);
    RunReference(dir_,
                 {"decode", dir_ + "/tokenizer.model", dir_ + "/ids.txt", dir_ + "/decoded.bin"});
    std::ifstream out(dir_ + "/decoded.bin", std::ios::binary);
    std::vector<std::string> texts;
    for (size_t i = 0; i < sequences.size(); ++i) texts.push_back(ReadText(out));
    EXPECT_TRUE(out.good());
    return texts;
  }

 private:
  std::string dir_;
  std::unique_ptr<SentencePieceTokenizer> tokenizer_;
};

// The default normalizer (nmt_nfkc, add_dummy_prefix, remove_extra_whitespaces).
const Model& DefaultModel() {
  static const Model* model = new Model("spm-default", "");
  return *model;
}

// ASCII, spaces where the normalizer removes or keeps them, accents (pieces of the
// vocabulary), CJK, emoji and a ZWJ sequence (byte fallback), NFKC-normalized forms.
const std::vector<std::string>& Texts() {
  static const std::vector<std::string> texts = {
      "First Citizen: Before we proceed any further, hear me speak.",
      "  leading,  double   and trailing spaces  ",
      " one leading space",
      "Café, élève, déjà vu: l'été à la française.",
      "naïve façade où Ærø ß",
      "日本語のテキスト、中文文本",
      "emoji 😀🎉 and a family 👨‍👩‍👧 together",
      "tabs\tand\nnewlines\r\nmixed",
      "ﬁ ligature, ① circled, ｆｕｌｌ width",
      "x",
      "",
  };
  return texts;
}

// The text streamed token by token: bytes through a Utf8StreamDecoder, as StreamTask
// streams them; from the start of a text (TokenBytesAtStart) or inside one (TokenBytes).
std::string Stream(const SentencePieceTokenizer& t, const std::vector<int64_t>& ids,
                   bool from_text_start) {
  Utf8StreamDecoder decoder;
  std::string text;
  bool at_start = from_text_start;
  for (int64_t id : ids) decoder.AppendBytes(t.TokenBytesAtStart(id, &at_start), &text);
  return text + decoder.Finish();
}

TEST(SentencePieceTokenizerTest, EncodesAsEncodeAsIds) {
  const Model& model = DefaultModel();
  const std::vector<Reference> references = model.Encode(Texts());
  for (size_t i = 0; i < Texts().size(); ++i) {
    EXPECT_EQ(model.tokenizer().Encode(Texts()[i]), references[i].ids) << Texts()[i];
  }
  EXPECT_EQ(model.tokenizer().piece_count(), 400);
  EXPECT_EQ(model.tokenizer().unk_id(), 0);
  EXPECT_EQ(model.tokenizer().bos_id(), 1);
  EXPECT_EQ(model.tokenizer().eos_id(), 2);
  EXPECT_TRUE(model.tokenizer().drops_leading_space());
}

// Characters outside the vocabulary fall back to their UTF-8 bytes, one <0xNN> piece
// each: the pieces' bytes are the character's.
TEST(SentencePieceTokenizerTest, CharactersOutsideTheVocabularyFallBackToBytes) {
  const SentencePieceTokenizer& t = DefaultModel().tokenizer();
  for (const std::string character : {"語", "😀", "Ж"}) {
    const std::vector<int64_t> ids = t.Encode("a" + character);
    ASSERT_GT(ids.size(), character.size()) << character;
    std::string bytes;
    for (size_t i = ids.size() - character.size(); i < ids.size(); ++i) {
      EXPECT_EQ(t.TokenBytes(ids[i]).size(), 1u);
      bytes += t.TokenBytes(ids[i]);
    }
    EXPECT_EQ(bytes, character);
  }
  // An accented letter of the corpus is a piece (▁ and é, or ▁é), not two bytes.
  const std::vector<int64_t> ids = t.Encode("é");
  std::string bytes;
  for (int64_t id : ids) bytes += t.TokenBytes(id);
  EXPECT_EQ(bytes, " é");
  EXPECT_LT(ids.size(), 3u);
}

// Streamed from the start of a text, the tokens give DecodeIds' text of the whole
// sequence; streamed as the continuation of a prompt, what DecodeIds(prompt + generated)
// adds to DecodeIds(prompt), whose leading space DecodeIds(generated) alone would drop.
TEST(SentencePieceTokenizerTest, StreamingGivesDecodeIdsText) {
  const Model& model = DefaultModel();
  const SentencePieceTokenizer& t = model.tokenizer();
  const std::vector<Reference> references = model.Encode(Texts());
  for (size_t i = 0; i < Texts().size(); ++i) {
    EXPECT_EQ(Stream(t, references[i].ids, true), references[i].decoded) << Texts()[i];
  }
  const std::vector<int64_t> prompt = t.Encode("Hello there,");
  const std::vector<int64_t> generated = t.Encode("my good friend");
  std::vector<int64_t> whole = prompt;
  whole.insert(whole.end(), generated.begin(), generated.end());
  const std::vector<std::string> decoded = model.Decode({prompt, generated, whole});
  EXPECT_EQ(decoded[1], "my good friend");
  EXPECT_EQ(decoded[2], decoded[0] + " my good friend");
  EXPECT_EQ(Stream(t, generated, false), " my good friend");
  EXPECT_EQ(Stream(t, prompt, true) + Stream(t, generated, false), decoded[2]);
}

// Every token alone from the start of a text, and after "x" (inside one), against
// DecodeIds: byte pieces as their byte (alone, a lone byte >= 0x80 is U+FFFD to both),
// control pieces empty, the unknown piece as " ⁇ ", ▁ as a space.
TEST(SentencePieceTokenizerTest, EachTokensBytesAreWhatDecodeIdsGives) {
  const Model& model = DefaultModel();
  const SentencePieceTokenizer& t = model.tokenizer();
  const std::vector<int64_t> x = t.Encode("x");
  std::vector<std::vector<int64_t>> sequences = {x};
  for (int64_t id = 0; id < t.piece_count(); ++id) {
    sequences.push_back({id});
    sequences.push_back(x);
    sequences.back().push_back(id);
  }
  const std::vector<std::string> decoded = model.Decode(sequences);
  ASSERT_EQ(decoded[0], "x");
  for (int64_t id = 0; id < t.piece_count(); ++id) {
    bool at_start = true;
    EXPECT_EQ(DecodeBytesLossy(t.TokenBytesAtStart(id, &at_start)), decoded[1 + 2 * id]) << id;
    EXPECT_EQ("x" + DecodeBytesLossy(t.TokenBytes(id)), decoded[2 + 2 * id]) << id;
  }
  EXPECT_EQ(t.TokenBytes(t.unk_id()), " \xE2\x81\x87 ");
  EXPECT_EQ(t.TokenBytes(t.bos_id()), "");
  EXPECT_EQ(t.TokenBytes(t.eos_id()), "");
  EXPECT_EQ(t.TokenBytes(-1), "");
  EXPECT_EQ(t.TokenBytes(t.piece_count()), "");
}

// The start of a text: control pieces (BOS) keep it a start; a piece of ▁ alone leaves
// the text empty and, with remove_extra_whitespaces, the next piece loses its space too.
// Each model's normalizer differs: the default, add_dummy_prefix alone, neither.
TEST(SentencePieceTokenizerTest, LeadingSpacesFollowDecodeIdsAtTheStartOfAText) {
  static const Model* dummy_only = new Model("spm-dummy", "--remove_extra_whitespaces=false");
  static const Model* no_prefix =
      new Model("spm-noprefix", "--add_dummy_prefix=false --remove_extra_whitespaces=false");
  EXPECT_TRUE(dummy_only->tokenizer().drops_leading_space());
  EXPECT_FALSE(no_prefix->tokenizer().drops_leading_space());
  for (const Model* model : {&DefaultModel(), dummy_only, no_prefix}) {
    const SentencePieceTokenizer& t = model->tokenizer();
    // Ids 3 .. 258 are the byte pieces (after <unk>, <s>, </s>); the piece of ▁ alone
    // comes after them.
    for (int b = 0; b < 256; ++b)
      ASSERT_EQ(t.TokenBytes(3 + b), std::string(1, static_cast<char>(b)));
    int64_t bare = -1;
    for (int64_t id = 259; id < t.piece_count() && bare < 0; ++id) {
      if (t.TokenBytes(id) == " ") bare = id;
    }
    ASSERT_GE(bare, 0) << model->dir();
    const int64_t bos = t.bos_id();
    std::vector<std::vector<int64_t>> sequences;
    for (const Reference& r : model->Encode(Texts())) {
      for (const std::vector<int64_t>& prefix : std::vector<std::vector<int64_t>>{
               {}, {bos}, {bare}, {bare, bare}, {bos, bare}, {bare, bos}, {bos, bare, bos}}) {
        std::vector<int64_t> ids = prefix;
        ids.insert(ids.end(), r.ids.begin(), r.ids.end());
        sequences.push_back(ids);
      }
    }
    const std::vector<std::string> decoded = model->Decode(sequences);
    for (size_t i = 0; i < sequences.size(); ++i) {
      EXPECT_EQ(Stream(t, sequences[i], true), decoded[i]) << model->dir() << " #" << i;
    }
  }
}

// A character spread over several <0xNN> pieces streams as one character, through
// StreamTask (Utf8StreamDecoder::AppendBytes): nothing until its last byte; the
// logprobs' token bytes are each piece's byte. The config's eos ends the stream.
TEST(SentencePieceTokenizerTest, ByteFallbackPiecesStreamAsOneCharacter) {
  const Model& model = DefaultModel();
  ModelConfig config;
  config.tokenizer = "sentencepiece";
  config.vocab_size = 400;
  config.eos_token_id = 2;
  auto tokenizer = TextTokenizer::ForModel(config, model.dir());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_STREQ(tokenizer->name(), "sentencepiece");
  EXPECT_EQ(tokenizer->end_of_text(), 2);
  const std::vector<int64_t> ids = tokenizer->Encode("a😀");  // "a", then four bytes
  ASSERT_GE(ids.size(), 5u);
  fwserve::StreamLimits limits;
  limits.max_tokens = 100;
  limits.logprobs = true;
  limits.tokenizer = &*tokenizer;
  fwserve::StreamTask stream(limits);
  const absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  std::vector<std::string> texts;
  for (int64_t id : ids) {
    stream.AddSampled(id, 0.0f, now);
    fwserve::GenerateChunk chunk = stream.TakeChunkForWrite();
    stream.ConfirmWrite();
    texts.push_back(chunk.text);
    ASSERT_EQ(chunk.token_bytes.size(), 1u);
    EXPECT_EQ(chunk.token_bytes[0], tokenizer->TokenBytesView(id));
  }
  ASSERT_EQ(texts.size(), ids.size());
  EXPECT_EQ(std::vector<std::string>(texts.end() - 4, texts.end()),
            (std::vector<std::string>{"", "", "", "😀"}));
  std::string all;
  for (const std::string& text : texts) all += text;
  EXPECT_EQ(all, " a😀");
  EXPECT_FALSE(stream.stop_hit());
  stream.AddSampled(tokenizer->end_of_text(), 0.0f, now);
  EXPECT_TRUE(stream.stop_hit());
  EXPECT_EQ(stream.TakeChunkForWrite().text, "");
}

// The model directory's tokenizer.model: missing, corrupt or empty, or with more pieces
// than the model's vocab_size, refused with errors that name the file, never the
// directory.
TEST(SentencePieceTokenizerTest, BadModelFilesAreRefusedNamingTheFile) {
  ModelConfig config;
  config.tokenizer = "sentencepiece";
  config.vocab_size = 400;
  config.eos_token_id = 2;
  const std::string dir = fwtest::MakeTempDir("spm-bad");
  auto expect_refused = [&](const std::string& what) {
    auto tokenizer = TextTokenizer::ForModel(config, dir);
    ASSERT_FALSE(tokenizer.ok()) << what;
    const std::string message(tokenizer.status().message());
    EXPECT_NE(message.find("tokenizer.model"), std::string::npos) << what << ": " << message;
    EXPECT_EQ(message.find(dir), std::string::npos) << what << ": " << message;
    std::string error;
    EXPECT_EQ(SentencePieceTokenizer::LoadFromDirectory(dir, &error), nullptr) << what;
    EXPECT_NE(error.find("tokenizer.model"), std::string::npos) << what << ": " << error;
    EXPECT_EQ(error.find(dir), std::string::npos) << what << ": " << error;
  };
  expect_refused("missing");
  WriteAll(dir + "/tokenizer.model", "this is not a SentencePiece model \xff\xfe\x01");
  expect_refused("corrupt");
  WriteAll(dir + "/tokenizer.model", "");
  expect_refused("empty");
  WriteAll(dir + "/tokenizer.model", ReadAll(DefaultModel().dir() + "/tokenizer.model"));
  config.vocab_size = 399;
  auto too_many = TextTokenizer::ForModel(config, dir);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("400"), std::string::npos) << too_many.status();
  EXPECT_NE(too_many.status().message().find("399"), std::string::npos) << too_many.status();
  EXPECT_NE(too_many.status().message().find("tokenizer.model"), std::string::npos);
  config.vocab_size = 512;  // more rows than pieces is fine
  EXPECT_TRUE(TextTokenizer::ForModel(config, dir).ok());
}

// With the library loaded (by the tests above, or here), what fwserve has that clashes
// with it still works: libprotobuf parses, absl parses flags; and the library's symbols
// are not the process's.
TEST(SentencePieceTokenizerTest, TheLibraryStaysOutOfTheProcesssSymbols) {
  ASSERT_GT(DefaultModel().tokenizer().Encode("hello").size(), 0u);
  EXPECT_NE(dlopen(SentencePieceTokenizer::kLibrary, RTLD_NOW | RTLD_NOLOAD), nullptr);
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "_ZN13sentencepiece22SentencePieceProcessorC1Ev"), nullptr);
  google::protobuf::Struct message;
  (*message.mutable_fields())["key"].set_string_value("value");
  google::protobuf::Struct parsed;
  ASSERT_TRUE(parsed.ParseFromString(message.SerializeAsString()));
  EXPECT_EQ(parsed.fields().at("key").string_value(), "value");
  std::vector<char*> argv = {const_cast<char*>("test"),
                             const_cast<char*>("--sentencepiece_test_flag=7")};
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  EXPECT_EQ(absl::GetFlag(FLAGS_sentencepiece_test_flag), 7);
  EXPECT_EQ(DefaultModel().tokenizer().Encode("hello"), DefaultModel().tokenizer().Encode("hello"));
}

}  // namespace
}  // namespace fwmodel
