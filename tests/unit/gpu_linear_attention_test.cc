// The fused `linear_attention` recurrence kernel's grid (models/gpu/linear_attention.cu),
// run on the CPU by its mirror (models/gpu/linear_attention_host.h: the same blocks,
// threads and phases over linear_attention_rule.h's bodies), equals the LibTorch mixer
// (linear_attention.cc's LinearAttention, which Model::Step and Model::Forward call)
// within 1e-4 relative: y and the new state (S, z), for the decode step (several Steps in
// a row) and the sequence form (Forward at T = 1, 3 and 70: one chunk, and more than
// ModelOptions::attention_chunk = 64), with heads of 8, 64 and 128 (compiled widths) and
// 24 (a width off them), from random states and a fresh one. In place the same bits; on a
// state pool through `rows` (permuted, some pool rows unnamed), in place and not, the same
// bits with the unnamed rows untouched. The launcher's refusals mirrored. The CUDA kernel
// itself runs in GpuLinearAttentionCudaEquivalenceTest on a GPU machine.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/mixer.h"
#include "models/gpu/linear_attention_host.h"
#if defined(FWSERVE_CUDA_TESTS)
#include <torch/cuda.h>
#endif
#include "tests/unit/test_models.h"

namespace gpu_linear_attention_test {

constexpr double kLinearAttentionTolerance = 1e-4;
constexpr int64_t kLinearAttentionB = 3;

struct Shape {
  int d_model;
  int n_heads;
};

fwmodel::ModelConfig LinearAttentionConfig(const Shape& shape) {
  return fwtest::ConfigCase{fwmodel::Architecture::kLinearAttention,
                            fwmodel::FfnKind::kSquaredRelu,
                            0,
                            1,
                            false,
                            shape.d_model,
                            shape.n_heads}
      .Config();
}

// B random states: S [B, H, N, N] normal, z [B, H, N] positive (a sum of φ > 0); session
// 1 fresh (zeros).
std::vector<torch::Tensor> RandomLinearAttentionStates(const fwmodel::ModelConfig& config,
                                                       int64_t B) {
  const int64_t H = config.n_heads, N = config.d_head();
  torch::Tensor S = torch::randn({B, H, N, N}) * 0.5, z = torch::rand({B, H, N}) * 2 + 0.5;
  S.select(0, 1).zero_();
  z.select(0, 1).zero_();
  return {S, z};
}

// The mirror's arguments for contiguous CPU float32 tensors (projections [B, T, d]).
fwmodel::kernels::LinearAttentionArgs MirrorArgs(const fwmodel::ModelConfig& config,
                                                 const std::vector<torch::Tensor>& pr,
                                                 const torch::Tensor& S_in, torch::Tensor& S_out,
                                                 const torch::Tensor& z_in, torch::Tensor& z_out,
                                                 torch::Tensor& y) {
  fwmodel::kernels::LinearAttentionArgs args;
  args.B = pr[0].size(0);
  args.T = pr[0].size(1);
  args.H = config.n_heads;
  args.N = config.d_head();
  args.q = pr[0].data_ptr<float>();
  args.k = pr[1].data_ptr<float>();
  args.v = pr[2].data_ptr<float>();
  args.S_in = S_in.data_ptr<float>();
  args.S_out = S_out.data_ptr<float>();
  args.z_in = z_in.data_ptr<float>();
  args.z_out = z_out.data_ptr<float>();
  args.y = y.data_ptr<float>();
  args.eps = static_cast<float>(config.attn_eps);
  return args;
}

// (shape, T)
class GpuLinearAttentionTest : public testing::TestWithParam<std::tuple<Shape, int64_t>> {};

TEST_P(GpuLinearAttentionTest, HostGridEqualsLibTorchForward) {
  c10::NoGradGuard no_grad;
  const auto [shape, T] = GetParam();
  const fwmodel::ModelConfig config = LinearAttentionConfig(shape);
  const int64_t B = kLinearAttentionB, d = config.d_model, H = config.n_heads, N = config.d_head();
  torch::manual_seed(static_cast<uint64_t>(d * 100 + H * 10 + T));
  const auto mixer = fwmodel::MakeMixer(config, fwmodel::ModelOptions{});
  const std::vector<torch::Tensor> state0 = RandomLinearAttentionStates(config, B);
  const std::vector<torch::Tensor> pr = {torch::randn({B, T, d}), torch::randn({B, T, d}),
                                         torch::randn({B, T, d})};

  // The reference: the LibTorch sequence form.
  torch::Tensor ref_state[2] = {state0[0].clone(), state0[1].clone()};
  const torch::Tensor proj[3] = {pr[0], pr[1], pr[2]};
  const torch::Tensor y_ref = mixer->Forward(torch::zeros({B, T, d}), proj, ref_state);

  torch::Tensor S_in = state0[0].clone(), z_in = state0[1].clone();
  torch::Tensor S_out = torch::empty_like(S_in), z_out = torch::empty_like(z_in),
                y = torch::empty({B, T, d});
  fwmodel::kernels::LinearAttentionArgs args = MirrorArgs(config, pr, S_in, S_out, z_in, z_out, y);
  ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
  fwtest::ExpectNearRelative(y, y_ref, kLinearAttentionTolerance, "y");
  fwtest::ExpectNearRelative(S_out, ref_state[0], kLinearAttentionTolerance, "S");
  fwtest::ExpectNearRelative(z_out, ref_state[1], kLinearAttentionTolerance, "z");
  EXPECT_TRUE(torch::equal(S_in, state0[0]) && torch::equal(z_in, state0[1]))
      << "the state in was written";

  // In place: the same bits.
  torch::Tensor S_inplace = state0[0].clone(), z_inplace = state0[1].clone(),
                y_inplace = torch::empty_like(y);
  args.S_in = args.S_out = S_inplace.data_ptr<float>();
  args.z_in = args.z_out = z_inplace.data_ptr<float>();
  args.y = y_inplace.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
  EXPECT_TRUE(torch::equal(S_inplace, S_out)) << "in place: S";
  EXPECT_TRUE(torch::equal(z_inplace, z_out)) << "in place: z";
  EXPECT_TRUE(torch::equal(y_inplace, y)) << "in place: y";

  // On pools of B + 2 rows through `rows` (permuted; pool rows 1 and 3 unnamed): out of
  // place, then in place, the same bits as above, the unnamed rows untouched.
  ASSERT_EQ(B, 3);
  const std::vector<int64_t> rows = {4, 0, 2};
  const torch::Tensor row_index = torch::tensor(rows, torch::kLong);
  const torch::Tensor unnamed = torch::tensor(std::vector<int64_t>{1, 3}, torch::kLong);
  torch::Tensor S_pool = torch::randn({B + 2, H, N, N}), z_pool = torch::randn({B + 2, H, N});
  S_pool.index_copy_(0, row_index, state0[0]);
  z_pool.index_copy_(0, row_index, state0[1]);
  const torch::Tensor S_pool0 = S_pool.clone(), z_pool0 = z_pool.clone();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  torch::Tensor S_pool_out = torch::full_like(S_pool, nan),
                z_pool_out = torch::full_like(z_pool, nan);
  torch::Tensor y_pool = torch::empty_like(y);
  args.rows = rows.data();
  args.S_in = S_pool.data_ptr<float>();
  args.S_out = S_pool_out.data_ptr<float>();
  args.z_in = z_pool.data_ptr<float>();
  args.z_out = z_pool_out.data_ptr<float>();
  args.y = y_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, out of place: y";
  EXPECT_TRUE(torch::equal(S_pool_out.index_select(0, row_index), S_out)) << "rows: S";
  EXPECT_TRUE(torch::equal(z_pool_out.index_select(0, row_index), z_out)) << "rows: z";
  EXPECT_TRUE(S_pool_out.index_select(0, unnamed).isnan().all().item<bool>() &&
              z_pool_out.index_select(0, unnamed).isnan().all().item<bool>())
      << "an unnamed pool row was written";
  EXPECT_TRUE(torch::equal(S_pool, S_pool0) && torch::equal(z_pool, z_pool0))
      << "the state in was written";
  args.S_out = S_pool.data_ptr<float>();
  args.z_out = z_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, in place: y";
  EXPECT_TRUE(torch::equal(S_pool.index_select(0, row_index), S_out)) << "rows, in place: S";
  EXPECT_TRUE(torch::equal(z_pool.index_select(0, row_index), z_out)) << "rows, in place: z";
  EXPECT_TRUE(torch::equal(S_pool.index_select(0, unnamed), S_pool0.index_select(0, unnamed)) &&
              torch::equal(z_pool.index_select(0, unnamed), z_pool0.index_select(0, unnamed)))
      << "an unnamed pool row was written in place";
}

INSTANTIATE_TEST_SUITE_P(LinearAttention, GpuLinearAttentionTest,
                         testing::Combine(testing::Values(Shape{16, 2}, Shape{48, 2}, Shape{64, 1},
                                                          Shape{128, 1}),
                                          testing::Values(int64_t{1}, int64_t{3}, int64_t{70})),
                         [](const testing::TestParamInfo<std::tuple<Shape, int64_t>>& info) {
                           const Shape shape = std::get<0>(info.param);
                           return absl::StrCat("N", shape.d_model / shape.n_heads, "_T",
                                               std::get<1>(info.param));
                         });

// The decode step: five Steps in a row of the LibTorch mixer ([B, d] projections each)
// against five T = 1 runs of the mirror on its own state (in place), from random states
// (session 1 fresh): y of every step and the final state within the tolerance.
TEST(GpuLinearAttentionStepTest, HostGridEqualsLibTorchSteps) {
  c10::NoGradGuard no_grad;
  for (const Shape shape : {Shape{16, 2}, Shape{48, 2}, Shape{128, 1}}) {
    const fwmodel::ModelConfig config = LinearAttentionConfig(shape);
    SCOPED_TRACE(absl::StrCat("N = ", config.d_head()));
    const int64_t B = kLinearAttentionB, d = config.d_model;
    torch::manual_seed(static_cast<uint64_t>(d));
    const auto mixer = fwmodel::MakeMixer(config, fwmodel::ModelOptions{});
    const std::vector<torch::Tensor> state0 = RandomLinearAttentionStates(config, B);
    torch::Tensor ref_state[2] = {state0[0].clone(), state0[1].clone()};
    torch::Tensor S = state0[0].clone(), z = state0[1].clone();
    for (int step = 0; step < 5; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      const std::vector<torch::Tensor> pr = {torch::randn({B, 1, d}), torch::randn({B, 1, d}),
                                             torch::randn({B, 1, d})};
      const torch::Tensor proj[3] = {pr[0].squeeze(1), pr[1].squeeze(1), pr[2].squeeze(1)};
      const torch::Tensor y_ref = mixer->Step(torch::zeros({B, d}), proj, ref_state);
      torch::Tensor y = torch::empty({B, 1, d});
      fwmodel::kernels::LinearAttentionArgs args = MirrorArgs(config, pr, S, S, z, z, y);
      ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
      fwtest::ExpectNearRelative(y.squeeze(1), y_ref, kLinearAttentionTolerance, "y");
    }
    fwtest::ExpectNearRelative(S, ref_state[0], kLinearAttentionTolerance, "S");
    fwtest::ExpectNearRelative(z, ref_state[1], kLinearAttentionTolerance, "z");
  }
}

// The launcher's refusals, mirrored (LinearAttentionArgsValid): a head wider than the
// kernel takes or empty, a negative size, a grid past 2^31 − 1 blocks, any missing pointer
// the launch needs; T = 0 needs no token pointer (the state is copied); B = 0 or H = 0
// none at all.
TEST(GpuLinearAttentionArgsTest, RefusesWhatTheLauncherRefuses) {
  using fwmodel::kernels::LinearAttentionArgs;
  const int64_t H = 2, N = 4, B = 2, T = 2, d = H * N;
  std::vector<float> q(B * T * d, 0.5f), k(B * T * d, 0.1f), v(B * T * d, 1.0f), y(B * T * d, 0.0f),
      S(B * H * N * N, 0.0f), z(B * H * N, 1.0f);
  LinearAttentionArgs args;
  args.B = B;
  args.T = T;
  args.H = H;
  args.N = N;
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.y = y.data();
  args.S_in = S.data();
  args.S_out = S.data();
  args.z_in = z.data();
  args.z_out = z.data();
  args.eps = 1e-6f;
  ASSERT_TRUE(fwmodel::kernels::LinearAttentionArgsValid(args));
  ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
  auto refused = [](const LinearAttentionArgs& changed) {
    return !fwmodel::kernels::LinearAttentionArgsValid(changed) &&
           !fwmodel::kernels::RunLinearAttentionOnHost(changed);
  };
  LinearAttentionArgs bad = args;
  bad.N = fwmodel::kernels::kLinearAttentionMaxN + 1;
  EXPECT_TRUE(refused(bad)) << "N too wide";
  bad.N = 0;
  EXPECT_TRUE(refused(bad)) << "N = 0";
  bad = args;
  bad.B = -1;
  EXPECT_TRUE(refused(bad)) << "B < 0";
  bad = args;
  bad.T = -1;
  EXPECT_TRUE(refused(bad)) << "T < 0";
  bad = args;
  bad.H = -1;
  EXPECT_TRUE(refused(bad)) << "H < 0";
  bad = args;
  bad.B = int64_t{INT32_MAX} / H + 1;
  EXPECT_TRUE(refused(bad)) << "too many blocks";
  bad.B = int64_t{INT32_MAX} / H;
  EXPECT_TRUE(fwmodel::kernels::LinearAttentionArgsValid(bad)) << "the most blocks";
  const float* LinearAttentionArgs::*inputs[] = {
      &LinearAttentionArgs::q, &LinearAttentionArgs::k, &LinearAttentionArgs::v,
      &LinearAttentionArgs::S_in, &LinearAttentionArgs::z_in};
  for (const auto member : inputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing input";
  }
  float* LinearAttentionArgs::*outputs[] = {&LinearAttentionArgs::S_out,
                                            &LinearAttentionArgs::z_out, &LinearAttentionArgs::y};
  for (const auto member : outputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing output";
  }
  // T = 0: the state copied, no token pointer read.
  for (size_t i = 0; i < S.size(); ++i) S[i] = static_cast<float>(i);
  for (size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>(i) + 0.5f;
  std::vector<float> S_copy(S.size(), -1.0f), z_copy(z.size(), -1.0f);
  bad = args;
  bad.T = 0;
  bad.q = bad.k = bad.v = nullptr;
  bad.y = nullptr;
  bad.S_out = S_copy.data();
  bad.z_out = z_copy.data();
  EXPECT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(bad));
  EXPECT_EQ(S_copy, S) << "T = 0 copies S";
  EXPECT_EQ(z_copy, z) << "T = 0 copies z";
  bad.z_out = nullptr;
  EXPECT_TRUE(refused(bad)) << "T = 0 without the state";
  LinearAttentionArgs empty;
  empty.N = N;
  EXPECT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(empty)) << "B = 0: nothing to do";
}

