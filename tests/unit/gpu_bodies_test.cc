// The fused RWKV-7 time-mix kernel's grid (models/gpu/rwkv7_wkv.cu), run on the CPU by its
// mirror (models/gpu/rwkv7_wkv_host.h: the same blocks, threads, phases, staging tile and
// reductions over rwkv7_rule.h's bodies), equals the LibTorch block (rwkv7.cc's
// Forward, token by token) within 1e-4 relative: the gated output y and the new state,
// at T = 1 (decode), T = 3 and T = 40 (prefill), in block 0 and block 1 (the value
// residual),
// with heads of 8, 16, 64 and 128 (the compiled widths) and 24 (a width off them, with
// threads past N), from random states; in place (state_in == state_out) the same bits;
// on a state pool through `rows` (permuted, some pool rows unnamed), in place and not,
// the same bits with the unnamed rows untouched. The reference's y is read through the
// block itself: with O the identity and the FFN's value matrix zero, Forward returns
// h + y. With T > 1 the split path's mirror too (a NaN-filled scratch: its three phases;
// T = 40 takes three staging chunks, the last partial), checked the same way. The CUDA
// kernel itself runs in CudaEquivalenceTest (model_cuda_test.cc) on a GPU
// machine; the CPU kernel's use of the same bodies in NativeRwkvTest.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/delta_net.h"
#include "models/architectures/model.h"
#include "models/architectures/rwkv_block.h"
#include "models/gpu/delta_rule_cuda_host.h"
#include "models/gpu/rwkv7_mix_host.h"
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
    // The single kernel's mirror, then (T > 1) the split path's (a scratch: its three
    // phases), each checked the same way.
    for (const bool split : {false, true}) {
      if (split && T == 1) continue;
      SCOPED_TRACE(split ? "split path" : "single kernel");
      // NaN-filled: a phase reading what no phase wrote shows in y or the state.
      std::vector<float> scratch(
          split ? static_cast<size_t>(fwmodel::kernels::Rwkv7WkvScratchFloats(B, T, H, N)) : 0,
          std::numeric_limits<float>::quiet_NaN());
      auto run = [&](const fwmodel::kernels::Rwkv7WkvArgs& run_args) {
        std::fill(scratch.begin(), scratch.end(), std::numeric_limits<float>::quiet_NaN());
        return fwmodel::kernels::RunRwkv7WkvOnHost(run_args);
      };
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
      args.scratch = split ? scratch.data() : nullptr;
      ASSERT_TRUE(run(args));

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
      ASSERT_TRUE(run(args));
      EXPECT_TRUE(torch::equal(S_inplace, S_out));
      EXPECT_TRUE(torch::equal(y_inplace, y));

      // On a pool of B + 2 rows through `rows` (permuted; pool rows 1 and 3 unnamed): out
      // of place, then in place, the same bits as above, the unnamed rows untouched.
      ASSERT_EQ(B, 3);
      const std::vector<int64_t> rows = {4, 0, 2};
      const torch::Tensor row_index = torch::tensor(rows, torch::kLong);
      const torch::Tensor unnamed = torch::tensor(std::vector<int64_t>{1, 3}, torch::kLong);
      torch::Tensor pool = torch::randn({B + 2, H, N, N});
      pool.index_copy_(0, row_index, S0);
      const torch::Tensor pool0 = pool.clone();
      torch::Tensor pool_out = torch::full_like(pool, std::numeric_limits<float>::quiet_NaN());
      torch::Tensor y_pool = torch::empty_like(y);
      args.rows = rows.data();
      args.state_in = pool.data_ptr<float>();
      args.state_out = pool_out.data_ptr<float>();
      args.y = y_pool.data_ptr<float>();
      ASSERT_TRUE(run(args));
      EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, out of place: y";
      EXPECT_TRUE(torch::equal(pool_out.index_select(0, row_index), S_out)) << "rows: the state";
      fwtest::ExpectNearRelative(pool_out.index_select(0, row_index), ref_state[1], kTolerance,
                                 "state through rows");
      EXPECT_TRUE(pool_out.index_select(0, unnamed).isnan().all().item<bool>())
          << "an unnamed pool row was written";
      EXPECT_TRUE(torch::equal(pool, pool0)) << "state_in was written";
      args.state_out = pool.data_ptr<float>();
      ASSERT_TRUE(run(args));
      EXPECT_TRUE(torch::equal(y_pool, y)) << "rows, in place: y";
      EXPECT_TRUE(torch::equal(pool.index_select(0, row_index), S_out)) << "rows, in place";
      EXPECT_TRUE(torch::equal(pool.index_select(0, unnamed), pool0.index_select(0, unnamed)))
          << "an unnamed pool row was written in place";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rwkv7, GpuBodiesTest,
                         testing::Combine(testing::Values(Shape{32, 4}, Shape{32, 2}, Shape{48, 2},
                                                          Shape{64, 1}, Shape{128, 1}),
                                          testing::Values(int64_t{1}, int64_t{3}, int64_t{40})),
                         [](const testing::TestParamInfo<std::tuple<Shape, int64_t>>& info) {
                           const Shape shape = std::get<0>(info.param);
                           return absl::StrCat("N", shape.d_model / shape.n_heads, "_T",
                                               std::get<1>(info.param));
                         });

