// The transport's writer thread runs posted work in order, from any thread, and runs
// everything posted before its destruction. The writer pool keeps each key's order on
// one thread and spreads keys over its threads.
#include "server/transport/grpc/writer_thread.h"

#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

#include "absl/synchronization/notification.h"

namespace {

TEST(WriterThreadTest, RunsWorkInTheOrderEachThreadPostedIt) {
  constexpr int kPosters = 4, kPerPoster = 500;
  std::vector<std::vector<int>> seen(kPosters);  // touched only by the writer thread
  {
    fwserve::WriterThread writer("test-writer");
    std::vector<std::thread> posters;
    for (int p = 0; p < kPosters; ++p) {
      posters.emplace_back([&writer, &seen, p] {
        for (int i = 0; i < kPerPoster; ++i) writer.Post([&seen, p, i] { seen[p].push_back(i); });
      });
    }
    for (auto& t : posters) t.join();
  }  // the destructor runs what is still queued
  for (int p = 0; p < kPosters; ++p) {
    ASSERT_EQ(seen[p].size(), static_cast<size_t>(kPerPoster)) << "poster " << p;
    for (int i = 0; i < kPerPoster; ++i) EXPECT_EQ(seen[p][i], i) << "poster " << p;
  }
}

TEST(WriterThreadTest, WorkRunsOnTheWriterThreadNotThePoster) {
  std::thread::id ran_on;
  absl::Notification done;
  fwserve::WriterThread writer("test-writer");
  writer.Post([&] {
    ran_on = std::this_thread::get_id();
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(WriterThreadTest, WorkPostedByWorkRunsBeforeTheDestructorReturns) {
  int runs = 0;
  {
    fwserve::WriterThread writer("test-writer");
    absl::Notification first_ran;
    writer.Post([&] {
      ++runs;
      writer.Post([&] { ++runs; });
      first_ran.Notify();
    });
    first_ran.WaitForNotification();
  }
  EXPECT_EQ(runs, 2);
}

TEST(WriterPoolTest, EachKeyKeepsItsOrderOnOneThreadAndKeysSpreadOverThreads) {
  constexpr int kKeys = 32, kPerKey = 200, kThreads = 3;
  std::vector<std::vector<int>> seen(kKeys);
  std::vector<std::set<std::thread::id>> threads_of_key(kKeys);
  absl::Mutex mu;
  std::set<std::thread::id> all_threads ABSL_GUARDED_BY(mu);
  {
    fwserve::WriterPool pool(kThreads, "test-writer");
    EXPECT_EQ(pool.size(), kThreads);
    std::vector<std::thread> posters;
    for (int p = 0; p < 4; ++p) {
      posters.emplace_back([&, p] {
        // Poster p owns keys p, p + 4, ...: each key's posts come from one thread.
        for (int i = 0; i < kPerKey; ++i) {
          for (int key = p; key < kKeys; key += 4) {
            pool.Post(static_cast<uint64_t>(key) * 64, [&, key, i] {
              seen[key].push_back(i);  // one thread per key: no race
              threads_of_key[key].insert(std::this_thread::get_id());
              absl::MutexLock lock(&mu);
              all_threads.insert(std::this_thread::get_id());
            });
          }
        }
      });
    }
    for (auto& t : posters) t.join();
  }  // each thread runs what is still queued
  for (int key = 0; key < kKeys; ++key) {
    ASSERT_EQ(seen[key].size(), static_cast<size_t>(kPerKey)) << "key " << key;
    for (int i = 0; i < kPerKey; ++i) EXPECT_EQ(seen[key][i], i) << "key " << key;
    EXPECT_EQ(threads_of_key[key].size(), 1u) << "key " << key << " ran on several threads";
  }
  absl::MutexLock lock(&mu);
  EXPECT_EQ(all_threads.size(), static_cast<size_t>(kThreads))
      << "32 keys did not use every thread";
}

TEST(WriterPoolTest, TheAutomaticCountIsOnePerFourCpusFromOneToEight) {
  EXPECT_EQ(fwserve::WriterThreadCount(5), 5);
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(fwserve::WriterThreadCount(0), std::clamp(cpus / 4, 1, 8));
}

}  // namespace
