// The fused RWKV-7 time-mix kernel's grid (models/gpu/rwkv7_wkv.cu), run on the CPU by its
// mirror (models/gpu/rwkv7_wkv_host.h: the same blocks, threads, phases and halving
// reductions over rwkv7_rule.h's bodies), equals the LibTorch block (rwkv7.cc's
// Forward, token by token) within 1e-4 relative: the gated output y and the new state,
// at T = 1 (decode) and T = 7 (prefill), in block 0 and block 1 (the value residual),
// with heads of 8, 16 and 64, from random states; in place (state_in == state_out) the
// same bits. The reference's y is read through the block itself: with O the identity
// and the FFN's value matrix zero, Forward returns h + y. The CUDA kernel itself runs
// in CudaEquivalenceTest (model_cuda_test.cc) on a GPU machine; the CPU kernel's use of
// the same bodies in NativeRwkvTest.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/architectures/rwkv_block.h"
#include "models/gpu/rwkv7_wkv_host.h"
#include "tests/unit/test_models.h"

namespace {

constexpr double kTolerance = 1e-4;

struct Shape {
  int d_model;
  int n_heads;
};

// (shape, T)
class GpuBodiesTest : public testing::TestWithParam<std::tuple<Shape, int64_t>> {};

// Block `layer` of `model` bound to its weights, with O = I and the FFN's value = 0.
std::unique_ptr<fwmodel::RwkvBlock> IdentityOutputBlock(const fwmodel::ModelConfig& config,
                                                        std::map<std::string, torch::Tensor>& w,
                                                        int layer) {
  const std::string prefix = absl::StrCat("blocks.", layer, ".");
  const int64_t d = config.d_model;
  w[prefix + "att.output.weight"] = torch::eye(d);
  w[prefix + "ffn.value.weight"] = torch::zeros_like(w.at(prefix + "ffn.value.weight"));
  auto block = fwmodel::MakeRwkvBlock(config, layer);
  block->Bind([&](const std::string& suffix) { return w.at(prefix + suffix); });
  return block;
}

TEST_P(GpuBodiesTest, HostGridEqualsLibTorchBlock) {
  c10::NoGradGuard no_grad;
  const auto [shape, T] = GetParam();
  const fwtest::ConfigCase config_case{fwmodel::Architecture::kRwkv7,
                                       fwmodel::FfnKind::kSquaredRelu,
                                       0,
                                       1,
                                       false,
                                       shape.d_model,
                                       shape.n_heads};
  const fwmodel::ModelConfig config = config_case.Config();
  const fwmodel::Model model = fwtest::RandomModel(config, /*seed=*/7);
  std::map<std::string, torch::Tensor> weights = model.ExportWeights();
  const int64_t B = 3, d = config.d_model, H = config.n_heads, N = config.d_head();
  torch::manual_seed(static_cast<uint64_t>(d * 100 + H * 10 + T));
  for (int layer = 0; layer < 2; ++layer) {
    SCOPED_TRACE(absl::StrCat("block ", layer, ", N = ", N, ", T = ", T));
    auto block = IdentityOutputBlock(config, weights, layer);
    const std::string p = absl::StrCat("blocks.", layer, ".");
    auto weight = [&](const std::string& name) { return weights.at(p + name); };
    // Small h (LayerNorm makes its scale irrelevant to the projections), so that
    // out − h is y to well within the tolerance.
    const torch::Tensor h = torch::randn({B, T, d}) * 0.1;
    const torch::Tensor shift = torch::randn({B, d}), S0 = torch::randn({B, H, N, N}) * 0.3;
    torch::Tensor v_first_in = layer == 0 ? torch::Tensor() : torch::randn({B, T, d});

    // The reference: the LibTorch block.
    torch::Tensor ref_state[3] = {shift.clone(), S0.clone(), torch::zeros({B, d})};
    torch::Tensor ref_v_first = v_first_in;
    const torch::Tensor y_ref = block->Forward(h, ref_state, &ref_v_first) - h;

    // The block's inputs to the kernel, as rwkv7.cc computes them.
    torch::Tensor x =
        torch::layer_norm(h, {d}, weight("ln1.weight"), weight("ln1.bias"), config.norm_eps);
    torch::Tensor shift_copy = shift.clone();
    const torch::Tensor delta = fwmodel::TokenShift(x, &shift_copy) - x;
    auto mixed = [&](const char* name) { return torch::addcmul(x, delta, weight(name)); };
    const torch::Tensor r = torch::linear(mixed("att.x_r"), weight("att.receptance.weight"));
    const torch::Tensor w_raw =
        torch::linear(torch::tanh(torch::linear(mixed("att.x_w"), weight("att.w1"))),
                      weight("att.w2"), weight("att.w0"));
    const torch::Tensor k = torch::linear(mixed("att.x_k"), weight("att.key.weight"));
    const torch::Tensor v = torch::linear(mixed("att.x_v"), weight("att.value.weight"));
    const torch::Tensor a_raw = torch::linear(torch::linear(mixed("att.x_a"), weight("att.a1")),
                                              weight("att.a2"), weight("att.a0"));
    const torch::Tensor g = torch::linear(
        torch::sigmoid(torch::linear(mixed("att.x_g"), weight("att.g1"))), weight("att.g2"));
    torch::Tensor v_raw;
    if (layer > 0) {
      v_raw = torch::linear(torch::linear(mixed("att.x_v"), weight("att.v1")), weight("att.v2"),
                            weight("att.v0"));
    }
    const torch::Tensor k_k = weight("att.k_k").contiguous(), k_a = weight("att.k_a").contiguous(),
                        r_k = weight("att.r_k").contiguous(),
                        ln_w = weight("att.ln_x.weight").contiguous(),
                        ln_b = weight("att.ln_x.bias").contiguous();
    torch::Tensor S_in = S0.clone(), S_out = torch::empty_like(S0), y = torch::empty({B, T, d});
    fwmodel::kernels::Rwkv7WkvArgs args;
    args.B = B;
    args.T = T;
    args.H = H;
    args.N = N;
    args.r = r.data_ptr<float>();
    args.w_raw = w_raw.data_ptr<float>();
    args.a_raw = a_raw.data_ptr<float>();
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
    args.g = g.data_ptr<float>();
    if (layer > 0) {
      args.v_raw = v_raw.data_ptr<float>();
      args.v_first = v_first_in.data_ptr<float>();
    }
    args.k_k = k_k.data_ptr<float>();
    args.k_a = k_a.data_ptr<float>();
    args.r_k = r_k.data_ptr<float>();
    args.ln_w = ln_w.data_ptr<float>();
    args.ln_b = ln_b.data_ptr<float>();
    args.state_in = S_in.data_ptr<float>();
    args.state_out = S_out.data_ptr<float>();
    args.y = y.data_ptr<float>();
    args.eps = static_cast<float>(static_cast<double>(N) * config.norm_eps);
    args.first_layer = layer == 0;
    ASSERT_TRUE(fwmodel::kernels::RunRwkv7WkvOnHost(args));

    fwtest::ExpectNearRelative(y, y_ref, kTolerance, "y");
    fwtest::ExpectNearRelative(S_out, ref_state[1], kTolerance, "state");
    EXPECT_TRUE(torch::equal(S_in, S0)) << "state_in was written";
    if (layer == 0) {
      EXPECT_TRUE(torch::equal(ref_v_first, v)) << "block 0's v_first is its v";
    }

    // In place: the same bits.
    torch::Tensor S_inplace = S0.clone(), y_inplace = torch::empty_like(y);
    args.state_in = S_inplace.data_ptr<float>();
    args.state_out = S_inplace.data_ptr<float>();
    args.y = y_inplace.data_ptr<float>();
    ASSERT_TRUE(fwmodel::kernels::RunRwkv7WkvOnHost(args));
    EXPECT_TRUE(torch::equal(S_inplace, S_out));
    EXPECT_TRUE(torch::equal(y_inplace, y));
  }
}

INSTANTIATE_TEST_SUITE_P(Rwkv7, GpuBodiesTest,
                         testing::Combine(testing::Values(Shape{32, 4}, Shape{32, 2}, Shape{64, 1}),
                                          testing::Values(int64_t{1}, int64_t{7})),
                         [](const testing::TestParamInfo<std::tuple<Shape, int64_t>>& info) {
                           const Shape shape = std::get<0>(info.param);
                           return absl::StrCat("N", shape.d_model / shape.n_heads, "_T",
                                               std::get<1>(info.param));
                         });

// The launcher's refusals, mirrored: a head wider than the kernel takes, a block > 0
// without its value residual's inputs.
TEST(GpuBodiesArgsTest, RefusesWhatTheLauncherRefuses) {
  fwmodel::kernels::Rwkv7WkvArgs args;
  args.B = 1;
  args.T = 1;
  args.H = 1;
  args.N = fwmodel::kernels::kRwkv7WkvMaxN + 1;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7WkvOnHost(args));
  args.N = 0;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7WkvOnHost(args));
  args.N = 8;
  args.first_layer = false;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7WkvOnHost(args));
}

}  // namespace
