// The bucketed decode step (models/kernels/graphed_step.h) on the CPU, where it runs eagerly on
// its fixed buffers: what a CUDA Graph replays. It equals Model::Step row by row on
// every configuration of the form-equivalence tests (padding, several passes when a
// batch exceeds the largest bucket), writes no pool row but the stepped ones, and
// refuses bad input without changing anything. Capture itself needs a CUDA run
// (scripts/gpu/check.sh); here `captured()` must say false.
#include "models/kernels/graphed_step.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/sampling/sampler.h"
#include "tests/unit/test_models.h"

namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

// float64: the same operations as Model::Step on other batch shapes.
constexpr double kGraphTolerance = 1e-10;

void ExpectNear(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  fwtest::ExpectNearRelative(a, b, kGraphTolerance, what);
}

class GraphedStepTest : public testing::TestWithParam<fwtest::ConfigCase> {};

// Six sessions in a pool of nine rows, buckets {1, 2, 4}: each step a different subset,
// in a different order, of 1 to 6 sessions (3 pads to 4; 5 and 6 run as 4 + 1 and
// 4 + 2). Each session is mirrored by a batch-1 state stepped with Model::Step.
TEST_P(GraphedStepTest, EqualsTheLibTorchStepRowByRow) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  fwmodel::Model model = fwtest::RandomModel(config, 7, torch::kFloat64);
  fwmodel::GraphedStepOptions options;
  options.buckets = {1, 2, 4};
  auto step = fwmodel::GraphedStep::Create(model, options);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE((*step)->captured());
  const int64_t capacity = 9, vocab = config.vocab_size;
  fwmodel::State pool = model.InitialState(capacity);
  // The pool's next-token logits (float32), written by the step too.
  torch::Tensor row_logits = torch::zeros({capacity, vocab}, torch::kFloat32);
  const fwmodel::State fresh = model.InitialState(1);
  const std::vector<int64_t> session_rows = {6, 0, 3, 8, 1, 2};  // 4, 5 and 7 stay unused
  std::vector<fwmodel::State> reference;
  for (size_t s = 0; s < session_rows.size(); ++s) reference.push_back(model.InitialState(1));
  std::mt19937_64 rng(11);
  int64_t expected_padding = 0;
  for (int step_index = 0; step_index < 12; ++step_index) {
    // Sizes 1..6, each twice.
    const size_t count = static_cast<size_t>(step_index % 6) + 1;
    std::vector<int64_t> sessions = {0, 1, 2, 3, 4, 5};
    std::shuffle(sessions.begin(), sessions.end(), rng);
    sessions.resize(count);
    std::vector<int64_t> tokens, rows;
    for (int64_t s : sessions) {
      tokens.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)));
      rows.push_back(session_rows[static_cast<size_t>(s)]);
    }
    if (count == 3) ++expected_padding;  // 5 and 6 run as 4 + 1 and 4 + 2: no padding
    auto logits = (*step)->Step(tokens, rows, &pool, &row_logits);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ASSERT_EQ(logits->sizes(), (std::vector<int64_t>{static_cast<int64_t>(count), vocab}));
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_TRUE(
          torch::allclose(row_logits[rows[i]].to(torch::kFloat64), (*logits)[i], 1e-6, 1e-6))
          << "row_logits of row " << rows[i];
    }
    for (size_t i = 0; i < sessions.size(); ++i) {
      const size_t s = static_cast<size_t>(sessions[i]);
      auto expected = model.Step(torch::tensor({tokens[i]}, torch::kInt64), &reference[s]);
      ASSERT_TRUE(expected.ok()) << expected.status();
      ExpectNear(logits->narrow(0, static_cast<int64_t>(i), 1), *expected,
                 absl::StrCat("logits, step ", step_index, ", session ", s));
    }
  }
  EXPECT_EQ((*step)->padded_rows(), expected_padding);
  for (size_t s = 0; s < session_rows.size(); ++s) {
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      ExpectNear(pool.tensors[t].narrow(0, session_rows[s], 1), reference[s].tensors[t],
                 absl::StrCat("state ", model.state_spec()[t].name, ", session ", s));
    }
  }
  for (int64_t unused : {4, 5, 7}) {
    EXPECT_EQ(row_logits[unused].abs().sum().item<double>(), 0.0) << "row_logits " << unused;
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(pool.tensors[t].narrow(0, unused, 1), fresh.tensors[t]))
          << "row " << unused << " was written";
    }
  }
}