// The launcher's refusals, mirrored (Rwkv7WkvArgsValid): a head wider than the kernel
// takes or empty, a negative size, a grid past 2^31 − 1 blocks, any missing pointer, a
// block > 0 without its value residual's inputs; nothing to do (B, T or H = 0) needs no
// pointer.
TEST(GpuBodiesArgsTest, RefusesWhatTheLauncherRefuses) {
  constexpr int64_t N = 8;
  std::vector<float> vectors(N, 0.5f), state_in(N * N, 0.25f), state_out(N * N, 0.0f), y(N, 0.0f);
  fwmodel::kernels::Rwkv7WkvArgs args;
  args.B = 1;
  args.T = 1;
  args.H = 1;
  args.N = N;
  for (const float** pointer :
       {&args.r, &args.w_raw, &args.a_raw, &args.k, &args.v, &args.v_raw, &args.v_first, &args.g,
        &args.k_k, &args.k_a, &args.r_k, &args.ln_w, &args.ln_b}) {
    *pointer = vectors.data();
  }
  args.state_in = state_in.data();
  args.state_out = state_out.data();
  args.y = y.data();
  args.eps = 1e-5f;
  ASSERT_TRUE(fwmodel::kernels::RunRwkv7WkvOnHost(args));
  EXPECT_NE(state_out, std::vector<float>(N * N, 0.0f));

  auto refused = [](fwmodel::kernels::Rwkv7WkvArgs changed) {
    return !fwmodel::kernels::Rwkv7WkvArgsValid(changed) &&
           !fwmodel::kernels::RunRwkv7WkvOnHost(changed);
  };
  fwmodel::kernels::Rwkv7WkvArgs bad = args;
  bad.N = fwmodel::kernels::kRwkv7WkvMaxN + 1;
  EXPECT_TRUE(refused(bad));
  bad.N = 0;
  EXPECT_TRUE(refused(bad));
  for (int64_t* size : {&bad.B, &bad.T, &bad.H}) {
    bad = args;
    *size = -1;
    EXPECT_TRUE(refused(bad));
  }
  bad = args;
  bad.B = int64_t{1} << 20;
  bad.H = int64_t{1} << 11;  // 2^31 blocks
  EXPECT_TRUE(refused(bad));
  bad.H = (int64_t{1} << 11) - 1;
  EXPECT_TRUE(fwmodel::kernels::Rwkv7WkvArgsValid(bad));
  for (const float** pointer : {&bad.r, &bad.w_raw, &bad.a_raw, &bad.k, &bad.v, &bad.g, &bad.k_k,
                                &bad.k_a, &bad.r_k, &bad.ln_w, &bad.ln_b, &bad.state_in}) {
    bad = args;
    *pointer = nullptr;
    EXPECT_TRUE(refused(bad));
  }
  bad = args;
  bad.state_out = nullptr;
  EXPECT_TRUE(refused(bad));
  bad = args;
  bad.y = nullptr;
  EXPECT_TRUE(refused(bad));
  // The value residual's inputs: needed after block 0 only.
  for (const float** pointer : {&bad.v_raw, &bad.v_first}) {
    bad = args;
    *pointer = nullptr;
    EXPECT_TRUE(refused(bad));
    bad.first_layer = true;
    EXPECT_TRUE(fwmodel::kernels::RunRwkv7WkvOnHost(bad));
  }
  // Nothing to do: no pointer needed, nothing written.
  fwmodel::kernels::Rwkv7WkvArgs empty;
  empty.N = N;
  empty.B = 4;
  empty.H = 2;
  EXPECT_TRUE(fwmodel::kernels::RunRwkv7WkvOnHost(empty));
}

