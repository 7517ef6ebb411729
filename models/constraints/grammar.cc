#include "models/constraints/grammar.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "models/constraints/nfa.h"

namespace fwserve::constraints {

bool Grammar::SameAutomaton(const Grammar& other) const {
  if (root_ != other.root_ || max_depth_ != other.max_depth_ ||
      num_classes_ != other.num_classes_ || byte_class_ != other.byte_class_ ||
      next_ != other.next_ || flags_ != other.flags_ || call_begin_ != other.call_begin_ ||
      calls_.size() != other.calls_.size()) {
    return false;
  }
  for (size_t i = 0; i < calls_.size(); ++i) {
    if (calls_[i].callee_start != other.calls_[i].callee_start ||
        calls_[i].ret != other.calls_[i].ret) {
      return false;
    }
  }
  return true;
}

size_t Grammar::MemoryBytes() const {
  return sizeof(Grammar) + next_.size() * sizeof(int32_t) + flags_.size() +
         bytes_.size() * sizeof(std::bitset<256>) + call_begin_.size() * sizeof(int32_t) +
         calls_.size() * sizeof(GrammarCall);
}

namespace internal {

class GrammarBuilder {
 public:
  GrammarBuilder(const Nfa& nfa, const std::vector<std::string>& rule_names,
                 const GrammarLimits& limits)
      : nfa_(nfa), rule_names_(rule_names), limits_(limits) {}

  absl::StatusOr<std::shared_ptr<const Grammar>> Build(int32_t root_rule);

 private:
  std::string RuleName(int32_t rule) const {
    if (rule < static_cast<int32_t>(rule_names_.size()) && !rule_names_[rule].empty()) {
      return rule_names_[rule];
    }
    return absl::StrCat("rule ", rule);
  }

  void BuildAdjacency();
  // The epsilon closure of `seeds`, sorted.
  std::vector<int32_t> Closure(const std::vector<int32_t>& seeds);
  // The DFA state of `set` (a closed, sorted set of NFA states of `rule`), added to the
  // work list when new.
  int32_t Intern(std::vector<int32_t> set, int32_t rule);
  int32_t RuleStart(int32_t rule);
  absl::Status Determinize(int32_t root_rule);

  const Nfa& nfa_;
  const std::vector<std::string>& rule_names_;
  const GrammarLimits limits_;
  int num_classes_ = 0;
  std::array<uint8_t, 256> class_of_{};

  // NFA adjacency by source state (CSR).
  std::vector<int32_t> byte_off_, eps_off_, call_off_;
  std::vector<Nfa::ByteEdge> byte_edges_;
  std::vector<int32_t> eps_to_;
  std::vector<Nfa::CallEdge> call_edges_;
  std::vector<uint32_t> mark_;
  uint32_t generation_ = 0;