#if defined(FWSERVE_CUDA_TESTS)
// On a GPU (built where LibTorch has CUDA; scripts/gpu/check.py runs *CudaEquivalence*):
// the mixer's Step and Forward on CUDA float32 tensors without autograd (the fused kernel
// where models/gpu built it) against the CPU mirror of its grid on the same inputs: y and
// the new state within 1e-5 relative (the same bodies; only the compilers' contraction and
// summation order differ), with heads of 8, 24, 64 and 128, T = 1 (Step and Forward) and
// 3, 70 (Forward), B = 3, from random states (session 1 fresh).
TEST(GpuLinearAttentionCudaEquivalenceTest, KernelEqualsItsMirror) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  for (const Shape shape : {Shape{16, 2}, Shape{48, 2}, Shape{64, 1}, Shape{128, 1}}) {
    const fwmodel::ModelConfig config = LinearAttentionConfig(shape);
    const auto mixer = fwmodel::MakeMixer(config, fwmodel::ModelOptions{});
    const int64_t B = kLinearAttentionB, d = config.d_model;
    torch::manual_seed(static_cast<uint64_t>(d + 1));
    for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{70}}) {
      for (const bool step : {false, true}) {
        if (step && T != 1) continue;
        SCOPED_TRACE(
            absl::StrCat("N = ", config.d_head(), ", T = ", T, step ? ", Step" : ", Forward"));
        const std::vector<torch::Tensor> state0 = RandomLinearAttentionStates(config, B);
        const std::vector<torch::Tensor> pr = {torch::randn({B, T, d}), torch::randn({B, T, d}),
                                               torch::randn({B, T, d})};
        torch::Tensor S_out = torch::empty_like(state0[0]), z_out = torch::empty_like(state0[1]),
                      y = torch::empty({B, T, d});
        fwmodel::kernels::LinearAttentionArgs args =
            MirrorArgs(config, pr, state0[0], S_out, state0[1], z_out, y);
        ASSERT_TRUE(fwmodel::kernels::RunLinearAttentionOnHost(args));
        torch::Tensor state[2] = {state0[0].to(cuda), state0[1].to(cuda)};
        torch::Tensor y_cuda;
        if (step) {
          const torch::Tensor proj[3] = {pr[0].squeeze(1).to(cuda), pr[1].squeeze(1).to(cuda),
                                         pr[2].squeeze(1).to(cuda)};
          y_cuda = mixer->Step(torch::zeros({B, d}, cuda), proj, state).unsqueeze(1);
        } else {
          const torch::Tensor proj[3] = {pr[0].to(cuda), pr[1].to(cuda), pr[2].to(cuda)};
          y_cuda = mixer->Forward(torch::zeros({B, T, d}, cuda), proj, state);
        }
        fwtest::ExpectNearRelative(y_cuda.cpu(), y, 1e-5, "y");
        fwtest::ExpectNearRelative(state[0].cpu(), S_out, 1e-5, "S");
        fwtest::ExpectNearRelative(state[1].cpu(), z_out, 1e-5, "z");
      }
    }
  }
}
#endif

}  // namespace gpu_linear_attention_test