// The split path's scratch (Rwkv7WkvArgs::scratch): its size, and the launcher's
// refusals, mirrored: with a scratch and T > 1 the per-token phases' grid (B·T·H blocks)
// must fit in 2^31 − 1, T·H included; without one, or at T = 1 (the single kernel), the
// same sizes pass.
TEST(GpuBodiesArgsTest, ScratchRefusesWhatTheLauncherRefuses) {
  namespace k = fwmodel::kernels;
  EXPECT_EQ(k::Rwkv7WkvScratchFloats(2, 5, 3, 8), 2 * 3 * 5 * (6 * 8 + 1));
  EXPECT_EQ(k::Rwkv7WkvScratchFloats(0, 5, 3, 8), 0);
  EXPECT_EQ(k::Rwkv7WkvScratchFloats(2, 0, 3, 8), 0);
  constexpr int64_t N = 8, T = 2;
  std::vector<float> vectors(T * N, 0.5f), state_in(N * N, 0.25f), state_out(N * N, 0.0f),
      y(T * N, 0.0f), scratch(static_cast<size_t>(k::Rwkv7WkvScratchFloats(1, T, 1, N)));
  k::Rwkv7WkvArgs args;
  args.B = 1;
  args.T = T;
  args.H = 1;
  args.N = N;
  for (const float** pointer :
       {&args.r, &args.w_raw, &args.a_raw, &args.k, &args.v, &args.v_raw, &args.v_first, &args.g,
        &args.k_k, &args.k_a, &args.r_k, &args.ln_w, &args.ln_b}) {
    *pointer = vectors.data();
  }
  args.state_in = state_in.data();
  args.state_out = state_out.data();
  args.y = y.data();
  args.eps = 1e-5f;
  args.scratch = scratch.data();
  ASSERT_TRUE(k::Rwkv7WkvSplit(args));
  ASSERT_TRUE(k::RunRwkv7WkvOnHost(args));
  EXPECT_NE(state_out, std::vector<float>(N * N, 0.0f));
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float e) { return std::isfinite(e); }));

  auto refused = [](k::Rwkv7WkvArgs changed) {
    return !k::Rwkv7WkvArgsValid(changed) && !k::RunRwkv7WkvOnHost(changed);
  };
  k::Rwkv7WkvArgs bad = args;
  bad.B = int64_t{1} << 10;
  bad.T = int64_t{1} << 11;
  bad.H = int64_t{1} << 10;  // 2^31 blocks per token phase; 2^20 (session, head) blocks
  EXPECT_TRUE(refused(bad));
  bad.scratch = nullptr;
  EXPECT_TRUE(k::Rwkv7WkvArgsValid(bad)) << "the single kernel's grid is B·H";
  bad.scratch = scratch.data();
  bad.H = (int64_t{1} << 10) - 1;
  EXPECT_TRUE(k::Rwkv7WkvArgsValid(bad));
  // T·H alone past 2^31 − 1 (B·T·H would overflow int64 unchecked).
  bad = args;
  bad.T = int64_t{1} << 40;
  bad.H = int64_t{1} << 10;
  EXPECT_TRUE(refused(bad));
  bad.scratch = nullptr;
  EXPECT_TRUE(k::Rwkv7WkvArgsValid(bad));
  // T = 1: the scratch is not used, the single kernel's limits apply.
  bad = args;
  bad.T = 1;
  bad.B = int64_t{1} << 20;
  bad.H = (int64_t{1} << 11) - 1;
  EXPECT_FALSE(k::Rwkv7WkvSplit(bad));
  EXPECT_TRUE(k::Rwkv7WkvArgsValid(bad));
  // The split path needs the same pointers as the single kernel.
  for (const float** pointer : {&bad.r, &bad.w_raw, &bad.k, &bad.g, &bad.state_in}) {
    bad = args;
    *pointer = nullptr;
    EXPECT_TRUE(refused(bad));
  }
  bad = args;
  bad.y = nullptr;
  EXPECT_TRUE(refused(bad));
}

