// The compiled automaton of a constrained-decoding grammar: a set of rules, each a
// deterministic automaton over bytes whose states may also call another rule (a pushdown
// automaton: a call pushes the state to return to). Built by CompileJsonSchema
// (json_schema.h); walked by Matcher (matcher.h) and TokenMasker (token_masker.h).
// Torch-free.
//
// Thread-safety: immutable after construction; any number of threads may read it.
#pragma once

#include <array>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fwserve::constraints {

namespace internal {
class Nfa;
class GrammarBuilder;
}  // namespace internal

// A call from a state: push `ret` (where the caller continues once the callee has matched
// a whole value) and continue at `callee_start`, the callee rule's start state.
struct GrammarCall {
  int32_t callee_start;
  int32_t ret;
};

class Grammar {
 public:
  static constexpr int32_t kNoState = -1;

  // States are 0 .. num_states() - 1; root_state() is where a document starts (alone on
  // the stack).
  int32_t num_states() const { return static_cast<int32_t>(flags_.size()); }
  int32_t root_state() const { return root_; }
  // The deepest stack a matcher keeps (1 = the root rule alone); calls beyond it are
  // refused.
  int max_depth() const { return max_depth_; }
  int num_byte_classes() const { return num_classes_; }

  // The state after `byte` from `state` in the same rule, or kNoState.
  int32_t Next(int32_t state, uint8_t byte) const {
    return next_[static_cast<size_t>(state) * num_classes_ + byte_class_[byte]];
  }
  // The bytes Next accepts from `state`.
  const std::bitset<256>& Bytes(int32_t state) const { return bytes_[state]; }
  bool HasBytes(int32_t state) const { return (flags_[state] & kHasBytes) != 0; }
  // The rule of `state` may end here (its value is complete): the caller's return state
  // continues, or, for the root rule, the document is complete.
  bool IsFinal(int32_t state) const { return (flags_[state] & kFinal) != 0; }
  bool HasCalls(int32_t state) const { return (flags_[state] & kHasCalls) != 0; }
  // Reads bytes, calls nothing and does not end its rule: a byte step from it is a table
  // lookup (the common case the walks take fast).
  bool IsPlain(int32_t state) const { return flags_[state] == kHasBytes; }
  const GrammarCall* CallsBegin(int32_t state) const { return calls_.data() + call_begin_[state]; }
  const GrammarCall* CallsEnd(int32_t state) const {
    return calls_.data() + call_begin_[state + 1];
  }

  // Unique to this object within the process.
  uint64_t id() const { return id_; }
  // A keyed 128-bit hash of the automaton (tables, root, depth bound): equal automata, as
  // compiled from equal schemas, have equal fingerprints. Caches key on it and confirm
  // with SameAutomaton.
  const std::array<uint64_t, 2>& fingerprint() const { return fingerprint_; }
  bool SameAutomaton(const Grammar& other) const;
  // Approximate heap bytes of the tables.
  size_t MemoryBytes() const;

 private:
  friend class internal::GrammarBuilder;
  Grammar() = default;

  static constexpr uint8_t kFinal = 1;
  static constexpr uint8_t kHasBytes = 2;
  static constexpr uint8_t kHasCalls = 4;

  int32_t root_ = 0;
  int max_depth_ = 1;
  int num_classes_ = 1;
  std::array<uint8_t, 256> byte_class_{};
  std::vector<int32_t> next_;  // state * num_classes_ + class
  std::vector<uint8_t> flags_;
  std::vector<std::bitset<256>> bytes_;
  std::vector<int32_t> call_begin_;  // num_states + 1 offsets into calls_
  std::vector<GrammarCall> calls_;
  uint64_t id_ = 0;
  std::array<uint64_t, 2> fingerprint_{};
};

namespace internal {

struct GrammarLimits {
  // Refuse automata with more states than this (InvalidArgument).
  int32_t max_states = 200000;
  // Grammar::max_depth().
  int max_depth = 64;
};

// Determinizes every rule reachable from `root_rule` (subset construction; calls are
// grouped by callee), drops states from which no value can be completed, checks that no
// rule can call itself without consuming a byte (left recursion), and fills the tables.
// `rule_names` (per rule, may be shorter) name rules in errors. InvalidArgument when the
// grammar matches nothing, is left-recursive or exceeds `limits`.
absl::StatusOr<std::shared_ptr<const Grammar>> BuildGrammar(
    const Nfa& nfa, int32_t root_rule, const std::vector<std::string>& rule_names,
    const GrammarLimits& limits);

}  // namespace internal
}  // namespace fwserve::constraints
