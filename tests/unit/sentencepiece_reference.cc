// The reference for tests/unit/sentencepiece_tokenizer_test.cc: libsentencepiece linked
// the ordinary way, in a process of its own (fwserve's tokenizer loads the library locally;
// linked into the same process, the two would share it). Trains models with
// SentencePieceTrainer and encodes and decodes with SentencePieceProcessor.
//
// Usage:
//   sentencepiece_reference train ARGS
//       SentencePieceTrainer::Train(ARGS), e.g. "--input=a.txt --model_prefix=m ...".
//   sentencepiece_reference encode MODEL IN OUT
//       IN: texts, each ended by a NUL byte. OUT, per text: its EncodeAsIds as a line of
//       ids ("N id1 ... idN"), then DecodeIds of them as "LENGTH\n" and LENGTH bytes.
//   sentencepiece_reference decode MODEL IN OUT
//       IN: lines of ids ("N id1 ... idN"). OUT, per line: DecodeIds as "LENGTH\n" and
//       LENGTH bytes.
// Exits 0, or 1 with the error on stderr.
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace {

int Fail(const std::string& message) {
  std::cerr << "sentencepiece_reference: " << message << "\n";
  return 1;
}

void WriteText(const std::string& text, std::ostream& out) {
  out << text.size() << "\n";
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "train") {
    const auto status = sentencepiece::SentencePieceTrainer::Train(args[1]);
    return status.ok() ? 0 : Fail(status.ToString());
  }
  if (args.size() != 4 || (args[0] != "encode" && args[0] != "decode")) {
    return Fail("usage: train ARGS | encode MODEL IN OUT | decode MODEL IN OUT");
  }
  sentencepiece::SentencePieceProcessor sp;
  const auto loaded = sp.Load(args[1]);
  if (!loaded.ok()) return Fail(loaded.ToString());
  std::ifstream in(args[2], std::ios::binary);
  std::ofstream out(args[3], std::ios::binary);
  if (!in || !out) return Fail("cannot open " + args[2] + " or " + args[3]);
  if (args[0] == "encode") {
    std::string text;
    while (std::getline(in, text, '\0')) {
      const std::vector<int> ids = sp.EncodeAsIds(text);
      out << ids.size();
      for (int id : ids) out << " " << id;
      out << "\n";
      WriteText(sp.DecodeIds(ids), out);
    }
  } else {
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      size_t n = 0;
      fields >> n;
      std::vector<int> ids(n);
      for (int& id : ids) fields >> id;
      if (!fields) return Fail("bad line: " + line);
      WriteText(sp.DecodeIds(ids), out);
    }
  }
  out.close();
  return out ? 0 : Fail("cannot write " + args[3]);
}
