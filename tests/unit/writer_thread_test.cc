// The transport's writer thread runs posted work in order, from any thread, and runs
// everything posted before its destruction.
#include "server/transport/grpc/writer_thread.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

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

}  // namespace
