// The RWKV native float32 CPU step (models/kernels/native_rwkv.h, through NativeStep) equals
// Model::Step (the LibTorch blocks of models/architectures/rwkv7.cc and rwkv4.cc) within 1e-4
// relative: RWKV-7 with 64-wide heads and with narrow ones (widths off the vector
// width), and RWKV-4, updating the pool's
// rows in place and leaving every other row alone; its prefill equals its steps; and
// splitting a call over threads changes nothing. With weights exact in bf16 or f16 the
// kernel keeps them in 16 bits and equals its float32-weight self within 1e-5 relative
// (decode at batch 1, 3 and 64, prefill); other weights stay float32, per projection.
// Releasing the Model's matrices (Model::ReleaseMatrices) changes nothing the kernel
// computes.
// rwkv_test.cc checks it against rwkv.cpp's trained models.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/kernels/native_step.h"
#include "models/kernels/scoring.h"
#include "tests/unit/test_models.h"

namespace {

using fwmodel::Architecture;

constexpr double kRwkvTolerance = 1e-4;
// 16-bit weights against the same values in float32: only the summation order differs.
constexpr double kNarrowTolerance = 1e-5;

// `model`'s weights rounded to `half` (kBFloat16 or kHalf), held in float32 as the
// loader widens a 16-bit checkpoint; nudge: this weight's first value moved one float32
// ulp off the 16-bit grid.
fwmodel::Model Rounded(const fwmodel::Model& model, torch::ScalarType half,
                       const std::string& nudge = "") {
  auto weights = model.ExportWeights();
  for (auto& [name, t] : weights) t = t.to(half).to(torch::kFloat32).contiguous();
  if (!nudge.empty()) {
    float* first = weights.at(nudge).data_ptr<float>();
    *first = std::nextafter(*first, 1.0f);
  }
  auto rounded = fwmodel::Model::Create(model.config(), std::move(weights));
  EXPECT_TRUE(rounded.ok()) << rounded.status();
  return std::move(*rounded);
}

// The native step of `narrow` (16-bit weights) against `wide` (float32 weights, the same
// values) on one model: `batch` sessions decode four tokens, then two of them (one at
// batch 1) absorb a nine-token prompt; logits and the whole pool within kNarrowTolerance.
void ExpectNarrowEqualsWide(const fwmodel::Model& model, fwmodel::NativeStep& narrow,
                            fwmodel::NativeStep& wide, int64_t batch, const std::string& what) {
  const int64_t vocab = model.config().vocab_size;
  fwmodel::State pool_narrow = model.InitialState(batch), pool_wide = model.InitialState(batch);
  std::vector<int64_t> rows(static_cast<size_t>(batch)), tokens(rows.size());
  std::iota(rows.begin(), rows.end(), 0);
  std::mt19937_64 rng(static_cast<uint64_t>(batch));
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<float> got(static_cast<size_t>(batch * vocab)), want(got.size());
  auto as_tensor = [&](std::vector<float>& v, int64_t n) {
    return torch::from_blob(v.data(), {n, vocab}).clone();
  };
  for (int step = 0; step < 4; ++step) {
    for (int64_t& t : tokens) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
    ASSERT_TRUE(narrow.Step(tokens, rows, &pool_narrow, got.data()).ok());
    ASSERT_TRUE(wide.Step(tokens, rows, &pool_wide, want.data()).ok());
    fwtest::ExpectNearRelative(as_tensor(got, batch), as_tensor(want, batch), kNarrowTolerance,
                               absl::StrCat(what, ": logits, batch ", batch, ", step ", step));
  }
  std::vector<int64_t> prompt(2 * 9);
  for (int64_t& t : prompt) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  std::vector<int64_t> prompt_rows = {rows[0]};
  if (batch > 1) prompt_rows.push_back(rows[static_cast<size_t>(batch - 1)]);
  const int64_t prompts = static_cast<int64_t>(prompt_rows.size());
  prompt.resize(static_cast<size_t>(prompts * 9));
  ASSERT_TRUE(narrow.Absorb(prompt, 9, prompt_rows, &pool_narrow, got.data()).ok());
  ASSERT_TRUE(wide.Absorb(prompt, 9, prompt_rows, &pool_wide, want.data()).ok());
  fwtest::ExpectNearRelative(as_tensor(got, prompts), as_tensor(want, prompts), kNarrowTolerance,
                             absl::StrCat(what, ": prefill logits, batch ", batch));
  for (size_t t = 0; t < pool_narrow.tensors.size(); ++t) {
    fwtest::ExpectNearRelative(
        pool_narrow.tensors[t], pool_wide.tensors[t], kNarrowTolerance,
        absl::StrCat(what, ": state ", model.state_spec()[t].name, ", batch ", batch));
  }
}

struct RwkvCase {
  std::string name;
  Architecture arch;
  int64_t d_model, n_heads, d_ff, vocab;
  int layers;
  bool tie;
};

// RWKV-7 with heads of 64 (the real models') with every projection over more than one
// 128-column panel, a ragged last panel, and a vocabulary of three panels; and with heads
// of 8 with LoRA ranks off the vector width, the head tied to the embedding. RWKV-4 over
// two panels, a width off the vector width.
std::vector<RwkvCase> Cases() {
  return {{"rwkv7_heads64", Architecture::kRwkv7, 192, 3, 320, 300, 3, false},
          {"rwkv7_heads8", Architecture::kRwkv7, 32, 4, 48, 256, 3, true},
          {"rwkv4", Architecture::kRwkv4, 140, 1, 200, 260, 3, false}};
}

fwmodel::ModelConfig Config(const RwkvCase& c) {
  fwmodel::ModelConfig config;
  config.architecture = c.arch;
  config.d_model = static_cast<int>(c.d_model);
  config.n_layers = c.layers;
  config.n_heads = static_cast<int>(c.n_heads);
  config.d_ff = static_cast<int>(c.d_ff);
  config.vocab_size = static_cast<int>(c.vocab);
  config.tie_embeddings = c.tie;
  if (c.arch == Architecture::kRwkv7) {
    config.decay_low_rank_dim = 9;
    config.a_low_rank_dim = 8;
    config.v_low_rank_dim = 5;
    config.gate_low_rank_dim = 12;
  }
  return config;
}

class NativeRwkvTest : public testing::TestWithParam<RwkvCase> {
 protected:
  void SetUp() override { config_ = Config(GetParam()); }
  fwmodel::ModelConfig config_;
};

// Six sessions in a pool of eight rows; each step a different subset of them, in a
// different order, absorbs a random token. Each session is mirrored by a batch-1
// LibTorch state stepped with Model::Step.
TEST_P(NativeRwkvTest, EqualsTheLibTorchStepRowByRowInPlace) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 7, torch::kFloat32);
  fwtest::ExpectNativeStepEqualsModelStepRowByRow(model, /*steps=*/12, kRwkvTolerance);
}

