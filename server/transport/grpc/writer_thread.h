// A thread that starts gRPC writes for others.
//
// gRPC's callback API sends a message inline, on the thread that calls StartWrite
// (serialisation, HTTP/2 framing, sendmsg). When that thread is the engine loop, every
// message costs the loop the time of its send. Posting the StartWrite here instead lets
// the loop compute the next step while the message goes out, and the tokens it samples
// meanwhile share the stream's next message.
//
// Thread-safety: Post may be called from any thread. Work runs on the writer thread in
// the order posted, one item at a time.
#pragma once

#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace fwserve {

class WriterThread {
 public:
  // Starts the thread; `name` (at most 15 characters) shows in top -H and profilers.
  explicit WriterThread(const char* name);
  // Runs everything posted so far (and what that work posts), then joins. Nothing else
  // may post once it began.
  ~WriterThread();

  WriterThread(const WriterThread&) = delete;
  WriterThread& operator=(const WriterThread&) = delete;

  // Queues `work`. It must not block: it shares the thread with every other write.
  void Post(absl::AnyInvocable<void() &&> work);

 private:
  void Loop();
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stop_; }

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fwserve
