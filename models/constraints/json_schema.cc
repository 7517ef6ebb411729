#include "models/constraints/json_schema.h"

#include <algorithm>
#include <cmath>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "models/constraints/nfa.h"
#include "models/constraints/regex.h"

namespace fwserve::constraints {
namespace {

using internal::CodePointNfa;
using internal::CodePointSet;
using internal::Nfa;
using Frag = Nfa::Frag;
using Json = nlohmann::ordered_json;

// A $ref target whose inlined automaton has more NFA states than this is compiled once,
// as a rule, and called from its later references (and a repeated array item likewise).
constexpr int32_t kInlineRefLimit = 400;
constexpr int32_t kInlineItemLimit = 64;
// minLength, maxLength, minItems, maxItems above this are refused.
constexpr int64_t kMaxCount = 10000;
// The NFA the compiler builds may not exceed this many states.
constexpr int32_t kMaxNfaStates = 2000000;
constexpr int kMaxRegexStates = 20000;

const std::set<std::string>& IgnoredKeywords() {
  static const auto* k = new std::set<std::string>{
      "description", "title",  "default",    "examples", "$schema",  "$id",
      "$comment",    "strict", "deprecated", "readOnly", "writeOnly"};
  return *k;
}

enum class Family { kObject, kArray, kString, kNumber, kOther };

// The supported keywords and the type each applies to (kOther: any type).
const std::map<std::string, Family>& SupportedKeywords() {
  static const auto* k = new std::map<std::string, Family>{
      {"type", Family::kOther},
      {"properties", Family::kObject},
      {"required", Family::kObject},
      {"additionalProperties", Family::kObject},
      {"items", Family::kArray},
      {"prefixItems", Family::kArray},
      {"minItems", Family::kArray},
      {"maxItems", Family::kArray},
      {"enum", Family::kOther},
      {"const", Family::kOther},
      {"anyOf", Family::kOther},
      {"oneOf", Family::kOther},
      {"allOf", Family::kOther},
      {"$ref", Family::kOther},
      {"$defs", Family::kOther},
      {"definitions", Family::kOther},
      {"minLength", Family::kString},
      {"maxLength", Family::kString},
      {"pattern", Family::kString},
      {"format", Family::kString},
      {"minimum", Family::kNumber},
      {"maximum", Family::kNumber},
      {"exclusiveMinimum", Family::kNumber},
      {"exclusiveMaximum", Family::kNumber},
      {"nullable", Family::kOther},
  };
  return *k;
}

const char* FamilyName(Family f) {
  switch (f) {
    case Family::kObject:
      return "object";
    case Family::kArray:
      return "array";
    case Family::kString:
      return "string";
    case Family::kNumber:
      return "number";
    default:
      return "any";
  }
}

// The regular patterns of the supported `format`s (docs/structured-output.md).
const std::map<std::string, std::string>& FormatPatterns() {
  static const auto* k = [] {
    // Calendar dates: 31-, 30- and 28-day months, and February 29 of leap years.
    const std::string date =
        "([0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|"
        "02-(0[1-9]|1[0-9]|2[0-8]))|([0-9]{2}(0[48]|[2468][048]|[13579][26])|"
        "([02468][048]|[13579][26])00)-02-29)";
    const std::string time =
        "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?"
        "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    return new std::map<std::string, std::string>{
        {"date", "^" + date + "$"},
        {"time", "^" + time + "$"},
        {"date-time", "^" + date + "T" + time + "$"},
        {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
        {"email",
         "^[A-Za-z0-9_%+-]+(\\.[A-Za-z0-9_%+-]+)*@([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?\\.)+"
         "[A-Za-z]{2,}$"},
    };
  }();
  return *k;
}

std::string Where(const std::string& pointer) { return pointer.empty() ? "/" : pointer; }

std::string PointerToken(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

absl::Status Error(const std::string& pointer, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(what, " at ", Where(pointer)));
}

// Printable unescaped string characters: not a control, '"' or '\'.
CodePointSet Printable() {
  CodePointSet s = CodePointSet::Of(0x20, internal::kMaxCodePoint);
  return s.Minus(CodePointSet::Of('"', '"')).Minus(CodePointSet::Of('\\', '\\'));
}

std::string Decimal(uint64_t v) { return std::to_string(v); }

uint64_t Pow10(int k) {
  uint64_t v = 1;
  for (int i = 0; i < k; ++i) v *= 10;
  return v;
}

// A numeric bound from a keyword: a value and whether it is exclusive.
struct Bound {
  long double value;
  bool open;
};

class SchemaCompiler {
 public:
  SchemaCompiler(const Json& root, const JsonSchemaOptions& options)
      : root_(root), options_(options) {}

  absl::StatusOr<std::shared_ptr<const Grammar>> CompileSchema() {
    const int32_t root_rule = ReserveRule("the root schema");
    auto body = Expand(root_, "");
    if (!body.ok()) return body.status();
    nfa_.SetRule(root_rule, *body);
    return Build(root_rule);
  }

  std::shared_ptr<const Grammar> CompileAnyObject() {
    const int32_t root_rule = ReserveRule("the root object");
    nfa_.SetRule(root_rule, AnyObject());
    auto g = Build(root_rule);
    return g.ok() ? *g : nullptr;
  }

 private:
  absl::StatusOr<std::shared_ptr<const Grammar>> Build(int32_t root_rule) {
    internal::GrammarLimits limits;
    limits.max_states = options_.max_states;
    limits.max_depth = options_.max_recursion_depth;
    return internal::BuildGrammar(nfa_, root_rule, rule_names_, limits);
  }

  int32_t ReserveRule(std::string name) {
    const int32_t rule = nfa_.ReserveRule();
    rule_names_.resize(rule + 1);
    rule_names_[rule] = std::move(name);
    return rule;
  }

  absl::Status CheckSize(const std::string& pointer) const {
    if (nfa_.num_states() > kMaxNfaStates) {
      return Error(pointer, "the schema is too large (lower maxLength, maxItems or {m,n} counts)");
    }
    return absl::OkStatus();
  }

  // ---- Lexical pieces ----

  // Up to max_whitespace whitespace bytes.
  Frag Ws() {
    const int32_t start = nfa_.AddState();
    const int32_t end = nfa_.AddState();
    int32_t at = start;
    nfa_.AddEps(at, end);
    for (int i = 0; i < options_.max_whitespace; ++i) {
      const int32_t next = nfa_.AddState();
      nfa_.AddByte(at, '\t', '\n', next);
      nfa_.AddByte(at, '\r', '\r', next);
      nfa_.AddByte(at, ' ', ' ', next);
      nfa_.AddEps(next, end);
      at = next;
    }
    return {start, end};
  }

  Frag Lit(std::string_view bytes) { return nfa_.Literal(bytes); }

  Frag Seq(std::initializer_list<Frag> parts) {
    Frag f = nfa_.Empty();
    for (const Frag& p : parts) f = nfa_.Seq(f, p);
    return f;
  }

  Frag Digits(int min, int max) {
    Frag f = nfa_.Empty();
    for (int i = 0; i < min; ++i) f = nfa_.Seq(f, nfa_.ByteRange('0', '9'));
    if (max > min) {
      const int32_t end = nfa_.AddState();
      for (int i = min; i < max; ++i) {
        nfa_.AddEps(f.end, end);
        f = nfa_.Seq(f, nfa_.ByteRange('0', '9'));
      }
      nfa_.AddEps(f.end, end);
      f.end = end;
    }
    return f;
  }

