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

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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

// Writer threads sharded by key: work posted with one key runs on one thread, in the
// order posted, so a stream keyed by its own identity keeps its order while many
// streams' sends spread over the threads (at millions of tokens per second one thread's
// sends are the limit).
//
// Thread-safety: Post may be called from any thread.
class WriterPool {
 public:
  // `threads` >= 1 threads, named `name_prefix` + their index (at most 15 characters in
  // all are kept).
  WriterPool(int threads, const std::string& name_prefix);
  // Each thread runs what was posted to it (WriterThread's destructor), then joins.
  ~WriterPool() = default;

  WriterPool(const WriterPool&) = delete;
  WriterPool& operator=(const WriterPool&) = delete;

  // Queues `work` on the thread of `key`.
  void Post(uint64_t key, absl::AnyInvocable<void() &&> work);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  std::vector<std::string> names_;  // outlive the threads that read them
  std::vector<std::unique_ptr<WriterThread>> threads_;
};

// The writer threads a server with `requested` (GrpcServerOptions::writer_threads) runs
// on this machine: `requested` when positive, else one per 4 CPUs, 1 to 8.
int WriterThreadCount(int requested);

}  // namespace fwserve
