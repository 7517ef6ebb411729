#include "models/constraints/regex.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace fwserve::constraints::internal {
namespace {

// The regex's syntax tree, in an arena.
struct RegexNode {
  enum Kind { kSet, kConcat, kAlt, kRepeat, kStartAnchor, kEndAnchor };
  Kind kind = kSet;
  CodePointSet set;
  std::vector<int> kids;
  int min = 0;
  int max = -1;  // -1: unbounded
};

CodePointSet DigitSet() { return CodePointSet::Of('0', '9'); }

CodePointSet WordSet() {
  CodePointSet s = CodePointSet::Of('0', '9');
  s.Add('A', 'Z');
  s.Add('a', 'z');
  s.Add('_', '_');
  return s;
}

// ECMAScript's WhiteSpace and LineTerminator.
CodePointSet SpaceSet() {
  CodePointSet s = CodePointSet::Of('\t', '\r');  // \t \n \v \f \r
  for (uint32_t cp :
       {0x20u, 0xA0u, 0x1680u, 0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u, 0xFEFFu}) {
    s.Add(cp, cp);
  }
  s.Add(0x2000, 0x200A);
  return s;
}

CodePointSet DotSet() {
  CodePointSet exclude = CodePointSet::Of('\n', '\n');
  exclude.Add('\r', '\r');
  exclude.Add(0x2028, 0x2029);
  return CodePointSet::All().Minus(exclude);
}

class RegexParser {
 public:
  explicit RegexParser(std::string_view pattern) : pattern_(pattern) {}

  absl::StatusOr<int> Parse() {
    auto decoded = Decode();
    if (!decoded.ok()) return decoded;
    auto root = ParseAlternation();
    if (!root.ok()) return root;
    if (pos_ < cps_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unbalanced ')' at offset ", pos_));
    }
    return *root;
  }

  std::vector<RegexNode>& nodes() { return nodes_; }

 private:
  absl::Status Error(std::string what) const { return absl::InvalidArgumentError(std::move(what)); }

  absl::StatusOr<int> Decode() {
    size_t i = 0;
    while (i < pattern_.size()) {
      const auto b0 = static_cast<uint8_t>(pattern_[i]);
      int len = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : (b0 >> 3) == 30 ? 4 : 0;
      if (len == 0 || i + len > pattern_.size()) return Error("the pattern is not valid UTF-8");
      uint32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
      for (int k = 1; k < len; ++k) {
        const auto b = static_cast<uint8_t>(pattern_[i + k]);
        if ((b & 0xC0) != 0x80) return Error("the pattern is not valid UTF-8");
        cp = (cp << 6) | (b & 0x3F);
      }
      cps_.push_back(cp);
      i += len;
    }
    return 0;
  }

  bool AtEnd() const { return pos_ >= cps_.size(); }
  uint32_t Peek(size_t ahead = 0) const {
    return pos_ + ahead < cps_.size() ? cps_[pos_ + ahead] : 0xFFFFFFFF;
  }

  int Add(RegexNode node) {
    nodes_.push_back(std::move(node));
    return static_cast<int>(nodes_.size()) - 1;
  }

  int SetNode(CodePointSet set) {
    RegexNode n;
    n.kind = RegexNode::kSet;
    n.set = std::move(set);
    return Add(std::move(n));
  }

  absl::StatusOr<int> ParseAlternation() {
    std::vector<int> alternatives;
    for (;;) {
      auto c = ParseConcat();
      if (!c.ok()) return c;
      alternatives.push_back(*c);
      if (AtEnd() || Peek() != '|') break;
      ++pos_;
    }
    if (alternatives.size() == 1) return alternatives[0];
    RegexNode n;
    n.kind = RegexNode::kAlt;
    n.kids = std::move(alternatives);
    return Add(std::move(n));
  }

  absl::StatusOr<int> ParseConcat() {
    RegexNode n;
    n.kind = RegexNode::kConcat;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      auto atom = ParseQuantified();
      if (!atom.ok()) return atom;
      n.kids.push_back(*atom);
    }
    return Add(std::move(n));
  }

