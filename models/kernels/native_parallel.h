// The native decode kernels' split of a loop over OpenMP workers (native_step.cc,
// native_rwkv.cc). Include only from files compiled with -fopenmp (models/CMakeLists.txt):
// without it the pragma is ignored and every loop runs on the calling thread.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fwmodel::native {

// f(begin, end) over [0, n) in at most `threads` contiguous tasks of at least `grain`
// items each, on OpenMP workers beside the calling thread (one task: inline). f must not
// throw. The team size is explicit, not the calling thread's OpenMP default, so the
// engine's and the prefill thread's steps can run with different counts.
template <typename F>
void ParallelRows(int threads, int64_t n, int64_t grain, const F& f) {
  const int64_t tasks = std::min<int64_t>(threads, n / std::max<int64_t>(grain, 1));
  if (tasks <= 1) {
    f(int64_t{0}, n);
    return;
  }
  const int team = static_cast<int>(tasks);
#pragma omp parallel for num_threads(team) schedule(static, 1)
  for (int64_t task = 0; task < tasks; ++task) f(n * task / tasks, n * (task + 1) / tasks);
}

}  // namespace fwmodel::native
