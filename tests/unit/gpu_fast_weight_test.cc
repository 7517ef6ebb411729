// The fused `fast_weight` recurrence kernel's grid (models/gpu/fast_weight.cu), run on the
// CPU by its mirror (models/gpu/fast_weight_host.h: the same blocks, threads and phases
// over fast_weight_rule.h's bodies), equals the LibTorch mixer (fast_weight.cc's
// FastWeight, which Model::Step and Model::Forward call) within 1e-4 relative: y and the
// new state W, for the decode step (several Steps in a row) and the sequence form (Forward
// at T = 1, 3 and 70: one chunk, and more than ModelOptions::attention_chunk = 64), with
// ν = 1, 2, 3 and heads of 8, 64 and 128 (compiled widths, 128 with ν > 1 on the run-time
// kernel) and 24 (a width off them), from random states and a fresh one. In place the same
// bits; on a state pool through `rows` (permuted, some pool rows unnamed), in place and
// not, the same bits with the unnamed rows untouched. The launcher's refusals mirrored.
// The CUDA kernel itself runs in GpuFastWeightCudaEquivalenceTest on a GPU machine.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/mixer.h"
#include "models/gpu/fast_weight_host.h"
#if defined(FWSERVE_CUDA_TESTS)
#include <torch/cuda.h>
#endif
#include "tests/unit/test_models.h"