  absl::StatusOr<Frag> Expand(const Json& target, const std::string& pointer);

  // One character of an unconstrained JSON string: printable UTF-8, or any escape (a
  // surrogate pair is one character).
  Frag PlainChar();
  // One code point of `set` as a JSON string writes it (raw, or its one escape).
  Frag JsonChar(const CodePointSet& set);
  // "..." with min..max characters (max < 0: unbounded).
  Frag PlainString(int min, int max);
  // "..." whose decoded content matches `re` and has min..max code points.
  absl::StatusOr<Frag> PatternString(const CodePointNfa& re, int min, int max,
                                     const std::string& pointer);
  // A JSON number within the digit bounds (integer: no fraction or exponent).
  Frag PlainNumber(bool integer);
  // Canonical decimals of a..b (0 <= a <= b < 10^18); equal-length digit strings lo..hi.
  Frag IntRange(uint64_t a, uint64_t b);
  Frag SameLengthRange(const std::string& lo, const std::string& hi);
  // Unsigned numbers without exponent from a to b (see the definition).
  Frag Magnitude(uint64_t a, bool a_open, bool has_b, uint64_t b, bool b_open);
  Frag Fraction(int kind);  // 0 any (optional), 1 nonzero (required), 2 zero (optional)

  // The rule of any JSON value (built on first use), and a call of it.
  int32_t AnyRule();
  Frag AnyValue() { return nfa_.Call(AnyRule()); }
  // Any object / array, their values any JSON values.
  Frag AnyObject();
  Frag AnyArray();
  // A quoted key without escapes that is none of `declared`.
  Frag AdditionalKey(const std::vector<std::string>& declared);

  // The value `s` (a schema at `pointer`) allows; InvalidArgument naming keyword and
  // pointer outside the subset.
  absl::StatusOr<Frag> Schema(const Json& s, const std::string& pointer);
  // The target of `ref`: inlined, or a call of its rule (recursive or large).
  absl::StatusOr<Frag> Ref(const Json& ref, const std::string& pointer);
  // Exactly the compact serializations of `values`.
  absl::StatusOr<Frag> Values(const std::vector<Json>& values, const std::string& pointer);
  absl::StatusOr<Frag> Object(const Json& s, const std::string& pointer);
  absl::StatusOr<Frag> Array(const Json& s, const std::string& pointer);
  absl::StatusOr<Frag> String(const Json& s, const std::string& pointer);
  absl::StatusOr<Frag> Number(const Json& s, const std::string& pointer, bool integer);
  // `keyword` of `s`: a non-negative integer up to kMaxCount.
  absl::StatusOr<int64_t> Count(const Json& s, const char* keyword, const std::string& pointer);

