// What --threads 0 resolves to (server/base/cpu_count.h).
#include "server/base/cpu_count.h"

#include <sched.h>
#include <stdlib.h>

#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace fwserve {
namespace {

TEST(CpuCountTest, CgroupQuotaIsRoundedUpToWholeCpus) {
  EXPECT_EQ(CpusOfCgroupQuota("200000 100000"), 2);
  EXPECT_EQ(CpusOfCgroupQuota("150000 100000\n"), 2);  // 1.5 CPUs: two threads
  EXPECT_EQ(CpusOfCgroupQuota("50000 100000"), 1);
  EXPECT_EQ(CpusOfCgroupQuota("max 100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota(""), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("0 100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("x 100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("17592186044415 1000"), INT32_MAX);  // no wrap to negative
}

// An environment variable set for one test and restored after it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(CpuCountTest, AnExplicitCountWinsThenOmpNumThreadsThenTheCores) {
  {
    ScopedEnv env("OMP_NUM_THREADS", "3");
    EXPECT_EQ(ResolveComputeThreads(5), 5);
    EXPECT_EQ(ResolveComputeThreads(0), 3);
  }
  {
    ScopedEnv env("OMP_NUM_THREADS", "4,2");  // nested levels: the outermost
    EXPECT_EQ(ResolveComputeThreads(0), 4);
  }
  {
    ScopedEnv env("OMP_NUM_THREADS", "not a number");
    EXPECT_EQ(ResolveComputeThreads(0), UsableCores());
  }
  {
    ScopedEnv env("OMP_NUM_THREADS", nullptr);
    EXPECT_EQ(ResolveComputeThreads(0), UsableCores());
  }
}

TEST(CpuCountTest, TheCoresNeverExceedTheAffinityMask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cpus = CPU_COUNT(&set);
  EXPECT_GE(UsableCores(), 1);
  EXPECT_LE(UsableCores(), cpus);
  // One CPU allowed: one core, whatever the machine has.
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) {
      CPU_SET(cpu, &one);
      break;
    }
  }
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(UsableCores(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(set), &set), 0);
  EXPECT_LE(UsableCores(), cpus);
}

}  // namespace
}  // namespace fwserve