// The kernel's reductions (rwkv7_wkv.cu's TreeSum, mirrored by HostBlockTreeSums: a warp
// butterfly after the tree's steps above 32 lanes) give every thread the halving tree's
// sum (HostTreeSum) bit for bit, for every width up to 256 (powers of two and not), on
// values whose sum depends on the order of the additions.
TEST(GpuBodiesTreeSumTest, EveryThreadGetsTheTreeSum) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int order_sensitive = 0;
  for (int n = 1; n <= 256; ++n) {
    SCOPED_TRACE(absl::StrCat("n = ", n));
    const int p = fwmodel::kernels::TreeWidth(n);
    std::vector<float> values(static_cast<size_t>(p));
    for (float& x : values) x = normal(rng) * std::exp2(static_cast<float>(rng() % 24));
    std::vector<float> tree = values;
    const float expected = fwmodel::kernels::HostTreeSum(tree, n);
    const std::vector<float> sums = fwmodel::kernels::HostBlockTreeSums(values, n);
    ASSERT_EQ(sums.size(), static_cast<size_t>(p));
    for (int i = 0; i < p; ++i) {
      ASSERT_EQ(sums[static_cast<size_t>(i)], expected) << "thread " << i;
    }
    float sequential = 0.0f;
    for (int i = 0; i < n; ++i) sequential += values[static_cast<size_t>(i)];
    order_sensitive += sequential != expected;
  }
  EXPECT_GT(order_sensitive, 100) << "the values do not tell the orders apart";
}

// The fused DeltaNet / Gated DeltaNet delta-rule kernel's grid (models/gpu/delta_rule_cuda.cu),
// run on the CPU by its mirror (models/gpu/delta_rule_cuda_host.h: the same blocks,
// threads, phases and halving reduction over delta_rule_column.h's bodies), equals the
// LibTorch block (delta_net.cc's Forward, token by token) within 1e-4 relative: the
// normed, gated output o and the new state, at T = 1 and T = 5, with heads of 8, 16, 24
// (threads past V) and 64 (K = V), DeltaNet and Gated DeltaNet, and Gated DeltaNet with
// two value heads per q/k head; in place, the same bits; on a state pool through `rows`
// (permuted, some pool rows unnamed), in place and not, the same bits with the unnamed
// rows untouched. The reference's o is read through the block: with
// o_proj the identity (d_model = HV·V) and the MLP's down_proj zero, Forward returns h + o.
struct DeltaShape {
  bool gated;
  int width;  // K = V
  int nu;     // value heads per q/k head
};

class GpuBodiesDeltaRuleTest : public testing::TestWithParam<std::tuple<DeltaShape, int64_t>> {};