  const Json& root_;
  const JsonSchemaOptions options_;
  Nfa nfa_;
  std::vector<std::string> rule_names_;
  int32_t any_rule_ = -1;
  // $ref targets being inlined (a reference to one of them is recursion).
  std::set<std::string> expanding_;
  // $ref targets compiled as rules.
  std::map<std::string, int32_t> ref_rule_;
  // NFA states of a $ref target's first inlined expansion.
  std::map<std::string, int32_t> ref_size_;
};

Frag SchemaCompiler::PlainChar() {
  const int32_t start = nfa_.AddState();
  const int32_t end = nfa_.AddState();
  const Frag raw = nfa_.Utf8(Printable());
  nfa_.AddEps(start, raw.start);
  nfa_.AddEps(raw.end, end);
  const int32_t backslash = nfa_.AddState();
  nfa_.AddByte(start, '\\', '\\', backslash);
  for (char c : std::string("\"\\/bfnrt")) {
    nfa_.AddByte(backslash, static_cast<uint8_t>(c), static_cast<uint8_t>(c), end);
  }
  // Shared chains: hex_to_end[k] reads k hex digits to the end; after_high[k] reads k hex
  // digits, then \u and a low surrogate.
  auto hex = [&](int32_t from, int32_t to) {
    nfa_.AddByte(from, '0', '9', to);
    nfa_.AddByte(from, 'a', 'f', to);
    nfa_.AddByte(from, 'A', 'F', to);
  };
  int32_t hex_to_end[4] = {end, nfa_.AddState(), nfa_.AddState(), nfa_.AddState()};
  for (int k = 1; k < 4; ++k) hex(hex_to_end[k], hex_to_end[k - 1]);
  const int32_t u = nfa_.AddState();
  nfa_.AddByte(backslash, 'u', 'u', u);
  // \uXXXX, not a surrogate: the first digit is not d/D, or d/D then 0-7.
  nfa_.AddByte(u, '0', '9', hex_to_end[3]);
  nfa_.AddByte(u, 'a', 'c', hex_to_end[3]);
  nfa_.AddByte(u, 'A', 'C', hex_to_end[3]);
  nfa_.AddByte(u, 'e', 'f', hex_to_end[3]);
  nfa_.AddByte(u, 'E', 'F', hex_to_end[3]);
  const int32_t d = nfa_.AddState();
  nfa_.AddByte(u, 'd', 'd', d);
  nfa_.AddByte(u, 'D', 'D', d);
  nfa_.AddByte(d, '0', '7', hex_to_end[2]);
  // A high surrogate (d8..db), then \u and a low one (dc..df).
  const int32_t low_backslash = nfa_.AddState();
  const int32_t high_1 = nfa_.AddState(), high_2 = nfa_.AddState();
  hex(high_2, high_1);
  hex(high_1, low_backslash);
  nfa_.AddByte(d, '8', '9', high_2);
  nfa_.AddByte(d, 'a', 'b', high_2);
  nfa_.AddByte(d, 'A', 'B', high_2);
  const int32_t low_u = nfa_.AddState(), low_d = nfa_.AddState(), low_digit = nfa_.AddState();
  nfa_.AddByte(low_backslash, '\\', '\\', low_u);
  nfa_.AddByte(low_u, 'u', 'u', low_d);
  nfa_.AddByte(low_d, 'd', 'd', low_digit);
  nfa_.AddByte(low_d, 'D', 'D', low_digit);
  nfa_.AddByte(low_digit, 'c', 'f', hex_to_end[2]);
  nfa_.AddByte(low_digit, 'C', 'F', hex_to_end[2]);
  return {start, end};
}

// One code point of `set`, as a JSON string writes it: raw UTF-8 when printable, else its
// one escape (\" \\ \b \f \n \r \t, \u00XX for the other controls).
Frag SchemaCompiler::JsonChar(const CodePointSet& set) {
  std::vector<Frag> alts;
  const CodePointSet raw = set.Intersect(Printable());
  if (!raw.empty()) alts.push_back(nfa_.Utf8(raw));
  if (set.Contains('"')) alts.push_back(Lit("\\\""));
  if (set.Contains('\\')) alts.push_back(Lit("\\\\"));
  const std::map<uint32_t, char> short_forms = {
      {0x08, 'b'}, {0x09, 't'}, {0x0A, 'n'}, {0x0C, 'f'}, {0x0D, 'r'}};
  for (int high = 0; high < 2; ++high) {
    std::vector<std::pair<uint8_t, uint8_t>> low_digits;
    for (uint32_t low = 0; low < 16; ++low) {
      const uint32_t cp = high * 16 + low;
      if (!set.Contains(cp)) continue;
      auto it = short_forms.find(cp);
      if (it != short_forms.end()) {
        alts.push_back(Lit(std::string("\\") + it->second));
        continue;
      }
      const auto digit = static_cast<uint8_t>(low < 10 ? '0' + low : 'a' + low - 10);
      low_digits.push_back({digit, digit});
    }
    if (!low_digits.empty()) {
      alts.push_back(nfa_.Seq(Lit(high == 0 ? "\\u000" : "\\u001"), nfa_.ByteRanges(low_digits)));
    }
  }
  return nfa_.Alt(alts);
}

Frag SchemaCompiler::PlainString(int min, int max) {
  Frag f = Lit("\"");
  for (int i = 0; i < min; ++i) f = nfa_.Seq(f, PlainChar());
  if (max < 0) {
    f = nfa_.Seq(f, nfa_.Star(PlainChar()));
  } else if (max > min) {
    const int32_t end = nfa_.AddState();
    for (int i = min; i < max; ++i) {
      nfa_.AddEps(f.end, end);
      f = nfa_.Seq(f, PlainChar());
    }
    nfa_.AddEps(f.end, end);
    f.end = end;
  }
  return nfa_.Seq(f, Lit("\""));
}

absl::StatusOr<Frag> SchemaCompiler::PatternString(const CodePointNfa& re, int min, int max,
                                                   const std::string& pointer) {
  // The pattern's automaton times a code-point counter saturating at `max` (or at `min`
  // when unbounded), built from the reachable pairs.
  const bool unbounded = max < 0;
  const int top = unbounded ? min : max;
  if (static_cast<int64_t>(re.num_states) * (top + 1) > kMaxNfaStates) {
    return Error(pointer, "the pattern with its length bounds is too large (lower maxLength)");
  }
  std::vector<std::vector<int32_t>> eps_out(re.num_states);
  std::vector<std::vector<int32_t>> edge_out(re.num_states);
  for (const auto& [from, to] : re.eps) eps_out[from].push_back(to);
  for (size_t k = 0; k < re.edges.size(); ++k) edge_out[re.edges[k].from].push_back(k);
  absl::flat_hash_map<int64_t, int32_t> state_of;
  std::vector<std::pair<int32_t, int>> work;
  auto state = [&](int32_t q, int c) {
    const int64_t key = static_cast<int64_t>(q) * (top + 1) + c;
    auto [it, inserted] = state_of.emplace(key, 0);
    if (inserted) {
      it->second = nfa_.AddState();
      work.push_back({q, c});
    }
    return it->second;
  };
  const Frag open = Lit("\"");
  const Frag close = Lit("\"");
  nfa_.AddEps(open.end, state(re.start, 0));
  while (!work.empty()) {
    const auto [q, c] = work.back();
    work.pop_back();
    const int32_t s = state(q, c);
    for (int32_t q2 : eps_out[q]) nfa_.AddEps(s, state(q2, c));
    for (int32_t k : edge_out[q]) {
      int next_c = c + 1;
      if (c == top) {
        if (!unbounded) continue;
        next_c = top;
      }
      const Frag ch = JsonChar(re.edges[k].set);
      nfa_.AddEps(s, ch.start);
      nfa_.AddEps(ch.end, state(re.edges[k].to, next_c));
    }
    if (q == re.accept && c >= min) nfa_.AddEps(s, close.start);
    if (auto status = CheckSize(pointer); !status.ok()) return status;
  }
  return Frag{open.start, close.end};
}

// -?(0|[1-9][0-9]{0,k-1}) then, for numbers, (\.[0-9]{1,f})? ([eE][+-]?[0-9]{1,e})?.
Frag SchemaCompiler::PlainNumber(bool integer) {
  Frag sign = nfa_.Optional(Lit("-"));
  Frag int_part = nfa_.Alt(
      {Lit("0"), nfa_.Seq(nfa_.ByteRange('1', '9'), Digits(0, options_.max_integer_digits - 1))});
  Frag f = nfa_.Seq(sign, int_part);
  if (integer) return f;
  if (options_.max_fraction_digits > 0) {
    f = nfa_.Seq(f, nfa_.Optional(nfa_.Seq(Lit("."), Digits(1, options_.max_fraction_digits))));
  }
  if (options_.max_exponent_digits > 0) {
    f = nfa_.Seq(f, nfa_.Optional(Seq({nfa_.ByteRanges({{'e', 'e'}, {'E', 'E'}}),
                                       nfa_.Optional(nfa_.ByteRanges({{'+', '+'}, {'-', '-'}})),
                                       Digits(1, options_.max_exponent_digits)})));
  }
  return f;
}

// Equal-length digit strings from lo to hi (lo <= hi).
Frag SchemaCompiler::SameLengthRange(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return nfa_.Empty();
  const size_t rest = lo.size() - 1;
  if (lo[0] == hi[0]) {
    return nfa_.Seq(Lit(lo.substr(0, 1)), SameLengthRange(lo.substr(1), hi.substr(1)));
  }
  const std::string zeros(rest, '0'), nines(rest, '9');
  if (lo.substr(1) == zeros && hi.substr(1) == nines) {
    return nfa_.Seq(nfa_.ByteRange(lo[0], hi[0]), Digits(rest, rest));
  }
  std::vector<Frag> alts;
  alts.push_back(nfa_.Seq(Lit(lo.substr(0, 1)), SameLengthRange(lo.substr(1), nines)));
  if (lo[0] + 1 <= hi[0] - 1) {
    alts.push_back(nfa_.Seq(nfa_.ByteRange(lo[0] + 1, hi[0] - 1), Digits(rest, rest)));
  }
  alts.push_back(nfa_.Seq(Lit(hi.substr(0, 1)), SameLengthRange(zeros, hi.substr(1))));
  return nfa_.Alt(alts);
}

// The canonical decimals (no leading zeros) of the integers a..b, 0 <= a <= b < 10^18.
Frag SchemaCompiler::IntRange(uint64_t a, uint64_t b) {
  std::vector<Frag> alts;
  const size_t la = Decimal(a).size(), lb = Decimal(b).size();
  for (size_t len = la; len <= lb; ++len) {
    const uint64_t lo = std::max<uint64_t>(a, len == 1 ? 0 : Pow10(len - 1));
    const uint64_t hi = std::min<uint64_t>(b, Pow10(len) - 1);
    if (lo > hi) continue;
    alts.push_back(SameLengthRange(Decimal(lo), Decimal(hi)));
  }
  return nfa_.Alt(alts);
}

// kind 0: (\.[0-9]{1,f})?; 1: \.[0-9]{1,f} not all zeros; 2: (\.0{1,f})?.
Frag SchemaCompiler::Fraction(int kind) {
  const int f = options_.max_fraction_digits;
  if (kind == 0) {
    return f > 0 ? nfa_.Optional(nfa_.Seq(Lit("."), Digits(1, f))) : nfa_.Empty();
  }
  if (kind == 2) {
    if (f == 0) return nfa_.Empty();
    Frag zeros = Lit(".");
    const int32_t end = nfa_.AddState();
    for (int i = 0; i < f; ++i) {
      zeros = nfa_.Seq(zeros, Lit("0"));
      nfa_.AddEps(zeros.end, end);
    }
    return nfa_.Optional(Frag{zeros.start, end});
  }
  if (f == 0) return nfa_.Nothing();
  // Two tracks: all zeros so far (z) and some nonzero digit seen (n).
  const Frag dot = Lit(".");
  const int32_t end = nfa_.AddState();
  int32_t z = dot.end, n = -1;
  for (int i = 0; i < f; ++i) {
    const int32_t z2 = nfa_.AddState(), n2 = nfa_.AddState();
    nfa_.AddByte(z, '0', '0', z2);
    nfa_.AddByte(z, '1', '9', n2);
    if (n >= 0) nfa_.AddByte(n, '0', '9', n2);
    nfa_.AddEps(n2, end);
    z = z2;
    n = n2;
  }
  return {dot.start, end};
}

// Non-negative numbers m = I.F (no exponent) with a <(=) m <(=) b (b absent: unbounded),
// I at most max_integer_digits digits. With integer bounds, m >= a iff I >= a; m > a iff
// I > a or (I = a and F nonzero); m <= b iff I < b or (I = b and F zero); m < b iff I < b.
Frag SchemaCompiler::Magnitude(uint64_t a, bool a_open, bool has_b, uint64_t b, bool b_open) {
  const uint64_t imax = Pow10(options_.max_integer_digits) - 1;
  if (has_b && b > imax) has_b = false;  // every representable magnitude is below it
  std::vector<Frag> alts;
  const uint64_t a1 = a + (a_open ? 1 : 0);
  if (!has_b || b >= 1) {
    const uint64_t b1 = has_b ? b - 1 : imax;
    if (a1 <= b1) alts.push_back(nfa_.Seq(IntRange(a1, b1), Fraction(0)));
  }
  if (a_open && a <= imax && (!has_b || a < b)) {
    alts.push_back(nfa_.Seq(Lit(Decimal(a)), Fraction(1)));
  }
  if (has_b && !b_open && (b > a || (b == a && !a_open))) {
    alts.push_back(nfa_.Seq(Lit(Decimal(b)), Fraction(2)));
  }
  return nfa_.Alt(alts);
}

Frag SchemaCompiler::AnyObject() {
  // { ws ( } | member ( ws , ws member )* ws } ), member = string ws : ws value.
  const Frag open = nfa_.Seq(Lit("{"), Ws());
  const int32_t end = nfa_.AddState();
  const Frag empty_close = Lit("}");
  nfa_.AddEps(open.end, empty_close.start);
  nfa_.AddEps(empty_close.end, end);
  const Frag member = Seq({PlainString(0, -1), Ws(), Lit(":"), Ws(), AnyValue()});
  nfa_.AddEps(open.end, member.start);
  const Frag next = Seq({Ws(), Lit(","), Ws()});
  nfa_.AddEps(member.end, next.start);
  nfa_.AddEps(next.end, member.start);
  const Frag close = nfa_.Seq(Ws(), Lit("}"));
  nfa_.AddEps(member.end, close.start);
  nfa_.AddEps(close.end, end);
  return {open.start, end};
}

Frag SchemaCompiler::AnyArray() {
  const Frag open = nfa_.Seq(Lit("["), Ws());
  const int32_t end = nfa_.AddState();
  const Frag empty_close = Lit("]");
  nfa_.AddEps(open.end, empty_close.start);
  nfa_.AddEps(empty_close.end, end);
  const Frag item = AnyValue();
  nfa_.AddEps(open.end, item.start);
  const Frag next = Seq({Ws(), Lit(","), Ws()});
  nfa_.AddEps(item.end, next.start);
  nfa_.AddEps(next.end, item.start);
  const Frag close = nfa_.Seq(Ws(), Lit("]"));
  nfa_.AddEps(item.end, close.start);
  nfa_.AddEps(close.end, end);
  return {open.start, end};
}

int32_t SchemaCompiler::AnyRule() {
  if (any_rule_ >= 0) return any_rule_;
  any_rule_ = ReserveRule("{} (any value)");
  nfa_.SetRule(any_rule_, nfa_.Alt({AnyObject(), AnyArray(), PlainString(0, -1), PlainNumber(false),
                                    Lit("true"), Lit("false"), Lit("null")}));
  return any_rule_;
}

// "key" for any key without escapes that is not one of `declared`.
Frag SchemaCompiler::AdditionalKey(const std::vector<std::string>& declared) {
  const CodePointSet printable = Printable();
  // A trie of the declared keys over code points.
  struct Node {
    std::map<uint32_t, int> children;
    bool is_key = false;
  };
  std::vector<Node> trie(1);
  for (const std::string& key : declared) {
    std::vector<uint32_t> cps;
    bool ok = true;
    for (size_t i = 0; i < key.size();) {
      const auto b0 = static_cast<uint8_t>(key[i]);
      const int len = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : 4;
      uint32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
      for (int k = 1; k < len && i + k < key.size(); ++k) {
        cp = (cp << 6) | (static_cast<uint8_t>(key[i + k]) & 0x3F);
      }
      if (!printable.Contains(cp)) ok = false;
      cps.push_back(cp);
      i += len;
    }
    if (!ok) continue;  // needs an escape: no escape-free key equals it
    int at = 0;
    for (uint32_t cp : cps) {
      auto it = trie[at].children.find(cp);
      if (it == trie[at].children.end()) {
        trie.push_back({});
        const int child = static_cast<int>(trie.size()) - 1;
        trie[at].children[cp] = child;
        at = child;
      } else {
        at = it->second;
      }
    }
    trie[at].is_key = true;
  }
  const Frag open = Lit("\"");
  const int32_t end = nfa_.AddState();
  std::vector<int32_t> state(trie.size());
  for (auto& s : state) s = nfa_.AddState();
  const int32_t other = nfa_.AddState();  // diverged from every declared key
  nfa_.AddEps(open.end, state[0]);
  for (size_t n = 0; n < trie.size(); ++n) {
    CodePointSet rest = printable;
    for (const auto& [cp, child] : trie[n].children) {
      const Frag ch = nfa_.Utf8(CodePointSet::Of(cp, cp));
      nfa_.AddEps(state[n], ch.start);
      nfa_.AddEps(ch.end, state[child]);
      rest = rest.Minus(CodePointSet::Of(cp, cp));
    }
    const Frag ch = nfa_.Utf8(rest);
    nfa_.AddEps(state[n], ch.start);
    nfa_.AddEps(ch.end, other);
    if (!trie[n].is_key) nfa_.AddByte(state[n], '"', '"', end);
  }
  const Frag loop = nfa_.Utf8(printable);
  nfa_.AddEps(other, loop.start);
  nfa_.AddEps(loop.end, other);
  nfa_.AddByte(other, '"', '"', end);
  return {open.start, end};
}

absl::StatusOr<Frag> SchemaCompiler::Expand(const Json& target, const std::string& pointer) {
  expanding_.insert(pointer);
  const int32_t before = nfa_.num_states();
  auto body = Schema(target, pointer);
  expanding_.erase(pointer);
  if (!body.ok()) return body;
  auto it = ref_rule_.find(pointer);
  if (it != ref_rule_.end()) {  // recursive (or large): this expansion is the rule's body
    nfa_.SetRule(it->second, *body);
    return nfa_.Call(it->second);
  }
  ref_size_[pointer] = nfa_.num_states() - before;
  return body;
}

absl::StatusOr<Frag> SchemaCompiler::Ref(const Json& ref, const std::string& pointer) {
  if (!ref.is_string()) return Error(pointer, "'$ref' must be a string");
  const std::string text = ref.get<std::string>();
  if (text.empty() || text[0] != '#' || (text.size() > 1 && text[1] != '/')) {
    return Error(pointer, absl::StrCat("unsupported '$ref' \"", text,
                                       "\" (only local JSON pointers: #, #/$defs/Name)"));
  }
  // Walk the pointer (percent-decoded, ~1 and ~0 unescaped).
  std::string decoded;
  for (size_t i = 1; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && absl::ascii_isxdigit(text[i + 1]) &&
        absl::ascii_isxdigit(text[i + 2])) {
      decoded.push_back(static_cast<char>(std::stoi(text.substr(i + 1, 2), nullptr, 16)));
      i += 2;
    } else {
      decoded.push_back(text[i]);
    }
  }
  const Json* at = &root_;
  std::string target_pointer;
  size_t i = 0;
  while (i < decoded.size()) {
    size_t next = decoded.find('/', i + 1);
    if (next == std::string::npos) next = decoded.size();
    const std::string raw = decoded.substr(i + 1, next - i - 1);
    std::string token;
    for (size_t k = 0; k < raw.size(); ++k) {
      if (raw[k] == '~' && k + 1 < raw.size() && (raw[k + 1] == '0' || raw[k + 1] == '1')) {
        token.push_back(raw[k + 1] == '0' ? '~' : '/');
        ++k;
      } else {
        token.push_back(raw[k]);
      }
    }
    const Json* child = nullptr;
    if (at->is_object()) {
      auto it = at->find(token);
      if (it != at->end()) child = &*it;
    } else if (at->is_array() && !token.empty() &&
               token.find_first_not_of("0123456789") == std::string::npos && token.size() < 10 &&
               std::stoul(token) < at->size()) {
      child = &(*at)[std::stoul(token)];
    }
    if (child == nullptr) {
      return Error(pointer, absl::StrCat("'$ref' \"", text, "\" points to nothing"));
    }
    at = child;
    target_pointer += "/" + PointerToken(token);
    i = next;
  }
  if (ref_rule_.count(target_pointer)) return nfa_.Call(ref_rule_[target_pointer]);
  if (expanding_.count(target_pointer) ||
      (ref_size_.count(target_pointer) && ref_size_[target_pointer] > kInlineRefLimit)) {
    const int32_t rule = ReserveRule(Where(target_pointer));
    ref_rule_[target_pointer] = rule;
    if (expanding_.count(target_pointer)) return nfa_.Call(rule);
  }
  return Expand(*at, target_pointer);
}

absl::StatusOr<Frag> SchemaCompiler::Values(const std::vector<Json>& values,
                                            const std::string& pointer) {
  std::vector<Frag> alts;
  std::set<std::string> seen;
  for (const Json& v : values) {
    std::string text;
    try {
      text = v.dump();
    } catch (const nlohmann::json::exception& e) {
      return Error(pointer, absl::StrCat("an enum value cannot be serialized: ", e.what()));
    }
    if (seen.insert(text).second) alts.push_back(Lit(text));
  }
  return nfa_.Alt(alts);
}

absl::StatusOr<int64_t> SchemaCompiler::Count(const Json& s, const char* keyword,
                                              const std::string& pointer) {
  const Json& v = s[keyword];
  if (!v.is_number_integer() &&
      !(v.is_number_float() && v.get<double>() == std::floor(v.get<double>()))) {
    return Error(pointer, absl::StrCat("'", keyword, "' must be a non-negative integer"));
  }
  const double d = v.get<double>();
  if (d < 0) return Error(pointer, absl::StrCat("'", keyword, "' must be a non-negative integer"));
  if (d > kMaxCount) {
    return Error(pointer, absl::StrCat("'", keyword, "' ", v.dump(),
                                       " is above the supported maximum ", kMaxCount));
  }
  return static_cast<int64_t>(d);
}

absl::StatusOr<Frag> SchemaCompiler::Schema(const Json& s, const std::string& pointer) {
  if (auto status = CheckSize(pointer); !status.ok()) return status;
  if (s.is_boolean()) return s.get<bool>() ? AnyValue() : nfa_.Nothing();
  if (!s.is_object()) return Error(pointer, "a schema must be an object or a boolean");
  const auto& supported = SupportedKeywords();
  std::vector<std::string> constraining;  // keywords other than annotations and $defs
  std::set<Family> families;
  for (auto it = s.begin(); it != s.end(); ++it) {
    const std::string& key = it.key();
    if (IgnoredKeywords().count(key)) continue;
    auto known = supported.find(key);
    if (known == supported.end()) {
      return Error(pointer, absl::StrCat("unsupported keyword '", key, "'"));
    }
    if (key == "$defs" || key == "definitions") {
      if (!it->is_object()) return Error(pointer, absl::StrCat("'", key, "' must be an object"));
      continue;
    }
    constraining.push_back(key);
    if (known->second != Family::kOther) families.insert(known->second);
  }
  auto only = [&](const std::string& keyword,
                  const std::set<std::string>& allowed) -> absl::Status {
    for (const std::string& k : constraining) {
      if (k != keyword && !allowed.count(k)) {
        return Error(pointer,
                     absl::StrCat("keyword '", k, "' alongside '", keyword, "' is not supported"));
      }
    }
    return absl::OkStatus();
  };

  if (s.contains("$ref")) {
    if (auto status = only("$ref", {}); !status.ok()) return status;
    return Ref(s["$ref"], pointer);
  }
  for (const char* keyword : {"anyOf", "oneOf"}) {
    if (!s.contains(keyword)) continue;
    // oneOf is compiled as anyOf: a document matching two branches is accepted.
    if (auto status = only(keyword, {}); !status.ok()) return status;
    const Json& branches = s[keyword];
    if (!branches.is_array() || branches.empty()) {
      return Error(pointer, absl::StrCat("'", keyword, "' must be a non-empty array"));
    }
    std::vector<Frag> alts;
    for (size_t i = 0; i < branches.size(); ++i) {
      auto f = Schema(branches[i], absl::StrCat(pointer, "/", keyword, "/", i));
      if (!f.ok()) return f;
      alts.push_back(*f);
    }
    return nfa_.Alt(alts);
  }
  if (s.contains("allOf")) {
    if (auto status = only("allOf", {}); !status.ok()) return status;
    const Json& all = s["allOf"];
    if (!all.is_array() || all.size() != 1) {
      return Error(pointer, "'allOf' with other than one schema is not supported");
    }
    return Schema(all[0], pointer + "/allOf/0");
  }

  // The types allowed.
  std::set<std::string> types;
  if (s.contains("type")) {
    const Json& t = s["type"];
    std::vector<Json> names;
    if (t.is_string()) {
      names.push_back(t);
    } else if (t.is_array() && !t.empty()) {
      names.assign(t.begin(), t.end());
    } else {
      return Error(pointer, "'type' must be a type name or a non-empty array of them");
    }
    for (const Json& n : names) {
      static const std::set<std::string> kTypes = {"object",  "array",   "string", "number",
                                                   "integer", "boolean", "null"};
      if (!n.is_string() || !kTypes.count(n.get<std::string>())) {
        return Error(pointer, absl::StrCat("unknown 'type' ", n.dump()));
      }
      types.insert(n.get<std::string>());
    }
  }
  bool nullable = false;
  if (s.contains("nullable")) {
    if (!s["nullable"].is_boolean()) return Error(pointer, "'nullable' must be a boolean");
    nullable = s["nullable"].get<bool>();
  }

  if (s.contains("enum") || s.contains("const")) {
    if (s.contains("enum") && s.contains("const")) {
      return Error(pointer, "keyword 'const' alongside 'enum' is not supported");
    }
    const std::string keyword = s.contains("enum") ? "enum" : "const";
    if (auto status = only(keyword, {"type", "nullable"}); !status.ok()) return status;
    std::vector<Json> values;
    if (keyword == "const") {
      values.push_back(s["const"]);
    } else {
      if (!s["enum"].is_array()) return Error(pointer, "'enum' must be an array");
      values.assign(s["enum"].begin(), s["enum"].end());
    }
    if (nullable && !types.empty()) types.insert("null");
    std::vector<Json> kept;
    for (const Json& v : values) {
      if (types.empty()) {
        kept.push_back(v);
        continue;
      }
      const bool integral =
          v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                    v.get<double>() == std::floor(v.get<double>()));
      if ((v.is_object() && types.count("object")) || (v.is_array() && types.count("array")) ||
          (v.is_string() && types.count("string")) || (v.is_number() && types.count("number")) ||
          (v.is_number() && integral && types.count("integer")) ||
          (v.is_boolean() && types.count("boolean")) || (v.is_null() && types.count("null"))) {
        kept.push_back(v);
      }
    }
    if (nullable && types.empty()) kept.push_back(nullptr);
    return Values(kept, pointer);
  }

