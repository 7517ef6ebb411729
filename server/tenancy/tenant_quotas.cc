#include "server/tenancy/tenant_quotas.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fwserve {

// The Generate observer of a tenant's stream. Owned by the core until the engine takes
// the request; from then on it deletes itself after OnFinish.
class TenantQuotas::StreamObserver : public GenerateObserver {
 public:
  StreamObserver(TenantQuotas* quotas, std::string tenant, GenerateObserver* inner)
      : quotas_(quotas), tenant_(std::move(tenant)), inner_(inner) {}
  // Destroyed without OnFinish: the request was refused before it started.
  ~StreamObserver() override {
    if (!finished_) quotas_->EndStream(tenant_);
  }
  void OnStart(std::shared_ptr<GenerateControl> stream) override {
    inner_->OnStart(std::move(stream));
  }
  void OnChunk(GenerateChunk chunk) override {
    quotas_->ChargeTokens(tenant_, static_cast<int64_t>(chunk.token_ids.size()));
    inner_->OnChunk(std::move(chunk));
  }
  void OnFinish(absl::Status status, GenerateSummary summary) override {
    finished_ = true;
    quotas_->EndStream(tenant_);
    inner_->OnFinish(std::move(status), std::move(summary));
    delete this;
  }

 private:
  TenantQuotas* const quotas_;
  const std::string tenant_;
  GenerateObserver* const inner_;
  bool finished_ = false;
};

TenantQuotas::TenantQuotas(const Tenants* tenants, const Clock* clock, Metrics* metrics)
    : tenants_(tenants), clock_(clock), metrics_(metrics) {}

std::optional<TenantQuota> TenantQuotas::QuotaOf(const std::string& tenant) const {
  if (tenants_ == nullptr) return std::nullopt;
  return tenants_->QuotaOf(tenant);
}

absl::Status TenantQuotas::Refuse(const char* reason, std::string message) {
  metrics_->CountRefused(reason);
  return absl::ResourceExhaustedError(std::move(message));
}

absl::Status TenantQuotas::CheckSessions(const std::string& tenant,
                                         const std::function<int64_t()>& held_sessions) {
  std::optional<TenantQuota> quota = QuotaOf(tenant);
  if (!quota.has_value() || quota->max_sessions <= 0) return absl::OkStatus();
  const int64_t held = held_sessions();
  if (held < quota->max_sessions) return absl::OkStatus();
  return Refuse("quota_sessions", absl::StrCat("tenant '", tenant, "' holds ", held,
                                               " sessions, its max_sessions quota; delete some "
                                               "first"));
}

absl::StatusOr<std::unique_ptr<GenerateObserver>> TenantQuotas::AdmitStream(
    const std::string& tenant, GenerateObserver* inner) {
  if (tenants_ == nullptr) return std::unique_ptr<GenerateObserver>();
  std::optional<TenantQuota> quota = QuotaOf(tenant);
  int64_t streams = 0;
  {
    absl::MutexLock lock(&mu_);
    Usage& usage = usage_[tenant];
    if (quota.has_value() && quota->max_streams > 0 && usage.streams >= quota->max_streams) {
      return Refuse("quota_streams",
                    absl::StrCat("tenant '", tenant, "' has ", usage.streams,
                                 " streams open, its max_streams quota; retry when one ends"));
    }
    if (quota.has_value() && quota->tokens_per_second > 0) {
      RefillLocked(usage, quota->tokens_per_second);
      if (usage.bucket <= 0) {
        const double wait_ms = std::ceil((1 - usage.bucket) / quota->tokens_per_second * 1000);
        return Refuse("quota_tokens",
                      absl::StrCat("tenant '", tenant, "' is over its tokens_per_second quota (",
                                   quota->tokens_per_second, "); retry in ", wait_ms, " ms"));
      }
    }
    streams = ++usage.streams;
  }
  metrics_->SetTenantActiveStreams(tenant, streams);
  return std::unique_ptr<GenerateObserver>(std::make_unique<StreamObserver>(this, tenant, inner));
}

void TenantQuotas::EndStream(const std::string& tenant) {
  int64_t streams = 0;
  {
    absl::MutexLock lock(&mu_);
    streams = --usage_[tenant].streams;
  }
  metrics_->SetTenantActiveStreams(tenant, streams);
}

void TenantQuotas::ChargeTokens(const std::string& tenant, int64_t tokens) {
  metrics_->AddTenantGeneratedTokens(tenant, tokens);
  std::optional<TenantQuota> quota = QuotaOf(tenant);
  if (!quota.has_value() || quota->tokens_per_second <= 0) return;
  absl::MutexLock lock(&mu_);
  Usage& usage = usage_[tenant];
  RefillLocked(usage, quota->tokens_per_second);
  usage.bucket -= static_cast<double>(tokens);
}

void TenantQuotas::RefillLocked(Usage& usage, double rate) {
  const absl::Time now = clock_->Now();
  if (usage.refilled == absl::InfinitePast()) {
    usage.bucket = rate;
  } else {
    usage.bucket =
        std::min(rate, usage.bucket + rate * absl::ToDoubleSeconds(now - usage.refilled));
  }
  usage.refilled = now;
}

int64_t TenantQuotas::OpenStreams(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(tenant);
  return it == usage_.end() ? 0 : it->second.streams;
}

std::optional<double> TenantQuotas::TokensAvailable(const std::string& tenant) {
  std::optional<TenantQuota> quota = QuotaOf(tenant);
  if (!quota.has_value() || quota->tokens_per_second <= 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  Usage& usage = usage_[tenant];
  RefillLocked(usage, quota->tokens_per_second);
  return usage.bucket;
}

}  // namespace fwserve
