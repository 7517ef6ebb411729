// Which queued work starts now: the engine's queue, its limits and its fair share
// between tenants. Pure: no threads, no clock, no model; the engine calls it under its
// own lock (so it needs none), and tests drive it directly.
//
// Rules (docs/serving.md, "Admission"):
// - Push refuses at once (RESOURCE_EXHAUSTED, naming the flag) when the queue holds
//   its capacity (max_queued, or less: Push's `capacity`), or when the item's tenant
//   already has half of that queued.
// - Work that is not a stream (session operations) never waits for a stream slot.
// - Stream slots (max_active_streams) go, one at a time, to the tenant with the fewest
//   streams running, ties to the tenant served least recently, then to the oldest
//   request: with one tenant this is FIFO.
// - With CoDel on (codel_target > 0; "Fail at Scale", Maurer 2015): once the queue has
//   not been empty for codel_interval, or has been full within it (a standing queue:
//   more arrives than the slots drain), the last tie goes to the newest request
//   instead (adaptive LIFO), and TakeShed takes out every stream queued longer than
//   codel_target, for the engine to refuse with a retry hint (not those of a tenant
//   below its fair share of the slots). A stream that starts has then waited at most
//   the target. Without a standing queue nothing is shed.
//
// `Item` is any type with a `std::string tenant` member; whether an item is a stream
// is told by the predicate given at construction. Times are passed in (`now`), never
// read. Not thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/base/retry_delay.h"

namespace fwserve {

struct AdmissionOptions {
  // The model's name, for refusal messages.
  std::string model;
  // Items waiting at most (--max-queued-requests); beyond it Push refuses.
  int64_t max_queued = 1024;
  // Named in refusals when Push's capacity is below max_queued (--max-queue-wait).
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // Streams running at once (--max-active-streams).
  int64_t max_active_streams = 256;
  // CoDel (--queue-codel-target): under a standing queue the longest a stream may wait
  // before it is shed; zero = off (FIFO, nothing shed).
  absl::Duration codel_target = absl::ZeroDuration();
  // The queue stands once it has stayed non-empty this long, or while it was full
  // within it (--queue-codel-interval).
  absl::Duration codel_interval = absl::Milliseconds(100);
};

// The flag behind a queue capacity (at most options.max_queued), for refusals:
// --max-queued-requests, or --max-queue-wait when the capacity is below it.
inline std::string QueueCapacityText(const AdmissionOptions& options, int64_t capacity) {
  if (capacity < options.max_queued) {
    return absl::StrCat(capacity, " requests, what drains within --max-queue-wait=",
                        absl::FormatDuration(options.max_queue_wait));
  }
  return absl::StrCat("--max-queued-requests=", options.max_queued);
}

// RESOURCE_EXHAUSTED for a queue holding `capacity` items, naming the flag behind it;
// its RefusalReason is kQueueWait when --max-queue-wait set the capacity.
inline absl::Status QueueFullError(const AdmissionOptions& options, int64_t capacity) {
  return WithRefusalReason(
      absl::ResourceExhaustedError(absl::StrCat("the queue of model '", options.model,
                                                "' is full (", QueueCapacityText(options, capacity),
                                                "); retry later")),
      capacity < options.max_queued ? RefusalReason::kQueueWait : RefusalReason::kQueueFull);
}

template <typename Item>
class AdmissionQueue {
 public:
  using IsStream = std::function<bool(const Item&)>;
  // Streams running per tenant now; asked only when the free slots are too few for
  // every waiting stream (the fair-share path).
  using RunningByTenant = std::function<absl::flat_hash_map<std::string, int64_t>()>;

  AdmissionQueue(AdmissionOptions options, IsStream is_stream)
      : options_(std::move(options)), is_stream_(std::move(is_stream)) {}

  // Queues `item` at time `now`, or refuses it with RESOURCE_EXHAUSTED and leaves it in
  // `item`. `capacity`: the items the queue may hold now, at most max_queued
  // (0 = max_queued).
  absl::Status Push(std::unique_ptr<Item>& item, int64_t capacity = 0,
                    absl::Time now = absl::InfinitePast()) {
    capacity = capacity > 0 ? std::min(capacity, options_.max_queued) : options_.max_queued;
    if (static_cast<int64_t>(queue_.size()) >= capacity) {
      full_at_ = now;
      return QueueFullError(options_, capacity);
    }
    if (!item->tenant.empty()) {
      // One tenant may hold at most half the queue: the rest stays open to the others.
      const int64_t share = std::max<int64_t>(1, capacity / 2);
      int64_t queued = 0;
      for (const auto& waiting : queue_) queued += waiting.item->tenant == item->tenant ? 1 : 0;
      if (queued >= share) {
        return WithRefusalReason(
            absl::ResourceExhaustedError(absl::StrCat(
                "tenant '", item->tenant, "' has ", queued, " requests queued for model '",
                options_.model, "', its share of the queue (half of ",
                QueueCapacityText(options_, capacity), "); retry later")),
            RefusalReason::kTenantQueueShare);
      }
    }
    if (queue_.empty()) empty_at_ = now;
    queue_.push_back(Entry{std::move(item), now});
    if (static_cast<int64_t>(queue_.size()) >= capacity) full_at_ = now;
    return absl::OkStatus();
  }

