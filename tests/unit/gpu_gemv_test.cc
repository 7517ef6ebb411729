// The grouped GEMV kernel's grid (models/gpu/gemv.cu), run on the CPU by its mirror
// (models/gpu/gemv_host.h: the same blocks, warps, lanes, 16-byte chunks and tails and
// shuffle butterflies over gemv_rule.h's bodies), equals torch::linear with the input
// activations (tanh, sigmoid), the bias and the epilogues (+ residual, relu²) within 1e-4
// relative: float32 weights, and bf16 weights against the float32 product of the
// bf16-rounded weights; M = 1, 3, 16 rows; in = 768, 64, 33 (the last: no 16-byte loads)
// and out = 768, 3072, 5; 1 to kGemvMaxProducts products per launch; rows of x with a
// stride (unaligned: element by element); a residual that is y itself. The mirror refuses
// what the launcher refuses. And rwkv7.cc's grouped-GEMV path (its decode projections),
// run on CPU tensors with the mirror in place of the launch, equals its LibTorch path:
// logits and states. The kernel's load groups cover a 768-wide float32 row at M <= 2. The
// CUDA kernel itself runs in CudaEquivalenceTest (model_cuda_test.cc) on a GPU machine,
// through rwkv7.cc, and against the mirror in scripts/gpu/gemv_check.cu.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/gpu/gemv_host.h"
#include "tests/unit/test_models.h"

namespace fwmodel {
// rwkv7.cc's test switch: its grouped-GEMV path on CPU float32 tensors, with the mirror.
void SetRwkv7HostGemvForTesting(bool on);
}  // namespace fwmodel

