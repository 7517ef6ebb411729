#include "models/constraints/nfa.h"

#include <algorithm>

namespace fwserve::constraints::internal {
namespace {

constexpr uint32_t kSurrogateLo = 0xD800;
constexpr uint32_t kSurrogateHi = 0xDFFF;

// Byte-range sequences whose concatenations are exactly the UTF-8 encodings of [lo, hi], a
// range of scalar values (no surrogates) of one encoded length (the classic split: after
// it, every continuation byte but those of the first differing position spans a full
// range, so each sequence is a product of byte ranges).
void SplitUtf8Range(uint32_t lo, uint32_t hi,
                    std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  // Split at the encoded-length boundaries first.
  for (uint32_t boundary : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= boundary && hi > boundary) {
      SplitUtf8Range(lo, boundary, out);
      SplitUtf8Range(boundary + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  for (int i = 1; i < 4; ++i) {
    const uint32_t mask = (1u << (6 * i)) - 1;
    if ((lo & ~mask) != (hi & ~mask)) {
      if ((lo & mask) != 0) {
        SplitUtf8Range(lo, lo | mask, out);
        SplitUtf8Range((lo | mask) + 1, hi, out);
        return;
      }
      if ((hi & mask) != mask) {
        SplitUtf8Range(lo, (hi & ~mask) - 1, out);
        SplitUtf8Range(hi & ~mask, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, &a);
  AppendUtf8(hi, &b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t k = 0; k < a.size(); ++k) {
    seq.push_back({static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k])});
  }
  out->push_back(std::move(seq));
}

}  // namespace

CodePointSet CodePointSet::Of(uint32_t lo, uint32_t hi) {
  CodePointSet s;
  s.Add(lo, hi);
  return s;
}

CodePointSet CodePointSet::All() {
  CodePointSet s;
  s.Add(0, kMaxCodePoint);
  return s;
}

void CodePointSet::Add(uint32_t lo, uint32_t hi) {
  hi = std::min(hi, kMaxCodePoint);
  if (lo > hi) return;
  // Surrogates are never members.
  if (lo <= kSurrogateHi && hi >= kSurrogateLo) {
    if (lo < kSurrogateLo) ranges_.push_back({lo, kSurrogateLo - 1});
    if (hi > kSurrogateHi) ranges_.push_back({kSurrogateHi + 1, hi});
  } else {
    ranges_.push_back({lo, hi});
  }
  Normalize();
}

void CodePointSet::Add(const CodePointSet& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  Normalize();
}

void CodePointSet::Normalize() {
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges_ = std::move(merged);
}

CodePointSet CodePointSet::Complement() const {
  CodePointSet out;
  uint32_t next = 0;
  for (const auto& r : ranges_) {
    if (r.first > next) out.Add(next, r.first - 1);
    next = r.second + 1;
  }
  if (next <= kMaxCodePoint) out.Add(next, kMaxCodePoint);
  return out;
}

CodePointSet CodePointSet::Intersect(const CodePointSet& other) const {
  CodePointSet out;
  size_t i = 0, j = 0;
  while (i < ranges_.size() && j < other.ranges_.size()) {
    const uint32_t lo = std::max(ranges_[i].first, other.ranges_[j].first);
    const uint32_t hi = std::min(ranges_[i].second, other.ranges_[j].second);
    if (lo <= hi) out.ranges_.push_back({lo, hi});
    if (ranges_[i].second < other.ranges_[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  out.Normalize();
  return out;
}

CodePointSet CodePointSet::Minus(const CodePointSet& other) const {
  return Intersect(other.Complement());
}

bool CodePointSet::Contains(uint32_t cp) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(cp, kMaxCodePoint + 1));
  if (it == ranges_.begin()) return false;
  --it;
  return cp >= it->first && cp <= it->second;
}

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

Nfa::Frag Nfa::Empty() {
  const int32_t s = AddState();
  return {s, s};
}

Nfa::Frag Nfa::Nothing() { return {AddState(), AddState()}; }

Nfa::Frag Nfa::Literal(std::string_view bytes) {
  const int32_t start = AddState();
  int32_t at = start;
  for (char c : bytes) {
    const int32_t next = AddState();
    const auto b = static_cast<uint8_t>(c);
    AddByte(at, b, b, next);
    at = next;
  }
  return {start, at};
}

Nfa::Frag Nfa::ByteRange(uint8_t lo, uint8_t hi) {
  const Frag f{AddState(), AddState()};
  AddByte(f.start, lo, hi, f.end);
  return f;
}

Nfa::Frag Nfa::ByteRanges(const std::vector<std::pair<uint8_t, uint8_t>>& ranges) {
  const Frag f{AddState(), AddState()};
  for (const auto& r : ranges) AddByte(f.start, r.first, r.second, f.end);
  return f;
}

Nfa::Frag Nfa::Utf8(const CodePointSet& set) {
  const Frag f{AddState(), AddState()};
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  for (const auto& r : set.ranges()) SplitUtf8Range(r.first, r.second, &seqs);
  // Shared states keep the automaton small: need[k] reads k more continuation bytes
  // (80..BF) to the end, and equal prefixes share their states.
  std::vector<int32_t> need = {f.end};
  auto needing = [&](size_t k) {
    while (need.size() <= k) {
      const int32_t s = AddState();
      AddByte(s, 0x80, 0xBF, need.back());
      need.push_back(s);
    }
    return need[k];
  };
  std::vector<std::pair<std::pair<int32_t, std::pair<uint8_t, uint8_t>>, int32_t>> prefix_states;
  for (const auto& seq : seqs) {
    size_t tail = 0;  // trailing full continuation ranges, never the lead byte
    while (tail + 1 < seq.size() &&
           seq[seq.size() - 1 - tail] == std::make_pair<uint8_t, uint8_t>(0x80, 0xBF)) {
      ++tail;
    }
    const size_t head = seq.size() - tail;
    int32_t at = f.start;
    for (size_t k = 0; k < head; ++k) {
      if (k + 1 == head) {
        AddByte(at, seq[k].first, seq[k].second, needing(tail));
        break;
      }
      int32_t next = -1;
      for (const auto& ps : prefix_states) {
        if (ps.first.first == at && ps.first.second == seq[k]) next = ps.second;
      }
      if (next < 0) {
        next = AddState();
        prefix_states.push_back({{at, seq[k]}, next});
        AddByte(at, seq[k].first, seq[k].second, next);
      }
      at = next;
    }
  }
  return f;
}

Nfa::Frag Nfa::Seq(Frag a, Frag b) {
  AddEps(a.end, b.start);
  return {a.start, b.end};
}

Nfa::Frag Nfa::Alt(const std::vector<Frag>& alternatives) {
  const Frag f{AddState(), AddState()};
  for (const Frag& a : alternatives) {
    AddEps(f.start, a.start);
    AddEps(a.end, f.end);
  }
  return f;
}

Nfa::Frag Nfa::Optional(Frag a) {
  const Frag f{AddState(), AddState()};
  AddEps(f.start, a.start);
  AddEps(a.end, f.end);
  AddEps(f.start, f.end);
  return f;
}

Nfa::Frag Nfa::Star(Frag a) {
  const Frag f{AddState(), AddState()};
  AddEps(f.start, a.start);
  AddEps(a.end, f.start);
  AddEps(f.start, f.end);
  return f;
}

Nfa::Frag Nfa::Call(int32_t rule) {
  const Frag f{AddState(), AddState()};
  AddCall(f.start, rule, f.end);
  return f;
}

}  // namespace fwserve::constraints::internal
