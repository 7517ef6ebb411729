// The fused `aft` recurrence kernel's grid (models/gpu/aft.cu), run on the CPU by its
// mirror (models/gpu/aft_host.h: the same threads over aft_rule.h's body), equals the
// LibTorch mixer (aft.cc's Aft, which Model::Step and Model::Forward call) within 1e-4
// relative: y and the new state, for the decode step (several Steps in a row, T = 1 each)
// and the sequence form (Forward at T = 1, 3, 17 and 40: one chunk, and more than one of
// ModelOptions::aft_chunk = 16), at d = 16, 40 and 300 (more channels than a block's
// threads, not a multiple of them), from random states and a fresh one. In place
// (state_in == state_out) the same bits; on a state pool through `rows` (permuted, some
// pool rows unnamed), in place and not, the same bits with the unnamed rows untouched.
// The launcher's refusals (AftArgsValid) mirrored. The CUDA kernel itself runs in
// GpuAftCudaEquivalenceTest on a GPU machine (built where LibTorch has CUDA).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/mixer.h"
#include "models/gpu/aft_host.h"
#if defined(FWSERVE_CUDA_TESTS)
#include <torch/cuda.h>
#endif
#include "tests/unit/test_models.h"

namespace gpu_aft_test {

constexpr double kAftTolerance = 1e-4;
constexpr int64_t kAftB = 3;

// A bound aft mixer of width d (random time_decay and time_first, float32 on `device`)
// with its weights.
struct AftLayer {
  fwmodel::ModelConfig config;
  std::unique_ptr<fwmodel::Mixer> mixer;
  torch::Tensor time_decay, time_first;  // [d], CPU float32, contiguous
};

AftLayer MakeAftLayer(int64_t d, uint64_t seed, torch::Device device = torch::kCPU) {
  AftLayer layer;
  layer.config = fwtest::ConfigCase{fwmodel::Architecture::kAft,
                                    fwmodel::FfnKind::kSquaredRelu,
                                    0,
                                    1,
                                    false,
                                    static_cast<int>(d),
                                    2}
                     .Config();
  torch::manual_seed(seed);
  layer.time_decay = torch::randn({d}) * 0.7;
  layer.time_first = torch::randn({d}) * 0.7;
  layer.mixer = fwmodel::MakeMixer(layer.config, fwmodel::ModelOptions{});
  const torch::Tensor decay = layer.time_decay.to(device), first = layer.time_first.to(device);
  layer.mixer->Bind([&](const std::string& suffix) {
    if (suffix == "mixer.time_decay") return decay;
    if (suffix == "mixer.time_first") return first;
    ADD_FAILURE() << "unexpected weight " << suffix;
    return torch::Tensor();
  });
  return layer;
}

// B random states [B, 3, d]: alpha any, beta > 0, p around 0; session 1 fresh (the
// mixer's InitState: 0, 0, −1e30).
torch::Tensor RandomAftStates(const AftLayer& layer, int64_t B) {
  const int64_t d = layer.config.d_model;
  torch::Tensor state = torch::stack(
      {torch::randn({B, d}), torch::rand({B, d}) * 2 + 0.1, torch::randn({B, d}) * 2}, 1);
  torch::Tensor fresh = torch::zeros({1, 3, d});
  layer.mixer->InitState(&fresh);
  state.narrow(0, 1, 1).copy_(fresh);
  return state;
}

// Random projections r (raw), k, v, [B, T, d] each.
std::vector<torch::Tensor> RandomProjections(int64_t B, int64_t T, int64_t d) {
  return {torch::randn({B, T, d}) * 2, torch::randn({B, T, d}) * 2, torch::randn({B, T, d})};
}

// The mirror's arguments for contiguous CPU float32 tensors (decay = exp(time_decay)).
fwmodel::kernels::AftArgs MirrorArgs(const AftLayer& layer, const std::vector<torch::Tensor>& pr,
                                     const torch::Tensor& decay, const torch::Tensor& state_in,
                                     torch::Tensor& state_out, torch::Tensor& y) {
  fwmodel::kernels::AftArgs args;
  args.B = pr[0].size(0);
  args.T = pr[0].size(1);
  args.d = layer.config.d_model;
  args.r = pr[0].data_ptr<float>();
  args.k = pr[1].data_ptr<float>();
  args.v = pr[2].data_ptr<float>();
  args.decay = decay.data_ptr<float>();
  args.time_first = layer.time_first.data_ptr<float>();
  args.state_in = state_in.data_ptr<float>();
  args.state_out = state_out.data_ptr<float>();
  args.y = y.data_ptr<float>();
  return args;
}

// States [B, 3, d] a and b within `tolerance` (ExpectNearRelative): p, and the sums as
// the weights they stand for (alpha·e^p and beta·e^p, both relative to the larger of the
// two p), since the sums are relative to their log scale.
void ExpectAftStatesNear(const torch::Tensor& a, const torch::Tensor& b, double tolerance) {
  const torch::Tensor p_a = a.select(1, 2), p_b = b.select(1, 2);
  fwtest::ExpectNearRelative(p_a, p_b, tolerance, "p");
  const torch::Tensor top = torch::maximum(p_a, p_b);
  const torch::Tensor shift_a = torch::exp(p_a - top), shift_b = torch::exp(p_b - top);
  fwtest::ExpectNearRelative(a.select(1, 0) * shift_a, b.select(1, 0) * shift_b, tolerance,
                             "alpha");
  fwtest::ExpectNearRelative(a.select(1, 1) * shift_a, b.select(1, 1) * shift_b, tolerance, "beta");
}

// (d, T)
class GpuAftTest : public testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(GpuAftTest, HostGridEqualsLibTorchForward) {
  c10::NoGradGuard no_grad;
  const auto [d, T] = GetParam();
  const int64_t B = kAftB;
  const AftLayer layer = MakeAftLayer(d, static_cast<uint64_t>(d * 100 + T));
  const torch::Tensor S0 = RandomAftStates(layer, B);
  const std::vector<torch::Tensor> pr = RandomProjections(B, T, d);
  const torch::Tensor decay = torch::exp(layer.time_decay).contiguous();