  // {m}, {m,}, {m,n} at pos_: true and the bounds, or false (a literal '{').
  bool ReadBraces(int* min, int* max, size_t* length) const {
    size_t i = pos_ + 1;
    auto number = [&](int* out) {
      const size_t begin = i;
      int64_t v = 0;
      while (i < cps_.size() && cps_[i] >= '0' && cps_[i] <= '9') {
        v = std::min<int64_t>(v * 10 + (cps_[i] - '0'), 1 << 30);
        ++i;
      }
      *out = static_cast<int>(v);
      return i > begin;
    };
    if (!number(min)) return false;
    *max = *min;
    if (i < cps_.size() && cps_[i] == ',') {
      ++i;
      if (!number(max)) *max = -1;
    }
    if (i >= cps_.size() || cps_[i] != '}') return false;
    *length = i + 1 - pos_;
    return true;
  }

  absl::StatusOr<int> ParseQuantified() {
    auto atom = ParseAtom();
    if (!atom.ok()) return atom;
    for (;;) {
      if (AtEnd()) return atom;
      int min = 0, max = -1;
      const uint32_t c = Peek();
      size_t length = 1;
      if (c == '*') {
        min = 0, max = -1;
      } else if (c == '+') {
        min = 1, max = -1;
      } else if (c == '?') {
        min = 0, max = 1;
      } else if (c == '{' && ReadBraces(&min, &max, &length)) {
        if (max >= 0 && max < min) return Error("a quantifier {m,n} with n < m");
      } else {
        return atom;
      }
      const RegexNode::Kind kind = nodes_[*atom].kind;
      if (kind == RegexNode::kStartAnchor || kind == RegexNode::kEndAnchor) {
        return Error("a quantifier after an anchor");
      }
      pos_ += length;
      if (!AtEnd() && Peek() == '?') ++pos_;  // lazy: the same language
      RegexNode n;
      n.kind = RegexNode::kRepeat;
      n.kids = {*atom};
      n.min = min;
      n.max = max;
      atom = Add(std::move(n));
    }
  }

  absl::StatusOr<int> ParseAtom() {
    const uint32_t c = Peek();
    switch (c) {
      case '(': {
        ++pos_;
        if (Peek() == '?') {
          if (Peek(1) == ':') {
            pos_ += 2;
          } else if (Peek(1) == '<' && Peek(2) != '=' && Peek(2) != '!') {
            pos_ += 2;
            while (!AtEnd() && Peek() != '>') ++pos_;
            if (AtEnd()) return Error("an unterminated group name");
            ++pos_;
          } else {
            return Error("lookaround assertions (?= (?! (?<= (?<! are not supported");
          }
        }
        auto inner = ParseAlternation();
        if (!inner.ok()) return inner;
        if (AtEnd() || Peek() != ')') return Error("an unterminated group");
        ++pos_;
        return inner;
      }
      case '[':
        return ParseClass();
      case '.':
        ++pos_;
        return SetNode(DotSet());
      case '^': {
        ++pos_;
        RegexNode n;
        n.kind = RegexNode::kStartAnchor;
        return Add(std::move(n));
      }
      case '$': {
        ++pos_;
        RegexNode n;
        n.kind = RegexNode::kEndAnchor;
        return Add(std::move(n));
      }
      case '*':
      case '+':
      case '?':
        return Error(absl::StrCat("nothing to repeat at offset ", pos_));
      case '{': {
        int min, max;
        size_t length;
        if (ReadBraces(&min, &max, &length)) {
          return Error(absl::StrCat("nothing to repeat at offset ", pos_));
        }
        ++pos_;
        return SetNode(CodePointSet::Of(c, c));
      }
      case '\\': {
        ++pos_;
        CodePointSet set;
        auto status = ParseEscape(/*in_class=*/false, &set);
        if (!status.ok()) return status;
        return SetNode(std::move(set));
      }
      default:
        ++pos_;
        return SetNode(CodePointSet::Of(c, c));
    }
  }