TEST_P(GpuBodiesDeltaRuleTest, HostGridEqualsLibTorchBlock) {
  c10::NoGradGuard no_grad;
  const auto [shape, T] = GetParam();
  const int64_t H = 2, HV = H * shape.nu, K = shape.width, V = shape.width, B = 3;
  const fwtest::ConfigCase config_case{
      shape.gated ? fwmodel::Architecture::kGatedDeltaNet : fwmodel::Architecture::kDeltaNet,
      fwmodel::FfnKind::kSwiglu,
      0,
      shape.nu,
      false,
      static_cast<int>(HV * V),
      static_cast<int>(H)};
  fwmodel::ModelConfig config = config_case.Config();
  config.head_k_dim = static_cast<int>(K);
  config.head_v_dim = static_cast<int>(V);
  ASSERT_TRUE(config.Validate().ok()) << config.Validate();
  ASSERT_FALSE(config.use_short_conv);
  ASSERT_TRUE(config.use_gate);
  const int64_t d = config.d_model;
  const fwmodel::Model model = fwtest::RandomModel(config, /*seed=*/5);
  std::map<std::string, torch::Tensor> weights = model.ExportWeights();
  torch::manual_seed(static_cast<uint64_t>(K * 100 + HV * 10 + T));
  const std::string p = "blocks.0.";
  weights[p + "attn.o_proj.weight"] = torch::eye(d);
  weights[p + "mlp.down_proj.weight"] = torch::zeros_like(weights.at(p + "mlp.down_proj.weight"));
  // A non-trivial o_norm weight, so that its indexing is checked too.
  weights[p + "attn.o_norm.weight"] = torch::rand({V}) + 0.5;
  auto block = fwmodel::MakeDeltaNetBlock(config, 0);
  block->Bind([&](const std::string& suffix) { return weights.at(p + suffix); });
  auto weight = [&](const std::string& name) { return weights.at(p + name); };
  SCOPED_TRACE(
      absl::StrCat(shape.gated ? "gated" : "ungated", ", K = V = ", K, ", HV = ", HV, ", T = ", T));

  const torch::Tensor h = torch::randn({B, T, d});
  const torch::Tensor S0 = torch::randn({B, HV, K, V}) * 0.3;
  torch::Tensor ref_state[1] = {S0.clone()};
  const torch::Tensor o_ref = block->Forward(h, ref_state, nullptr) - h;

  // The block's inputs to the kernel, as delta_net.cc computes them (silu, l2).
  const double eps = config.norm_eps;
  const torch::Tensor x = fwmodel::RmsNorm(h, weight("attn_norm.weight"), eps);
  torch::Tensor q = torch::silu(torch::linear(x, weight("attn.q_proj.weight"))).view({B, T, H, K});
  torch::Tensor k = torch::silu(torch::linear(x, weight("attn.k_proj.weight"))).view({B, T, H, K});
  q = q / torch::sqrt(q.square().sum(-1, /*keepdim=*/true) + 1e-6);
  k = k / torch::sqrt(k.square().sum(-1, /*keepdim=*/true) + 1e-6);
  q = (q * (1.0 / std::sqrt(static_cast<double>(K)))).contiguous();
  k = k.contiguous();
  const torch::Tensor v =
      torch::silu(torch::linear(x, weight("attn.v_proj.weight"))).view({B, T, HV, V}).contiguous();
  const torch::Tensor beta = torch::sigmoid(torch::linear(x, weight("attn.b_proj.weight")));
  torch::Tensor decay;
  if (shape.gated) {
    decay = torch::exp(
        -torch::exp(weight("attn.A_log")) *
        torch::softplus(torch::linear(x, weight("attn.a_proj.weight")) + weight("attn.dt_bias")));
  }
  const torch::Tensor gate = torch::linear(x, weight("attn.g_proj.weight"));
  const torch::Tensor norm_weight = weight("attn.o_norm.weight").contiguous();

  torch::Tensor S_in = S0.clone(), S_out = torch::empty_like(S0), o = torch::empty({B, T, HV, V});
  fwmodel::kernels::DeltaRuleArgs args;
  args.B = B;
  args.T = T;
  args.H = H;
  args.HV = HV;
  args.K = K;
  args.V = V;
  args.q = q.data_ptr<float>();
  args.k = k.data_ptr<float>();
  args.v = v.data_ptr<float>();
  args.beta = beta.data_ptr<float>();
  if (shape.gated) args.decay = decay.data_ptr<float>();
  args.gate = gate.data_ptr<float>();
  args.norm_weight = norm_weight.data_ptr<float>();
  args.state_in = S_in.data_ptr<float>();
  args.state_out = S_out.data_ptr<float>();
  args.o = o.data_ptr<float>();
  args.eps = static_cast<float>(eps);
  ASSERT_TRUE(fwmodel::kernels::RunDeltaRuleOnHost(args));

  fwtest::ExpectNearRelative(o.reshape({B, T, d}), o_ref, kTolerance, "o");
  fwtest::ExpectNearRelative(S_out, ref_state[0], kTolerance, "state");
  EXPECT_TRUE(torch::equal(S_in, S0)) << "state_in was written";

  // In place: the same bits.
  torch::Tensor S_inplace = S0.clone(), o_inplace = torch::empty_like(o);
  args.state_in = S_inplace.data_ptr<float>();
  args.state_out = S_inplace.data_ptr<float>();
  args.o = o_inplace.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  EXPECT_TRUE(torch::equal(S_inplace, S_out));
  EXPECT_TRUE(torch::equal(o_inplace, o));

  // On a pool of B + 2 rows through `rows` (permuted; pool rows 0 and 2 unnamed): out of
  // place, then in place, the same bits as above, the unnamed rows untouched.
  ASSERT_EQ(B, 3);
  const std::vector<int64_t> rows = {3, 4, 1};
  const torch::Tensor row_index = torch::tensor(rows, torch::kLong);
  const torch::Tensor unnamed = torch::tensor(std::vector<int64_t>{0, 2}, torch::kLong);
  torch::Tensor pool = torch::randn({B + 2, HV, K, V});
  pool.index_copy_(0, row_index, S0);
  const torch::Tensor pool0 = pool.clone();
  torch::Tensor pool_out = torch::full_like(pool, std::numeric_limits<float>::quiet_NaN());
  torch::Tensor o_pool = torch::empty_like(o);
  args.rows = rows.data();
  args.state_in = pool.data_ptr<float>();
  args.state_out = pool_out.data_ptr<float>();
  args.o = o_pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  EXPECT_TRUE(torch::equal(o_pool, o)) << "rows, out of place: o";
  EXPECT_TRUE(torch::equal(pool_out.index_select(0, row_index), S_out)) << "rows: the state";
  fwtest::ExpectNearRelative(pool_out.index_select(0, row_index), ref_state[0], kTolerance,
                             "state through rows");
  EXPECT_TRUE(pool_out.index_select(0, unnamed).isnan().all().item<bool>())
      << "an unnamed pool row was written";
  EXPECT_TRUE(torch::equal(pool, pool0)) << "state_in was written";
  args.state_out = pool.data_ptr<float>();
  ASSERT_TRUE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  EXPECT_TRUE(torch::equal(o_pool, o)) << "rows, in place: o";
  EXPECT_TRUE(torch::equal(pool.index_select(0, row_index), S_out)) << "rows, in place";
  EXPECT_TRUE(torch::equal(pool.index_select(0, unnamed), pool0.index_select(0, unnamed)))
      << "an unnamed pool row was written in place";
}

