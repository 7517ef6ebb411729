#include "server/transport/grpc/writer_thread.h"

#include <pthread.h>

#include <utility>

namespace fwserve {

WriterThread::WriterThread(const char* name) {
  thread_ = std::thread([this, name] {
    pthread_setname_np(pthread_self(), name);
    Loop();
  });
}

WriterThread::~WriterThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void WriterThread::Post(absl::AnyInvocable<void() &&> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
}

void WriterThread::Loop() {
  std::deque<absl::AnyInvocable<void() &&>> batch;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WriterThread::HasWorkOrStop));
      if (queue_.empty()) return;  // stopping, and nothing left
      batch.swap(queue_);
    }
    for (auto& work : batch) std::move(work)();
    batch.clear();
  }
}

}  // namespace fwserve