  absl::StatusOr<uint32_t> Hex(int digits) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      const uint32_t c = Peek();
      int h = c >= '0' && c <= '9'   ? static_cast<int>(c - '0')
              : c >= 'a' && c <= 'f' ? static_cast<int>(c - 'a' + 10)
              : c >= 'A' && c <= 'F' ? static_cast<int>(c - 'A' + 10)
                                     : -1;
      if (h < 0) return Error("a malformed hexadecimal escape");
      v = v * 16 + h;
      ++pos_;
    }
    return v;
  }

  // After a backslash: the escape's set (one code point, or a class escape).
  absl::Status ParseEscape(bool in_class, CodePointSet* set) {
    if (AtEnd()) return Error("the pattern ends in a backslash");
    const uint32_t c = Peek();
    ++pos_;
    auto one = [&](uint32_t cp) {
      *set = CodePointSet::Of(cp, cp);
      return absl::OkStatus();
    };
    switch (c) {
      case 'd':
        *set = DigitSet();
        return absl::OkStatus();
      case 'D':
        *set = DigitSet().Complement();
        return absl::OkStatus();
      case 'w':
        *set = WordSet();
        return absl::OkStatus();
      case 'W':
        *set = WordSet().Complement();
        return absl::OkStatus();
      case 's':
        *set = SpaceSet();
        return absl::OkStatus();
      case 'S':
        *set = SpaceSet().Complement();
        return absl::OkStatus();
      case 't':
        return one('\t');
      case 'n':
        return one('\n');
      case 'r':
        return one('\r');
      case 'v':
        return one(0x0B);
      case 'f':
        return one(0x0C);
      case 'b':
        if (in_class) return one(0x08);
        return Error("word boundaries (\\b) are not supported");
      case 'B':
        return Error("word boundaries (\\B) are not supported");
      case '0':
        if (Peek() >= '0' && Peek() <= '9') return Error("octal escapes are not supported");
        return one(0);
      case 'x': {
        auto v = Hex(2);
        if (!v.ok()) return v.status();
        return one(*v);
      }
      case 'u': {
        if (Peek() == '{') {
          ++pos_;
          uint32_t v = 0;
          int digits = 0;
          while (!AtEnd() && Peek() != '}') {
            auto h = Hex(1);
            if (!h.ok()) return h.status();
            v = v * 16 + *h;
            if (++digits > 6) return Error("a malformed \\u{...} escape");
          }
          if (AtEnd() || digits == 0 || v > kMaxCodePoint) {
            return Error("a malformed \\u{...} escape");
          }
          ++pos_;
          if (v >= 0xD800 && v <= 0xDFFF) return Error("a lone surrogate escape");
          return one(v);
        }
        auto v = Hex(4);
        if (!v.ok()) return v.status();
        if (*v >= 0xD800 && *v <= 0xDBFF && Peek() == '\\' && Peek(1) == 'u') {
          pos_ += 2;
          auto low = Hex(4);
          if (!low.ok()) return low.status();
          if (*low < 0xDC00 || *low > 0xDFFF) return Error("a lone surrogate escape");
          return one(0x10000 + ((*v - 0xD800) << 10) + (*low - 0xDC00));
        }
        if (*v >= 0xD800 && *v <= 0xDFFF) return Error("a lone surrogate escape");
        return one(*v);
      }
      default:
        break;
    }
    if (c >= '1' && c <= '9') return Error("backreferences are not supported");
    if (c == 'k') return Error("backreferences are not supported");
    if (c == 'p' || c == 'P') return Error("Unicode property escapes are not supported");
    if (c == 'c') return Error("control escapes (\\c) are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      return Error(absl::StrCat("an unknown escape \\", std::string(1, static_cast<char>(c))));
    }
    return one(c);  // \. \/ \\ \- ...: the character itself
  }

  absl::StatusOr<int> ParseClass() {
    ++pos_;  // '['
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    CodePointSet set;
    bool first = true;
    for (;;) {
      if (AtEnd()) return Error("an unterminated character class");
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      // One class atom: a code point (single == true) or a class escape.
      auto atom = [&](CodePointSet* out, bool* single, uint32_t* cp) -> absl::Status {
        const uint32_t c = Peek();
        ++pos_;
        if (c == '\\') {
          auto status = ParseEscape(/*in_class=*/true, out);
          if (!status.ok()) return status;
          *single = out->ranges().size() == 1 && out->ranges()[0].first == out->ranges()[0].second;
          if (*single) *cp = out->ranges()[0].first;
          return absl::OkStatus();
        }
        *out = CodePointSet::Of(c, c);
        *single = true;
        *cp = c;
        return absl::OkStatus();
      };
      CodePointSet a;
      bool a_single = false;
      uint32_t a_cp = 0;
      auto status = atom(&a, &a_single, &a_cp);
      if (!status.ok()) return status;
      first = false;
      if (a_single && Peek() == '-' && Peek(1) != ']' && Peek(1) != 0xFFFFFFFF) {
        ++pos_;  // '-'
        CodePointSet b;
        bool b_single = false;
        uint32_t b_cp = 0;
        status = atom(&b, &b_single, &b_cp);
        if (!status.ok()) return status;
        if (!b_single) return Error("a class range with a class escape");
        if (b_cp < a_cp) return Error("a class range out of order");
        set.Add(a_cp, b_cp);
        continue;
      }
      set.Add(a);
    }
    (void)first;
    return SetNode(negate ? set.Complement() : set);
  }

  std::string_view pattern_;
  std::vector<uint32_t> cps_;
  size_t pos_ = 0;
  std::vector<RegexNode> nodes_;
};

