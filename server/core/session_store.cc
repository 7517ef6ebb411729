#include "server/core/session_store.h"

#include <openssl/rand.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace fwserve {

std::string SessionStore::NewSessionId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    // The OS CSPRNG failing is unrecoverable: an id we cannot make unguessable must
    // not be handed out.
    std::abort();
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool SessionStore::IsWellFormedId(const std::string& id) {
  return id.size() == 32 && std::all_of(id.begin(), id.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

absl::Status SessionStore::FullError() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server holds the maximum number of sessions (--max-sessions=", max_sessions_,
      "); delete some or wait for them to expire"));
}

absl::Status SessionStore::CheckCapacity() const {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) return FullError();
  return absl::OkStatus();
}

absl::Status SessionStore::Insert(SessionRecord record) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) return FullError();
  std::string id = record.id;
  sessions_.emplace(std::move(id), std::move(record));
  return absl::OkStatus();
}

absl::StatusOr<SessionRecord> SessionStore::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session_id '", id, "' not found"));
  }
  return it->second;
}

std::vector<SessionRecord> SessionStore::List(const std::string& model) const {
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

absl::StatusOr<SessionRecord> SessionStore::Acquire(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session_id '", id, "' not found"));
  }
  if (it->second.busy) {
    return absl::AbortedError(
        absl::StrCat("session_id '", id, "' is busy with another request; retry when it ends"));
  }
  it->second.busy = true;
  return it->second;
}

void SessionStore::Release(const std::string& id, int64_t tokens, absl::Time used) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.busy = false;
  it->second.tokens = tokens;
  it->second.last_used = used;
}

void SessionStore::ReleaseUnchanged(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.busy = false;
}

void SessionStore::SetResident(const std::string& id, bool resident) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.resident = resident;
}

void SessionStore::Erase(const std::string& id) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(id);
}

bool SessionStore::EraseIfIdle(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.busy) return false;
  sessions_.erase(it);
  return true;
}

std::vector<std::string> SessionStore::TakeExpired(const std::string& model,
                                                   absl::Time idle_before) {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const SessionRecord& r = it->second;
    if (r.model == model && !r.busy && r.last_used < idle_before) {
      out.push_back(it->first);
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
  return out;
}

int64_t SessionStore::CountSpilled(const std::string& model) const {
  int64_t spilled = 0;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, record] : sessions_) {
    if (record.model == model && !record.resident) ++spilled;
  }
  return spilled;
}

int64_t SessionStore::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

}  // namespace fwserve
