// The state's row-copy kernels' grid (models/gpu/row_copy.cu), run on the CPU by its
// mirror (models/gpu/row_copy_host.h: the same plan, blocks, threads and row_copy_rule.h
// body), equals LibTorch's index_select (gather) and index_copy_ (scatter) bit for bit:
// rows of 1, 5, 6, 12, 768, 2049, 4099 and 49,152 floats (the odd ones copied by single
// floats, the others by 16-byte vectors, and by single floats again from a pointer off
// 16-byte alignment), permuted rows, n = 1 and 300, more tensors than one launch takes
// (LaunchRowCopyGroups, as State::Gather and State::Scatter call it), repeated rows and
// rows outside the pool, and the launchers' refusals. The kernels themselves run on a
// GPU machine through State::Gather / State::Scatter (models/architectures/model.cc) in
// CudaEquivalenceTest's in-place step (model_cuda_test.cc).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(FWSERVE_CUDA_TESTS)
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#endif

#include "absl/strings/str_cat.h"
#include "models/architectures/state.h"
#include "models/gpu/row_copy.h"
#include "models/gpu/row_copy_host.h"
#include "models/gpu/row_copy_rule.h"

namespace fwtest_row_copy {

namespace k = fwmodel::kernels;

// A pool ([pool_rows, row_floats] per tensor, random) and a batch ([n, row_floats] per
// tensor) of float32 CPU tensors, contiguous.
struct Tensors {
  std::vector<torch::Tensor> pool, batch;
};

Tensors MakeTensors(const std::vector<int64_t>& row_floats, int64_t pool_rows, int64_t n,
                    float batch_fill) {
  Tensors t;
  for (int64_t floats : row_floats) {
    t.pool.push_back(torch::randn({pool_rows, floats}));
    t.batch.push_back(torch::full({n, floats}, batch_fill));
  }
  return t;
}

// `launch` (int(const RowCopyArgs&): a launcher on a stream, or a mirror) over every
// tensor of `t` at `rows` (int64, [n], on the tensors' device) through
// LaunchRowCopyGroups, as State::Gather and State::Scatter call it; returns its result
// (0: every launch ran) and counts the launches in *launches.
template <typename Launch>
int RunGroups(Launch&& launch, const torch::Tensor& rows, Tensors& t, int* launches = nullptr) {
  const int64_t count = static_cast<int64_t>(t.pool.size());
  std::vector<float*> pool, batch;
  std::vector<int64_t> row_floats;
  for (int64_t i = 0; i < count; ++i) {
    pool.push_back(t.pool[i].data_ptr<float>());
    batch.push_back(t.batch[i].data_ptr<float>());
    row_floats.push_back(t.pool[i].numel() / t.pool[i].size(0));
  }
  int calls = 0;
  const int result = k::LaunchRowCopyGroups(count, rows.size(0), count > 0 ? t.pool[0].size(0) : 0,
                                            rows.data_ptr<int64_t>(), pool.data(), batch.data(),
                                            row_floats.data(), [&](const k::RowCopyArgs& args) {
                                              ++calls;
                                              return launch(args);
                                            });
  if (launches != nullptr) *launches = calls;
  return result;
}

// The CPU mirror through RunGroups.
int RunOnHost(bool gather, const torch::Tensor& rows, Tensors& t, int* launches = nullptr) {
  return RunGroups(
      [gather](const k::RowCopyArgs& args) {
        return (gather ? k::RunRowGatherOnHost(args) : k::RunRowScatterOnHost(args)) ? 0 : 1;
      },
      rows, t, launches);
}

// The mixed row sizes: 1, 5, 6, 2049 and 4099 defeat the 16-byte vectors; 768 and 49,152
// are RWKV-7 0.1B's shift and wkv state rows; 2049, 4099 and 49,152 span several chunks.
const std::vector<int64_t> kMixedRows = {1, 5, 6, 12, 768, 2049, 4099, 49152};

class GpuRowCopyTest : public testing::TestWithParam<int64_t> {};

TEST_P(GpuRowCopyTest, GatherEqualsIndexSelect) {
  const int64_t n = GetParam(), pool_rows = n + 7;
  torch::manual_seed(static_cast<uint64_t>(n));
  Tensors t = MakeTensors(kMixedRows, pool_rows, n, std::numeric_limits<float>::quiet_NaN());
  const torch::Tensor rows = torch::randperm(pool_rows, torch::kInt64).narrow(0, 0, n).clone();
  ASSERT_EQ(RunOnHost(/*gather=*/true, rows, t), 0);
  for (size_t i = 0; i < t.pool.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("row of ", kMixedRows[i], " floats"));
    EXPECT_TRUE(torch::equal(t.batch[i], t.pool[i].index_select(0, rows)));
  }
}

