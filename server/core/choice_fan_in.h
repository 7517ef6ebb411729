// Several choices of one Generate (GenerateParams::choices > 1; docs/http.md "Several
// choices"): the core runs them as `n` streams, choice 0 reading the prompt and the others
// starting from its state (server/engine/stream_driver.h, ChoiceGroup), and this joins
// them into the one stream the transport asked for. Torch-free.
//
// To the transport it is the request's GenerateControl: one chunk at a time (each with
// its choice_index), WriteDone routed to the choice whose chunk was written, Cancel to
// every choice, and one OnFinish after every choice finished and every chunk was
// written. Its summary counts the prompt once (choice 0's) and every choice's tokens,
// and lists how each choice ended (GenerateSummary::choices); a choice that failed
// fails the request with its status.
//
// Thread-safety: thread-safe. The members' calls come from the engine thread,
// WriteDone and Cancel from the transport's; `downstream` is called outside the lock,
// one call at a time, OnStart first and OnFinish last.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/api/requests.h"

namespace fwserve {

class ChoiceFanIn : public GenerateControl, public std::enable_shared_from_this<ChoiceFanIn> {
 public:
  // `downstream` (not owned) must outlive its OnFinish.
  static std::shared_ptr<ChoiceFanIn> Create(GenerateObserver* downstream, int32_t choices);

  // The observer of choice `index`'s stream, for the core's StartGenerate. Valid while
  // the fan-in lives: from Start until its OnFinish it keeps itself alive.
  GenerateObserver* member(int32_t index);
  // Choice 0 was accepted: `downstream` gets OnStart, then the chunks. Until then nothing
  // reaches it (a refused choice 0 is the caller's error; the fan-in is then dropped).
  void Start();
  // Choice `index` was refused before it started (its observer will never be called):
  // the others are cancelled, and the request fails with `status` once they ended.
  void Refused(int32_t index, absl::Status status);

  // GenerateControl: the transport's handle.
  std::string session_id() const override { return ""; }
  void WriteDone(bool ok) override;
  void Cancel() override;

 private:
  class Member;
  struct Queued {
    int32_t choice = 0;
    GenerateChunk chunk;
  };

  ChoiceFanIn(GenerateObserver* downstream, int32_t choices);
  void OnMemberStart(int32_t index, std::shared_ptr<GenerateControl> control);
  void OnMemberChunk(int32_t index, GenerateChunk chunk);
  void OnMemberFinish(int32_t index, absl::Status status, GenerateSummary summary);
  // Sends the next queued chunk, or the final OnFinish when everything is done, unless a
  // write is in flight. Called without the lock.
  void Pump();

  GenerateObserver* const downstream_;
  const int32_t choices_;
  std::vector<std::unique_ptr<Member>> members_;  // fixed after Create
  std::shared_ptr<ChoiceFanIn> self_;             // alive until the final OnFinish

  absl::Mutex mu_;
  std::vector<std::shared_ptr<GenerateControl>> controls_ ABSL_GUARDED_BY(mu_);
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  std::optional<int32_t> in_flight_ ABSL_GUARDED_BY(mu_);  // whose chunk is being written
  bool started_ ABSL_GUARDED_BY(mu_) = false;              // Start ran: downstream may be called
  bool sending_ ABSL_GUARDED_BY(mu_) = false;              // a Pump is calling downstream
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int32_t finished_ ABSL_GUARDED_BY(mu_) = 0;  // members finished or refused
  std::vector<bool> member_done_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // the first failure
  GenerateSummary summary_ ABSL_GUARDED_BY(mu_);
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fwserve