class RegexBuilder {
 public:
  RegexBuilder(const std::vector<RegexNode>& nodes, int max_states)
      : nodes_(nodes), max_states_(max_states) {}

  struct Frag {
    int32_t start, end;
  };

  int32_t NewState() { return nfa_.num_states++; }
  bool overflow() const { return nfa_.num_states > max_states_; }

  Frag SetFrag(const CodePointSet& set) {
    Frag f{NewState(), NewState()};
    if (!set.empty()) nfa_.edges.push_back({f.start, f.end, set});
    return f;
  }

  Frag Build(int id) {
    const RegexNode& n = nodes_[id];
    if (overflow()) return SetFrag({});
    switch (n.kind) {
      case RegexNode::kSet:
        return SetFrag(n.set);
      case RegexNode::kStartAnchor:
      case RegexNode::kEndAnchor: {
        const int32_t s = NewState();
        return {s, s};
      }
      case RegexNode::kConcat: {
        const int32_t s = NewState();
        Frag f{s, s};
        for (int kid : n.kids) {
          Frag k = Build(kid);
          nfa_.eps.push_back({f.end, k.start});
          f.end = k.end;
        }
        return f;
      }
      case RegexNode::kAlt: {
        Frag f{NewState(), NewState()};
        for (int kid : n.kids) {
          Frag k = Build(kid);
          nfa_.eps.push_back({f.start, k.start});
          nfa_.eps.push_back({k.end, f.end});
        }
        return f;
      }
      case RegexNode::kRepeat: {
        const int32_t s = NewState();
        Frag f{s, s};
        for (int i = 0; i < n.min && !overflow(); ++i) {
          Frag k = Build(n.kids[0]);
          nfa_.eps.push_back({f.end, k.start});
          f.end = k.end;
        }
        if (n.max < 0) {
          Frag k = Build(n.kids[0]);
          const int32_t loop = NewState();
          nfa_.eps.push_back({f.end, loop});
          nfa_.eps.push_back({loop, k.start});
          nfa_.eps.push_back({k.end, loop});
          f.end = loop;
          return f;
        }
        // (x(x(x)?)?)?: each optional copy may skip to the end.
        const int32_t end = NewState();
        for (int i = n.min; i < n.max && !overflow(); ++i) {
          nfa_.eps.push_back({f.end, end});
          Frag k = Build(n.kids[0]);
          nfa_.eps.push_back({f.end, k.start});
          f.end = k.end;
        }
        nfa_.eps.push_back({f.end, end});
        f.end = end;
        return f;
      }
    }
    return SetFrag({});
  }