INSTANTIATE_TEST_SUITE_P(
    DeltaNet, GpuBodiesDeltaRuleTest,
    testing::Combine(testing::Values(DeltaShape{false, 8, 1}, DeltaShape{false, 16, 1},
                                     DeltaShape{false, 64, 1}, DeltaShape{true, 8, 1},
                                     DeltaShape{true, 16, 1}, DeltaShape{true, 24, 1},
                                     DeltaShape{true, 64, 1}, DeltaShape{true, 8, 2},
                                     DeltaShape{true, 64, 2}),
                     testing::Values(int64_t{1}, int64_t{5})),
    [](const testing::TestParamInfo<std::tuple<DeltaShape, int64_t>>& info) {
      const DeltaShape shape = std::get<0>(info.param);
      return absl::StrCat(shape.gated ? "Gated" : "Plain", "_K", shape.width, "_nu", shape.nu, "_T",
                          std::get<1>(info.param));
    });

// The launcher's refusals, mirrored: K or V out of range, H not dividing HV, a missing
// pointer; T = 0 copies the state and reads no token.
TEST(GpuBodiesArgsTest, DeltaRuleRefusesWhatTheLauncherRefuses) {
  // Buffers of the widest state (GCC's -Warray-bounds follows the later K and V into the
  // inlined mirror); the case's state is the first 2 × 8 × 8 floats.
  const size_t widest = 2 * fwmodel::kernels::kDeltaRuleMaxK * fwmodel::kernels::kDeltaRuleMaxV;
  std::vector<float> state_in(widest, 1.5f), state_out(widest, 0.0f), weight(widest, 1.0f);
  fwmodel::kernels::DeltaRuleArgs args;
  args.B = 1;
  args.T = 0;
  args.H = 1;
  args.HV = 2;
  args.K = 8;
  args.V = 8;
  args.norm_weight = weight.data();
  args.state_in = state_in.data();
  args.state_out = state_out.data();
  EXPECT_TRUE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  EXPECT_EQ(std::vector<float>(state_out.begin(), state_out.begin() + 2 * 8 * 8),
            std::vector<float>(2 * 8 * 8, 1.5f));
  EXPECT_EQ(state_out[2 * 8 * 8], 0.0f);
  args.K = fwmodel::kernels::kDeltaRuleMaxK + 1;
  EXPECT_FALSE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  args.K = 8;
  args.V = fwmodel::kernels::kDeltaRuleMaxV + 1;
  EXPECT_FALSE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  args.V = 0;
  EXPECT_FALSE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  args.V = 8;
  args.H = 3;  // does not divide HV = 2
  EXPECT_FALSE(fwmodel::kernels::RunDeltaRuleOnHost(args));
  args.H = 1;
  args.T = 1;  // the tokens' pointers are now needed
  EXPECT_FALSE(fwmodel::kernels::RunDeltaRuleOnHost(args));
}

