#include "server/transport/grpc/writer_thread.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

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

WriterPool::WriterPool(int threads, const std::string& name_prefix) {
  const int count = threads < 1 ? 1 : threads;
  names_.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    names_.push_back(absl::StrCat(name_prefix, i).substr(0, 15));
  }
  for (int i = 0; i < count; ++i) {
    threads_.push_back(std::make_unique<WriterThread>(names_[static_cast<size_t>(i)].c_str()));
  }
}

void WriterPool::Post(uint64_t key, absl::AnyInvocable<void() &&> work) {
  // Keys are often pointers: mix the bits so neighbours spread over the threads.
  const uint64_t mixed = absl::HashOf(key);
  threads_[mixed % threads_.size()]->Post(std::move(work));
}

int WriterThreadCount(int requested) {
  if (requested > 0) return requested;
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cpus / 4, 1, 8);
}

}  // namespace fwserve
