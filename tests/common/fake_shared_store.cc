#include "tests/common/fake_shared_store.h"

#include "absl/strings/str_cat.h"

namespace fwtest {

using fwserve::SessionPage;
using fwserve::StoredSessionInfo;
using fwserve::StoreLeaseGrant;

absl::Status FakeSharedStore::Put(const std::string& id, const std::string& blob) {
  absl::MutexLock lock(&mu_);
  sessions_[id].blob = blob;
  return absl::OkStatus();
}

absl::StatusOr<std::string> FakeSharedStore::Get(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(id);
  return it->second.blob;
}

absl::Status FakeSharedStore::Delete(const std::string& id) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(id);
  return absl::OkStatus();
}

absl::Status FakeSharedStore::ForEachId(const std::function<bool(const std::string& id)>& visit) {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : sessions_) ids.push_back(id);
  }
  for (const std::string& id : ids) {
    if (!visit(id)) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<StoreLeaseGrant> FakeSharedStore::AcquireLease(const std::string& id, absl::Duration,
                                                              int64_t cached_version,
                                                              const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.info.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  }
  Entry& entry = it->second;
  if (!entry.lease.empty()) return absl::AbortedError(absl::StrCat("session ", id, " is leased"));
  entry.lease = absl::StrCat("token-", next_token_++);
  StoreLeaseGrant grant;
  grant.token = entry.lease;
  grant.info = entry.info;
  if (cached_version != entry.info.version) grant.blob = entry.blob;
  return grant;
}

absl::Status FakeSharedStore::RenewLease(const std::string& id, const std::string& token,
                                         absl::Duration) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.lease != token) return absl::AbortedError("lease lost");
  ++renewals_;
  return absl::OkStatus();
}

absl::Status FakeSharedStore::ReleaseLease(const std::string& id, const std::string& token) {
  absl::MutexLock lock(&mu_);
  ++releases_;
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.lease == token) it->second.lease.clear();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FakeSharedStore::CommitLeased(const std::string& id,
                                                      const std::string& token,
                                                      int64_t expected_version,
                                                      const std::string& blob, int64_t tokens,
                                                      absl::Time last_used) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::AbortedError("session gone");
  Entry& entry = it->second;
  if (entry.lease != token || entry.info.version != expected_version) {
    if (entry.lease == token) entry.lease.clear();
    return absl::AbortedError("lease lost or version moved on");
  }
  entry.blob = blob;
  entry.info.version += 1;
  entry.info.tag = token;
  entry.info.tokens = tokens;
  entry.info.last_used = last_used;
  entry.lease.clear();
  return entry.info.version;
}

absl::Status FakeSharedStore::CreateSession(const StoredSessionInfo& info,
                                            const std::string& blob) {
  absl::MutexLock lock(&mu_);
  if (sessions_.count(info.id) > 0) return absl::AlreadyExistsError(info.id);
  Entry& entry = sessions_[info.id];
  entry.info = info;
  entry.info.version = 1;
  entry.blob = blob;
  return absl::OkStatus();
}

absl::Status FakeSharedStore::DeleteLeased(const std::string& id, const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.lease != token) return absl::AbortedError("lease lost");
  sessions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<StoredSessionInfo> FakeSharedStore::GetInfo(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(id);
  StoredSessionInfo info = it->second.info;
  info.busy = !it->second.lease.empty();
  return info;
}

absl::StatusOr<SessionPage> FakeSharedStore::List(const std::string& model,
                                                  const std::string& tenant, int page_size,
                                                  const std::string& page_token) {
  absl::MutexLock lock(&mu_);
  SessionPage page;
  for (auto it = sessions_.upper_bound(page_token); it != sessions_.end(); ++it) {
    const StoredSessionInfo& info = it->second.info;
    if (info.tenant != tenant || (!model.empty() && info.model != model)) continue;
    if (static_cast<int>(page.sessions.size()) == page_size) {
      page.next_page_token = page.sessions.back().id;
      break;
    }
    page.sessions.push_back(info);
  }
  return page;
}

void FakeSharedStore::DropLease(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(id); it != sessions_.end()) it->second.lease.clear();
}

bool FakeSharedStore::LeaseHeld(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  return it != sessions_.end() && !it->second.lease.empty();
}

int64_t FakeSharedStore::renewals() const {
  absl::MutexLock lock(&mu_);
  return renewals_;
}

int64_t FakeSharedStore::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

absl::StatusOr<std::string> FakeSharedStore::BlobOf(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(id);
  return it->second.blob;
}

}  // namespace fwtest