  if (types.empty()) {
    if (families.size() > 1) {
      return Error(pointer, "keywords of several types without 'type' are not supported");
    }
    if (families.empty()) {
      return AnyValue();  // `nullable` alone adds nothing to any value
    }
    switch (*families.begin()) {
      case Family::kObject:
        types.insert("object");
        break;
      case Family::kArray:
        types.insert("array");
        break;
      case Family::kString:
        types.insert("string");
        break;
      default:
        types.insert("number");
        break;
    }
  }
  if (nullable) types.insert("null");
  for (const std::string& k : constraining) {
    const Family f = supported.at(k);
    const bool applies =
        f == Family::kOther || (f == Family::kObject && types.count("object")) ||
        (f == Family::kArray && types.count("array")) ||
        (f == Family::kString && types.count("string")) ||
        (f == Family::kNumber && (types.count("number") || types.count("integer")));
    if (!applies) {
      return Error(pointer, absl::StrCat("keyword '", k, "' (for type ", FamilyName(f),
                                         ") does not apply to the schema's type"));
    }
  }
  std::vector<Frag> alts;
  for (const std::string& t : types) {
    absl::StatusOr<Frag> f;
    if (t == "object") {
      f = Object(s, pointer);
    } else if (t == "array") {
      f = Array(s, pointer);
    } else if (t == "string") {
      f = String(s, pointer);
    } else if (t == "number") {
      f = Number(s, pointer, false);
    } else if (t == "integer") {
      if (types.count("number")) continue;  // numbers include the integers
      f = Number(s, pointer, true);
    } else if (t == "boolean") {
      f = nfa_.Alt({Lit("true"), Lit("false")});
    } else {
      f = Lit("null");
    }
    if (!f.ok()) return f;
    alts.push_back(*f);
  }
  return alts.size() == 1 ? alts[0] : nfa_.Alt(alts);
}