// The RWKV-7 block-input kernels' grids (models/gpu/rwkv7_mix.cu), run on the CPU by their
// mirror (models/gpu/rwkv7_mix_host.h: the same blocks, threads, per-thread partial sums
// and halving reductions over rwkv7_mix_rule.h's bodies), equal rwkv7.cc's LibTorch ops
// within 1e-4 relative: LayerNorm, TokenShift and addcmul give the six time-mix inputs
// (count 6) and the channel mix's x_k (count 1), and TokenShift's new shift state; at
// T = 1 and T = 5, d of 32 and 64 (one channel per thread), 48 (idle threads past d) and
// 320 (threads looping over channels past the 256-wide block), from a nonzero shift
// state. The CUDA kernels themselves run in CudaEquivalenceTest on a GPU machine.
class GpuBodiesShiftMixTest : public testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(GpuBodiesShiftMixTest, HostGridEqualsLibTorchOps) {
  c10::NoGradGuard no_grad;
  const auto [d, T] = GetParam();
  const int64_t B = 3;
  const double eps = 1e-5;
  torch::manual_seed(static_cast<uint64_t>(d * 10 + T));
  // An offset and a scale, so that the mean and the variance both matter.
  const torch::Tensor h = torch::randn({B, T, d}) * 2.0 + 0.5;
  const torch::Tensor ln_w = torch::rand({d}) + 0.5, ln_b = torch::randn({d}) * 0.1;
  const torch::Tensor shift0 = torch::randn({B, d});
  ASSERT_GT(shift0.abs().min().item<float>(), 0.0f);
  for (const int count : {6, 1}) {
    SCOPED_TRACE(absl::StrCat("d = ", d, ", T = ", T, ", count = ", count));
    std::vector<torch::Tensor> mixes;
    for (int m = 0; m < count; ++m) mixes.push_back(torch::rand({d}));

    // The reference: rwkv7.cc's LibTorch ops.
    const torch::Tensor x = torch::layer_norm(h, {d}, ln_w, ln_b, eps);
    torch::Tensor ref_shift = shift0.clone();
    const torch::Tensor delta = fwmodel::TokenShift(x, &ref_shift) - x;

    const float nan = std::numeric_limits<float>::quiet_NaN();
    torch::Tensor shift_in = shift0.clone(), shift_out = torch::full({B, d}, nan),
                  out = torch::full({count, B, T, d}, nan);
    fwmodel::kernels::Rwkv7ShiftMixArgs args;
    args.B = B;
    args.T = T;
    args.d = d;
    args.h = h.data_ptr<float>();
    args.ln_w = ln_w.data_ptr<float>();
    args.ln_b = ln_b.data_ptr<float>();
    args.eps = static_cast<float>(eps);
    args.shift_in = shift_in.data_ptr<float>();
    args.shift_out = shift_out.data_ptr<float>();
    args.count = count;
    for (int m = 0; m < count; ++m) args.mix[m] = mixes[static_cast<size_t>(m)].data_ptr<float>();
    args.out = out.data_ptr<float>();
    ASSERT_TRUE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));

    for (int m = 0; m < count; ++m) {
      fwtest::ExpectNearRelative(out[m], torch::addcmul(x, delta, mixes[static_cast<size_t>(m)]),
                                 kTolerance, absl::StrCat("mix ", m));
    }
    fwtest::ExpectNearRelative(shift_out, ref_shift, kTolerance, "new shift state");
    EXPECT_TRUE(torch::equal(shift_in, shift0)) << "shift_in was written";
  }
}

INSTANTIATE_TEST_SUITE_P(Rwkv7, GpuBodiesShiftMixTest,
                         testing::Combine(testing::Values(32, 48, 64, 320),
                                          testing::Values(int64_t{1}, int64_t{5})),
                         [](const testing::TestParamInfo<std::tuple<int, int64_t>>& info) {
                           return absl::StrCat("d", std::get<0>(info.param), "_T",
                                               std::get<1>(info.param));
                         });