namespace {

using fwmodel::kernels::GemvEpilogue;
using fwmodel::kernels::GemvInput;
using fwmodel::kernels::GemvProduct;
using fwmodel::kernels::GemvWeight;
using fwmodel::kernels::GroupedGemvArgs;
using fwmodel::kernels::kGemvMaxProducts;
using fwmodel::kernels::kGemvMaxRows;
using fwmodel::kernels::RunGroupedGemvOnHost;

constexpr double kTolerance = 1e-4;

// One product of a test launch.
struct Spec {
  int64_t in;
  int64_t out;
  GemvInput input;
  bool bias;
  GemvEpilogue epilogue;
  int64_t x_pad = 0;  // x's row stride is in + x_pad
};

// kGemvMaxProducts products covering the sizes, inputs, biases and epilogues.
std::vector<Spec> Specs() {
  return {
      {768, 768, GemvInput::kNone, false, GemvEpilogue::kNone},
      {64, 3072, GemvInput::kTanh, true, GemvEpilogue::kNone},
      {33, 5, GemvInput::kSigmoid, false, GemvEpilogue::kResidual},
      {768, 5, GemvInput::kNone, true, GemvEpilogue::kSquaredRelu},
      {33, 768, GemvInput::kTanh, true, GemvEpilogue::kResidual},
      {64, 768, GemvInput::kNone, false, GemvEpilogue::kSquaredRelu, /*x_pad=*/1},
      {768, 64, GemvInput::kSigmoid, true, GemvEpilogue::kResidual, /*x_pad=*/4},
      {64, 5, GemvInput::kNone, true, GemvEpilogue::kNone},
  };
}

// The tensors of one product, and its reference output.
struct Case {
  torch::Tensor x_storage, x, w, w_device, bias, residual, y, expected;
};

// Builds product `spec` over M rows into *product and returns its tensors: the weights
// float32 or bf16 (the reference then uses the bf16-rounded weights in float32).
Case MakeCase(const Spec& spec, int64_t M, GemvWeight weight, GemvProduct* product) {
  Case c;
  c.x_storage = torch::randn({M, spec.in + spec.x_pad});
  c.x = c.x_storage.narrow(1, 0, spec.in);
  torch::Tensor w = torch::randn({spec.out, spec.in}) / std::sqrt(static_cast<double>(spec.in));
  if (weight == GemvWeight::kBFloat16) {
    c.w_device = w.to(torch::kBFloat16).contiguous();
    c.w = c.w_device.to(torch::kFloat32);
  } else {
    c.w = w;
    c.w_device = w;
  }
  if (spec.bias) c.bias = torch::randn({spec.out});
  if (spec.epilogue == GemvEpilogue::kResidual) c.residual = torch::randn({M, spec.out});
  c.y = torch::full({M, spec.out}, 1234.5f);

  torch::Tensor input = c.x;
  if (spec.input == GemvInput::kTanh) input = torch::tanh(input);
  if (spec.input == GemvInput::kSigmoid) input = torch::sigmoid(input);
  c.expected = c.bias.defined() ? torch::linear(input, c.w, c.bias) : torch::linear(input, c.w);
  if (spec.epilogue == GemvEpilogue::kResidual) c.expected = c.residual + c.expected;
  if (spec.epilogue == GemvEpilogue::kSquaredRelu) c.expected = torch::relu(c.expected).square();

  product->w = c.w_device.data_ptr();
  product->x = c.x_storage.data_ptr<float>();
  product->x_stride = spec.in + spec.x_pad;
  product->bias = c.bias.defined() ? c.bias.data_ptr<float>() : nullptr;
  product->residual = c.residual.defined() ? c.residual.data_ptr<float>() : nullptr;
  product->residual_stride = spec.out;
  product->y = c.y.data_ptr<float>();
  product->y_stride = spec.out;
  product->in = spec.in;
  product->out = spec.out;
  product->input = spec.input;
  product->epilogue = spec.epilogue;
  return c;
}

// (weight type, M)
class GpuGemvTest : public testing::TestWithParam<std::tuple<GemvWeight, int>> {};

TEST_P(GpuGemvTest, HostGridEqualsLibTorch) {
  const auto [weight, M] = GetParam();
  const std::vector<Spec> specs = Specs();
  ASSERT_EQ(static_cast<int>(specs.size()), kGemvMaxProducts);
  torch::manual_seed(static_cast<uint64_t>(M * 10 + static_cast<int>(weight)));
  for (int count : {1, 3, kGemvMaxProducts}) {
    // Groups of `count` products starting at different specs, so every spec runs alone.
    for (int first = 0; first < kGemvMaxProducts; first += count) {
      SCOPED_TRACE(absl::StrCat("count ", count, ", first ", first));
      GroupedGemvArgs args;
      args.M = M;
      args.count = count;
      args.weight = weight;
      std::vector<Case> cases;
      for (int g = 0; g < count; ++g) {
        const Spec& spec = specs[static_cast<size_t>((first + g) % kGemvMaxProducts)];
        cases.push_back(MakeCase(spec, M, weight, &args.products[g]));
      }
      ASSERT_TRUE(RunGroupedGemvOnHost(args));
      for (int g = 0; g < count; ++g) {
        fwtest::ExpectNearRelative(cases[static_cast<size_t>(g)].y,
                                   cases[static_cast<size_t>(g)].expected, kTolerance,
                                   absl::StrCat("product ", g));
      }
    }
  }
}

// The 16-byte path is what the aligned products take, the element-by-element one the
// others.
TEST_P(GpuGemvTest, VectorLoadsWhereRowsAreAligned) {
  const auto [weight, M] = GetParam();
  const std::vector<Spec> specs = Specs();
  for (const Spec& spec : specs) {
    GemvProduct product;
    const Case c = MakeCase(spec, M, weight, &product);
    const int vector = fwmodel::kernels::GemvVector(weight);
    const bool aligned = spec.in % vector == 0 && (spec.in + spec.x_pad) % 4 == 0;
    EXPECT_EQ(fwmodel::kernels::GemvVectorChunks(product, weight), aligned ? spec.in / vector : 0)
        << "in " << spec.in << ", pad " << spec.x_pad;
  }
}

// A residual that is y itself: y = y + result, in place.
TEST_P(GpuGemvTest, ResidualInPlace) {
  const auto [weight, M] = GetParam();
  torch::manual_seed(5);
  GroupedGemvArgs args;
  args.M = M;
  args.count = 1;
  args.weight = weight;
  Case c = MakeCase({768, 768, GemvInput::kNone, true, GemvEpilogue::kResidual}, M, weight,
                    &args.products[0]);
  c.y.copy_(c.residual);
  args.products[0].residual = c.y.data_ptr<float>();
  ASSERT_TRUE(RunGroupedGemvOnHost(args));
  fwtest::ExpectNearRelative(c.y, c.expected, kTolerance, "in place");
}

INSTANTIATE_TEST_SUITE_P(
    Gemv, GpuGemvTest,
    testing::Combine(testing::Values(GemvWeight::kFloat32, GemvWeight::kBFloat16),
                     testing::Values(1, 3, kGemvMaxRows)),
    [](const testing::TestParamInfo<std::tuple<GemvWeight, int>>& info) {
      return absl::StrCat(std::get<0>(info.param) == GemvWeight::kBFloat16 ? "Bf16" : "Float32",
                          "_M", std::get<1>(info.param));
    });

// The bf16 widening is the high half of a float32: exact for bf16 values.
TEST(GpuGemvBodiesTest, Bf16WideningIsExact) {
  const torch::Tensor values = torch::randn({257}).to(torch::kBFloat16);
  const torch::Tensor widened = values.to(torch::kFloat32);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(values.data_ptr());
  for (int64_t i = 0; i < values.numel(); ++i) {
    EXPECT_EQ(fwmodel::kernels::Bf16ToFloat(bits[i]), widened[i].item<float>()) << i;
  }
  const uint32_t word = (static_cast<uint32_t>(bits[1]) << 16) | bits[0];
  EXPECT_EQ(fwmodel::kernels::Bf16LowOf(word), widened[0].item<float>());
  EXPECT_EQ(fwmodel::kernels::Bf16HighOf(word), widened[1].item<float>());
}

TEST(GpuGemvBodiesTest, TanhWithinToleranceOfLibTorch) {
  const torch::Tensor z = torch::linspace(-30.0, 30.0, 6001, torch::kFloat32);
  torch::Tensor got = torch::empty_like(z);
  for (int64_t i = 0; i < z.numel(); ++i) {
    got[i] = fwmodel::kernels::GemvTanh(z[i].item<float>());
  }
  EXPECT_LE(fwtest::MaxAbsDiff(got, torch::tanh(z)), 1e-6);
}

// The kernel's load groups (gemv_rule.h, gemv.cu): a float32 768-wide row (the 0.1B's d)
// is one group of loads per lane at M <= 2, its x loaded with it at M = 1; no bucket is
// shallower than the 2 chunks a lane kept in flight before; the x preloaded stays within
// 6 float4 a lane.
TEST(GpuGemvBodiesTest, LoadGroupsCoverShortRows) {
  using fwmodel::kernels::GemvPreloadX;
  using fwmodel::kernels::GemvUnroll;
  using fwmodel::kernels::GemvVector;
  using fwmodel::kernels::kGemvWarpSize;
  for (int rows : {1, 2}) {
    EXPECT_GE(GemvUnroll(rows) * kGemvWarpSize * GemvVector(GemvWeight::kFloat32), 768) << rows;
  }
  EXPECT_TRUE(GemvPreloadX(1, GemvWeight::kFloat32));
  for (int rows = 1; rows <= kGemvMaxRows; rows *= 2) {
    EXPECT_GE(GemvUnroll(rows), 2) << rows;
    for (GemvWeight weight : {GemvWeight::kFloat32, GemvWeight::kBFloat16}) {
      const int x_vectors = weight == GemvWeight::kBFloat16 ? 2 : 1;
      if (GemvPreloadX(rows, weight)) {
        EXPECT_LE(GemvUnroll(rows) * rows * x_vectors, 6) << rows;
      }
    }
  }
}

TEST(GpuGemvArgsTest, RefusesWhatTheLauncherRefuses) {
  torch::manual_seed(3);
  GroupedGemvArgs good;
  good.M = 3;
  good.count = 2;
  const Case c0 = MakeCase({33, 5, GemvInput::kNone, false, GemvEpilogue::kResidual}, 3,
                           GemvWeight::kFloat32, &good.products[0]);
  const Case c1 = MakeCase({64, 5, GemvInput::kNone, true, GemvEpilogue::kNone}, 3,
                           GemvWeight::kFloat32, &good.products[1]);
  ASSERT_TRUE(fwmodel::kernels::GroupedGemvArgsValid(good));
  ASSERT_TRUE(RunGroupedGemvOnHost(good));

  auto refused = [&](const char* what, auto&& change) {
    GroupedGemvArgs args = good;
    change(args);
    EXPECT_FALSE(fwmodel::kernels::GroupedGemvArgsValid(args)) << what;
    EXPECT_FALSE(RunGroupedGemvOnHost(args)) << what;
  };
  refused("M > 16", [](GroupedGemvArgs& a) { a.M = kGemvMaxRows + 1; });
  refused("M < 0", [](GroupedGemvArgs& a) { a.M = -1; });
  refused("no products", [](GroupedGemvArgs& a) { a.count = 0; });
  refused("too many products", [](GroupedGemvArgs& a) { a.count = kGemvMaxProducts + 1; });
  refused("weight type", [](GroupedGemvArgs& a) { a.weight = static_cast<GemvWeight>(2); });
  refused("null w", [](GroupedGemvArgs& a) { a.products[1].w = nullptr; });
  refused("null x", [](GroupedGemvArgs& a) { a.products[1].x = nullptr; });
  refused("null y", [](GroupedGemvArgs& a) { a.products[0].y = nullptr; });
  refused("null residual", [](GroupedGemvArgs& a) { a.products[0].residual = nullptr; });
  refused("residual stride", [](GroupedGemvArgs& a) { a.products[0].residual_stride = 4; });
  refused("in 0", [](GroupedGemvArgs& a) { a.products[1].in = 0; });
  refused("out 0", [](GroupedGemvArgs& a) { a.products[1].out = 0; });
  refused("x stride < in", [](GroupedGemvArgs& a) { a.products[1].x_stride = 63; });
  refused("y stride < out", [](GroupedGemvArgs& a) { a.products[1].y_stride = 4; });
  refused("input", [](GroupedGemvArgs& a) { a.products[1].input = static_cast<GemvInput>(3); });
  refused("epilogue",
          [](GroupedGemvArgs& a) { a.products[1].epilogue = static_cast<GemvEpilogue>(3); });

  // M = 0: nothing to do, nothing written.
  GroupedGemvArgs empty = good;
  empty.M = 0;
  const torch::Tensor before = c1.y.clone();
  EXPECT_TRUE(RunGroupedGemvOnHost(empty));
  EXPECT_TRUE(torch::equal(c1.y, before));
}

// (config case, B, T)
class Rwkv7GemvPathTest
    : public testing::TestWithParam<std::tuple<fwtest::ConfigCase, int64_t, int64_t>> {
 protected:
  void TearDown() override { fwmodel::SetRwkv7HostGemvForTesting(false); }
};

// rwkv7.cc's grouped-GEMV path (the mirror standing in for the launches) equals its
// LibTorch path: a prefill of T tokens then a step, from fresh states, in float32. B·T
// past kGemvMaxRows takes the LibTorch path (the same bits).
TEST_P(Rwkv7GemvPathTest, EqualsLibTorchPath) {
  c10::NoGradGuard no_grad;
  const auto [config_case, B, T] = GetParam();
  const fwmodel::ModelConfig config = config_case.Config();
  const fwmodel::Model model =
      fwtest::RandomModel(config, /*seed=*/11, torch::kFloat32, /*scale=*/0.3);
  const torch::Tensor tokens = fwtest::RandomTokens(B, T, config.vocab_size, 17);
  const torch::Tensor next = fwtest::RandomTokens(B, 1, config.vocab_size, 19).view({B});

  auto run = [&](bool gemv, torch::Tensor* logits, torch::Tensor* step_logits,
                 fwmodel::State* state) {
    fwmodel::SetRwkv7HostGemvForTesting(gemv);
    *state = model.InitialState(B);
    auto forward = model.Forward(tokens, state);
    ASSERT_TRUE(forward.ok()) << forward.status();
    *logits = *forward;
    auto step = model.Step(next, state);
    ASSERT_TRUE(step.ok()) << step.status();
    *step_logits = *step;
  };
  torch::Tensor ref_logits, ref_step, logits, step;
  fwmodel::State ref_state, state;
  run(false, &ref_logits, &ref_step, &ref_state);
  run(true, &logits, &step, &state);
  fwmodel::SetRwkv7HostGemvForTesting(false);

  fwtest::ExpectNearRelative(logits, ref_logits, kTolerance, "prefill logits");
  fwtest::ExpectNearRelative(step, ref_step, kTolerance, "step logits");
  ASSERT_EQ(state.tensors.size(), ref_state.tensors.size());
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    fwtest::ExpectNearRelative(state.tensors[i], ref_state.tensors[i], kTolerance,
                               absl::StrCat("state ", i));
  }
  if (B * T <= kGemvMaxRows) {
    // The path ran: its sums in another order than LibTorch's give other bits.
    EXPECT_FALSE(torch::equal(logits, ref_logits)) << "the grouped-GEMV path did not run";
  } else {
    EXPECT_TRUE(torch::equal(logits, ref_logits)) << "B·T > 16 must keep the LibTorch path";
  }
}

