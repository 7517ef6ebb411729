// The compiler's intermediate form (internal to models/constraints): sets of code points, and
// a byte-level NFA with epsilon moves and rule calls, built from Thompson fragments. The
// JSON Schema and regex compilers build one Nfa; BuildGrammar (grammar.h) turns its rules
// into the deterministic tables a Matcher walks. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fwserve::constraints::internal {

// Unicode scalar values: code points 0..0x10FFFF without the surrogates D800..DFFF.
inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// A set of code points as sorted, disjoint, non-adjacent inclusive ranges.
class CodePointSet {
 public:
  CodePointSet() = default;
  static CodePointSet Of(uint32_t lo, uint32_t hi);
  // Every scalar value (no surrogates).
  static CodePointSet All();

  void Add(uint32_t lo, uint32_t hi);
  void Add(const CodePointSet& other);
  // All() minus this set.
  CodePointSet Complement() const;
  CodePointSet Intersect(const CodePointSet& other) const;
  CodePointSet Minus(const CodePointSet& other) const;
  bool Contains(uint32_t cp) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<uint32_t, uint32_t>>& ranges() const { return ranges_; }
  bool operator==(const CodePointSet& other) const { return ranges_ == other.ranges_; }

 private:
  void Normalize();
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;
};

// The UTF-8 encoding of `cp` appended to `out`.
void AppendUtf8(uint32_t cp, std::string* out);

// A byte-level NFA with epsilon moves and calls. Several rules share one state space; a
// rule is a fragment (start, end) whose states connect to no other rule's states except
// through calls: a call edge `from --call(rule, ret)-->` runs `rule` from its start to its
// end and continues at `ret`. Fragments are Thompson fragments: one start, one end, built
// fresh for every use (a fragment is never connected twice).
class Nfa {
 public:
  struct Frag {
    int32_t start = -1;
    int32_t end = -1;
  };
  struct ByteEdge {
    int32_t from;
    int32_t to;
    uint8_t lo;
    uint8_t hi;
  };
  struct EpsEdge {
    int32_t from;
    int32_t to;
  };
  struct CallEdge {
    int32_t from;
    int32_t rule;
    int32_t ret;
  };

  int32_t AddState() { return num_states_++; }
  int32_t num_states() const { return num_states_; }

  void AddByte(int32_t from, uint8_t lo, uint8_t hi, int32_t to) {
    bytes_.push_back({from, to, lo, hi});
  }
  void AddEps(int32_t from, int32_t to) { eps_.push_back({from, to}); }
  void AddCall(int32_t from, int32_t rule, int32_t ret) { calls_.push_back({from, rule, ret}); }

  // Rules: Reserve a rule id first (a recursive body calls itself), then set its body.
  int32_t ReserveRule() {
    rules_.push_back(Frag{});
    return static_cast<int32_t>(rules_.size()) - 1;
  }
  void SetRule(int32_t rule, Frag body) { rules_[rule] = body; }
  const std::vector<Frag>& rules() const { return rules_; }

  const std::vector<ByteEdge>& byte_edges() const { return bytes_; }
  const std::vector<EpsEdge>& eps_edges() const { return eps_; }
  const std::vector<CallEdge>& call_edges() const { return calls_; }

  // Fragment constructors. Each returns a fresh fragment.
  // The empty string.
  Frag Empty();
  // No string at all (the end is unreachable).
  Frag Nothing();
  // Exactly these bytes.
  Frag Literal(std::string_view bytes);
  // One byte in [lo, hi].
  Frag ByteRange(uint8_t lo, uint8_t hi);
  // One byte of a list of ranges.
  Frag ByteRanges(const std::vector<std::pair<uint8_t, uint8_t>>& ranges);
  // The UTF-8 encoding of one code point of `set` (empty set: Nothing()).
  Frag Utf8(const CodePointSet& set);
  // a then b.
  Frag Seq(Frag a, Frag b);
  // Any one of `alternatives` (none: Nothing()).
  Frag Alt(const std::vector<Frag>& alternatives);
  // a or the empty string.
  Frag Optional(Frag a);
  // Zero or more repetitions of a (a's states are reused by the loop).
  Frag Star(Frag a);
  // A call of `rule`.
  Frag Call(int32_t rule);

 private:
  int32_t num_states_ = 0;
  std::vector<ByteEdge> bytes_;
  std::vector<EpsEdge> eps_;
  std::vector<CallEdge> calls_;
  std::vector<Frag> rules_;
};

}  // namespace fwserve::constraints::internal
