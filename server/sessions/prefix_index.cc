#include "server/sessions/prefix_index.h"

#include <algorithm>

namespace fwserve {

std::optional<PrefixIndex::Match> PrefixIndex::Find(const std::string& tenant,
                                                    const std::string& model,
                                                    absl::Span<const int64_t> prompt) {
  absl::MutexLock lock(&mu_);
  auto owner = entries_.find(Owner{tenant, model});
  if (owner == entries_.end()) return std::nullopt;
  std::list<Entry>& list = owner->second;
  auto best = list.end();
  for (auto it = list.begin(); it != list.end(); ++it) {
    const Tokens& c = it->conversation;
    if (c.size() > prompt.size() || (best != list.end() && c.size() <= best->conversation.size())) {
      continue;
    }
    if (std::equal(c.begin(), c.end(), prompt.begin())) best = it;
  }
  if (best == list.end()) return std::nullopt;
  list.splice(list.begin(), list, best);
  return Match{list.front().session_id, list.front().conversation.size()};
}

std::vector<std::string> PrefixIndex::Insert(const std::string& tenant, const std::string& model,
                                             Tokens conversation, std::string session_id,
                                             bool owned) {
  std::vector<std::string> evicted;
  if (capacity_ == 0) {
    if (owned) evicted.push_back(std::move(session_id));
    return evicted;
  }
  absl::MutexLock lock(&mu_);
  std::list<Entry>& list = entries_[Owner{tenant, model}];
  // One entry per conversation: the newer state replaces the older.
  for (auto it = list.begin(); it != list.end();) {
    if (it->conversation == conversation) {
      if (it->owned) evicted.push_back(std::move(it->session_id));
      it = list.erase(it);
      --size_;
    } else {
      ++it;
    }
  }
  list.push_front(Entry{std::move(conversation), std::move(session_id), owned});
  ++size_;
  while (list.size() > capacity_) {
    if (list.back().owned) evicted.push_back(std::move(list.back().session_id));
    list.pop_back();
    --size_;
  }
  return evicted;
}

bool PrefixIndex::Erase(const std::string& tenant, const std::string& model,
                        const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto owner = entries_.find(Owner{tenant, model});
  if (owner == entries_.end()) return false;
  std::list<Entry>& list = owner->second;
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (it->session_id == session_id) {
      list.erase(it);
      --size_;
      if (list.empty()) entries_.erase(owner);
      return true;
    }
  }
  return false;
}

size_t PrefixIndex::CountOfTenant(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  size_t count = 0;
  for (const auto& [owner, list] : entries_) {
    if (owner.first != tenant) continue;
    for (const Entry& e : list) count += e.owned ? 1 : 0;
  }
  return count;
}

size_t PrefixIndex::size() const {
  absl::MutexLock lock(&mu_);
  return size_;
}

}  // namespace fwserve