TEST_P(GpuRowCopyTest, ScatterEqualsIndexCopy) {
  const int64_t n = GetParam(), pool_rows = n + 7;
  torch::manual_seed(static_cast<uint64_t>(n + 1));
  Tensors t = MakeTensors(kMixedRows, pool_rows, n, 0.0f);
  std::vector<torch::Tensor> expected;
  const torch::Tensor rows = torch::randperm(pool_rows, torch::kInt64).narrow(0, 0, n).clone();
  for (size_t i = 0; i < t.pool.size(); ++i) {
    t.batch[i].normal_();
    expected.push_back(t.pool[i].clone().index_copy_(0, rows, t.batch[i]));
  }
  ASSERT_EQ(RunOnHost(/*gather=*/false, rows, t), 0);
  for (size_t i = 0; i < t.pool.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("row of ", kMixedRows[i], " floats"));
    EXPECT_TRUE(torch::equal(t.pool[i], expected[i]));
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, GpuRowCopyTest, testing::Values(int64_t{1}, int64_t{300}),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return absl::StrCat("n", info.param);
                         });

// The grid: ⌈row_floats / kRowCopyChunkFloats⌉ blocks per (tensor, row), tensor after
// tensor; vectors exactly where the row is a multiple of 4 floats and both pointers are
// 16-byte aligned.
TEST(GpuRowCopyPlanTest, BlocksPerRowAndVectors) {
  ASSERT_EQ(k::kRowCopyChunkFloats, 2048);
  Tensors t = MakeTensors(kMixedRows, 4, 3, 0.0f);
  k::RowCopyArgs args;
  args.count = static_cast<int>(kMixedRows.size());
  args.n = 3;
  args.pool_rows = 4;
  const torch::Tensor rows = torch::tensor({0, 1, 2}, torch::kInt64);
  args.rows = rows.data_ptr<int64_t>();
  for (int i = 0; i < args.count; ++i) {
    args.pool[i] = t.pool[static_cast<size_t>(i)].data_ptr<float>();
    args.batch[i] = t.batch[static_cast<size_t>(i)].data_ptr<float>();
    args.row_floats[i] = kMixedRows[static_cast<size_t>(i)];
  }
  k::RowCopyGrid grid;
  ASSERT_TRUE(k::PlanRowCopy(args, &grid));
  const std::vector<int64_t> chunks = {1, 1, 1, 1, 1, 2, 3, 24};
  int64_t first = 0;
  for (int i = 0; i < args.count; ++i) {
    EXPECT_EQ(grid.first_block[i], first) << "tensor " << i;
    first += 3 * chunks[static_cast<size_t>(i)];
  }
  EXPECT_EQ(grid.first_block[args.count], first);
  EXPECT_EQ(grid.blocks, first);
  // 12, 768 and 49,152 (tensors 3, 4, 7) by vectors: LibTorch's CPU allocations are
  // 64-byte aligned.
  EXPECT_EQ(grid.vectors, (uint64_t{1} << 3) | (uint64_t{1} << 4) | (uint64_t{1} << 7));
  // One float off alignment: single floats.
  torch::Tensor shifted = torch::randn({4 * 768 + 1}).narrow(0, 1, 4 * 768).view({4, 768});
  args.pool[4] = shifted.data_ptr<float>();
  ASSERT_TRUE(k::PlanRowCopy(args, &grid));
  EXPECT_EQ(grid.vectors, (uint64_t{1} << 3) | (uint64_t{1} << 7));
}