absl::StatusOr<Frag> SchemaCompiler::Object(const Json& s, const std::string& pointer) {
  struct Property {
    std::string key;
    const Json* schema;
    std::string pointer;
    bool required;
  };
  static const Json kTrue = true;
  std::vector<Property> props;
  std::vector<std::string> declared;
  std::set<std::string> required;
  if (s.contains("required")) {
    const Json& r = s["required"];
    if (!r.is_array()) return Error(pointer, "'required' must be an array of strings");
    for (const Json& k : r) {
      if (!k.is_string()) return Error(pointer, "'required' must be an array of strings");
      required.insert(k.get<std::string>());
    }
  }
  const Json* additional = &kTrue;
  std::string additional_pointer = pointer + "/additionalProperties";
  if (s.contains("additionalProperties")) {
    additional = &s["additionalProperties"];
    if (!additional->is_boolean() && !additional->is_object()) {
      return Error(pointer, "'additionalProperties' must be a boolean or a schema");
    }
  }
  const bool additional_allowed = !(additional->is_boolean() && !additional->get<bool>());
  std::set<std::string> seen;
  if (s.contains("properties")) {
    const Json& p = s["properties"];
    if (!p.is_object()) return Error(pointer, "'properties' must be an object");
    for (auto it = p.begin(); it != p.end(); ++it) {
      declared.push_back(it.key());
      seen.insert(it.key());
      const bool is_required = required.count(it.key()) > 0;
      if (it->is_boolean() && !it->get<bool>()) {
        if (is_required) return nfa_.Nothing();  // a required property that cannot exist
        continue;
      }
      props.push_back(
          {it.key(), &*it, pointer + "/properties/" + PointerToken(it.key()), is_required});
    }
  }
  for (const std::string& k : required) {
    if (seen.count(k)) continue;
    if (!additional_allowed) {
      return Error(pointer, absl::StrCat("required property '", k,
                                         "' is not in 'properties' and additionalProperties "
                                         "is false"));
    }
    declared.push_back(k);
    props.push_back({k, additional, additional_pointer, true});
  }

  // { ws, then the declared properties in order (each optional one may be skipped), then
  // additional ones; n[i] / c[i]: before property i with none / some written.
  const Frag open = nfa_.Seq(Lit("{"), Ws());
  const int32_t end = nfa_.AddState();
  const size_t count = props.size();
  std::vector<int32_t> none(count + 1, -1), some(count + 1);
  none[0] = open.end;
  for (size_t i = 0; i <= count; ++i) some[i] = nfa_.AddState();
  for (size_t i = 0; i < count; ++i) {
    auto value = Schema(*props[i].schema, props[i].pointer);
    if (!value.ok()) return value;
    const Frag item = Seq({Lit(Json(props[i].key).dump()), Ws(), Lit(":"), Ws(), *value});
    if (none[i] >= 0) nfa_.AddEps(none[i], item.start);
    const Frag comma = Seq({Ws(), Lit(","), Ws()});
    nfa_.AddEps(some[i], comma.start);
    nfa_.AddEps(comma.end, item.start);
    nfa_.AddEps(item.end, some[i + 1]);
    if (!props[i].required) {
      if (none[i] >= 0) {
        none[i + 1] = nfa_.AddState();
        nfa_.AddEps(none[i], none[i + 1]);
      }
      nfa_.AddEps(some[i], some[i + 1]);
    }
  }
  if (additional_allowed) {
    auto value = Schema(*additional, additional_pointer);
    if (!value.ok()) return value;
    const Frag item = Seq({AdditionalKey(declared), Ws(), Lit(":"), Ws(), *value});
    if (none[count] >= 0) nfa_.AddEps(none[count], item.start);
    const Frag comma = Seq({Ws(), Lit(","), Ws()});
    nfa_.AddEps(some[count], comma.start);
    nfa_.AddEps(comma.end, item.start);
    nfa_.AddEps(item.end, some[count]);
  }
  if (none[count] >= 0) {
    const Frag close = Lit("}");
    nfa_.AddEps(none[count], close.start);
    nfa_.AddEps(close.end, end);
  }
  const Frag close = nfa_.Seq(Ws(), Lit("}"));
  nfa_.AddEps(some[count], close.start);
  nfa_.AddEps(close.end, end);
  return Frag{open.start, end};
}