// Five sessions stepped together over ten tokens: the native step against one batched
// LibTorch step each time, logits and the whole state.
TEST_P(NativeRwkvTest, EqualsTheBatchedLibTorchStep) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 3, torch::kFloat32);
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  const int64_t batch = 5, vocab = config_.vocab_size;
  const torch::Tensor tokens = fwtest::RandomTokens(batch, 10, vocab, 17);
  fwmodel::State pool = model.InitialState(batch);
  fwmodel::State reference = model.InitialState(batch);
  std::vector<int64_t> rows(batch);
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> logits(static_cast<size_t>(batch * vocab));
  for (int64_t t = 0; t < 10; ++t) {
    const torch::Tensor column = tokens.select(1, t).contiguous();
    std::vector<int64_t> ids(column.data_ptr<int64_t>(), column.data_ptr<int64_t>() + batch);
    ASSERT_TRUE((*native)->Step(ids, rows, &pool, logits.data()).ok());
    auto expected = model.Step(column, &reference);
    ASSERT_TRUE(expected.ok()) << expected.status();
    fwtest::ExpectNearRelative(torch::from_blob(logits.data(), {batch, vocab}).clone(), *expected,
                               kRwkvTolerance, absl::StrCat("logits, token ", t));
  }
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    fwtest::ExpectNearRelative(pool.tensors[t], reference.tensors[t], kRwkvTolerance,
                               "state " + model.state_spec()[t].name);
  }
  // The recurrence ran: the state moved away from its fresh values.
  EXPECT_FALSE(torch::equal(pool.tensors[1], model.InitialState(batch).tensors[1]));
}