// Rows a multiple of 4 floats, but a pointer off 16-byte alignment (pool or batch): the
// single-float path, still equal to index_select and index_copy_.
TEST(GpuRowCopyPlanTest, UnalignedPointersCopyBySingleFloats) {
  const int64_t pool_rows = 9, n = 5, floats = 2048 + 768;
  torch::manual_seed(3);
  const torch::Tensor pool_storage = torch::randn({pool_rows * floats + 1});
  const torch::Tensor batch_storage = torch::full({n * floats + 1}, -7.0f);
  Tensors t;
  t.pool = {pool_storage.narrow(0, 1, pool_rows * floats).view({pool_rows, floats}),
            torch::randn({pool_rows, floats})};
  t.batch = {torch::full({n, floats}, -7.0f),
             batch_storage.narrow(0, 1, n * floats).view({n, floats})};
  const torch::Tensor rows = torch::tensor({8, 0, 3, 6, 1}, torch::kInt64);
  ASSERT_EQ(RunOnHost(/*gather=*/true, rows, t), 0);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(torch::equal(t.batch[i], t.pool[i].index_select(0, rows))) << "tensor " << i;
  }
  std::vector<torch::Tensor> expected;
  for (size_t i = 0; i < 2; ++i) {
    t.batch[i].normal_();
    expected.push_back(t.pool[i].clone().index_copy_(0, rows, t.batch[i]));
  }
  ASSERT_EQ(RunOnHost(/*gather=*/false, rows, t), 0);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(torch::equal(t.pool[i], expected[i])) << "tensor " << i;
  }
}

// 150 tensors: three launches of at most kRowCopyMaxTensors, as State::Gather and
// State::Scatter group them.
TEST(GpuRowCopyGroupsTest, MoreTensorsThanOneLaunchTakes) {
  std::vector<int64_t> row_floats;
  for (int i = 0; i < 150; ++i) row_floats.push_back(kMixedRows[static_cast<size_t>(i % 6)]);
  torch::manual_seed(5);
  const int64_t pool_rows = 6, n = 4;
  Tensors t = MakeTensors(row_floats, pool_rows, n, std::numeric_limits<float>::quiet_NaN());
  const torch::Tensor rows = torch::tensor({5, 2, 0, 3}, torch::kInt64);
  int launches = 0;
  ASSERT_EQ(RunOnHost(/*gather=*/true, rows, t, &launches), 0);
  EXPECT_EQ(launches, 3);
  for (size_t i = 0; i < t.pool.size(); ++i) {
    EXPECT_TRUE(torch::equal(t.batch[i], t.pool[i].index_select(0, rows))) << "tensor " << i;
  }
  std::vector<torch::Tensor> expected;
  for (size_t i = 0; i < t.pool.size(); ++i) {
    t.batch[i].normal_();
    expected.push_back(t.pool[i].clone().index_copy_(0, rows, t.batch[i]));
  }
  ASSERT_EQ(RunOnHost(/*gather=*/false, rows, t, &launches), 0);
  EXPECT_EQ(launches, 3);
  for (size_t i = 0; i < t.pool.size(); ++i) {
    EXPECT_TRUE(torch::equal(t.pool[i], expected[i])) << "tensor " << i;
  }
}

// The first failing launch's result is returned, and the later groups do not run.
TEST(GpuRowCopyGroupsTest, StopsAtTheFirstFailure) {
  std::vector<float*> pointers(130, nullptr);
  std::vector<int64_t> row_floats(130, 4);
  const int64_t row = 0;
  int calls = 0;
  const int result = k::LaunchRowCopyGroups(130, 1, 1, &row, pointers.data(), pointers.data(),
                                            row_floats.data(), [&](const k::RowCopyArgs& args) {
                                              ++calls;
                                              EXPECT_EQ(args.count, k::kRowCopyMaxTensors);
                                              return calls == 2 ? 7 : 0;
                                            });
  EXPECT_EQ(result, 7);
  EXPECT_EQ(calls, 2);
}