  // The DFA under construction.
  std::vector<std::vector<int32_t>> sets_;
  std::vector<int32_t> rule_of_;
  absl::flat_hash_map<std::vector<int32_t>, int32_t> index_;
  std::vector<int32_t> rule_start_;
  std::vector<int32_t> next_;  // dfa * num_classes_ + class
  std::vector<uint8_t> final_;
  // Calls of each DFA state: (callee rule, return DFA state).
  std::vector<std::vector<std::pair<int32_t, int32_t>>> calls_;
};

void GrammarBuilder::BuildAdjacency() {
  const int32_t n = nfa_.num_states();
  auto offsets = [n](const auto& edges, std::vector<int32_t>* off) {
    off->assign(n + 1, 0);
    for (const auto& e : edges) ++(*off)[e.from + 1];
    for (int32_t i = 0; i < n; ++i) (*off)[i + 1] += (*off)[i];
  };
  offsets(nfa_.byte_edges(), &byte_off_);
  offsets(nfa_.eps_edges(), &eps_off_);
  offsets(nfa_.call_edges(), &call_off_);
  byte_edges_.resize(nfa_.byte_edges().size());
  eps_to_.resize(nfa_.eps_edges().size());
  call_edges_.resize(nfa_.call_edges().size());
  std::vector<int32_t> fill(byte_off_.begin(), byte_off_.end() - 1);
  for (const auto& e : nfa_.byte_edges()) byte_edges_[fill[e.from]++] = e;
  fill.assign(eps_off_.begin(), eps_off_.end() - 1);
  for (const auto& e : nfa_.eps_edges()) eps_to_[fill[e.from]++] = e.to;
  fill.assign(call_off_.begin(), call_off_.end() - 1);
  for (const auto& e : nfa_.call_edges()) call_edges_[fill[e.from]++] = e;
  mark_.assign(n, 0);

  // Byte classes: the intervals between the edges' range boundaries.
  std::array<bool, 257> boundary{};
  boundary[0] = true;
  for (const auto& e : nfa_.byte_edges()) {
    boundary[e.lo] = true;
    boundary[e.hi + 1] = true;
  }
  int c = -1;
  for (int b = 0; b < 256; ++b) {
    if (boundary[b]) ++c;
    class_of_[b] = static_cast<uint8_t>(c);
  }
  num_classes_ = c + 1;
}

std::vector<int32_t> GrammarBuilder::Closure(const std::vector<int32_t>& seeds) {
  ++generation_;
  std::vector<int32_t> out;
  std::vector<int32_t> work;
  for (int32_t s : seeds) {
    if (mark_[s] != generation_) {
      mark_[s] = generation_;
      work.push_back(s);
    }
  }
  while (!work.empty()) {
    const int32_t s = work.back();
    work.pop_back();
    out.push_back(s);
    for (int32_t k = eps_off_[s]; k < eps_off_[s + 1]; ++k) {
      const int32_t t = eps_to_[k];
      if (mark_[t] != generation_) {
        mark_[t] = generation_;
        work.push_back(t);
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

int32_t GrammarBuilder::Intern(std::vector<int32_t> set, int32_t rule) {
  auto it = index_.find(set);
  if (it != index_.end()) return it->second;
  const auto id = static_cast<int32_t>(sets_.size());
  index_.emplace(set, id);
  sets_.push_back(std::move(set));
  rule_of_.push_back(rule);
  return id;
}

int32_t GrammarBuilder::RuleStart(int32_t rule) {
  if (rule_start_[rule] < 0) {
    rule_start_[rule] = Intern(Closure({nfa_.rules()[rule].start}), rule);
  }
  return rule_start_[rule];
}

absl::Status GrammarBuilder::Determinize(int32_t root_rule) {
  rule_start_.assign(nfa_.rules().size(), -1);
  RuleStart(root_rule);
  std::vector<std::vector<int32_t>> targets(num_classes_);
  for (size_t d = 0; d < sets_.size(); ++d) {
    if (static_cast<int64_t>(sets_.size()) > limits_.max_states) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the schema is too large: its automaton exceeds ", limits_.max_states,
          " states (lower maxLength, maxItems or {m,n} counts, or simplify the schema)"));
    }
    const int32_t rule = rule_of_[d];
    const int32_t rule_end = nfa_.rules()[rule].end;
    for (auto& t : targets) t.clear();
    bool is_final = false;
    std::vector<std::pair<int32_t, std::vector<int32_t>>> call_returns;  // callee -> rets
    // Copy: Intern may grow sets_.
    const std::vector<int32_t> members = sets_[d];
    for (int32_t m : members) {
      if (m == rule_end) is_final = true;
      for (int32_t k = byte_off_[m]; k < byte_off_[m + 1]; ++k) {
        const Nfa::ByteEdge& e = byte_edges_[k];
        for (int c = class_of_[e.lo]; c <= class_of_[e.hi]; ++c) targets[c].push_back(e.to);
      }
      for (int32_t k = call_off_[m]; k < call_off_[m + 1]; ++k) {
        const Nfa::CallEdge& e = call_edges_[k];
        auto it = std::find_if(call_returns.begin(), call_returns.end(),
                               [&](const auto& p) { return p.first == e.rule; });
        if (it == call_returns.end()) {
          call_returns.push_back({e.rule, {e.ret}});
        } else {
          it->second.push_back(e.ret);
        }
      }
    }
    std::vector<int32_t> row(num_classes_, Grammar::kNoState);
    for (int c = 0; c < num_classes_; ++c) {
      if (targets[c].empty()) continue;
      row[c] = Intern(Closure(targets[c]), rule);
    }
    next_.insert(next_.end(), row.begin(), row.end());
    final_.push_back(is_final ? 1 : 0);
    std::vector<std::pair<int32_t, int32_t>> calls;
    for (auto& [callee, rets] : call_returns) {
      RuleStart(callee);
      calls.push_back({callee, Intern(Closure(rets), rule)});
    }
    calls_.push_back(std::move(calls));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::Build(int32_t root_rule) {
  BuildAdjacency();
  if (auto status = Determinize(root_rule); !status.ok()) return status;
  const auto n = static_cast<int32_t>(sets_.size());
  const int32_t num_rules = static_cast<int32_t>(nfa_.rules().size());

  // Which states can complete their rule's value, given which rules can complete (a fixed
  // point: a call edge counts once its callee is known to complete).
  std::vector<std::vector<int32_t>> byte_preds(n);
  std::vector<std::vector<std::pair<int32_t, int32_t>>> call_preds(n);  // (state, callee)
  for (int32_t d = 0; d < n; ++d) {
    for (int c = 0; c < num_classes_; ++c) {
      const int32_t t = next_[static_cast<size_t>(d) * num_classes_ + c];
      if (t >= 0) byte_preds[t].push_back(d);
    }
    for (const auto& [callee, ret] : calls_[d]) call_preds[ret].push_back({d, callee});
  }
  std::vector<uint8_t> completes(num_rules, 0);
  std::vector<uint8_t> can_finish;
  for (;;) {
    can_finish.assign(n, 0);
    std::vector<int32_t> work;
    for (int32_t d = 0; d < n; ++d) {
      if (final_[d]) {
        can_finish[d] = 1;
        work.push_back(d);
      }
    }
    while (!work.empty()) {
      const int32_t t = work.back();
      work.pop_back();
      for (int32_t p : byte_preds[t]) {
        if (!can_finish[p]) {
          can_finish[p] = 1;
          work.push_back(p);
        }
      }
      for (const auto& [p, callee] : call_preds[t]) {
        if (completes[callee] && !can_finish[p]) {
          can_finish[p] = 1;
          work.push_back(p);
        }
      }
    }
    bool changed = false;
    for (int32_t r = 0; r < num_rules; ++r) {
      if (!completes[r] && rule_start_[r] >= 0 && can_finish[rule_start_[r]]) {
        completes[r] = 1;
        changed = true;
      }
    }
    if (!changed) break;
  }
  const int32_t root_start = rule_start_[root_rule];
  if (!can_finish[root_start]) {
    return absl::InvalidArgumentError("the schema matches no JSON value");
  }

  // Keep the states reachable from the root through live edges.
  std::vector<uint8_t> keep(n, 0);
  {
    std::vector<int32_t> work = {root_start};
    keep[root_start] = 1;
    auto visit = [&](int32_t t) {
      if (t >= 0 && can_finish[t] && !keep[t]) {
        keep[t] = 1;
        work.push_back(t);
      }
    };
    while (!work.empty()) {
      const int32_t d = work.back();
      work.pop_back();
      for (int c = 0; c < num_classes_; ++c)
        visit(next_[static_cast<size_t>(d) * num_classes_ + c]);
      for (const auto& [callee, ret] : calls_[d]) {
        if (completes[callee] && can_finish[ret]) {
          visit(rule_start_[callee]);
          visit(ret);
        }
      }
    }
  }
  std::vector<int32_t> new_id(n, -1);
  int32_t kept = 0;
  for (int32_t d = 0; d < n; ++d) {
    if (keep[d]) new_id[d] = kept++;
  }

  // No rule may be empty, nor call itself before consuming a byte.
  std::vector<std::vector<int32_t>> first_calls(num_rules);
  for (int32_t r = 0; r < num_rules; ++r) {
    const int32_t s = rule_start_[r];
    if (s < 0 || !keep[s]) continue;
    if (final_[s]) {
      return absl::InvalidArgumentError(
          absl::StrCat("internal: ", RuleName(r), " matches the empty string"));
    }
    for (const auto& [callee, ret] : calls_[s]) {
      if (completes[callee] && can_finish[ret]) first_calls[r].push_back(callee);
    }
  }
  {
    std::vector<uint8_t> color(num_rules, 0);  // 0 new, 1 on the path, 2 done
    std::vector<std::pair<int32_t, size_t>> path;
    for (int32_t r0 = 0; r0 < num_rules; ++r0) {
      if (color[r0] != 0) continue;
      path.push_back({r0, 0});
      color[r0] = 1;
      while (!path.empty()) {
        auto& [r, k] = path.back();
        if (k < first_calls[r].size()) {
          const int32_t callee = first_calls[r][k++];
          if (color[callee] == 1) {
            return absl::InvalidArgumentError(absl::StrCat(
                "a $ref cycle that consumes no input (left recursion) through ", RuleName(callee)));
          }
          if (color[callee] == 0) {
            color[callee] = 1;
            path.push_back({callee, 0});
          }
        } else {
          color[r] = 2;
          path.pop_back();
        }
      }
    }
  }

  // Merge byte classes whose columns are equal over the kept states.
  std::vector<int> final_class(num_classes_);
  int num_final_classes = 0;
  {
    absl::flat_hash_map<std::vector<int32_t>, int> columns;
    for (int c = 0; c < num_classes_; ++c) {
      std::vector<int32_t> column;
      column.reserve(kept);
      for (int32_t d = 0; d < n; ++d) {
        if (!keep[d]) continue;
        const int32_t t = next_[static_cast<size_t>(d) * num_classes_ + c];
        column.push_back(t >= 0 && keep[t] ? new_id[t] : -1);
      }
      auto [it, inserted] = columns.emplace(std::move(column), num_final_classes);
      if (inserted) ++num_final_classes;
      final_class[c] = it->second;
    }
  }

  std::shared_ptr<Grammar> g(new Grammar());
  static std::atomic<uint64_t> next_grammar_id{1};
  g->id_ = next_grammar_id.fetch_add(1);
  g->root_ = new_id[root_start];
  g->max_depth_ = limits_.max_depth;
  g->num_classes_ = num_final_classes;
  for (int b = 0; b < 256; ++b) g->byte_class_[b] = static_cast<uint8_t>(final_class[class_of_[b]]);
  g->next_.assign(static_cast<size_t>(kept) * num_final_classes, Grammar::kNoState);
  g->flags_.assign(kept, 0);
  g->bytes_.assign(kept, {});
  g->call_begin_.assign(kept + 1, 0);
  for (int32_t d = 0; d < n; ++d) {
    if (!keep[d]) continue;
    const int32_t nd = new_id[d];
    for (int b = 0; b < 256; ++b) {
      const int32_t t = next_[static_cast<size_t>(d) * num_classes_ + class_of_[b]];
      if (t >= 0 && keep[t]) {
        g->next_[static_cast<size_t>(nd) * num_final_classes + g->byte_class_[b]] = new_id[t];
        g->bytes_[nd].set(b);
      }
    }
    g->flags_[nd] =
        (final_[d] ? Grammar::kFinal : 0) | (g->bytes_[nd].any() ? Grammar::kHasBytes : 0);
    for (const auto& [callee, ret] : calls_[d]) {
      if (completes[callee] && keep[ret] && keep[rule_start_[callee]]) {
        g->calls_.push_back({new_id[rule_start_[callee]], new_id[ret]});
      }
    }
    g->call_begin_[nd + 1] = static_cast<int32_t>(g->calls_.size());
    if (g->call_begin_[nd + 1] != g->call_begin_[nd]) g->flags_[nd] |= Grammar::kHasCalls;
  }
  std::vector<int32_t> flat_calls;
  for (const GrammarCall& c : g->calls_) {
    flat_calls.push_back(c.callee_start);
    flat_calls.push_back(c.ret);
  }
  const std::vector<uint8_t> classes(g->byte_class_.begin(), g->byte_class_.end());
  for (int k = 0; k < 2; ++k) {
    g->fingerprint_[k] = absl::HashOf(k, g->root_, g->max_depth_, g->num_classes_, classes,
                                      g->next_, g->flags_, g->call_begin_, flat_calls);
  }
  return std::shared_ptr<const Grammar>(std::move(g));
}

absl::StatusOr<std::shared_ptr<const Grammar>> BuildGrammar(
    const Nfa& nfa, int32_t root_rule, const std::vector<std::string>& rule_names,
    const GrammarLimits& limits) {
  GrammarBuilder builder(nfa, rule_names, limits);
  return builder.Build(root_rule);
}

}  // namespace internal
}  // namespace fwserve::constraints