  CodePointNfa& nfa() { return nfa_; }

 private:
  const std::vector<RegexNode>& nodes_;
  int max_states_;
  CodePointNfa nfa_;
};

// True when node `id` or anything under it is an anchor.
bool HasAnchor(const std::vector<RegexNode>& nodes, int id) {
  const RegexNode& n = nodes[id];
  if (n.kind == RegexNode::kStartAnchor || n.kind == RegexNode::kEndAnchor) return true;
  for (int kid : n.kids) {
    if (HasAnchor(nodes, kid)) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<CodePointNfa> CompileRegex(std::string_view pattern, int max_states) {
  RegexParser parser(pattern);
  auto root = parser.Parse();
  if (!root.ok()) return root.status();
  std::vector<RegexNode>& nodes = parser.nodes();
  // The top-level alternatives, each with its anchors stripped (recorded) and checked to
  // appear nowhere else.
  std::vector<int> alternatives;
  if (nodes[*root].kind == RegexNode::kAlt) {
    alternatives = nodes[*root].kids;
  } else {
    alternatives = {*root};
  }
  struct Alternative {
    int node;
    bool anchored_start;
    bool anchored_end;
  };
  std::vector<Alternative> parts;
  for (int a : alternatives) {
    Alternative part{a, false, false};
    if (nodes[a].kind == RegexNode::kConcat) {
      std::vector<int> kids = nodes[a].kids;
      size_t begin = 0, end = kids.size();
      while (begin < end && nodes[kids[begin]].kind == RegexNode::kStartAnchor) {
        part.anchored_start = true;
        ++begin;
      }
      while (end > begin && nodes[kids[end - 1]].kind == RegexNode::kEndAnchor) {
        part.anchored_end = true;
        --end;
      }
      for (size_t k = begin; k < end; ++k) {
        if (HasAnchor(nodes, kids[k])) {
          return absl::InvalidArgumentError(
              "anchors (^ $) are only supported at the ends of the pattern");
        }
      }
      nodes[a].kids.assign(kids.begin() + begin, kids.begin() + end);
    } else if (HasAnchor(nodes, a)) {
      return absl::InvalidArgumentError(
          "anchors (^ $) are only supported at the ends of the pattern");
    }
    parts.push_back(part);
  }
  RegexBuilder builder(nodes, max_states);
  CodePointNfa& nfa = builder.nfa();
  nfa.start = builder.NewState();
  nfa.accept = builder.NewState();
  for (const Alternative& part : parts) {
    RegexBuilder::Frag f = builder.Build(part.node);
    int32_t start = f.start, end = f.end;
    if (!part.anchored_start) {  // any text before
      const int32_t loop = builder.NewState();
      nfa.edges.push_back({loop, loop, CodePointSet::All()});
      nfa.eps.push_back({loop, start});
      start = loop;
    }
    if (!part.anchored_end) {  // any text after
      const int32_t loop = builder.NewState();
      nfa.edges.push_back({loop, loop, CodePointSet::All()});
      nfa.eps.push_back({end, loop});
      end = loop;
    }
    nfa.eps.push_back({nfa.start, start});
    nfa.eps.push_back({end, nfa.accept});
  }
  if (builder.overflow()) {
    return absl::InvalidArgumentError(absl::StrCat("the pattern's automaton is too large (over ",
                                                   max_states, " states; reduce {m,n} counts)"));
  }
  return std::move(nfa);
}

}  // namespace fwserve::constraints::internal
