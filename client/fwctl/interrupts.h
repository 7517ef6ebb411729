// SIGINT (Ctrl-C) in fwctl: blocked in every thread and taken by a watcher thread with
// sigwait(), which runs whatever handler the current command installed (a Generate
// stream's Cancel(), thread-safe) or, with none, prints "fwctl: interrupted" and ends
// the process with 130. So no gRPC code ever runs in a signal handler.
#ifndef FWSERVE_CLIENT_FWCTL_INTERRUPTS_H_
#define FWSERVE_CLIENT_FWCTL_INTERRUPTS_H_

#include <atomic>
#include <functional>
#include <mutex>

namespace fwctl {

class Interrupts {
 public:
  // Blocks SIGINT in the calling thread (and so in every thread started after this:
  // call it first thing in main) and starts the watcher thread.
  static void Start();

  // SIGINTs received so far.
  static int count() { return count_.load(); }
  // Readable after each SIGINT (one byte per signal), for poll().
  static int wake_fd() { return wake_pipe_[0]; }
  // Discards the pending wake bytes.
  static void DrainWakeups();

  // While alive, each SIGINT runs `handler` on the watcher thread instead of ending the
  // process. Handlers nest: the previous one is restored when this one goes.
  class Handler {
   public:
    explicit Handler(std::function<void()> handler);
    ~Handler();
    Handler(const Handler&) = delete;
    Handler& operator=(const Handler&) = delete;

   private:
    std::function<void()> previous_;  // restored when this one goes
  };

 private:
  static inline std::atomic<int> count_{0};
  static inline int wake_pipe_[2] = {-1, -1};
  static inline std::mutex mutex_;
  static inline std::function<void()> handler_;
};

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_INTERRUPTS_H_