absl::StatusOr<Frag> SchemaCompiler::Array(const Json& s, const std::string& pointer) {
  static const Json kTrue = true;
  std::vector<const Json*> prefix;
  std::vector<std::string> prefix_pointers;
  const Json* items = &kTrue;
  std::string items_pointer = pointer + "/items";
  if (s.contains("prefixItems")) {
    const Json& p = s["prefixItems"];
    if (!p.is_array()) return Error(pointer, "'prefixItems' must be an array of schemas");
    for (size_t i = 0; i < p.size(); ++i) {
      prefix.push_back(&p[i]);
      prefix_pointers.push_back(absl::StrCat(pointer, "/prefixItems/", i));
    }
  }
  if (s.contains("items")) {
    const Json& it = s["items"];
    if (it.is_array()) {  // the tuple form of earlier drafts: prefixItems
      if (!prefix.empty()) return Error(pointer, "'items' as an array alongside 'prefixItems'");
      for (size_t i = 0; i < it.size(); ++i) {
        prefix.push_back(&it[i]);
        prefix_pointers.push_back(absl::StrCat(pointer, "/items/", i));
      }
    } else {
      items = &it;
    }
  }
  int64_t min = 0, max = -1;
  if (s.contains("minItems")) {
    auto v = Count(s, "minItems", pointer);
    if (!v.ok()) return v.status();
    min = *v;
  }
  if (s.contains("maxItems")) {
    auto v = Count(s, "maxItems", pointer);
    if (!v.ok()) return v.status();
    max = *v;
  }
  const int64_t p = static_cast<int64_t>(prefix.size());
  const bool no_more = items->is_boolean() && !items->get<bool>();
  if (no_more && (max < 0 || max > p)) max = p;
  if (max >= 0 && min > max) return nfa_.Nothing();
  // Element k; items copies beyond the first are inline copies of a small schema, or
  // calls of a rule holding a large one.
  int32_t items_rule = -1;
  int items_copies = 0;
  auto element = [&](int64_t k) -> absl::StatusOr<Frag> {
    if (k < p) return Schema(*prefix[k], prefix_pointers[k]);
    if (items_rule >= 0) return nfa_.Call(items_rule);
    const int32_t before = nfa_.num_states();
    auto f = Schema(*items, items_pointer);
    if (!f.ok()) return f;
    ++items_copies;
    if (items_copies == 1 && nfa_.num_states() - before > kInlineItemLimit) {
      items_rule = ReserveRule(Where(items_pointer));
      nfa_.SetRule(items_rule, *f);
      return nfa_.Call(items_rule);
    }
    return f;
  };
  // e[k]: after k elements. Bounded: e[0..max]; unbounded: e[0..top] with a loop at top.
  const int64_t top = max >= 0 ? max : std::max<int64_t>({p, min, 1});
  const Frag open = nfa_.Seq(Lit("["), Ws());
  const int32_t end = nfa_.AddState();
  std::vector<int32_t> e(top + 1);
  e[0] = open.end;
  for (int64_t k = 1; k <= top; ++k) e[k] = nfa_.AddState();
  if (min == 0) {
    const Frag close = Lit("]");
    nfa_.AddEps(e[0], close.start);
    nfa_.AddEps(close.end, end);
  }
  for (int64_t k = 0; k < top; ++k) {
    auto f = element(k);
    if (!f.ok()) return f;
    if (k == 0) {
      nfa_.AddEps(e[0], f->start);
    } else {
      const Frag comma = Seq({Ws(), Lit(","), Ws()});
      nfa_.AddEps(e[k], comma.start);
      nfa_.AddEps(comma.end, f->start);
    }
    nfa_.AddEps(f->end, e[k + 1]);
    if (k + 1 >= min) {
      const Frag close = nfa_.Seq(Ws(), Lit("]"));
      nfa_.AddEps(e[k + 1], close.start);
      nfa_.AddEps(close.end, end);
    }
    if (auto status = CheckSize(pointer); !status.ok()) return status;
  }
  if (max < 0 && !no_more) {
    auto f = element(top);
    if (!f.ok()) return f;
    const Frag comma = Seq({Ws(), Lit(","), Ws()});
    nfa_.AddEps(e[top], comma.start);
    nfa_.AddEps(comma.end, f->start);
    nfa_.AddEps(f->end, e[top]);
  }
  return Frag{open.start, end};
}

