#include "server/sessions/session_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fwserve {

SessionLease& SessionLease::operator=(SessionLease&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = other.registry_;
    id_ = std::move(other.id_);
    other.registry_ = nullptr;
    other.id_.clear();
  }
  return *this;
}

void SessionLease::Commit(int64_t tokens, absl::Time last_used, bool stored) {
  if (registry_ == nullptr) return;
  registry_->Commit(id_, tokens, last_used, stored);
  registry_ = nullptr;
}

void SessionLease::Release() {
  if (registry_ == nullptr) return;
  registry_->ReleaseUnchanged(id_);
  registry_ = nullptr;
}

void SessionLease::ReleaseUsed(absl::Time last_used) {
  if (registry_ == nullptr) return;
  registry_->ReleaseUsed(id_, last_used);
  registry_ = nullptr;
}

void SessionLease::Forget() { registry_ = nullptr; }

absl::Status SessionRegistry::FullError() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server holds the maximum number of sessions (--max-sessions=", max_sessions_,
      "); delete some or wait for them to expire"));
}

absl::Status SessionRegistry::Busy(const std::string& id, absl::string_view field) {
  return absl::AbortedError(
      absl::StrCat(field, " '", id, "' is busy with another request; retry when it ends"));
}

absl::Status SessionRegistry::Unknown(const std::string& id, absl::string_view field) const {
  if (indexing_) {
    return absl::UnavailableError(
        absl::StrCat(field, " '", id,
                     "' is not loaded yet: the server is still indexing its session store; "
                     "retry shortly"));
  }
  return absl::NotFoundError(absl::StrCat(field, " '", id, "' not found"));
}

void SessionRegistry::PutLocked(SessionRecord record) {
  auto it = sessions_.find(record.id);
  if (it != sessions_.end()) {
    --sessions_of_tenant_[it->second.tenant];
    ++sessions_of_tenant_[record.tenant];
    it->second = std::move(record);
    return;
  }
  ++sessions_of_tenant_[record.tenant];
  std::string id = record.id;
  sessions_.emplace(std::move(id), std::move(record));
}

void SessionRegistry::EraseLocked(absl::flat_hash_map<std::string, SessionRecord>::iterator it) {
  auto count = sessions_of_tenant_.find(it->second.tenant);
  if (count != sessions_of_tenant_.end() && --count->second <= 0) sessions_of_tenant_.erase(count);
  sessions_.erase(it);
}

int64_t SessionRegistry::CountOfTenant(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_of_tenant_.find(tenant);
  return it == sessions_of_tenant_.end() ? 0 : it->second;
}

absl::Status SessionRegistry::NotFoundError(const std::string& id, absl::string_view field) const {
  absl::MutexLock lock(&mu_);
  return Unknown(id, field);
}

absl::Status SessionRegistry::CheckCapacity() const {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) return FullError();
  return absl::OkStatus();
}

absl::Status SessionRegistry::Insert(SessionRecord record) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) return FullError();
  record.busy = false;
  PutLocked(std::move(record));
  return absl::OkStatus();
}

absl::StatusOr<SessionLease> SessionRegistry::InsertLeased(SessionRecord record) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) return FullError();
  record.busy = true;
  std::string id = record.id;
  PutLocked(std::move(record));
  return SessionLease(this, std::move(id));
}

absl::StatusOr<SessionRecord> SessionRegistry::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return Unknown(id);
  return it->second;
}

std::vector<SessionRecord> SessionRegistry::List(const std::string& model) const {
  std::vector<SessionRecord> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, record] : sessions_) {
      if (model.empty() || record.model == model) out.push_back(record);
    }
  }
  std::sort(out.begin(), out.end(), [](const SessionRecord& a, const SessionRecord& b) {
    return a.created != b.created ? a.created < b.created : a.id < b.id;
  });
  return out;
}

absl::StatusOr<SessionLease> SessionRegistry::Acquire(const std::string& id,
                                                      absl::string_view field) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return Unknown(id, field);
  if (it->second.busy) return Busy(id, field);
  it->second.busy = true;
  return SessionLease(this, id);
}

void SessionRegistry::Commit(const std::string& id, int64_t tokens, absl::Time last_used,
                             bool stored) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.busy = false;
  it->second.tokens = tokens;
  it->second.last_used = last_used;
  it->second.stored = stored;
}

void SessionRegistry::ReleaseUnchanged(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.busy = false;
}

void SessionRegistry::ReleaseUsed(const std::string& id, absl::Time last_used) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.busy = false;
  it->second.last_used = last_used;
}

void SessionRegistry::SetResident(const std::string& id, bool resident, int64_t version) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.resident = resident;
  it->second.version = resident ? version : 0;
}

absl::StatusOr<SessionLease> SessionRegistry::AcquireFromStore(const SessionRecord& record,
                                                               absl::string_view field) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(record.id);
  if (it == sessions_.end()) {
    if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) {
      auto idle = std::find_if(sessions_.begin(), sessions_.end(), [](const auto& entry) {
        return !entry.second.busy && !entry.second.resident;
      });
      if (idle == sessions_.end()) return FullError();
      EraseLocked(idle);
    }
    SessionRecord added = record;
    added.resident = false;
    added.version = 0;
    PutLocked(std::move(added));
    it = sessions_.find(record.id);
  } else {
    if (it->second.busy) return Busy(record.id, field);
    SessionRecord& existing = it->second;
    if (existing.tenant != record.tenant) {
      --sessions_of_tenant_[existing.tenant];
      ++sessions_of_tenant_[record.tenant];
      existing.tenant = record.tenant;
    }
    existing.model = record.model;
    existing.tokens = record.tokens;
    existing.created = record.created;
    existing.last_used = std::max(existing.last_used, record.last_used);
  }
  it->second.stored = true;
  it->second.busy = true;
  return SessionLease(this, record.id);
}

void SessionRegistry::Erase(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(id); it != sessions_.end()) EraseLocked(it);
}

bool SessionRegistry::EraseIfIdle(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.busy) return false;
  EraseLocked(it);
  return true;
}

std::vector<std::string> SessionRegistry::TakeExpired(const std::string& model,
                                                      absl::Time idle_before) {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const SessionRecord& r = it->second;
    if (r.model == model && !r.busy && r.last_used < idle_before) {
      out.push_back(it->first);
      EraseLocked(it++);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<std::string> SessionRegistry::Unstored(const std::string& model) const {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, r] : sessions_) {
    if (r.model == model && r.resident && !r.stored && !r.busy) out.push_back(id);
  }
  return out;
}

int64_t SessionRegistry::CountNotResident(const std::string& model) const {
  int64_t count = 0;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, record] : sessions_) {
    if (record.model == model && !record.resident) ++count;
  }
  return count;
}

int64_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

void SessionRegistry::SetIndexing(bool indexing) {
  absl::MutexLock lock(&mu_);
  indexing_ = indexing;
}

bool SessionRegistry::indexing() const {
  absl::MutexLock lock(&mu_);
  return indexing_;
}

}  // namespace fwserve