// In place (a PoolBinding): the bucket reads and writes the bound pool through its rows,
// and samples each row as the engine's next sampling would. Six sessions in a pool of
// nine rows plus the pad row, buckets {1, 2, 4}, twelve steps of 1 to 6 rows; every
// session has its own sampling parameters (greedy, temperature with top-k, top-p and
// min-p, a repetition penalty over its recent tokens) and generator. Each session is
// mirrored by a batch-1 state stepped with Model::Step and sampled with SampleToken on
// the same generator's copy: the tokens are equal, the logprobs close, the states and
// logits equal to the tolerance, and no row but the stepped ones and the pad row is
// written.
TEST_P(GraphedStepTest, InPlaceStepsAndSamplesLikeModelStepAndSampleToken) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  fwmodel::Model model = fwtest::RandomModel(config, 7, torch::kFloat64);
  const int64_t capacity = 9, pad_row = 9, vocab = config.vocab_size;
  fwmodel::State pool = model.InitialState(capacity + 1);
  torch::Tensor pool_logits = torch::zeros({capacity + 1, vocab}, torch::kFloat32);
  fwmodel::GraphedStepOptions options;
  options.buckets = {1, 2, 4};
  options.penalty_width = 8;
  auto step = fwmodel::GraphedStep::Create(model, options, {&pool, &pool_logits, pad_row});
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE((*step)->in_place());
  EXPECT_FALSE((*step)->captured());
  const fwmodel::State fresh = model.InitialState(1);
  const std::vector<int64_t> session_rows = {6, 0, 3, 8, 1, 2};  // 4, 5 and 7 stay unused
  struct Session {
    fwmodel::State reference;
    fwserve::SamplingParams params;
    std::mt19937_64 rng;
    std::vector<int64_t> recent;
    std::vector<uint8_t> allowed;  // sessions 1 and 4: a new constraint mask each step
  };
  std::vector<Session> sessions(session_rows.size());
  for (size_t s = 0; s < sessions.size(); ++s) {
    sessions[s].reference = model.InitialState(1);
    sessions[s].rng.seed(100 + s);
    fwserve::SamplingParams& p = sessions[s].params;
    p.temperature = s == 0 ? 0.0f : 0.6f + 0.3f * static_cast<float>(s);
    if (s == 2) p.top_k = 5;
    if (s == 3) p.top_p = 0.8f;
    if (s == 4) p.min_p = 0.1f;
    if (s == 5 || s == 0) p.repetition_penalty = 1.4f;
  }
  std::mt19937_64 pick(11);
  for (int step_index = 0; step_index < 12; ++step_index) {
    const size_t count = static_cast<size_t>(step_index % 6) + 1;
    std::vector<size_t> chosen = {0, 1, 2, 3, 4, 5};
    std::shuffle(chosen.begin(), chosen.end(), pick);
    chosen.resize(count);
    std::vector<int64_t> tokens, rows;
    std::vector<fwserve::RowDraw> draws;
    std::vector<std::mt19937_64> generators;  // what the step's draws come from
    for (size_t s : chosen) {
      tokens.push_back(static_cast<int64_t>(pick() % static_cast<uint64_t>(vocab)));
      rows.push_back(session_rows[s]);
      Session& session = sessions[s];
      session.recent.push_back(tokens.back());
      if (session.recent.size() > 8) session.recent.erase(session.recent.begin());
      fwserve::RowDraw d;
      d.params = &session.params;
      d.recent = &session.recent;
      std::mt19937_64 copy = session.rng;
      if (session.params.temperature != 0) d.uniform = fwserve::CanonicalDraw(copy);
      if (s == 1 || s == 4) {
        // About a third of the vocabulary, and at least one token.
        session.allowed.assign(static_cast<size_t>(vocab), 0);
        for (auto& a : session.allowed) a = pick() % 3 == 0 ? 1 : 0;
        session.allowed[pick() % static_cast<uint64_t>(vocab)] = 1;
        d.allowed = session.allowed.data();
      }
      draws.push_back(d);
    }
    ASSERT_TRUE((*step)->CanSampleInStep(draws));
    auto sampled = (*step)->StepInPlace(tokens, rows, draws);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    ASSERT_EQ(sampled->size(), count);
    for (size_t i = 0; i < chosen.size(); ++i) {
      Session& session = sessions[chosen[i]];
      auto expected = model.Step(torch::tensor({tokens[i]}, torch::kInt64), &session.reference);
      ASSERT_TRUE(expected.ok()) << expected.status();
      const torch::Tensor row_logits = pool_logits[rows[i]];
      ExpectNear(row_logits.to(torch::kFloat64),
                 expected->squeeze(0).to(torch::kFloat32).to(torch::kFloat64),
                 absl::StrCat("logits, step ", step_index, ", row ", rows[i]));
      std::vector<float> host(row_logits.data_ptr<float>(), row_logits.data_ptr<float>() + vocab);
      const int64_t token =
          fwserve::SampleToken(host.data(), vocab, session.params, session.rng, session.recent,
                               draws[i].allowed);
      EXPECT_EQ((*sampled)[i].token, token) << "step " << step_index << ", row " << rows[i];
      if (draws[i].allowed != nullptr) {
        EXPECT_EQ(draws[i].allowed[(*sampled)[i].token], 1) << "a masked token was drawn";
      }
      EXPECT_NEAR((*sampled)[i].logprob, fwserve::TokenLogProb(host.data(), vocab, token), 1e-4);
    }
  }
  for (size_t s = 0; s < session_rows.size(); ++s) {
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      ExpectNear(pool.tensors[t].narrow(0, session_rows[s], 1), sessions[s].reference.tensors[t],
                 absl::StrCat("state ", model.state_spec()[t].name, ", session ", s));
    }
  }
  for (int64_t unused : {4, 5, 7}) {
    EXPECT_EQ(pool_logits[unused].abs().sum().item<double>(), 0.0) << "logits row " << unused;
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(pool.tensors[t].narrow(0, unused, 1), fresh.tensors[t]))
          << "row " << unused << " was written";
    }
  }
}

