#include "models/constraints/matcher.h"

#include <algorithm>

namespace fwserve::constraints {

using internal::StackSet;
using internal::StepInfo;

Matcher::Matcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  int32_t frames[internal::kMaxDepthLimit + 1];
  frames[0] = grammar_->root_state();
  StepInfo info;
  internal::ExpandStack(*grammar_, frames, 1, /*local=*/false, &stacks_, &info);
  internal::Canonicalize(&stacks_);
  complete_ = info.complete;
}

bool Matcher::Advance(uint8_t byte) {
  StackSet next;
  StepInfo info;
  if (!internal::StepStacks(*grammar_, stacks_.data(), stacks_.data() + stacks_.size(), byte,
                            /*local=*/false, &next, &info)) {
    return false;
  }
  internal::Canonicalize(&next);
  stacks_ = std::move(next);
  complete_ = info.complete;
  return true;
}

bool Matcher::AdvanceBytes(std::string_view bytes) {
  if (bytes.size() == 1) return Advance(static_cast<uint8_t>(bytes[0]));
  Matcher copy = *this;
  for (char c : bytes) {
    if (!copy.Advance(static_cast<uint8_t>(c))) return false;
  }
  *this = std::move(copy);
  return true;
}

bool Matcher::Accepts(uint8_t byte) const {
  Matcher copy = *this;
  return copy.Advance(byte);
}

std::bitset<256> Matcher::NextBytes() const {
  std::bitset<256> out;
  int deepest = 0;
  for (const int32_t* p = stacks_.data(); p < stacks_.data() + stacks_.size(); p += *p + 1) {
    out |= grammar_->Bytes(p[*p]);
    deepest = std::max(deepest, *p);
  }
  // Near the depth bound a byte may lead only into refused calls: check each.
  if (deepest + 1 >= grammar_->max_depth()) {
    for (int b = 0; b < 256; ++b) {
      if (out[b] && !Accepts(static_cast<uint8_t>(b))) out.reset(b);
    }
  }
  return out;
}

}  // namespace fwserve::constraints
