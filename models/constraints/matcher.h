// One generated stream's position in a Grammar: which bytes may come next, and whether the
// bytes so far are a whole document. Torch-free.
//
// Thread-safety: a Matcher is not thread-safe; copies are independent (a forked stream
// copies its matcher). The Grammar it points to is shared and immutable.
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/types/span.h"
#include "models/constraints/grammar.h"
#include "models/constraints/stacks.h"

namespace fwserve::constraints {

class Matcher {
 public:
  // At the start of a document of `grammar` (not null).
  explicit Matcher(std::shared_ptr<const Grammar> grammar);

  // Copyable and cheap to copy: a shared_ptr and a small inline vector (one allocation
  // only when the stacks outgrow it: deep recursion or several live alternatives).
  Matcher(const Matcher&) = default;
  Matcher& operator=(const Matcher&) = default;
  Matcher(Matcher&&) = default;
  Matcher& operator=(Matcher&&) = default;

  // Consumes `byte`: true when it may come next; false, and the matcher unchanged, when
  // not.
  bool Advance(uint8_t byte);
  // Consumes all of `bytes` or, when one may not come next, none (false).
  bool AdvanceBytes(std::string_view bytes);
  // Whether Advance(byte) would succeed (without changing the matcher).
  bool Accepts(uint8_t byte) const;
  // The bytes that may come next (empty once IsFinished()).
  std::bitset<256> NextBytes() const;
  // The bytes so far are one whole valid document (the stream may end here).
  bool IsComplete() const { return complete_; }
  // Complete, and no byte may follow: the stream must end.
  bool IsFinished() const { return complete_ && stacks_.empty(); }

  const std::shared_ptr<const Grammar>& grammar() const { return grammar_; }
  // The position: the ready stacks (flat, see stacks.h), canonical order.
  absl::Span<const int32_t> stacks() const { return {stacks_.data(), stacks_.size()}; }

  // Equal positions in the same grammar object accept the same continuations; a mask
  // cache may key on (grammar fingerprint, position).
  friend bool operator==(const Matcher& a, const Matcher& b) {
    return a.grammar_ == b.grammar_ && a.complete_ == b.complete_ && a.stacks_ == b.stacks_;
  }
  friend bool operator!=(const Matcher& a, const Matcher& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const Matcher& m) {
    return H::combine(std::move(h), m.grammar_.get(), m.complete_, m.stacks_);
  }

 private:
  std::shared_ptr<const Grammar> grammar_;
  internal::StackSet stacks_;
  bool complete_ = false;
};

}  // namespace fwserve::constraints