// Gathered rows may repeat; a row outside the pool gathers zeros and scatters nothing.
TEST(GpuRowCopyRowsTest, RepeatedRowsAndRowsOutsideThePool) {
  torch::manual_seed(9);
  const std::vector<int64_t> floats = {5, 768, 4099};
  const int64_t pool_rows = 4;
  Tensors t = MakeTensors(floats, pool_rows, 5, std::numeric_limits<float>::quiet_NaN());
  const torch::Tensor rows = torch::tensor({2, -1, 2, 4, 0}, torch::kInt64);
  ASSERT_EQ(RunOnHost(/*gather=*/true, rows, t), 0);
  const torch::Tensor inside = torch::tensor({0, 2, 4}, torch::kInt64);
  const torch::Tensor outside = torch::tensor({1, 3}, torch::kInt64);
  for (size_t i = 0; i < floats.size(); ++i) {
    EXPECT_TRUE(torch::equal(t.batch[i].index_select(0, inside),
                             t.pool[i].index_select(0, torch::tensor({2, 2, 0}, torch::kInt64))));
    EXPECT_TRUE(torch::equal(t.batch[i].index_select(0, outside), torch::zeros({2, floats[i]})));
  }
  // Scatter: rows 2 and 0 written (row 2 twice, from batch rows 0 and 2, made equal here),
  // rows -1 and 4 skipped.
  std::vector<torch::Tensor> expected;
  for (size_t i = 0; i < floats.size(); ++i) {
    t.batch[i].normal_();
    t.batch[i][2].copy_(t.batch[i][0]);
    expected.push_back(t.pool[i].clone());
    expected[i][2].copy_(t.batch[i][0]);
    expected[i][0].copy_(t.batch[i][4]);
  }
  ASSERT_EQ(RunOnHost(/*gather=*/false, rows, t), 0);
  for (size_t i = 0; i < floats.size(); ++i) {
    EXPECT_TRUE(torch::equal(t.pool[i], expected[i])) << "tensor " << i;
  }
}