// Multi-step decode: nine rows plus the pad row, buckets {1, 2, 4}, twelve calls of up
// to K = 4 steps over 1 to 6 sessions, each row with its own limit in [1, K] and a
// quarter of the vocabulary as stop tokens. Each session is mirrored by K single steps: Model::Step
// on a batch-1 state, SampleToken on the same generator. The drawn tokens are equal (a row stops at
// its limit or after a stop token), the logprobs close, the states and logits after the
// call equal to the tolerance (the row absorbed every drawn token but its last), and no
// row but the stepped ones and the pad row is written.
TEST_P(GraphedStepTest, MultiStepEqualsSingleStepsWithItsMasks) {
  c10::NoGradGuard no_grad;
  const fwmodel::ModelConfig config = GetParam().Config();
  fwmodel::Model model = fwtest::RandomModel(config, 9, torch::kFloat64);
  const int64_t capacity = 9, pad_row = 9, vocab = config.vocab_size, kSteps = 4;
  fwmodel::State pool = model.InitialState(capacity + 1);
  torch::Tensor pool_logits = torch::zeros({capacity + 1, vocab}, torch::kFloat32);
  fwmodel::GraphedStepOptions options;
  options.buckets = {1, 2, 4};
  auto step = fwmodel::GraphedStep::Create(model, options, {&pool, &pool_logits, pad_row});
  ASSERT_TRUE(step.ok()) << step.status();
  const fwmodel::State fresh = model.InitialState(1);
  const std::vector<int64_t> session_rows = {6, 0, 3, 8, 1, 2};  // 4, 5 and 7 stay unused
  // Every fourth id: about a quarter of the draws stop their row.
  std::vector<int64_t> stop_tokens;
  for (int64_t id = 1; id < vocab; id += 4) stop_tokens.push_back(id);
  struct Session {
    fwmodel::State reference;
    fwserve::SamplingParams params;
    std::mt19937_64 rng;
    int64_t next = 0;  // the token the next call absorbs first
  };
  std::vector<Session> sessions(session_rows.size());
  for (size_t s = 0; s < sessions.size(); ++s) {
    sessions[s].reference = model.InitialState(1);
    sessions[s].rng.seed(200 + s);
    sessions[s].next = static_cast<int64_t>(3 + s);
    fwserve::SamplingParams& p = sessions[s].params;
    p.temperature = s == 0 ? 0.0f : 0.7f + 0.3f * static_cast<float>(s);
    if (s == 2) p.top_k = 5;
    if (s == 3) p.top_p = 0.8f;
    if (s == 4) p.min_p = 0.1f;
  }
  std::mt19937_64 pick(13);
  int64_t early_stops = 0, limited = 0;
  for (int call = 0; call < 12; ++call) {
    const size_t count = static_cast<size_t>(call % 6) + 1;
    std::vector<size_t> chosen = {0, 1, 2, 3, 4, 5};
    std::shuffle(chosen.begin(), chosen.end(), pick);
    chosen.resize(count);
    std::vector<int64_t> tokens, rows, limits;
    std::vector<fwserve::RowDraw> draws;
    std::vector<double> uniforms;
    for (size_t s : chosen) {
      Session& session = sessions[s];
      tokens.push_back(session.next);
      rows.push_back(session_rows[s]);
      limits.push_back(1 + static_cast<int64_t>(pick() % kSteps));
      fwserve::RowDraw d;
      d.params = &session.params;
      draws.push_back(d);
      std::mt19937_64 copy = session.rng;
      for (int64_t j = 0; j < kSteps; ++j) {
        uniforms.push_back(session.params.temperature != 0 ? fwserve::CanonicalDraw(copy) : 0.0);
      }
    }
    auto drawn =
        (*step)->MultiStepInPlace(tokens, rows, draws, uniforms, kSteps, limits, stop_tokens);
    ASSERT_TRUE(drawn.ok()) << drawn.status();
    ASSERT_EQ(drawn->size(), count);
    for (size_t i = 0; i < chosen.size(); ++i) {
      Session& session = sessions[chosen[i]];
      const std::vector<fwmodel::SampledToken>& got = (*drawn)[i];
      // K single steps: absorb, draw; go on while under the limit and not stopped.
      std::vector<int64_t> want;
      std::vector<float> want_logprobs;
      int64_t input = tokens[i];
      torch::Tensor last_logits;
      for (int64_t j = 0; j < limits[i]; ++j) {
        auto logits = model.Step(torch::tensor({input}, torch::kInt64), &session.reference);
        ASSERT_TRUE(logits.ok()) << logits.status();
        last_logits = logits->squeeze(0).to(torch::kFloat32).contiguous();
        const float* host = last_logits.data_ptr<float>();
        const int64_t token = fwserve::SampleToken(host, vocab, session.params, session.rng, {});
        want.push_back(token);
        want_logprobs.push_back(fwserve::TokenLogProb(host, vocab, token));
        input = token;
        if (std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end()) {
          if (j + 1 < limits[i]) ++early_stops;
          break;
        }
      }
      if (static_cast<int64_t>(want.size()) == limits[i] && limits[i] < kSteps) ++limited;
      ASSERT_EQ(got.size(), want.size()) << "call " << call << ", row " << rows[i];
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_EQ(got[j].token, want[j])
            << "call " << call << ", row " << rows[i] << ", step " << j;
        EXPECT_NEAR(got[j].logprob, want_logprobs[j], 1e-4);
      }
      session.next = want.back();
      ExpectNear(pool_logits[rows[i]].to(torch::kFloat64), last_logits.to(torch::kFloat64),
                 absl::StrCat("logits, call ", call, ", row ", rows[i]));
    }
  }
  EXPECT_GT(early_stops, 0) << "no row stopped on a stop token before its limit";
  EXPECT_GT(limited, 0) << "no row stopped at a limit below K";
  for (size_t s = 0; s < session_rows.size(); ++s) {
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      ExpectNear(pool.tensors[t].narrow(0, session_rows[s], 1), sessions[s].reference.tensors[t],
                 absl::StrCat("state ", model.state_spec()[t].name, ", session ", s));
    }
  }
  for (int64_t unused : {4, 5, 7}) {
    EXPECT_EQ(pool_logits[unused].abs().sum().item<double>(), 0.0) << "logits row " << unused;
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(pool.tensors[t].narrow(0, unused, 1), fresh.tensors[t]))
          << "row " << unused << " was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllConfigurations, GraphedStepTest,
                         testing::ValuesIn(fwtest::AllConfigCases()), fwtest::ConfigCaseName);
