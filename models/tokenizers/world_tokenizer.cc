#include "models/tokenizers/world_tokenizer.h"

#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/base/file_util.h"

namespace fwmodel {
namespace {

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The bytes of a Python str (UTF-8 encoded) or bytes literal, the whole of `literal`.
absl::StatusOr<std::string> ParseLiteral(std::string_view literal) {
  bool is_bytes = false;
  if (!literal.empty() && literal[0] == 'b') {
    is_bytes = true;
    literal.remove_prefix(1);
  }
  if (literal.size() < 2 || (literal[0] != '\'' && literal[0] != '"') ||
      literal.back() != literal[0]) {
    return absl::InvalidArgumentError("not a quoted Python literal");
  }
  const char quote = literal[0];
  std::string_view body = literal.substr(1, literal.size() - 2);
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c == quote) return absl::InvalidArgumentError("unescaped quote inside the literal");
    if (c != '\\') {
      if (is_bytes && static_cast<unsigned char>(c) >= 0x80) {
        return absl::InvalidArgumentError("non-ASCII character in a bytes literal");
      }
      out.push_back(c);  // UTF-8 of the file passes through
      continue;
    }
    if (++i >= body.size()) return absl::InvalidArgumentError("literal ends in a backslash");
    const char e = body[i];
    auto hex = [&](size_t digits) -> absl::StatusOr<uint32_t> {
      uint32_t value = 0;
      for (size_t k = 1; k <= digits; ++k) {
        const int h = i + k < body.size() ? HexValue(body[i + k]) : -1;
        if (h < 0) return absl::InvalidArgumentError("bad hexadecimal escape");
        value = value * 16 + static_cast<uint32_t>(h);
      }
      i += digits;
      return value;
    };
    switch (e) {
      case '\\':
        out.push_back('\\');
        break;
      case '\'':
        out.push_back('\'');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'x': {
        auto v = hex(2);
        if (!v.ok()) return v.status();
        if (is_bytes) {
          out.push_back(static_cast<char>(*v));
        } else {
          AppendUtf8(*v, &out);  // a code point U+0000..U+00FF
        }
        break;
      }
      case 'u':
      case 'U': {
        if (is_bytes) return absl::InvalidArgumentError("\\u escape in a bytes literal");
        auto v = hex(e == 'u' ? 4 : 8);
        if (!v.ok()) return v.status();
        if (*v > 0x10FFFF || (*v >= 0xD800 && *v <= 0xDFFF)) {
          return absl::InvalidArgumentError("escape is not a Unicode scalar value");
        }
        AppendUtf8(*v, &out);
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat("unsupported escape \\", std::string(1, e)));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<WorldTokenizer> WorldTokenizer::Parse(std::string_view text) {
  WorldTokenizer t;
  t.tokens_.push_back("");  // id 0: end of text
  t.token_of_.push_back(0);
  int64_t line_number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat(kFileName, ": line ", line_number, ": ", what));
    };
    const size_t first_space = line.find(' ');
    const size_t last_space = line.rfind(' ');
    if (first_space == std::string_view::npos || last_space == first_space) {
      return bad("expected `<id> <literal> <length>`");
    }
    int64_t id = 0, length = 0;
    const std::string_view id_text = line.substr(0, first_space);
    const std::string_view length_text = line.substr(last_space + 1);
    if (!absl::SimpleAtoi(absl::string_view(id_text.data(), id_text.size()), &id) ||
        !absl::SimpleAtoi(absl::string_view(length_text.data(), length_text.size()), &length)) {
      return bad("id or length is not an integer");
    }
    if (id != static_cast<int64_t>(t.tokens_.size())) {
      return bad(absl::StrCat("id ", id, " out of order (expected ", t.tokens_.size(), ")"));
    }
    auto bytes = ParseLiteral(line.substr(first_space + 1, last_space - first_space - 1));
    if (!bytes.ok()) return bad(bytes.status().message());
    if (bytes->empty() || static_cast<int64_t>(bytes->size()) != length) {
      return bad(absl::StrCat("literal has ", bytes->size(), " bytes, the line says ", length));
    }
    // Insert into the trie.
    int32_t node = 0;
    for (unsigned char c : *bytes) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | c;
      auto it = t.edges_.find(key);
      if (it == t.edges_.end()) {
        const int32_t child = static_cast<int32_t>(t.token_of_.size());
        t.token_of_.push_back(0);
        t.edges_.emplace(key, child);
        node = child;
      } else {
        node = it->second;
      }
    }
    if (t.token_of_[static_cast<size_t>(node)] != 0) {
      return bad(absl::StrCat("the same bytes as token ", t.token_of_[static_cast<size_t>(node)]));
    }
    t.token_of_[static_cast<size_t>(node)] = static_cast<int32_t>(id);
    t.tokens_.push_back(std::move(*bytes));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = t.edges_.find(static_cast<uint64_t>(b));
    if (it == t.edges_.end() || t.token_of_[static_cast<size_t>(it->second)] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kFileName, ": byte ", b, " is not a token by itself"));
    }
  }
  return t;
}

absl::StatusOr<WorldTokenizer> WorldTokenizer::LoadFromDirectory(const std::string& dir) {
  auto text = ReadFile(dir + "/" + kFileName);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("cannot read ", kFileName, " in the model directory"));
  }
  return Parse(*text);
}

std::vector<int64_t> WorldTokenizer::Encode(std::string_view text) const {
  std::vector<int64_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    int32_t node = 0, best = 0;
    size_t best_end = i + 1;
    for (size_t j = i; j < text.size(); ++j) {
      auto it =
          edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(text[j]));
      if (it == edges_.end()) break;
      node = it->second;
      if (token_of_[static_cast<size_t>(node)] != 0) {
        best = token_of_[static_cast<size_t>(node)];
        best_end = j + 1;
      }
    }
    ids.push_back(best);  // never 0: Parse checked that every byte is a token
    i = best_end;
  }
  return ids;
}

std::string_view WorldTokenizer::TokenBytes(int64_t id) const {
  if (id <= 0 || id > max_id()) return {};
  return tokens_[static_cast<size_t>(id)];
}

std::string WorldTokenizer::DecodeBytes(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) out.append(TokenBytes(id));
  return out;
}

}  // namespace fwmodel