  // Moves the items that may start now into `admitted`, in the order they start.
  // `active` counts the streams running and is raised by each stream admitted. With
  // `admit_all` (shutdown: everything is answered now) every item is taken, oldest first.
  // `now`: for CoDel's standing-queue test (Standing).
  void TakeAdmissible(int64_t& active, bool admit_all, const RunningByTenant& running_by_tenant,
                      std::vector<std::unique_ptr<Item>>& admitted,
                      absl::Time now = absl::InfinitePast()) {
    int64_t waiting_streams = 0;
    for (const auto& entry : queue_) waiting_streams += is_stream_(*entry.item) ? 1 : 0;
    const int64_t room = options_.max_active_streams - active;
    if (admit_all || waiting_streams <= room) {
      for (auto& entry : queue_) {
        if (is_stream_(*entry.item)) {
          ++active;
          last_admission_[entry.item->tenant] = ++admissions_;
        }
        admitted.push_back(std::move(entry.item));
      }
      queue_.clear();
      empty_at_ = now;
      return;
    }
    // Decided before anything leaves: taking the queue's items does not end its standing.
    const bool newest_first = Standing(now);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (!is_stream_(*it->item)) {
        admitted.push_back(std::move(it->item));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    absl::flat_hash_map<std::string, int64_t> running = running_by_tenant();
    const auto served_at = [this](const std::string& tenant) {
      auto it = last_admission_.find(tenant);
      return it == last_admission_.end() ? uint64_t{0} : it->second;
    };
    for (int64_t slot = 0; slot < room && !queue_.empty(); ++slot) {
      auto chosen = queue_.begin();
      for (auto it = std::next(queue_.begin()); it != queue_.end(); ++it) {
        const std::string& tenant = it->item->tenant;
        const std::string& best_tenant = chosen->item->tenant;
        const int64_t mine = running[tenant], best = running[best_tenant];
        const uint64_t served = served_at(tenant), best_served = served_at(best_tenant);
        // Queue order is arrival order: a later item wins a full tie only newest-first.
        if (mine < best || (mine == best && served < best_served) ||
            (newest_first && mine == best && served == best_served)) {
          chosen = it;
        }
      }
      ++running[chosen->item->tenant];
      last_admission_[chosen->item->tenant] = ++admissions_;
      ++active;
      admitted.push_back(std::move(chosen->item));
      queue_.erase(chosen);
    }
    if (queue_.empty()) empty_at_ = now;
  }

  // Whether the queue stands at `now`: CoDel on, the queue not empty, and either not
  // empty for codel_interval or full within it. (A queue that sheds what waited past
  // the target can run empty for a moment under a storm; having been full says the
  // storm is still there.)
  bool Standing(absl::Time now) const {
    return options_.codel_target > absl::ZeroDuration() && !queue_.empty() &&
           (now - empty_at_ >= options_.codel_interval || now - full_at_ < options_.codel_interval);
  }

  // With a standing queue, moves every stream queued before `now - codel_target` into
  // `shed`, oldest first. Never shed: session operations, and the streams of a tenant
  // running fewer than its fair share of the slots (max_active_streams over the tenants
  // with streams running or waiting): a storm is shed, not the tenant beside it.
  void TakeShed(absl::Time now, const RunningByTenant& running_by_tenant,
                std::vector<std::unique_ptr<Item>>& shed) {
    if (!Standing(now)) return;
    const absl::Time queued_before = now - options_.codel_target;
    bool any_old = false;
    for (const auto& entry : queue_) {
      any_old = any_old || (entry.queued_at < queued_before && is_stream_(*entry.item));
    }
    if (!any_old) return;
    // Every tenant with streams running, and (added at 0) every tenant with one waiting.
    absl::flat_hash_map<std::string, int64_t> running = running_by_tenant();
    for (const auto& entry : queue_) {
      if (is_stream_(*entry.item)) running.try_emplace(entry.item->tenant, 0);
    }
    const int64_t share =
        options_.max_active_streams / std::max<int64_t>(1, static_cast<int64_t>(running.size()));
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->queued_at < queued_before && is_stream_(*it->item) &&
          running[it->item->tenant] >= share) {
        shed.push_back(std::move(it->item));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    if (queue_.empty()) empty_at_ = now;
  }

  // Whether TakeAdmissible would take something with `active` streams running.
  bool HasAdmissible(int64_t active) const {
    for (const auto& entry : queue_) {
      if (!is_stream_(*entry.item) || active < options_.max_active_streams) return true;
    }
    return false;
  }

  // The tenants of the streams waiting, oldest first (one entry per stream).
  std::vector<std::string> WaitingStreamTenants() const {
    std::vector<std::string> tenants;
    for (const auto& entry : queue_) {
      if (is_stream_(*entry.item)) tenants.push_back(entry.item->tenant);
    }
    return tenants;
  }

  bool empty() const { return queue_.empty(); }
  int64_t size() const { return static_cast<int64_t>(queue_.size()); }

 private:
  struct Entry {
    std::unique_ptr<Item> item;
    absl::Time queued_at;
  };

  const AdmissionOptions options_;
  const IsStream is_stream_;
  std::deque<Entry> queue_;  // arrival order
  // When the queue was last seen empty, and last full (CoDel's standing-queue test).
  absl::Time empty_at_ = absl::InfinitePast();
  absl::Time full_at_ = absl::InfinitePast();
  // When each tenant last got a stream slot, in admissions counted from 1.
  absl::flat_hash_map<std::string, uint64_t> last_admission_;
  uint64_t admissions_ = 0;
};

}  // namespace fwserve