// RWKV-7 and RWKV-4: the graph kernel a CUDA server runs them on (eager here).
INSTANTIATE_TEST_SUITE_P(Rwkv, GraphedStepTest, testing::ValuesIn(fwtest::RwkvConfigCases()),
                         fwtest::ConfigCaseName);

TEST(GraphedStepBucketsTest, AStepPadsToTheSmallestBucketThatFits) {
  fwmodel::Model model = fwtest::RandomModel(
      fwtest::TinyConfig(Architecture::kAft, FfnKind::kSquaredRelu, 0), 1, torch::kFloat32);
  auto step = fwmodel::GraphedStep::Create(model);  // default buckets 1, 2, 4, ..., 256
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ((*step)->BucketFor(1), 1);
  EXPECT_EQ((*step)->BucketFor(3), 4);
  EXPECT_EQ((*step)->BucketFor(64), 64);
  EXPECT_EQ((*step)->BucketFor(65), 128);
  EXPECT_EQ((*step)->BucketFor(256), 256);
  EXPECT_EQ((*step)->BucketFor(1000), 256);
  fwmodel::State pool = model.InitialState(300);
  std::vector<int64_t> tokens(300, 5), rows(300);
  for (int64_t r = 0; r < 300; ++r) rows[static_cast<size_t>(r)] = 299 - r;
  // 300 = 256 + 44, the second pass padded to 64.
  auto logits = (*step)->Step(tokens, rows, &pool);
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(logits->size(0), 300);
  EXPECT_EQ((*step)->padded_rows(), 20);
  // Every session got the same token from the same state: equal logits and states, to
  // float32 rounding (a row's place in the GEMM decides which OpenBLAS micro-kernel path
  // computes it: with OPENBLAS_CORETYPE=Haswell rows differ in the last bits).
  EXPECT_TRUE(torch::allclose(logits->narrow(0, 0, 1).expand({300, -1}), *logits, 1e-4, 1e-5));
  for (const torch::Tensor& t : pool.tensors) {
    EXPECT_TRUE(torch::allclose(t.narrow(0, 0, 1).expand_as(t), t, 1e-4, 1e-5));
  }
}