absl::StatusOr<Frag> SchemaCompiler::String(const Json& s, const std::string& pointer) {
  int64_t min = 0, max = -1;
  if (s.contains("minLength")) {
    auto v = Count(s, "minLength", pointer);
    if (!v.ok()) return v.status();
    min = *v;
  }
  if (s.contains("maxLength")) {
    auto v = Count(s, "maxLength", pointer);
    if (!v.ok()) return v.status();
    max = *v;
  }
  if (max >= 0 && min > max) return nfa_.Nothing();
  if (s.contains("pattern") && s.contains("format")) {
    return Error(pointer, "keyword 'pattern' alongside 'format' is not supported");
  }
  std::string regex;
  std::string keyword;
  if (s.contains("pattern")) {
    keyword = "pattern";
    if (!s["pattern"].is_string()) return Error(pointer, "'pattern' must be a string");
    regex = s["pattern"].get<std::string>();
  } else if (s.contains("format")) {
    keyword = "format";
    if (!s["format"].is_string()) return Error(pointer, "'format' must be a string");
    const std::string format = s["format"].get<std::string>();
    auto it = FormatPatterns().find(format);
    if (it == FormatPatterns().end()) {
      return Error(pointer, absl::StrCat("unsupported 'format' \"", format,
                                         "\" (supported: date-time, date, time, uuid, email)"));
    }
    regex = it->second;
  } else {
    return PlainString(static_cast<int>(min), static_cast<int>(max));
  }
  auto re = internal::CompileRegex(regex, kMaxRegexStates);
  if (!re.ok()) {
    return Error(pointer, absl::StrCat("unsupported '", keyword, "': ", re.status().message()));
  }
  return PatternString(*re, static_cast<int>(min), static_cast<int>(max), pointer);
}

