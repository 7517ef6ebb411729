// JSON Schema `pattern`s (internal to models/constraints): the regular subset of ECMAScript
// regular expressions compiled to an automaton over code points. Torch-free.
//
// Supported: literals (UTF-8), escapes \d \D \w \W \s \S \t \n \r \v \f \0 \xHH \uHHHH
// \u{H...} and escaped punctuation (\. \/ \\ ...), classes [a-z] [^...] with class escapes,
// `.` (any code point but \n \r U+2028 U+2029), groups (...) (?:...) (?<name>...),
// alternation |, quantifiers * + ? {m} {m,} {m,n} (a lazy `?` after one is accepted: it does
// not change the language), and the anchors ^ and $ at the ends of a top-level alternative.
// As JSON Schema says, a pattern is unanchored: an alternative without ^ may be preceded by
// any text, one without $ followed by any. Refused: backreferences, lookaround, \b \B, \p,
// \c, anchors anywhere else. Code points, not UTF-16 units, are the unit of `.` and classes
// (ECMAScript's `u` mode).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "models/constraints/nfa.h"

namespace fwserve::constraints::internal {

// An NFA over code points: edges labelled with code-point sets, and epsilon moves. The
// language is the strings of code points leading from `start` to `accept`.
struct CodePointNfa {
  struct Edge {
    int32_t from;
    int32_t to;
    CodePointSet set;
  };
  int32_t num_states = 0;
  int32_t start = 0;
  int32_t accept = 0;
  std::vector<Edge> edges;
  std::vector<std::pair<int32_t, int32_t>> eps;
};

// Compiles `pattern` (see above). InvalidArgument naming what is unsupported or malformed
// (without the keyword or pointer: the caller adds them); also when the automaton would
// have more than `max_states` states (large counted repetitions).
absl::StatusOr<CodePointNfa> CompileRegex(std::string_view pattern, int max_states);

}  // namespace fwserve::constraints::internal