TEST(GraphedStepBucketsTest, BadBucketsAreRefused) {
  fwmodel::Model model = fwtest::RandomModel(
      fwtest::TinyConfig(Architecture::kAft, FfnKind::kSquaredRelu, 0), 1, torch::kFloat32);
  for (const std::vector<int64_t>& buckets :
       {std::vector<int64_t>{}, {0, 4}, {4, 2}, {2, 2}, {-1}}) {
    fwmodel::GraphedStepOptions options;
    options.buckets = buckets;
    auto step = fwmodel::GraphedStep::Create(model, options);
    EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument)
        << testing::PrintToString(buckets);
  }
  fwmodel::GraphedStepOptions options;
  options.warmup_runs = -1;
  auto step = fwmodel::GraphedStep::Create(model, options);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(step.status().message().find("warmup_runs must be >= 0, got -1"), std::string::npos);
}

TEST(GraphedStepInputTest, BadArgumentsAreRefusedAndChangeNothing) {
  c10::NoGradGuard no_grad;
  fwmodel::ModelConfig config =
      fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kSquaredRelu, 3);
  fwmodel::Model model = fwtest::RandomModel(config, 3, torch::kFloat32);
  auto step = fwmodel::GraphedStep::Create(model);
  ASSERT_TRUE(step.ok());
  fwmodel::State pool = model.InitialState(4);
  const fwmodel::State before = pool.Clone();
  auto refused = [&](std::vector<int64_t> tokens, std::vector<int64_t> rows,
                     const std::string& message) {
    absl::Status s = (*step)->Step(tokens, rows, &pool).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_NE(s.message().find(message), std::string::npos) << s.message();
  };
  refused({1, config.vocab_size}, {0, 1}, absl::StrCat("token ", config.vocab_size));
  refused({1, -1}, {0, 1}, "token -1 at position 1");
  refused({1, 2}, {0, 4}, "row 4 at position 1 is outside the pool [0, 4)");
  refused({1, 2}, {2, 2}, "row 2 appears twice");
  refused({1, 2}, {0}, "tokens has 2 entries, rows 1");
  refused({}, {}, "at least one row");
  torch::Tensor small_logits = torch::zeros({3, config.vocab_size}, torch::kFloat32);
  EXPECT_EQ((*step)->Step({1}, {0}, &pool, &small_logits).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(pool.tensors[t], before.tensors[t]));
  }
  fwmodel::State wrong = model.InitialState(4);
  wrong.tensors[0] = wrong.tensors[0].to(torch::kFloat64);
  EXPECT_EQ((*step)->Step({1}, {0}, &wrong).status().code(), absl::StatusCode::kInvalidArgument);
  wrong.tensors.pop_back();
  EXPECT_EQ((*step)->Step({1}, {0}, &wrong).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GraphedStepInPlaceTest, BadBindingsAndArgumentsAreRefused) {
  c10::NoGradGuard no_grad;
  fwmodel::ModelConfig config = fwtest::TinyConfig(Architecture::kAft, FfnKind::kSquaredRelu, 0);
  fwmodel::Model model = fwtest::RandomModel(config, 3, torch::kFloat32);
  fwmodel::State pool = model.InitialState(5);
  torch::Tensor logits = torch::zeros({5, config.vocab_size}, torch::kFloat32);
  fwmodel::GraphedStepOptions options;
  options.buckets = {1, 2};
  options.penalty_width = 2;
  EXPECT_EQ(fwmodel::GraphedStep::Create(model, options, {&pool, &logits, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);  // the pad row is outside the pool
  torch::Tensor short_logits = torch::zeros({4, config.vocab_size}, torch::kFloat32);
  EXPECT_EQ(fwmodel::GraphedStep::Create(model, options, {&pool, &short_logits, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto step = fwmodel::GraphedStep::Create(model, options, {&pool, &logits, 4});
  ASSERT_TRUE(step.ok()) << step.status();
  const fwmodel::State before = pool.Clone();
  absl::Status pad = (*step)->StepInPlace({1}, {4}, {}).status();
  EXPECT_EQ(pad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pad.message().find("row 4 at position 0 is the pool's pad row"), std::string::npos)
      << pad.message();
  fwserve::SamplingParams penalised;
  penalised.repetition_penalty = 1.2f;
  const std::vector<int64_t> recent = {1, 2, 3};  // wider than penalty_width 2
  fwserve::RowDraw wide;
  wide.params = &penalised;
  wide.recent = &recent;
  EXPECT_FALSE((*step)->CanSampleInStep({wide}));
  EXPECT_EQ((*step)->StepInPlace({1}, {0}, {wide}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*step)->Step({1}, {0}, &pool).status().code(), absl::StatusCode::kFailedPrecondition);
  // Constraint masks: at most masked_rows per pass, never in a multi-step launch.
  fwserve::SamplingParams plain;
  const std::vector<uint8_t> mask(static_cast<size_t>(config.vocab_size), 1);
  fwserve::RowDraw masked;
  masked.params = &plain;
  masked.allowed = mask.data();
  EXPECT_TRUE((*step)->CanSampleInStep({masked, masked}));
  fwmodel::GraphedStepOptions one_mask = options;
  one_mask.masked_rows = 1;
  auto narrow = fwmodel::GraphedStep::Create(model, one_mask, {&pool, &logits, 4});
  ASSERT_TRUE(narrow.ok()) << narrow.status();
  EXPECT_TRUE((*narrow)->CanSampleInStep({masked}));
  EXPECT_FALSE((*narrow)->CanSampleInStep({masked, masked}));
  one_mask.masked_rows = -1;
  EXPECT_EQ(fwmodel::GraphedStep::Create(model, one_mask, {&pool, &logits, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*step)
                ->MultiStepInPlace({1}, {0}, {masked}, {0.5, 0.5}, 2, {2}, {})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(pool.tensors[t], before.tensors[t]));
  }
  // Without draws the step steps only, and returns no tokens.
  auto stepped = (*step)->StepInPlace({1, 2}, {0, 3}, {});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_TRUE(stepped->empty());
  EXPECT_FALSE(torch::equal(pool.tensors[0][3], before.tensors[0][3]));
  EXPECT_GT((*step)->last_step_time(), absl::ZeroDuration());
}

}  // namespace