// Two calls in a row (T = 5, then T = 1 from the first call's new shift state) equal one
// LibTorch pass over the six tokens: the shift state carries the last token's x.
TEST(GpuBodiesShiftMixChainTest, SecondCallContinuesTheFirst) {
  c10::NoGradGuard no_grad;
  const int64_t B = 2, d = 64;
  const double eps = 1e-5;
  torch::manual_seed(11);
  const torch::Tensor h = torch::randn({B, 6, d}), ln_w = torch::rand({d}) + 0.5,
                      ln_b = torch::randn({d}) * 0.1, mix = torch::rand({d});
  const torch::Tensor shift0 = torch::randn({B, d});
  const torch::Tensor x = torch::layer_norm(h, {d}, ln_w, ln_b, eps);
  torch::Tensor ref_shift = shift0.clone();
  const torch::Tensor ref = torch::addcmul(x, fwmodel::TokenShift(x, &ref_shift) - x, mix);

  torch::Tensor shift = shift0.clone();
  std::vector<torch::Tensor> outs;
  for (const auto& [begin, T] : {std::pair<int64_t, int64_t>{0, 5}, {5, 1}}) {
    const torch::Tensor part = h.narrow(1, begin, T).contiguous();
    torch::Tensor shift_out = torch::empty({B, d}), out = torch::empty({1, B, T, d});
    fwmodel::kernels::Rwkv7ShiftMixArgs args;
    args.B = B;
    args.T = T;
    args.d = d;
    args.h = part.data_ptr<float>();
    args.ln_w = ln_w.data_ptr<float>();
    args.ln_b = ln_b.data_ptr<float>();
    args.eps = static_cast<float>(eps);
    args.shift_in = shift.data_ptr<float>();
    args.shift_out = shift_out.data_ptr<float>();
    args.count = 1;
    args.mix[0] = mix.data_ptr<float>();
    args.out = out.data_ptr<float>();
    ASSERT_TRUE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
    outs.push_back(out[0]);
    shift = shift_out;
  }
  fwtest::ExpectNearRelative(torch::cat(outs, 1), ref, kTolerance, "x_k over two calls");
  fwtest::ExpectNearRelative(shift, ref_shift, kTolerance, "shift state after two calls");
}

// The channel mix's relu(·)² kernel's mirror equals torch::relu(z).square() (the same
// bits), out of place and in place.
TEST(GpuBodiesSquaredReluTest, HostGridEqualsLibTorchOps) {
  torch::manual_seed(3);
  const torch::Tensor z = torch::randn({3, 5, 96});
  const torch::Tensor ref = torch::relu(z).square();
  torch::Tensor out = torch::full_like(z, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(fwmodel::kernels::RunSquaredReluOnHost(z.data_ptr<float>(), out.data_ptr<float>(),
                                                     z.numel()));
  fwtest::ExpectNearRelative(out, ref, kTolerance, "relu²");
  EXPECT_TRUE(torch::equal(out, ref));
  torch::Tensor in_place = z.clone();
  ASSERT_TRUE(fwmodel::kernels::RunSquaredReluOnHost(in_place.data_ptr<float>(),
                                                     in_place.data_ptr<float>(), z.numel()));
  EXPECT_TRUE(torch::equal(in_place, ref));
}

// The launchers' refusals, mirrored: a count other than 1 or 6, no token, no channel, a
// missing pointer; no session is nothing to do.
TEST(GpuBodiesArgsTest, ShiftMixRefusesWhatTheLauncherRefuses) {
  std::vector<float> h(2 * 8, 1.0f), weight(8, 1.0f), shift_in(2 * 8, 0.5f), shift_out(2 * 8, 0.0f),
      out(6 * 2 * 8, 0.0f);
  fwmodel::kernels::Rwkv7ShiftMixArgs args;
  args.B = 2;
  args.T = 1;
  args.d = 8;
  args.h = h.data();
  args.ln_w = weight.data();
  args.ln_b = weight.data();
  args.eps = 1e-5f;
  args.shift_in = shift_in.data();
  args.shift_out = shift_out.data();
  args.count = 1;
  args.mix[0] = weight.data();
  args.out = out.data();
  EXPECT_TRUE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.count = 2;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.count = 6;  // mix[1..5] missing
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.count = 1;
  args.T = 0;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.T = 1;
  args.d = 0;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.d = 8;
  args.shift_out = nullptr;
  EXPECT_FALSE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  args.B = 0;
  args.shift_out = shift_out.data();
  EXPECT_TRUE(fwmodel::kernels::RunRwkv7ShiftMixOnHost(args));
  EXPECT_FALSE(fwmodel::kernels::RunSquaredReluOnHost(nullptr, out.data(), 4));
  EXPECT_FALSE(fwmodel::kernels::RunSquaredReluOnHost(h.data(), out.data(), -1));
  EXPECT_TRUE(fwmodel::kernels::RunSquaredReluOnHost(nullptr, nullptr, 0));
}

}  // namespace