std::vector<fwtest::ConfigCase> Rwkv7Cases() {
  std::vector<fwtest::ConfigCase> cases;
  for (const fwtest::ConfigCase& c : fwtest::RwkvConfigCases()) {
    if (c.arch == fwmodel::Architecture::kRwkv7) cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Rwkv7, Rwkv7GemvPathTest,
    testing::Combine(testing::ValuesIn(Rwkv7Cases()), testing::Values(int64_t{1}, int64_t{3}),
                     testing::Values(int64_t{1}, int64_t{5}, int64_t{7})),
    [](const testing::TestParamInfo<std::tuple<fwtest::ConfigCase, int64_t, int64_t>>& info) {
      return absl::StrCat(std::get<0>(info.param).Name(), "_B", std::get<1>(info.param), "_T",
                          std::get<2>(info.param));
    });

// ModelOptions::bf16_matrices: an RWKV-7 model that keeps its matrices in bf16 computes
// what the float32 model over the bf16-rounded matrices computes (a prefill of T tokens,
// then a step), through LibTorch (the matrices widened per product) and through the
// grouped-GEMV path's mirror reading bf16 (the same sums as over the rounded float32
// matrices); the matrices are bf16 in weights(), everything else float32; and other
// architectures, or float64 compute, are refused.
TEST_P(Rwkv7GemvPathTest, Bf16MatricesEqualFloat32OverRoundedMatrices) {
  c10::NoGradGuard no_grad;
  const auto [config_case, B, T] = GetParam();
  const fwmodel::ModelConfig config = config_case.Config();
  const std::map<std::string, torch::Tensor> weights =
      fwtest::RandomModel(config, /*seed=*/13, torch::kFloat32, /*scale=*/0.3).ExportWeights();
  std::map<std::string, torch::Tensor> rounded = weights;
  int64_t matrices = 0;
  for (auto& [name, t] : rounded) {
    if (!fwmodel::Bf16MatrixName(name)) continue;
    t = t.to(torch::kBFloat16).to(torch::kFloat32);
    ++matrices;
  }
  ASSERT_GE(matrices, 13 * config.n_layers);  // r, k, v, o, 8 LoRA (6 in block 0), 2 FFN
  fwmodel::ModelOptions bf16_options;
  bf16_options.bf16_matrices = true;
  auto reference = fwmodel::Model::Create(config, rounded);
  auto bf16 = fwmodel::Model::Create(config, weights, bf16_options);
  ASSERT_TRUE(reference.ok() && bf16.ok()) << bf16.status();
  for (const auto& [name, t] : bf16->weights()) {
    EXPECT_EQ(t.scalar_type(), fwmodel::Bf16MatrixName(name) ? torch::kBFloat16 : torch::kFloat32)
        << name;
  }
  EXPECT_TRUE(torch::equal(bf16->ExportWeights().at("blocks.0.att.key.weight"),
                           rounded.at("blocks.0.att.key.weight")));

  const torch::Tensor tokens = fwtest::RandomTokens(B, T, config.vocab_size, 23);
  const torch::Tensor next = fwtest::RandomTokens(B, 1, config.vocab_size, 29).view({B});
  auto run = [&](const fwmodel::Model& model, bool gemv, torch::Tensor* logits,
                 torch::Tensor* step_logits, fwmodel::State* state) {
    fwmodel::SetRwkv7HostGemvForTesting(gemv);
    *state = model.InitialState(B);
    auto forward = model.Forward(tokens, state);
    ASSERT_TRUE(forward.ok()) << forward.status();
    *logits = *forward;
    auto step = model.Step(next, state);
    ASSERT_TRUE(step.ok()) << step.status();
    *step_logits = *step;
  };
  torch::Tensor ref_logits, ref_step;
  fwmodel::State ref_state;
  run(*reference, false, &ref_logits, &ref_step, &ref_state);
  for (bool gemv : {false, true}) {
    SCOPED_TRACE(gemv ? "grouped GEMV mirror" : "LibTorch");
    torch::Tensor logits, step;
    fwmodel::State state;
    run(*bf16, gemv, &logits, &step, &state);
    fwmodel::SetRwkv7HostGemvForTesting(false);
    if (gemv && B * T <= kGemvMaxRows) {
      EXPECT_FALSE(torch::equal(logits, ref_logits)) << "the grouped-GEMV path did not run";
    }
    if (!gemv) {
      // torch::linear over the widened matrices: the reference's own sums.
      EXPECT_TRUE(torch::equal(logits, ref_logits));
      EXPECT_TRUE(torch::equal(step, ref_step));
    }
    fwtest::ExpectNearRelative(logits, ref_logits, kTolerance, "prefill logits");
    fwtest::ExpectNearRelative(step, ref_step, kTolerance, "step logits");
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      EXPECT_EQ(state.tensors[i].scalar_type(), torch::kFloat32);
      fwtest::ExpectNearRelative(state.tensors[i], ref_state.tensors[i], kTolerance,
                                 absl::StrCat("state ", i));
    }
  }
  // The unrounded float32 model differs: the rounding is real.
  auto exact = fwmodel::Model::Create(config, weights);
  ASSERT_TRUE(exact.ok());
  fwmodel::State exact_state = exact->InitialState(B);
  auto exact_logits = exact->Forward(tokens, &exact_state);
  ASSERT_TRUE(exact_logits.ok());
  EXPECT_FALSE(torch::equal(*exact_logits, ref_logits));

  fwmodel::ModelOptions f64 = bf16_options;
  f64.dtype = torch::kFloat64;
  EXPECT_EQ(fwmodel::Model::Create(config, weights, f64).status().code(),
            absl::StatusCode::kInvalidArgument);
  const fwmodel::ModelConfig aft =
      fwtest::TinyConfig(fwmodel::Architecture::kAft, fwmodel::FfnKind::kRelu, 0);
  auto aft_status = fwmodel::Model::Create(
      aft, fwtest::RandomModel(aft, 1, torch::kFloat32).ExportWeights(), bf16_options);
  EXPECT_EQ(aft_status.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(aft_status.status().message().find("bf16_matrices"), std::string::npos);
}

}  // namespace