// What the launchers refuse (cudaErrorInvalidValue), the mirror refuses too, writing
// nothing; nothing to do (count or n 0) is not refused, null pointers and all.
TEST(GpuRowCopyArgsTest, RefusesWhatTheLauncherRefuses) {
  float pool[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  float batch[4] = {0, 0, 0, 0};
  const int64_t rows[1] = {1};
  auto valid = [&] {
    k::RowCopyArgs args;
    args.count = 1;
    args.n = 1;
    args.pool_rows = 2;
    args.rows = rows;
    args.pool[0] = pool;
    args.batch[0] = batch;
    args.row_floats[0] = 4;
    return args;
  };
  k::RowCopyArgs args = valid();
  ASSERT_TRUE(k::RunRowGatherOnHost(args));
  EXPECT_EQ(batch[0], 5.0f);
  EXPECT_EQ(batch[3], 8.0f);
  batch[0] = 0;

  std::vector<k::RowCopyArgs> refused;
  args = valid();
  args.count = k::kRowCopyMaxTensors + 1;
  refused.push_back(args);
  args = valid();
  args.count = -1;
  refused.push_back(args);
  args = valid();
  args.n = -1;
  refused.push_back(args);
  args = valid();
  args.pool_rows = -1;
  refused.push_back(args);
  args = valid();
  args.row_floats[0] = 0;
  refused.push_back(args);
  args = valid();
  args.rows = nullptr;
  refused.push_back(args);
  args = valid();
  args.pool[0] = nullptr;
  refused.push_back(args);
  args = valid();
  args.batch[0] = nullptr;
  refused.push_back(args);
  args = valid();
  args.n = int64_t{INT_MAX} + 1;  // more rows than the grid takes
  refused.push_back(args);
  args = valid();
  args.n = 1 << 20;  // 2^20 rows of 2^21 chunks: more than 2^31 - 1 blocks
  args.row_floats[0] = int64_t{1} << 32;
  refused.push_back(args);
  for (size_t i = 0; i < refused.size(); ++i) {
    k::RowCopyGrid grid;
    EXPECT_FALSE(k::PlanRowCopy(refused[i], &grid)) << "case " << i;
    EXPECT_FALSE(k::RunRowGatherOnHost(refused[i])) << "case " << i;
    EXPECT_FALSE(k::RunRowScatterOnHost(refused[i])) << "case " << i;
  }
  EXPECT_EQ(batch[0], 0.0f);
  EXPECT_EQ(pool[4], 5.0f);

  k::RowCopyArgs empty;  // count 0: nothing to do
  k::RowCopyGrid grid;
  EXPECT_TRUE(k::PlanRowCopy(empty, &grid));
  EXPECT_EQ(grid.blocks, 0);
  empty.count = 2;
  empty.row_floats[0] = empty.row_floats[1] = 3;  // n 0, null pointers
  EXPECT_TRUE(k::PlanRowCopy(empty, &grid));
  EXPECT_EQ(grid.blocks, 0);
  EXPECT_TRUE(k::RunRowScatterOnHost(empty));
}

#if defined(FWSERVE_CUDA_TESTS)
// On a GPU (built where models/gpu built the kernels; scripts/gpu/kernel-run.sh runs
// *GpuRowCopy*): LaunchRowGather and LaunchRowScatter on CUDA tensors, and State::Gather
// and State::Scatter (model.cc's hooks onto them), equal index_select and index_copy_ on
// the same tensors bit for bit: the mixed rows at n = 1 and 300, the state hooks with
// RWKV-7's [12, 64, 64] rows too, and 150 tensors (three launches).
TEST(GpuRowCopyCudaTest, KernelsAndStateHooksEqualTheOps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<int64_t> many;
  for (int i = 0; i < 150; ++i) many.push_back(kMixedRows[static_cast<size_t>(i % 6)]);
  for (const std::vector<int64_t>& floats : {kMixedRows, many}) {
    for (int64_t n : {int64_t{1}, int64_t{300}}) {
      SCOPED_TRACE(absl::StrCat(floats.size(), " tensors, n = ", n));
      torch::manual_seed(static_cast<uint64_t>(n + static_cast<int64_t>(floats.size())));
      const int64_t pool_rows = n + 7;
      Tensors t = MakeTensors(floats, pool_rows, n, std::numeric_limits<float>::quiet_NaN());
      for (size_t i = 0; i < floats.size(); ++i) {
        t.pool[i] = t.pool[i].to(cuda);
        t.batch[i] = t.batch[i].to(cuda);
      }
      const torch::Tensor rows =
          torch::randperm(pool_rows, torch::kInt64).narrow(0, 0, n).clone().to(cuda);
      // The launchers.
      ASSERT_EQ(
          RunGroups([&](const k::RowCopyArgs& args) { return k::LaunchRowGather(args, stream); },
                    rows, t),
          0);
      for (size_t i = 0; i < floats.size(); ++i) {
        ASSERT_TRUE(torch::equal(t.batch[i], t.pool[i].index_select(0, rows))) << "tensor " << i;
      }
      std::vector<torch::Tensor> expected;
      for (size_t i = 0; i < floats.size(); ++i) {
        t.batch[i].normal_();
        expected.push_back(t.pool[i].clone().index_copy_(0, rows, t.batch[i]));
      }
      ASSERT_EQ(
          RunGroups([&](const k::RowCopyArgs& args) { return k::LaunchRowScatter(args, stream); },
                    rows, t),
          0);
      for (size_t i = 0; i < floats.size(); ++i) {
        ASSERT_TRUE(torch::equal(t.pool[i], expected[i])) << "tensor " << i;
      }
      // The state hooks, with a [12, 64, 64] row as RWKV-7's wkv state.
      fwmodel::State pool{t.pool};
      pool.tensors.push_back(torch::randn({pool_rows, 12, 64, 64}, cuda));
      const fwmodel::State gathered = pool.Gather(rows);
      ASSERT_EQ(gathered.tensors.size(), pool.tensors.size());
      fwmodel::State source;
      expected.clear();
      for (size_t i = 0; i < pool.tensors.size(); ++i) {
        ASSERT_TRUE(torch::equal(gathered.tensors[i], pool.tensors[i].index_select(0, rows)))
            << "state tensor " << i;
        source.tensors.push_back(torch::randn_like(gathered.tensors[i]));
        expected.push_back(pool.tensors[i].clone().index_copy_(0, rows, source.tensors[i]));
      }
      pool.Scatter(rows, source);
      for (size_t i = 0; i < pool.tensors.size(); ++i) {
        ASSERT_TRUE(torch::equal(pool.tensors[i], expected[i])) << "state tensor " << i;
      }
    }
  }
}
#endif

}  // namespace fwtest_row_copy