// Prefill: two sessions absorb nine tokens each in one Absorb call; the reference
// steps them one token at a time with Model::Step. Then one more decode Step.
TEST_P(NativeRwkvTest, AbsorbEqualsSteppingTokenByToken) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 5, torch::kFloat32);
  fwtest::ExpectAbsorbEqualsSteppingTokenByToken(model, kRwkvTolerance);
}

// Score on the kernel's prefill with every position's logits equals the sequence form.
TEST_P(NativeRwkvTest, ScoreEqualsTheSequenceForm) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 19, torch::kFloat32);
  fwtest::ExpectNativeScoreEqualsSequenceForm(model, kRwkvTolerance);
}

// Splitting a call over threads (the GEMMs' panels, the (session, head) pairs, the
// tokens) changes no result: 3 threads against 1, for a decode step of 40 sessions and
// a prefill of 3 sessions x 20 tokens.
TEST_P(NativeRwkvTest, ThreeThreadsEqualOne) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 21, torch::kFloat32);
  fwtest::ExpectThreeThreadsEqualOne(model, /*sessions=*/40, /*capacity=*/48, {41, 44, 47},
                                     /*prompt_tokens=*/20, 1e-6, "");
}

// An instance made with CreateSharing (the server's prefill instance) reads the first's
// weights, not a copy, with scratch of its own: the two run at once on two threads (a
// step on one pool, a prefill on another) and give what an instance of its own gives.
TEST_P(NativeRwkvTest, AnInstanceSharingWeightsRunsBesideTheFirst) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = fwtest::RandomModel(config_, 23, torch::kFloat32);
  fwmodel::NativeStepOptions one;
  one.threads = 1;
  auto first = fwmodel::NativeStep::Create(model, one);
  ASSERT_TRUE(first.ok()) << first.status();
  auto sharing = fwmodel::NativeStep::CreateSharing(**first, one);
  auto own = fwmodel::NativeStep::Create(model, one);
  ASSERT_TRUE(sharing.ok() && own.ok());
  const int64_t vocab = config_.vocab_size;
  std::mt19937_64 rng(9);
  std::vector<int64_t> step_rows = {0, 2, 3}, step_tokens(3), prompt_rows = {1, 4}, prompt(2 * 16);
  for (int64_t& t : step_tokens) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  for (int64_t& t : prompt) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  fwmodel::State step_pool = model.InitialState(5), prompt_pool = model.InitialState(5);
  fwmodel::State step_reference = step_pool.Clone(), prompt_reference = prompt_pool.Clone();
  std::vector<float> step_logits(3 * static_cast<size_t>(vocab)), prompt_logits(2 * vocab);
  std::vector<float> step_want(step_logits.size()), prompt_want(prompt_logits.size());
  for (int round = 0; round < 3; ++round) {
    std::thread stepping([&] {
      EXPECT_TRUE((*first)->Step(step_tokens, step_rows, &step_pool, step_logits.data()).ok());
    });
    EXPECT_TRUE(
        (*sharing)->Absorb(prompt, 16, prompt_rows, &prompt_pool, prompt_logits.data()).ok());
    stepping.join();
    ASSERT_TRUE((*own)->Step(step_tokens, step_rows, &step_reference, step_want.data()).ok());
    ASSERT_TRUE(
        (*own)->Absorb(prompt, 16, prompt_rows, &prompt_reference, prompt_want.data()).ok());
    EXPECT_EQ(step_logits, step_want) << "round " << round;
    EXPECT_EQ(prompt_logits, prompt_want) << "round " << round;
  }
  for (size_t t = 0; t < step_pool.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(step_pool.tensors[t], step_reference.tensors[t])) << t;
    EXPECT_TRUE(torch::equal(prompt_pool.tensors[t], prompt_reference.tensors[t])) << t;
  }
}