  // The reference: the LibTorch sequence form.
  torch::Tensor ref_state = S0.clone();
  const torch::Tensor proj[3] = {pr[0], pr[1], pr[2]};
  const torch::Tensor y_ref = layer.mixer->Forward(torch::zeros({B, T, d}), proj, &ref_state);

  torch::Tensor S_in = S0.clone(), S_out = torch::empty_like(S0), y = torch::empty({B, T, d});
  fwmodel::kernels::AftArgs args = MirrorArgs(layer, pr, decay, S_in, S_out, y);
  ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
  fwtest::ExpectNearRelative(y, y_ref, kAftTolerance, "y");
  ExpectAftStatesNear(S_out, ref_state, kAftTolerance);
  EXPECT_TRUE(torch::equal(S_in, S0)) << "state_in was written";

  // In place: the same bits.
  torch::Tensor S_inplace = S0.clone(), y_inplace = torch::empty_like(y);
  args.state_in = S_inplace.data_ptr<float>();
  args.state_out = S_inplace.data_ptr<float>();
  args.y = y_inplace.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
  EXPECT_TRUE(torch::equal(S_inplace, S_out)) << "in place: the state";
  EXPECT_TRUE(torch::equal(y_inplace, y)) << "in place: y";

  // On a pool of B + 2 rows through `rows` (permuted; pool rows 1 and 3 unnamed): out of
  // place, then in place, the same bits as above, the unnamed rows untouched.
  ASSERT_EQ(B, 3);
  const std::vector<int64_t> rows = {4, 0, 2};
  const torch::Tensor row_index = torch::tensor(rows, torch::kLong);
  const torch::Tensor unnamed = torch::tensor(std::vector<int64_t>{1, 3}, torch::kLong);
  torch::Tensor pool = torch::randn({B + 2, 3, d});
  pool.index_copy_(0, row_index, S0);
  const torch::Tensor pool0 = pool.clone();
  torch::Tensor pool_out = torch::full_like(pool, std::numeric_limits<float>::quiet_NaN());
  torch::Tensor y_pool = torch::empty_like(y);
  args.rows = rows.data();
  args.state_in = pool.data_ptr<float>();
  args.state_out = pool_out.data_ptr<float>();
  args.y = y_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, out of place: y";
  EXPECT_TRUE(torch::equal(pool_out.index_select(0, row_index), S_out)) << "rows: the state";
  EXPECT_TRUE(pool_out.index_select(0, unnamed).isnan().all().item<bool>())
      << "an unnamed pool row was written";
  EXPECT_TRUE(torch::equal(pool, pool0)) << "state_in was written";
  args.state_out = pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
  EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, in place: y";
  EXPECT_TRUE(torch::equal(pool.index_select(0, row_index), S_out)) << "rows, in place";
  EXPECT_TRUE(torch::equal(pool.index_select(0, unnamed), pool0.index_select(0, unnamed)))
      << "an unnamed pool row was written in place";
}

INSTANTIATE_TEST_SUITE_P(Aft, GpuAftTest,
                         testing::Combine(testing::Values(int64_t{16}, int64_t{40}, int64_t{300}),
                                          testing::Values(int64_t{1}, int64_t{3}, int64_t{17},
                                                          int64_t{40})),
                         [](const testing::TestParamInfo<std::tuple<int64_t, int64_t>>& info) {
                           return absl::StrCat("d", std::get<0>(info.param), "_T",
                                               std::get<1>(info.param));
                         });

// The decode step: five Steps in a row of the LibTorch mixer ([B, d] projections each)
// against five T = 1 runs of the mirror on its own state, from random states (session 1
// fresh): y of every step and the final state within the tolerance.
TEST(GpuAftStepTest, HostGridEqualsLibTorchSteps) {
  c10::NoGradGuard no_grad;
  for (const int64_t d : {int64_t{16}, int64_t{40}, int64_t{300}}) {
    SCOPED_TRACE(absl::StrCat("d = ", d));
    const int64_t B = kAftB;
    const AftLayer layer = MakeAftLayer(d, static_cast<uint64_t>(d));
    const torch::Tensor decay = torch::exp(layer.time_decay).contiguous();
    torch::Tensor ref_state = RandomAftStates(layer, B);
    torch::Tensor state = ref_state.clone();
    for (int step = 0; step < 5; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      const std::vector<torch::Tensor> pr = RandomProjections(B, 1, d);
      const torch::Tensor proj[3] = {pr[0].squeeze(1), pr[1].squeeze(1), pr[2].squeeze(1)};
      const torch::Tensor y_ref = layer.mixer->Step(torch::zeros({B, d}), proj, &ref_state);
      torch::Tensor y = torch::empty({B, 1, d});
      fwmodel::kernels::AftArgs args = MirrorArgs(layer, pr, decay, state, state, y);
      ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
      fwtest::ExpectNearRelative(y.squeeze(1), y_ref, kAftTolerance, "y");
    }
    // The same recurrence token by token: the state's scale p too.
    fwtest::ExpectNearRelative(state, ref_state, kAftTolerance, "state");
  }
}

// The launcher's refusals, mirrored (AftArgsValid): no channels, a negative size, a grid
// past 2^31 − 1 blocks, any missing pointer the launch needs; T = 0 needs no token
// pointer (the state is copied), B = 0 none at all.
TEST(GpuAftArgsTest, RefusesWhatTheLauncherRefuses) {
  const int64_t d = 8, B = 2, T = 2;
  std::vector<float> r(B * T * d, 0.5f), k(B * T * d, 0.1f), v(B * T * d, 1.0f), y(B * T * d, 0.0f),
      decay(d, 1.0f), first(d, 0.0f), state(B * 3 * d, 0.0f);
  fwmodel::kernels::AftArgs args;
  args.B = B;
  args.T = T;
  args.d = d;
  args.r = r.data();
  args.k = k.data();
  args.v = v.data();
  args.y = y.data();
  args.decay = decay.data();
  args.time_first = first.data();
  args.state_in = state.data();
  args.state_out = state.data();
  ASSERT_TRUE(fwmodel::kernels::AftArgsValid(args));
  ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
  auto refused = [](const fwmodel::kernels::AftArgs& changed) {
    return !fwmodel::kernels::AftArgsValid(changed) && !fwmodel::kernels::RunAftOnHost(changed);
  };
  fwmodel::kernels::AftArgs bad = args;
  bad.d = 0;
  EXPECT_TRUE(refused(bad)) << "d = 0";
  bad = args;
  bad.B = -1;
  EXPECT_TRUE(refused(bad)) << "B < 0";
  bad = args;
  bad.T = -1;
  EXPECT_TRUE(refused(bad)) << "T < 0";
  bad = args;
  bad.B = (int64_t{INT32_MAX} / d + 1) * fwmodel::kernels::kAftThreads;
  EXPECT_TRUE(refused(bad)) << "too many blocks";
  bad.B = int64_t{INT32_MAX} / d * fwmodel::kernels::kAftThreads;
  EXPECT_TRUE(fwmodel::kernels::AftArgsValid(bad)) << "the most blocks";
  const float* fwmodel::kernels::AftArgs::*inputs[] = {
      &fwmodel::kernels::AftArgs::r,          &fwmodel::kernels::AftArgs::k,
      &fwmodel::kernels::AftArgs::v,          &fwmodel::kernels::AftArgs::decay,
      &fwmodel::kernels::AftArgs::time_first, &fwmodel::kernels::AftArgs::state_in};
  for (const auto member : inputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing input";
  }
  float* fwmodel::kernels::AftArgs::*outputs[] = {&fwmodel::kernels::AftArgs::state_out,
                                                  &fwmodel::kernels::AftArgs::y};
  for (const auto member : outputs) {
    bad = args;
    bad.*member = nullptr;
    EXPECT_TRUE(refused(bad)) << "a missing output";
  }
  // T = 0: the state copied, no token pointer read.
  std::vector<float> copied(B * 3 * d, -1.0f);
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<float>(i);
  bad = args;
  bad.T = 0;
  bad.r = bad.k = bad.v = nullptr;
  bad.y = nullptr;
  bad.state_out = copied.data();
  EXPECT_TRUE(fwmodel::kernels::RunAftOnHost(bad));
  EXPECT_EQ(copied, state) << "T = 0 copies the state";
  bad.state_out = nullptr;
  EXPECT_TRUE(refused(bad)) << "T = 0 without the state";
  fwmodel::kernels::AftArgs empty;
  empty.d = d;
  EXPECT_TRUE(fwmodel::kernels::RunAftOnHost(empty)) << "B = 0: nothing to do";
}

#if defined(FWSERVE_CUDA_TESTS)
// On a GPU (built where LibTorch has CUDA; scripts/gpu/check.py runs *CudaEquivalence*):
// the mixer's Step and Forward on CUDA float32 tensors without autograd (the fused kernel
// where models/gpu built it) against the CPU mirror of its grid on the same inputs: y and
// the new state within 1e-5 relative (the same body; only the compilers' contraction into
// fused multiply-adds differs), at d = 40 and 300, T = 1 (Step and Forward) and 3, 17, 40
// (Forward), B = 3, from random states (session 1 fresh).
TEST(GpuAftCudaEquivalenceTest, KernelEqualsItsMirror) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  for (const int64_t d : {int64_t{40}, int64_t{300}}) {
    const AftLayer layer = MakeAftLayer(d, static_cast<uint64_t>(d + 1), cuda);
    const torch::Tensor decay = torch::exp(layer.time_decay).contiguous();
    for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{40}}) {
      for (const bool step : {false, true}) {
        if (step && T != 1) continue;
        SCOPED_TRACE(absl::StrCat("d = ", d, ", T = ", T, step ? ", Step" : ", Forward"));
        const int64_t B = kAftB;
        const torch::Tensor S0 = RandomAftStates(layer, B);
        const std::vector<torch::Tensor> pr = RandomProjections(B, T, d);
        torch::Tensor S_out = torch::empty_like(S0), y = torch::empty({B, T, d});
        fwmodel::kernels::AftArgs args = MirrorArgs(layer, pr, decay, S0, S_out, y);
        ASSERT_TRUE(fwmodel::kernels::RunAftOnHost(args));
        torch::Tensor state = S0.to(cuda), y_cuda;
        if (step) {
          const torch::Tensor proj[3] = {pr[0].squeeze(1).to(cuda), pr[1].squeeze(1).to(cuda),
                                         pr[2].squeeze(1).to(cuda)};
          y_cuda = layer.mixer->Step(torch::zeros({B, d}, cuda), proj, &state).unsqueeze(1);
        } else {
          const torch::Tensor proj[3] = {pr[0].to(cuda), pr[1].to(cuda), pr[2].to(cuda)};
          y_cuda = layer.mixer->Forward(torch::zeros({B, T, d}, cuda), proj, &state);
        }
        fwtest::ExpectNearRelative(y_cuda.cpu(), y, 1e-5, "y");
        ExpectAftStatesNear(state.cpu(), S_out, 1e-5);
      }
    }
  }
}
#endif

}  // namespace gpu_aft_test