namespace gpu_fast_weight_test {

constexpr double kFastWeightTolerance = 1e-4;
constexpr int64_t kFastWeightB = 3;

struct Shape {
  int d_model;
  int n_heads;
};

// A bound fast_weight mixer (random β weight [H, d], float32 on `device`) with its weight.
struct FastWeightLayer {
  fwmodel::ModelConfig config;
  std::unique_ptr<fwmodel::Mixer> mixer;
  torch::Tensor beta_w;  // [H, d], CPU float32
};

FastWeightLayer MakeFastWeightLayer(const Shape& shape, int nu, uint64_t seed,
                                    torch::Device device = torch::kCPU) {
  FastWeightLayer layer;
  layer.config = fwtest::ConfigCase{fwmodel::Architecture::kFastWeight,
                                    fwmodel::FfnKind::kSquaredRelu,
                                    0,
                                    nu,
                                    false,
                                    shape.d_model,
                                    shape.n_heads}
                     .Config();
  layer.config.n_heads = shape.n_heads;  // ConfigCase keeps TinyConfig's 2 heads
  torch::manual_seed(seed);
  layer.beta_w = torch::randn({shape.n_heads, shape.d_model}) / std::sqrt(shape.d_model);
  layer.mixer = fwmodel::MakeMixer(layer.config, fwmodel::ModelOptions{});
  const torch::Tensor beta_w = layer.beta_w.to(device);
  layer.mixer->Bind([&](const std::string& suffix) {
    if (suffix == "mixer.beta.weight") return beta_w;
    ADD_FAILURE() << "unexpected weight " << suffix;
    return torch::Tensor();
  });
  return layer;
}

// B random states W [B, H, N, d_phi] (normal); session 1 fresh (zeros).
torch::Tensor RandomFastWeightState(const fwmodel::ModelConfig& config, int64_t B) {
  torch::Tensor W = torch::randn({B, config.n_heads, config.d_head(), config.d_phi()}) * 0.5;
  W.select(0, 1).zero_();
  return W;
}

// The token inputs of T steps: a (the mixer's input) and q, k, v, [B, T, d] each, and β's
// logits a·betaᵀ [B, T, H] for the mirror.
struct Tokens {
  torch::Tensor a, q, k, v, beta;
};
Tokens RandomTokens(const FastWeightLayer& layer, int64_t B, int64_t T) {
  const int64_t d = layer.config.d_model;
  Tokens tokens{torch::randn({B, T, d}), torch::randn({B, T, d}), torch::randn({B, T, d}),
                torch::randn({B, T, d}), torch::Tensor()};
  tokens.beta = torch::linear(tokens.a, layer.beta_w).contiguous();
  return tokens;
}

// The mirror's arguments for contiguous CPU float32 tensors.
fwmodel::kernels::FastWeightArgs MirrorArgs(const fwmodel::ModelConfig& config,
                                            const Tokens& tokens, const torch::Tensor& W_in,
                                            torch::Tensor& W_out, torch::Tensor& y) {
  fwmodel::kernels::FastWeightArgs args;
  args.B = tokens.q.size(0);
  args.T = tokens.q.size(1);
  args.H = config.n_heads;
  args.N = config.d_head();
  args.nu = config.dpfp_nu;
  args.q = tokens.q.data_ptr<float>();
  args.k = tokens.k.data_ptr<float>();
  args.v = tokens.v.data_ptr<float>();
  args.beta = tokens.beta.data_ptr<float>();
  args.W_in = W_in.data_ptr<float>();
  args.W_out = W_out.data_ptr<float>();
  args.y = y.data_ptr<float>();
  args.eps = static_cast<float>(config.attn_eps);
  return args;
}

std::vector<Shape> Shapes() { return {Shape{16, 2}, Shape{48, 2}, Shape{64, 1}, Shape{128, 1}}; }

// (shape, nu, T)
class GpuFastWeightTest : public testing::TestWithParam<std::tuple<Shape, int, int64_t>> {};

TEST_P(GpuFastWeightTest, HostGridEqualsLibTorchForward) {
  c10::NoGradGuard no_grad;
  const auto [shape, nu, T] = GetParam();
  const FastWeightLayer layer =
      MakeFastWeightLayer(shape, nu, static_cast<uint64_t>(shape.d_model * 100 + nu * 10 + T));
  const fwmodel::ModelConfig& config = layer.config;
  const int64_t B = kFastWeightB, d = config.d_model, H = config.n_heads, N = config.d_head(),
                dphi = config.d_phi();
  const torch::Tensor state0 = RandomFastWeightState(config, B);
  const Tokens tokens = RandomTokens(layer, B, T);

  // The reference: the LibTorch sequence form.
  torch::Tensor ref_state[1] = {state0.clone()};
  const torch::Tensor proj[3] = {tokens.q, tokens.k, tokens.v};
  const torch::Tensor y_ref = layer.mixer->Forward(tokens.a, proj, ref_state);

  torch::Tensor W_in = state0.clone();
  torch::Tensor W_out = torch::empty_like(W_in), y = torch::empty({B, T, d});
  fwmodel::kernels::FastWeightArgs args = MirrorArgs(config, tokens, W_in, W_out, y);
  ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
  fwtest::ExpectNearRelative(y, y_ref, kFastWeightTolerance, "y");
  fwtest::ExpectNearRelative(W_out, ref_state[0], kFastWeightTolerance, "W");
  EXPECT_TRUE(torch::equal(W_in, state0)) << "the state in was written";

  // In place: the same bits.
  torch::Tensor W_inplace = state0.clone(), y_inplace = torch::empty_like(y);
  args.W_in = args.W_out = W_inplace.data_ptr<float>();
  args.y = y_inplace.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
  EXPECT_TRUE(torch::equal(W_inplace, W_out)) << "in place: W";
  EXPECT_TRUE(torch::equal(y_inplace, y)) << "in place: y";

  // On a pool of B + 2 rows through `rows` (permuted; pool rows 1 and 3 unnamed): out of
  // place, then in place, the same bits as above, the unnamed rows untouched.
  ASSERT_EQ(B, 3);
  const std::vector<int64_t> rows = {4, 0, 2};
  const torch::Tensor row_index = torch::tensor(rows, torch::kLong);
  const torch::Tensor unnamed = torch::tensor(std::vector<int64_t>{1, 3}, torch::kLong);
  torch::Tensor W_pool = torch::randn({B + 2, H, N, dphi});
  W_pool.index_copy_(0, row_index, state0);
  const torch::Tensor W_pool0 = W_pool.clone();
  torch::Tensor W_pool_out = torch::full_like(W_pool, std::numeric_limits<float>::quiet_NaN());
  torch::Tensor y_pool = torch::empty_like(y);
  args.rows = rows.data();
  args.W_in = W_pool.data_ptr<float>();
  args.W_out = W_pool_out.data_ptr<float>();
  args.y = y_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, out of place: y";
  EXPECT_TRUE(torch::equal(W_pool_out.index_select(0, row_index), W_out)) << "rows: W";
  EXPECT_TRUE(W_pool_out.index_select(0, unnamed).isnan().all().item<bool>())
      << "an unnamed pool row was written";
  EXPECT_TRUE(torch::equal(W_pool, W_pool0)) << "the state in was written";
  args.W_out = W_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, in place: y";
  EXPECT_TRUE(torch::equal(W_pool.index_select(0, row_index), W_out)) << "rows, in place: W";
  EXPECT_TRUE(torch::equal(W_pool.index_select(0, unnamed), W_pool0.index_select(0, unnamed)))
      << "an unnamed pool row was written in place";
}

INSTANTIATE_TEST_SUITE_P(FastWeight, GpuFastWeightTest,
                         testing::Combine(testing::ValuesIn(Shapes()), testing::Values(1, 2, 3),
                                          testing::Values(int64_t{1}, int64_t{3}, int64_t{70})),
                         [](const testing::TestParamInfo<std::tuple<Shape, int, int64_t>>& info) {
                           const Shape shape = std::get<0>(info.param);
                           return absl::StrCat("N", shape.d_model / shape.n_heads, "_nu",
                                               std::get<1>(info.param), "_T",
                                               std::get<2>(info.param));
                         });

// The decode step: five Steps in a row of the LibTorch mixer ([B, d] projections each)
// against five T = 1 runs of the mirror on its own state (in place), from random states
// (session 1 fresh): y of every step and the final state within the tolerance.
TEST(GpuFastWeightStepTest, HostGridEqualsLibTorchSteps) {
  c10::NoGradGuard no_grad;
  for (const Shape shape : Shapes()) {
    for (const int nu : {1, 2, 3}) {
      const FastWeightLayer layer =
          MakeFastWeightLayer(shape, nu, static_cast<uint64_t>(shape.d_model + nu));
      const fwmodel::ModelConfig& config = layer.config;
      SCOPED_TRACE(absl::StrCat("N = ", config.d_head(), ", nu = ", nu));
      const int64_t B = kFastWeightB, d = config.d_model;
      const torch::Tensor state0 = RandomFastWeightState(config, B);
      torch::Tensor ref_state[1] = {state0.clone()};
      torch::Tensor W = state0.clone();
      for (int step = 0; step < 5; ++step) {
        SCOPED_TRACE(absl::StrCat("step ", step));
        const Tokens tokens = RandomTokens(layer, B, 1);
        const torch::Tensor proj[3] = {tokens.q.squeeze(1), tokens.k.squeeze(1),
                                       tokens.v.squeeze(1)};
        const torch::Tensor y_ref = layer.mixer->Step(tokens.a.squeeze(1), proj, ref_state);
        torch::Tensor y = torch::empty({B, 1, d});
        fwmodel::kernels::FastWeightArgs args = MirrorArgs(config, tokens, W, W, y);
        ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
        fwtest::ExpectNearRelative(y.squeeze(1), y_ref, kFastWeightTolerance, "y");
      }
      fwtest::ExpectNearRelative(W, ref_state[0], kFastWeightTolerance, "W");
    }
  }
}

// The launcher's refusals, mirrored (FastWeightArgsValid): a head wider than the kernel
// takes or empty, ν < 1 or too many features for a block, a negative size, a grid past
// 2^31 − 1 blocks, any missing pointer the launch needs; T = 0 needs no token pointer (the
// state is copied); B = 0 or H = 0 none at all.
TEST(GpuFastWeightArgsTest, RefusesWhatTheLauncherRefuses) {
  using fwmodel::kernels::FastWeightArgs;
  const int64_t H = 2, N = 4, nu = 2, B = 2, T = 2, d = H * N, dphi = 2 * nu * N;
  std::vector<float> q(B * T * d, 0.5f), k(B * T * d, 0.1f), v(B * T * d, 1.0f),
      beta(B * T * H, 0.3f), y(B * T * d, 0.0f), W(B * H * N * dphi, 0.0f);
  FastWeightArgs args;
  args.B = B;
  args.T = T;
  args.H = H;
  args.N = N;
  args.nu = nu;
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.beta = beta.data();
  args.y = y.data();
  args.W_in = W.data();
  args.W_out = W.data();
  args.eps = 1e-6f;
  ASSERT_TRUE(fwmodel::kernels::FastWeightArgsValid(args));
  ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
  auto refused = [](const FastWeightArgs& changed) {
    return !fwmodel::kernels::FastWeightArgsValid(changed) &&
           !fwmodel::kernels::RunFastWeightOnHost(changed);
  };
  FastWeightArgs bad = args;
  bad.N = fwmodel::kernels::kFastWeightMaxN + 1;
  EXPECT_TRUE(refused(bad)) << "N too wide";
  bad.N = 0;
  EXPECT_TRUE(refused(bad)) << "N = 0";
  bad = args;
  bad.nu = 0;
  EXPECT_TRUE(refused(bad)) << "nu = 0";
  bad.N = 128;
  bad.nu = 5;
  EXPECT_TRUE(refused(bad)) << "2·nu·N > kFastWeightMaxPhi";
  bad.nu = 4;
  EXPECT_TRUE(fwmodel::kernels::FastWeightArgsValid(bad)) << "2·nu·N = kFastWeightMaxPhi";
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
  EXPECT_TRUE(fwmodel::kernels::FastWeightArgsValid(bad)) << "the most blocks";
  const float* FastWeightArgs::*inputs[] = {&FastWeightArgs::q, &FastWeightArgs::k,
                                            &FastWeightArgs::v, &FastWeightArgs::beta,
                                            &FastWeightArgs::W_in};
  for (const auto member : inputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing input";
  }
  float* FastWeightArgs::*outputs[] = {&FastWeightArgs::W_out, &FastWeightArgs::y};
  for (const auto member : outputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing output";
  }
  // T = 0: the state copied, no token pointer read.
  for (size_t i = 0; i < W.size(); ++i) W[i] = static_cast<float>(i);
  std::vector<float> W_copy(W.size(), -1.0f);
  bad = args;
  bad.T = 0;
  bad.q = bad.k = bad.v = bad.beta = nullptr;
  bad.y = nullptr;
  bad.W_out = W_copy.data();
  EXPECT_TRUE(fwmodel::kernels::RunFastWeightOnHost(bad));
  EXPECT_EQ(W_copy, W) << "T = 0 copies W";
  bad.W_out = nullptr;
  EXPECT_TRUE(refused(bad)) << "T = 0 without the state";
  FastWeightArgs empty;
  empty.N = N;
  empty.nu = nu;
  EXPECT_TRUE(fwmodel::kernels::RunFastWeightOnHost(empty)) << "B = 0: nothing to do";
}

#if defined(FWSERVE_CUDA_TESTS)
// On a GPU (built where LibTorch has CUDA; scripts/gpu/check.py runs *CudaEquivalence*):
// the mixer's Step and Forward on CUDA float32 tensors without autograd (the fused kernel
// where models/gpu built it) against the CPU mirror of its grid on the same inputs: y and
// the new state within 1e-5 relative (the same bodies; only the compilers' contraction
// and β's logits' product differ), with heads of 8, 24, 64 and 128, ν = 1, 2, 3, T = 1
// (Step and Forward) and 3, 70 (Forward), B = 3, from random states (session 1 fresh).
TEST(GpuFastWeightCudaEquivalenceTest, KernelEqualsItsMirror) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  for (const Shape shape : Shapes()) {
    for (const int nu : {1, 2, 3}) {
      const FastWeightLayer layer =
          MakeFastWeightLayer(shape, nu, static_cast<uint64_t>(shape.d_model + nu + 1), cuda);
      const fwmodel::ModelConfig& config = layer.config;
      const int64_t B = kFastWeightB, d = config.d_model;
      for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{70}}) {
        for (const bool step : {false, true}) {
          if (step && T != 1) continue;
          SCOPED_TRACE(absl::StrCat("N = ", config.d_head(), ", nu = ", nu, ", T = ", T,
                                    step ? ", Step" : ", Forward"));
          const torch::Tensor state0 = RandomFastWeightState(config, B);
          Tokens tokens = RandomTokens(layer, B, T);
          // β's logits as the mixer computes them on the GPU (the product's rounding there).
          tokens.beta = torch::linear(tokens.a.to(cuda), layer.beta_w.to(cuda)).cpu().contiguous();
          torch::Tensor W_out = torch::empty_like(state0), y = torch::empty({B, T, d});
          fwmodel::kernels::FastWeightArgs args = MirrorArgs(config, tokens, state0, W_out, y);
          ASSERT_TRUE(fwmodel::kernels::RunFastWeightOnHost(args));
          torch::Tensor state[1] = {state0.to(cuda)};
          torch::Tensor y_cuda;
          if (step) {
            const torch::Tensor proj[3] = {tokens.q.squeeze(1).to(cuda),
                                           tokens.k.squeeze(1).to(cuda),
                                           tokens.v.squeeze(1).to(cuda)};
            y_cuda = layer.mixer->Step(tokens.a.squeeze(1).to(cuda), proj, state).unsqueeze(1);
          } else {
            const torch::Tensor proj[3] = {tokens.q.to(cuda), tokens.k.to(cuda), tokens.v.to(cuda)};
            y_cuda = layer.mixer->Forward(tokens.a.to(cuda), proj, state);
          }
          fwtest::ExpectNearRelative(y_cuda.cpu(), y, 1e-5, "y");
          fwtest::ExpectNearRelative(state[0].cpu(), W_out, 1e-5, "W");
        }
      }
    }
  }
}
#endif

}  // namespace gpu_fast_weight_test