// Weights rounded to bf16, then to f16: every projection keeps 16 bits (weight_format),
// and the step equals the float32-weight step on the same values at batch 1, 3 and 64
// (the AVX-512 kernel up to 4 rows, the widened panels above) and in prefill.
TEST_P(NativeRwkvTest, SixteenBitWeightsEqualFloat32Weights) {
  c10::NoGradGuard no_grad;
  const fwmodel::Model random = fwtest::RandomModel(config_, 31, torch::kFloat32);
  for (torch::ScalarType half : {torch::kBFloat16, torch::kHalf}) {
    const fwmodel::Model model = Rounded(random, half);
    fwmodel::NativeStepOptions wide_options;
    wide_options.narrow_weights = false;
    auto narrow = fwmodel::NativeStep::Create(model);
    auto wide = fwmodel::NativeStep::Create(model, wide_options);
    ASSERT_TRUE(narrow.ok() && wide.ok());
    const std::string what = half == torch::kBFloat16 ? "bf16" : "f16";
    EXPECT_EQ((*narrow)->weight_format(), what);
    EXPECT_EQ((*narrow)->weight_bits(), 16);
    EXPECT_EQ((*wide)->weight_format(), "f32");
    EXPECT_EQ((*wide)->weight_bits(), 32);
    for (int64_t batch : {1, 3, 64}) ExpectNarrowEqualsWide(model, **narrow, **wide, batch, what);
  }
}

