// An in-memory SharedSessionStore with the same lease, fence and tenant rules as the
// redis:// store (server/sessions/store/shared_session_store.h), for unit tests of the
// layers above it. The real-Redis tests (tests/unit/redis_store_test.cc, the shared
// store integration tests) stay the proof of the real store; this fake only stands in
// where a test is about the caller's logic. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/sessions/store/shared_session_store.h"

namespace fwtest {

class FakeSharedStore : public fwserve::SharedSessionStore {
 public:
  std::string Describe() const override { return "fake shared store"; }

  absl::Status Put(const std::string& id, const std::string& blob) override;
  absl::StatusOr<std::string> Get(const std::string& id) override;
  absl::Status Delete(const std::string& id) override;
  absl::Status ForEachId(const std::function<bool(const std::string& id)>& visit) override;

  absl::StatusOr<fwserve::StoreLeaseGrant> AcquireLease(const std::string& id,
                                                        absl::Duration lease_ttl,
                                                        int64_t cached_version,
                                                        const std::string& tenant) override;
  absl::Status RenewLease(const std::string& id, const std::string& token,
                          absl::Duration lease_ttl) override;
  absl::Status ReleaseLease(const std::string& id, const std::string& token) override;
  absl::StatusOr<int64_t> CommitLeased(const std::string& id, const std::string& token,
                                       int64_t expected_version, const std::string& blob,
                                       int64_t tokens, absl::Time last_used) override;
  absl::Status CreateSession(const fwserve::StoredSessionInfo& info,
                             const std::string& blob) override;
  absl::Status DeleteLeased(const std::string& id, const std::string& token) override;
  absl::StatusOr<fwserve::StoredSessionInfo> GetInfo(const std::string& id) override;
  absl::StatusOr<fwserve::SessionPage> List(const std::string& model, const std::string& tenant,
                                            int page_size, const std::string& page_token) override;

  // Test controls: the lease as if it expired; what the store holds.
  void DropLease(const std::string& id);
  bool LeaseHeld(const std::string& id) const;
  int64_t renewals() const;
  int64_t releases() const;
  absl::StatusOr<std::string> BlobOf(const std::string& id) const;

 private:
  struct Entry {
    fwserve::StoredSessionInfo info;
    std::string blob;
    std::string lease;  // empty: free
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t renewals_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fwtest