absl::StatusOr<Frag> SchemaCompiler::Number(const Json& s, const std::string& pointer,
                                            bool integer) {
  std::optional<Bound> lo, hi;
  for (const char* keyword : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
    if (!s.contains(keyword)) continue;
    const Json& v = s[keyword];
    if (!v.is_number()) {
      return Error(pointer, absl::StrCat("'", keyword,
                                         "' must be a number (the boolean form of "
                                         "draft 4 is not supported)"));
    }
    long double value = v.is_number_unsigned()  ? static_cast<long double>(v.get<uint64_t>())
                        : v.is_number_integer() ? static_cast<long double>(v.get<int64_t>())
                                                : static_cast<long double>(v.get<double>());
    if (!std::isfinite(static_cast<double>(value))) {
      return Error(pointer, absl::StrCat("'", keyword, "' must be finite"));
    }
    const bool open = keyword[0] == 'e';
    const bool is_lower = std::string(keyword).find("inimum") != std::string::npos;
    if (!integer && value != std::floor(value)) {
      return Error(pointer, absl::StrCat("'", keyword, "' ", v.dump(),
                                         ": only integer bounds are supported for type number"));
    }
    std::optional<Bound>& b = is_lower ? lo : hi;
    // Keep the tighter bound.
    if (!b || (is_lower ? (value > b->value || (value == b->value && open))
                        : (value < b->value || (value == b->value && open)))) {
      b = Bound{value, open};
    }
  }
  if (!lo && !hi) return PlainNumber(integer);
  const long double imax = static_cast<long double>(Pow10(options_.max_integer_digits) - 1);
  auto clamp = [&](long double v) { return std::max(-imax - 1, std::min(imax + 1, v)); };
  if (integer) {
    // Inclusive integer bounds, clamped to the representable range.
    long double l = -imax, h = imax;
    if (lo) l = std::max(l, lo->open ? std::floor(lo->value) + 1 : std::ceil(lo->value));
    if (hi) h = std::min(h, hi->open ? std::ceil(hi->value) - 1 : std::floor(hi->value));
    if (l > h) return nfa_.Nothing();
    const auto li = static_cast<int64_t>(l), hi_i = static_cast<int64_t>(h);
    std::vector<Frag> alts;
    if (hi_i >= 0) alts.push_back(IntRange(static_cast<uint64_t>(std::max<int64_t>(li, 0)), hi_i));
    if (li < 0) {
      alts.push_back(nfa_.Seq(Lit("-"), IntRange(static_cast<uint64_t>(std::max<int64_t>(1, -hi_i)),
                                                 static_cast<uint64_t>(-li))));
    }
    return nfa_.Alt(alts);
  }
  // Numbers: no exponent; the nonnegative and the negative branches by magnitude.
  std::vector<Frag> alts;
  const long double l = lo ? clamp(lo->value) : 0, h = hi ? clamp(hi->value) : 0;
  const bool l_open = lo && lo->open, h_open = hi && hi->open;
  if (!hi || h > 0 || (h == 0 && !h_open)) {
    const bool l_pos = lo && l >= 0;
    alts.push_back(Magnitude(l_pos ? static_cast<uint64_t>(l) : 0, l_pos && l_open, hi.has_value(),
                             hi ? static_cast<uint64_t>(h) : 0, h_open));
  }
  if (!lo || l < 0) {
    // -0 is not written: the magnitude is above 0, or above -h.
    const bool h_neg = hi && h < 0;
    alts.push_back(
        nfa_.Seq(Lit("-"), Magnitude(h_neg ? static_cast<uint64_t>(-h) : 0, h_neg ? h_open : true,
                                     lo.has_value(), lo ? static_cast<uint64_t>(-l) : 0, l_open)));
  }
  return nfa_.Alt(alts);
}

absl::Status CheckOptions(const JsonSchemaOptions& o) {
  auto range = [](const char* name, int v, int lo, int hi) -> absl::Status {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, " = ", v, " is outside [", lo, ", ", hi, "]"));
    }
    return absl::OkStatus();
  };
  for (const absl::Status& s : {range("max_whitespace", o.max_whitespace, 0, 64),
                                range("max_integer_digits", o.max_integer_digits, 1, 18),
                                range("max_fraction_digits", o.max_fraction_digits, 0, 32),
                                range("max_exponent_digits", o.max_exponent_digits, 0, 2),
                                range("max_recursion_depth", o.max_recursion_depth, 2, 200),
                                range("max_states", o.max_states, 16, 4000000)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(
    const nlohmann::ordered_json& schema, const JsonSchemaOptions& options) {
  if (auto status = CheckOptions(options); !status.ok()) return status;
  SchemaCompiler compiler(schema, options);
  return compiler.CompileSchema();
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema,
                                                                 const JsonSchemaOptions& options) {
  // The same document with the std::map's (alphabetical) key order.
  return CompileJsonSchema(nlohmann::ordered_json::parse(schema.dump()), options);
}

std::shared_ptr<const Grammar> AnyJsonObject(const JsonSchemaOptions& options) {
  // The default options' grammar is built once and shared.
  const JsonSchemaOptions d;
  if (options.max_whitespace == d.max_whitespace &&
      options.max_integer_digits == d.max_integer_digits &&
      options.max_fraction_digits == d.max_fraction_digits &&
      options.max_exponent_digits == d.max_exponent_digits &&
      options.max_recursion_depth == d.max_recursion_depth && options.max_states == d.max_states) {
    static const auto* shared = new std::shared_ptr<const Grammar>(
        SchemaCompiler(nlohmann::ordered_json::object(), d).CompileAnyObject());
    return *shared;
  }
  JsonSchemaOptions o = options;
  o.max_whitespace = std::clamp(o.max_whitespace, 0, 64);
  o.max_integer_digits = std::clamp(o.max_integer_digits, 1, 18);
  o.max_fraction_digits = std::clamp(o.max_fraction_digits, 0, 32);
  o.max_exponent_digits = std::clamp(o.max_exponent_digits, 0, 2);
  o.max_recursion_depth = std::clamp(o.max_recursion_depth, 2, 200);
  o.max_states = std::clamp(o.max_states, 100000, 4000000);
  SchemaCompiler compiler(nlohmann::ordered_json::object(), o);
  return compiler.CompileAnyObject();
}

namespace {

// The cache behind CompileJsonSchemaCached: least recently used first out.
class CompiledSchemaCache {
 public:
  std::shared_ptr<const Grammar> Find(const std::string& key) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);  // most recently used
    return it->second->second;
  }
  void Insert(const std::string& key, std::shared_ptr<const Grammar> grammar) {
    absl::MutexLock lock(&mu_);
    if (index_.count(key) > 0) return;
    order_.emplace_front(key, std::move(grammar));
    index_[key] = order_.begin();
    if (order_.size() > kCompiledSchemaCacheEntries) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const Grammar>>;
  absl::Mutex mu_;
  std::list<Entry> order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
};

CompiledSchemaCache& SchemaCache() {
  static auto* cache = new CompiledSchemaCache();
  return *cache;
}

template <typename Json>
absl::StatusOr<std::shared_ptr<const Grammar>> CompileCached(const Json& schema, char kind) {
  // The kind keeps a sorted-key and an ordered schema apart (their property orders differ).
  const std::string key = kind + schema.dump();
  if (auto hit = SchemaCache().Find(key); hit != nullptr) return hit;
  auto grammar = CompileJsonSchema(schema);
  if (grammar.ok()) SchemaCache().Insert(key, *grammar);
  return grammar;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaCached(
    const nlohmann::json& schema) {
  return CompileCached(schema, 's');
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaCached(
    const nlohmann::ordered_json& schema) {
  return CompileCached(schema, 'o');
}

}  // namespace fwserve::constraints