// Model::ReleaseMatrices, as the server does once the native kernels exist: the kernels
// (a decode instance and one sharing its weights, as the server's prefill) give the same
// bits as on an unreleased twin (decode, prefill, Score), for float32 values and for bf16
// ones (whose embedding the kernel keeps in 16 bits); the model still gives its
// state layout, fresh states and parameter count, refuses its LibTorch forms by name,
// and exports only what it kept.
TEST_P(NativeRwkvTest, ReleasedMatricesChangeNothingForTheKernels) {
  c10::NoGradGuard no_grad;
  const fwmodel::Model random = fwtest::RandomModel(config_, 43, torch::kFloat32);
  // Values off the 16-bit grids (the kernel reads the model's float32 embedding), then
  // rounded to bf16 (the kernel keeps a 16-bit copy of its own).
  for (const bool rounded : {false, true}) {
    SCOPED_TRACE(rounded ? "bf16 values" : "float32 values");
    const fwmodel::Model twin = rounded ? Rounded(random, torch::kBFloat16)
                                        : fwtest::RandomModel(config_, 43, torch::kFloat32);
    auto created = fwmodel::Model::Create(config_, twin.ExportWeights());
    ASSERT_TRUE(created.ok()) << created.status();
    fwmodel::Model released = std::move(*created);
    auto decode_twin = fwmodel::NativeStep::Create(twin);
    auto decode = fwmodel::NativeStep::Create(released);
    ASSERT_TRUE(decode_twin.ok() && decode.ok());
    auto prefill = fwmodel::NativeStep::CreateSharing(**decode, {});
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    const int64_t parameters = released.parameter_count();
    released.ReleaseMatrices();
    EXPECT_TRUE(released.matrices_released());
    EXPECT_EQ(released.parameter_count(), parameters);
    ASSERT_EQ(released.state_spec().size(), twin.state_spec().size());
    const fwmodel::State fresh = released.InitialState(2), fresh_twin = twin.InitialState(2);
    for (size_t t = 0; t < fresh.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(fresh.tensors[t], fresh_twin.tensors[t])) << t;
    }
    for (const auto& [name, t] : released.ExportWeights()) EXPECT_NE(t.dim(), 2) << name;
    const torch::Tensor one = torch::zeros({1}, torch::kInt64);
    fwmodel::State state = released.InitialState(1);
    EXPECT_EQ(released.Step(one, &state).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(released.Forward(one.view({1, 1}), &state).status().code(),
              absl::StatusCode::kFailedPrecondition);

    const int64_t vocab = config_.vocab_size;
    const torch::Tensor random = fwtest::RandomTokens(1, 20, vocab, 47);
    const std::vector<int64_t> tokens(random.data_ptr<int64_t>(), random.data_ptr<int64_t>() + 20);
    fwmodel::State pool = released.InitialState(3), pool_twin = twin.InitialState(3);
    std::vector<float> got(3 * static_cast<size_t>(vocab)), want(got.size());
    const std::vector<int64_t> rows = {2, 0};
    ASSERT_TRUE((*decode)->Step({tokens[0], tokens[1]}, rows, &pool, got.data()).ok());
    ASSERT_TRUE((*decode_twin)->Step({tokens[0], tokens[1]}, rows, &pool_twin, want.data()).ok());
    EXPECT_EQ(got, want) << "decode";
    ASSERT_TRUE((*prefill)
                    ->Absorb(absl::MakeConstSpan(tokens).subspan(2, 18), 9, rows, &pool, got.data())
                    .ok());
    ASSERT_TRUE(
        (*decode_twin)
            ->Absorb(absl::MakeConstSpan(tokens).subspan(2, 18), 9, rows, &pool_twin, want.data())
            .ok());
    EXPECT_EQ(got, want) << "prefill";
    auto score = fwmodel::ScoreTokens(released, tokens, nullptr, 8, prefill->get());
    auto score_twin = fwmodel::ScoreTokens(twin, tokens, nullptr, 8, decode_twin->get());
    ASSERT_TRUE(score.ok() && score_twin.ok()) << score.status() << score_twin.status();
    EXPECT_EQ(*score, *score_twin) << "score";
    // Without the kernel, Score needs the model's forms: refused, not wrong.
    EXPECT_EQ(fwmodel::ScoreTokens(released, tokens).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NativeRwkvTest, testing::ValuesIn(Cases()),
                         [](const testing::TestParamInfo<RwkvCase>& info) {
                           return info.param.name;
                         });

// Bad arguments are refused before anything is written, as for every architecture.
TEST(NativeRwkvInputTest, BadArgumentsAreRefusedAndChangeNothing) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = Config(Cases()[1]);
  fwmodel::Model model = fwtest::RandomModel(config, 3, torch::kFloat32);
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  fwmodel::State pool = model.InitialState(4);
  const fwmodel::State before = pool.Clone();
  std::vector<float> logits(2 * static_cast<size_t>(config.vocab_size));
  absl::Status s = (*native)->Step({1, config.vocab_size}, {0, 1}, &pool, logits.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = (*native)->Step({1, 2}, {3, 3}, &pool, logits.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(pool.tensors[t], before.tensors[t]));
  }
  fwmodel::Model f64 = fwtest::RandomModel(config, 3, torch::kFloat64);
  EXPECT_EQ(fwmodel::NativeStep::Create(f64).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Float32 weights off the 16-bit grids stay float32; the decision is per projection: a
// bf16 model with one value of one projection off the grid keeps that projection in
// float32 ("bf16+f32") and still equals its float32-weight self.
TEST(NativeRwkvWeightFormatTest, WeightsNotExactIn16BitsStayFloat32) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = Config(Cases()[0]);
  const fwmodel::Model random = fwtest::RandomModel(config, 3, torch::kFloat32);
  auto plain = fwmodel::NativeStep::Create(random);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->weight_format(), "f32");
  EXPECT_EQ((*plain)->weight_bits(), 32);
  const fwmodel::Model mixed = Rounded(random, torch::kBFloat16, "blocks.1.att.key.weight");
  auto narrow = fwmodel::NativeStep::Create(mixed);
  fwmodel::NativeStepOptions wide_options;
  wide_options.narrow_weights = false;
  auto wide = fwmodel::NativeStep::Create(mixed, wide_options);
  ASSERT_TRUE(narrow.ok() && wide.ok());
  EXPECT_EQ((*narrow)->weight_format(), "bf16+f32");
  EXPECT_EQ((*narrow)->weight_bits(), 32);
  ExpectNarrowEqualsWide(mixed, **narrow, **wide, 3, "mixed");
}

}  // namespace
