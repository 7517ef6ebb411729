// The plain sampling kernel's grid (models/gpu/sample.cu), run on the CPU by its mirror
// (models/gpu/sample_host.h: the same blocks, threads, phases, butterflies and scan over
// sample_rule.h's bodies), draws what SampleOnDevice with filters = false draws (the
// LibTorch ops the kernel replaces on CUDA, here on CPU tensors) and what the host
// sampler SampleToken draws: 40 rounds of mixed rows (greedy, temperatures 0.5, 1 and 2,
// repetition penalties, NaN and ±inf logits, rows with no finite logit), at the RWKV
// world vocabulary (65,536: 128 ids a thread) and at small ones (fewer ids than threads,
// and a vocabulary that does not divide into the threads); then with logit biases. Tokens
// equal, log-probabilities within 1e-5. The CUDA kernel itself runs on a GPU machine.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/gpu/sample_host.h"
#if defined(FWSERVE_CUDA_TESTS)
#include <torch/cuda.h>
#endif
#include "models/sampling/batch_sampler.h"

namespace {

using fwserve::RowDraw;
using fwserve::SamplingParams;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// How a stream's logits look each round.
enum class RowKind { kNormal, kSomeNonFinite, kNoneFinite, kTopIsPlusInf };

struct Stream {
  SamplingParams params;
  RowKind kind = RowKind::kNormal;
  std::vector<int64_t> recent;
  std::mt19937_64 host_rng, batch_rng;
};

// `count` streams (16 by default), stream i as stream i % 16 of 16: each temperature (0,
// 0.5, 1, 2) with and without a repetition penalty (1.3 or 0.8), over every kind of row.
std::vector<Stream> MakeStreams(int64_t vocab, size_t count = 16) {
  const float temperatures[] = {0.0f, 0.5f, 1.0f, 2.0f};
  std::mt19937_64 pick(11);
  std::vector<Stream> streams(count);
  for (size_t i = 0; i < streams.size(); ++i) {
    Stream& s = streams[i];
    const size_t k = i % 16;
    s.params.temperature = temperatures[k % 4];
    s.params.repetition_penalty = (k / 4) % 2 == 0 ? 1.0f : (k % 3 == 0 ? 0.8f : 1.3f);
    s.kind = k == 5 || k == 10 ? RowKind::kSomeNonFinite
             : k == 7          ? RowKind::kNoneFinite
             : k == 13         ? RowKind::kTopIsPlusInf
                               : RowKind::kNormal;
    s.params.seed = 500 + i;
    s.host_rng.seed(s.params.seed);
    s.batch_rng.seed(s.params.seed);
    // Repeats and ids outside the vocabulary, which the penalty skips.
    for (int j = 0; j < static_cast<int>(pick() % 10); ++j) {
      s.recent.push_back(j % 4 == 3 ? (j % 2 ? -1 : vocab + 3)
                                    : static_cast<int64_t>(pick() % std::min<int64_t>(vocab, 40)));
    }
  }
  return streams;
}

// One row of logits of `kind` from `normal`.
void FillRow(RowKind kind, int64_t vocab, std::normal_distribution<float>& normal,
             std::mt19937& rng, float* row) {
  for (int64_t i = 0; i < vocab; ++i) row[i] = normal(rng);
  switch (kind) {
    case RowKind::kNormal:
      break;
    case RowKind::kSomeNonFinite:
      for (int64_t i = 0; i < vocab; i += 5) row[i] = i % 3 == 0 ? kNaN : -kInf;
      row[vocab - 1] = kInf;
      break;
    case RowKind::kNoneFinite:
      for (int64_t i = 0; i < vocab; ++i) row[i] = i % 2 == 0 ? -kInf : kNaN;
      break;
    case RowKind::kTopIsPlusInf:
      row[vocab / 2] = kInf;  // counted as −inf: not the argmax
      break;
  }
}

// The draws' parameters as SampleOnDevice's tensors and the kernel's arguments.
struct Packed {
  std::vector<double> columns;
  std::vector<int64_t> index;
  std::vector<double> factor;
  int64_t width = 0;
  torch::Tensor column_tensor, penalty_index, penalty_factor;
};

Packed Pack(const std::vector<RowDraw>& batch, int64_t vocab) {
  Packed p;
  const int64_t rows = static_cast<int64_t>(batch.size());
  p.width = fwserve::PenaltyWidth(batch);
  p.columns.resize(static_cast<size_t>(fwserve::kSampleColumns * rows));
  p.index.resize(static_cast<size_t>(rows * p.width));
  p.factor.resize(static_cast<size_t>(rows));
  EXPECT_TRUE(
      fwserve::PackDraws(batch, vocab, p.width, p.columns.data(), p.index.data(), p.factor.data()));
  p.column_tensor = torch::tensor(p.columns, torch::kFloat64).view({fwserve::kSampleColumns, rows});
  if (p.width > 0) {
    p.penalty_index = torch::tensor(p.index, torch::kInt64).view({rows, p.width});
    p.penalty_factor = torch::tensor(p.factor, torch::kFloat64).view({rows, 1});
  }
  return p;
}

// The kernel's arguments for `logits` and `p`, writing `out` and, where the launch is
// chunked, `scratch` (sized here).
fwmodel::kernels::SampleArgs KernelArgs(
    const torch::Tensor& logits, const Packed& p, std::vector<double>* out,
    std::vector<fwmodel::kernels::SampleChunkPartial>* scratch) {
  const int64_t rows = logits.size(0);
  out->assign(static_cast<size_t>(2 * rows), -7.0);
  scratch->assign(
      static_cast<size_t>(rows * fwmodel::kernels::SampleChunksPerRow(rows, logits.size(1))),
      fwmodel::kernels::SampleChunkPartial());
  fwmodel::kernels::SampleArgs args;
  args.rows = rows;
  args.vocab = logits.size(1);
  args.logits = logits.data_ptr<float>();
  args.temperature = p.columns.data() + fwserve::kSampleTemperature * rows;
  args.uniform = p.columns.data() + fwserve::kSampleUniform * rows;
  args.penalty_width = p.width;
  args.penalty_index = p.width > 0 ? p.index.data() : nullptr;
  args.penalty_factor = p.width > 0 ? p.factor.data() : nullptr;
  args.out = out->data();
  args.partials = scratch->data();
  return args;
}

// Points `args` at the packed draws' top_k, top_p and min_p columns (the filters).
void SetFilterColumns(const Packed& p, int64_t rows, fwmodel::kernels::SampleArgs* args) {
  args->top_k = p.columns.data() + fwserve::kSampleTopK * rows;
  args->top_p = p.columns.data() + fwserve::kSampleTopP * rows;
  args->min_p = p.columns.data() + fwserve::kSampleMinP * rows;
}

class GpuSampleTest : public testing::TestWithParam<int64_t> {};

TEST_P(GpuSampleTest, HostGridDrawsWhatSampleOnDeviceAndSampleTokenDraw) {
  c10::NoGradGuard no_grad;
  const int64_t vocab = GetParam();
  std::vector<Stream> streams = MakeStreams(vocab);
  const int64_t rows = static_cast<int64_t>(streams.size());
  std::mt19937 logits_rng(23);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int64_t non_greedy = 0, distinct = 0;
  std::vector<bool> seen(static_cast<size_t>(vocab), false);
  for (int round = 0; round < 40; ++round) {
    torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, data + r * vocab);
    }
    std::vector<RowDraw> batch(streams.size());
    for (size_t r = 0; r < streams.size(); ++r) {
      batch[r].row = static_cast<int64_t>(r);
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
    }
    const Packed packed = Pack(batch, vocab);
    std::vector<double> out;
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(KernelArgs(logits, packed, &out, &scratch)));
    const torch::Tensor reference =
        fwserve::SampleOnDevice(logits, packed.column_tensor, packed.penalty_index,
                                packed.penalty_factor, /*filters=*/false);
    const double* expected = reference.data_ptr<double>();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const std::string where = absl::StrCat("vocab ", vocab, ", round ", round, ", row ", r);
      const float* row = data + static_cast<int64_t>(r) * vocab;
      const int64_t token = static_cast<int64_t>(out[2 * r]);
      const double logprob = out[2 * r + 1];
      ASSERT_EQ(token, static_cast<int64_t>(expected[2 * r])) << where;
      if (std::isinf(expected[2 * r + 1])) {
        EXPECT_EQ(logprob, expected[2 * r + 1]) << where;
      } else {
        EXPECT_NEAR(logprob, expected[2 * r + 1], 1e-5) << where;
      }
      if (s.kind != RowKind::kNoneFinite) {  // SampleToken draws nothing for such a row
        ASSERT_EQ(token, fwserve::SampleToken(row, vocab, s.params, s.host_rng, s.recent)) << where;
        EXPECT_NEAR(logprob, fwserve::TokenLogProb(row, vocab, token), 1e-5) << where;
      } else {
        EXPECT_EQ(token, 0) << where;
        EXPECT_EQ(logprob, -std::numeric_limits<double>::infinity()) << where;
      }
      non_greedy += s.params.temperature != 0 && s.kind != RowKind::kNoneFinite;
      if (!seen[static_cast<size_t>(token)]) ++distinct;
      seen[static_cast<size_t>(token)] = true;
      s.recent.push_back(token);
    }
  }
  EXPECT_EQ(non_greedy, 40 * 11);
  EXPECT_GT(distinct, std::min<int64_t>(vocab / 2, 100));  // it samples, not only argmaxes
}

// 65,536: the RWKV world vocabulary (128 ids a thread); 7: fewer ids than threads; 1,000:
// chunks of 2 ids, the last thread's part-empty; 256: the batch sampler test's.
INSTANTIATE_TEST_SUITE_P(Vocab, GpuSampleTest, testing::Values(65536, 7, 1000, 256),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return absl::StrCat("V", info.param);
                         });

// logit_bias (SampleRows passes it to SampleOnDevice; the graphed step does not): ±100
// and small biases, padded (0, 0) entries, rows with and without a penalty, as
// SampleOnDevice's scatter_add and SampleToken add them.
TEST(GpuSampleBiasTest, HostGridAddsTheBiasAsSampleOnDeviceAndSampleToken) {
  c10::NoGradGuard no_grad;
  constexpr int64_t kVocab = 3000;
  std::vector<Stream> streams = MakeStreams(kVocab);
  const int64_t rows = static_cast<int64_t>(streams.size());
  std::mt19937_64 pick(29);
  for (size_t r = 0; r < streams.size(); ++r) {
    if (r % 3 == 0) continue;  // no bias
    std::vector<int64_t> ids;
    for (int j = 0; j < 1 + static_cast<int>(pick() % 6); ++j) {
      const int64_t id = static_cast<int64_t>(pick() % 40) + 40 * j;  // ascending, distinct
      const float value = j == 0 ? 100.0f : (j == 1 ? -100.0f : static_cast<float>(j) - 2.5f);
      streams[r].params.logit_bias.emplace_back(id, value);
    }
  }
  std::mt19937 logits_rng(31);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int round = 0; round < 40; ++round) {
    torch::Tensor logits = torch::empty({rows, kVocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      FillRow(streams[static_cast<size_t>(r)].kind, kVocab, normal, logits_rng, data + r * kVocab);
    }
    std::vector<RowDraw> batch(streams.size());
    size_t bias_width = 0;
    for (size_t r = 0; r < streams.size(); ++r) {
      batch[r].row = static_cast<int64_t>(r);
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      bias_width = std::max(bias_width, streams[r].params.logit_bias.size());
    }
    const Packed packed = Pack(batch, kVocab);
    // As SampleRows packs them: (0, 0) pads.
    std::vector<int64_t> ids(static_cast<size_t>(rows) * bias_width, 0);
    std::vector<float> values(ids.size(), 0.0f);
    for (size_t r = 0; r < streams.size(); ++r) {
      const auto& bias = streams[r].params.logit_bias;
      for (size_t j = 0; j < bias.size(); ++j) {
        ids[r * bias_width + j] = bias[j].first;
        values[r * bias_width + j] = bias[j].second;
      }
    }
    const int64_t width = static_cast<int64_t>(bias_width);
    const torch::Tensor bias_index = torch::tensor(ids, torch::kInt64).view({rows, width});
    const torch::Tensor bias_value = torch::tensor(values, torch::kFloat32).view({rows, width});
    std::vector<double> out;
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
    fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
    args.bias_width = width;
    args.bias_index = ids.data();
    args.bias_value = values.data();
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor reference = fwserve::SampleOnDevice(
        logits, packed.column_tensor, packed.penalty_index, packed.penalty_factor,
        /*filters=*/false, bias_index, bias_value);
    const double* expected = reference.data_ptr<double>();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const std::string where = absl::StrCat("round ", round, ", row ", r);
      const int64_t token = static_cast<int64_t>(out[2 * r]);
      ASSERT_EQ(token, static_cast<int64_t>(expected[2 * r])) << where;
      if (std::isinf(expected[2 * r + 1])) {
        EXPECT_EQ(out[2 * r + 1], expected[2 * r + 1]) << where;
      } else {
        EXPECT_NEAR(out[2 * r + 1], expected[2 * r + 1], 1e-5) << where;
      }
      if (s.kind != RowKind::kNoneFinite) {
        ASSERT_EQ(token, fwserve::SampleToken(data + static_cast<int64_t>(r) * kVocab, kVocab,
                                              s.params, s.host_rng, s.recent))
            << where;
      }
      s.recent.push_back(token);
    }
  }
}

// The chunked launch (fewer than kSampleChunkedRowsBelow rows: C blocks per row, four
// launches through the scratch partials) on the CPU by its mirror: 1, 3 and 63 mixed rows
// (greedy and sampled, repetition penalties, logit biases with (0, 0) pads, NaN and ±inf
// logits, rows with no finite logit) at the 65,536 vocabulary (32 chunks of 4 ids a
// thread) and at vocabularies that split into chunks unevenly (50,257: 25 chunks, the
// last part-empty; 4,099: 3 chunks, the last thread's ids not a multiple of 4) draw what
// SampleOnDevice (filters = false) and SampleToken draw; log-probabilities within 1e-5.
using ChunkCase = std::tuple<int64_t, int64_t>;  // rows, vocab
class GpuSampleChunkTest : public testing::TestWithParam<ChunkCase> {};

TEST_P(GpuSampleChunkTest, ChunkedHostGridDrawsWhatSampleOnDeviceAndSampleTokenDraw) {
  c10::NoGradGuard no_grad;
  const auto [rows, vocab] = GetParam();
  ASSERT_GT(fwmodel::kernels::SampleChunksPerRow(rows, vocab), 1);
  // Streams 5, 6, ... of MakeStreams: one row is sampled with a penalty and non-finite
  // logits, three add a greedy penalised row and one with no finite logit.
  std::vector<Stream> streams = MakeStreams(vocab, static_cast<size_t>(rows) + 5);
  streams.erase(streams.begin(), streams.begin() + 5);
  std::mt19937_64 pick(37);
  for (size_t r = 0; r < streams.size(); ++r) {
    if (r % 3 == 1) continue;  // no bias
    for (int j = 0; j < 1 + static_cast<int>(pick() % 4); ++j) {
      // Ascending, distinct ids spread over the row's chunks.
      const int64_t id = (static_cast<int64_t>(pick() % 500) + 500 * j + 977 * j * j) % vocab;
      const float value = j == 0 ? 100.0f : (j == 1 ? -100.0f : static_cast<float>(j) - 2.5f);
      streams[r].params.logit_bias.emplace_back(id, value);
    }
  }
  std::mt19937 logits_rng(47);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int rounds = rows > 8 ? 3 : 12;
  int64_t sampled = 0;
  for (int round = 0; round < rounds; ++round) {
    torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, data + r * vocab);
    }
    std::vector<RowDraw> batch(streams.size());
    size_t bias_width = 0;
    for (size_t r = 0; r < streams.size(); ++r) {
      batch[r].row = static_cast<int64_t>(r);
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      bias_width = std::max(bias_width, streams[r].params.logit_bias.size());
    }
    const Packed packed = Pack(batch, vocab);
    std::vector<int64_t> ids(static_cast<size_t>(rows) * bias_width, 0);
    std::vector<float> values(ids.size(), 0.0f);
    for (size_t r = 0; r < streams.size(); ++r) {
      const auto& bias = streams[r].params.logit_bias;
      for (size_t j = 0; j < bias.size(); ++j) {
        ids[r * bias_width + j] = bias[j].first;
        values[r * bias_width + j] = bias[j].second;
      }
    }
    const int64_t width = static_cast<int64_t>(bias_width);
    torch::Tensor bias_index, bias_value;
    std::vector<double> out;
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
    fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
    if (width > 0) {
      bias_index = torch::tensor(ids, torch::kInt64).view({rows, width});
      bias_value = torch::tensor(values, torch::kFloat32).view({rows, width});
      args.bias_width = width;
      args.bias_index = ids.data();
      args.bias_value = values.data();
    }
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor reference = fwserve::SampleOnDevice(
        logits, packed.column_tensor, packed.penalty_index, packed.penalty_factor,
        /*filters=*/false, bias_index, bias_value);
    const double* expected = reference.data_ptr<double>();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const std::string where =
          absl::StrCat("rows ", rows, ", vocab ", vocab, ", round ", round, ", row ", r);
      const int64_t token = static_cast<int64_t>(out[2 * r]);
      ASSERT_EQ(token, static_cast<int64_t>(expected[2 * r])) << where;
      if (std::isinf(expected[2 * r + 1])) {
        EXPECT_EQ(out[2 * r + 1], expected[2 * r + 1]) << where;
      } else {
        EXPECT_NEAR(out[2 * r + 1], expected[2 * r + 1], 1e-5) << where;
      }
      if (s.kind != RowKind::kNoneFinite) {
        ASSERT_EQ(token, fwserve::SampleToken(data + static_cast<int64_t>(r) * vocab, vocab,
                                              s.params, s.host_rng, s.recent))
            << where;
      } else {
        EXPECT_EQ(token, 0) << where;
      }
      sampled += s.params.temperature != 0 && s.kind != RowKind::kNoneFinite;
      s.recent.push_back(token);
    }
  }
  EXPECT_GT(sampled, 0);
}

INSTANTIATE_TEST_SUITE_P(RowsVocab, GpuSampleChunkTest,
                         testing::Combine(testing::Values(1, 3, 63),
                                          testing::Values(65536, 50257, 4099)),
                         [](const testing::TestParamInfo<ChunkCase>& info) {
                           return absl::StrCat("R", std::get<0>(info.param), "V",
                                               std::get<1>(info.param));
                         });

// How many chunks a row takes: one block per row from 64 rows or below 2,049 ids, else
// ceil(V / 2048) up to 32; the scratch is 48 bytes a chunk, none unchunked.
TEST(GpuSampleArgsTest, ChunksPerRow) {
  using fwmodel::kernels::SampleChunksPerRow;
  EXPECT_EQ(SampleChunksPerRow(1, 65536), 32);
  EXPECT_EQ(SampleChunksPerRow(63, 65536), 32);
  EXPECT_EQ(SampleChunksPerRow(64, 65536), 1);
  EXPECT_EQ(SampleChunksPerRow(512, 65536), 1);
  EXPECT_EQ(SampleChunksPerRow(1, 1 << 20), 32);
  EXPECT_EQ(SampleChunksPerRow(1, 50257), 25);
  EXPECT_EQ(SampleChunksPerRow(3, 4099), 3);
  EXPECT_EQ(SampleChunksPerRow(1, 2048), 1);
  EXPECT_EQ(SampleChunksPerRow(1, 7), 1);
  EXPECT_EQ(sizeof(fwmodel::kernels::SampleChunkPartial), 48u);
  EXPECT_EQ(fwmodel::kernels::SampleScratchBytes(3, 65536), 3 * 32 * 48);
  EXPECT_EQ(fwmodel::kernels::SampleScratchBytes(64, 65536), 0);
  // With the filters or a mask: one block per row however few the rows.
  fwmodel::kernels::SampleArgs args;
  args.rows = 1;
  args.vocab = 65536;
  EXPECT_EQ(fwmodel::kernels::SampleLaunchChunks(args), 32);
  const double column = 1.0;
  args.top_k = args.top_p = args.min_p = &column;
  EXPECT_EQ(fwmodel::kernels::SampleLaunchChunks(args), 1);
  args.top_k = args.top_p = args.min_p = nullptr;
  const uint8_t allowed = 1;
  args.allowed = &allowed;
  EXPECT_EQ(fwmodel::kernels::SampleLaunchChunks(args), 1);
}

// The mirror refuses what LaunchSample refuses (cudaErrorInvalidValue), and does nothing
// for no rows.
TEST(GpuSampleArgsTest, RefusesWhatTheLauncherRefuses) {
  const float logits[4] = {0.0f, 1.0f, 2.0f, 3.0f};
  const double temperature = 1.0, uniform = 0.5;
  const int64_t index[1] = {2};
  const double factor = 1.5;
  double out[2] = {-7.0, -7.0};
  fwmodel::kernels::SampleArgs good;
  good.rows = 1;
  good.vocab = 4;
  good.logits = logits;
  good.temperature = &temperature;
  good.uniform = &uniform;
  good.out = out;
  EXPECT_TRUE(fwmodel::kernels::RunSampleOnHost(good));
  EXPECT_GE(out[0], 0.0);
  auto refused = [&](auto change) {
    fwmodel::kernels::SampleArgs args = good;
    change(args);
    return !fwmodel::kernels::RunSampleOnHost(args);
  };
  EXPECT_TRUE(refused([](auto& a) { a.vocab = 0; }));
  EXPECT_TRUE(refused([](auto& a) { a.rows = -1; }));
  EXPECT_TRUE(refused([](auto& a) { a.logits = nullptr; }));
  EXPECT_TRUE(refused([](auto& a) { a.uniform = nullptr; }));
  EXPECT_TRUE(refused([](auto& a) { a.penalty_width = 1; }));  // no ids, no factor
  EXPECT_TRUE(refused([&](auto& a) {
    a.penalty_width = fwmodel::kernels::kSampleMaxAdjustments + 1;
    a.penalty_index = index;
    a.penalty_factor = &factor;
  }));
  EXPECT_TRUE(refused([](auto& a) { a.bias_width = -1; }));
  std::vector<float> wide(65536, 0.0f);
  const double top_k = 2.0, top_p = 0.9, min_p = 0.0;
  EXPECT_TRUE(refused([&](auto& a) { a.top_k = &top_k; }));  // no top_p, no min_p
  EXPECT_TRUE(refused([&](auto& a) {
    a.top_k = &top_k;
    a.top_p = &top_p;
  }));
  EXPECT_TRUE(refused([&](auto& a) { a.min_p = &min_p; }));
  std::vector<uint8_t> allow_wide(65536, 1);
  EXPECT_FALSE(refused([&](auto& a) {  // nor does a mask
    a.allowed = allow_wide.data();
    a.vocab = 65536;
    a.logits = wide.data();
  }));
  EXPECT_FALSE(refused([&](auto& a) {  // the filters take no scratch however few the rows
    a.top_k = &top_k;
    a.top_p = &top_p;
    a.min_p = &min_p;
    a.vocab = 65536;
    a.logits = wide.data();
  }));
  // A chunked launch (one row of 65,536 ids: 32 chunks) without its scratch.
  EXPECT_TRUE(refused([&](auto& a) {
    a.vocab = 65536;
    a.logits = wide.data();
  }));
  EXPECT_FALSE(refused([](auto& a) {
    a.rows = 0;
    a.logits = nullptr;
  }));
}

// The crossing: u · mass just inside each token's share draws that token, at every
// position of a chunk and across the threads' chunks (a flat row of 1,000 ids at
// temperature 1: token i's running sum is i + 1 in units of p).
TEST(GpuSampleArgsTest, EachShareOfTheMassDrawsItsToken) {
  constexpr int64_t kVocab = 1000;
  std::vector<float> logits(kVocab, 0.5f);
  const double temperature = 1.0;
  for (int64_t token : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{511}, int64_t{512},
                        int64_t{998}, int64_t{999}}) {
    const double uniform = (static_cast<double>(token) + 0.5) / kVocab;
    double out[2] = {-7.0, -7.0};
    fwmodel::kernels::SampleArgs args;
    args.rows = 1;
    args.vocab = kVocab;
    args.logits = logits.data();
    args.temperature = &temperature;
    args.uniform = &uniform;
    args.out = out;
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    EXPECT_EQ(out[0], static_cast<double>(token));
    EXPECT_NEAR(out[1], -std::log(static_cast<double>(kVocab)), 1e-12);
  }
}

// The same across the chunks of a chunked launch: a flat row of 65,536 ids (32 chunks of
// 2,048 ids, 4 ids a thread), u · mass just inside the first and last ids of chunks and
// of threads.
TEST(GpuSampleArgsTest, EachShareOfTheMassDrawsItsTokenAcrossChunks) {
  constexpr int64_t kVocab = 65536;
  ASSERT_EQ(fwmodel::kernels::SampleChunksPerRow(1, kVocab), 32);
  std::vector<float> logits(kVocab, 0.5f);
  const double temperature = 1.0;
  for (int64_t token :
       {int64_t{0}, int64_t{3}, int64_t{4}, int64_t{2047}, int64_t{2048}, int64_t{2049},
        int64_t{4095}, int64_t{30000}, int64_t{63488}, int64_t{65535}}) {
    const double uniform = (static_cast<double>(token) + 0.5) / kVocab;
    double out[2] = {-7.0, -7.0};
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch(32);
    fwmodel::kernels::SampleArgs args;
    args.rows = 1;
    args.vocab = kVocab;
    args.logits = logits.data();
    args.temperature = &temperature;
    args.uniform = &uniform;
    args.out = out;
    args.partials = scratch.data();
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    EXPECT_EQ(out[0], static_cast<double>(token));
    EXPECT_NEAR(out[1], -std::log(static_cast<double>(kVocab)), 1e-12);
  }
}

// The filters' parameters of stream i in round `round`: top_k 0 (off), 1, 2, 40 or the
// vocabulary; top_p 1 (off), 0.1, 0.5 or 0.9; min_p 0, 0.05 or 0.5; cycled at different
// rates so that the rounds combine them with each temperature and penalty.
void SetFilters(size_t i, int round, int64_t vocab, SamplingParams* params) {
  const int64_t ks[] = {0, 1, 2, 40, vocab};
  const float ps[] = {1.0f, 0.1f, 0.5f, 0.9f};
  const float mins[] = {0.0f, 0.05f, 0.5f};
  const size_t r = static_cast<size_t>(round);
  params->top_k = ks[(i + r) % 5];
  params->top_p = ps[(i / 2 + r) % 4];
  params->min_p = mins[(i + 2 * r) % 3];
}

// Rounds each finite logit to a multiple of `step`: many equal logits, so that the
// filters' cuts fall among equal probabilities and the id order decides.
void Quantize(float step, int64_t vocab, float* row) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(row[i])) row[i] = std::round(row[i] / step) * step;
  }
}

// The filters (top_k, top_p, min_p; SampleArgs::top_k set: one block per row whatever
// the rows) on the CPU by the kernel's mirror draw what SampleOnDevice with filters =
// true (the LibTorch ops: a stable sort per row) and SampleToken draw: 16 streams of
// mixed rows (greedy, temperatures 0.5, 1 and 2, repetition penalties, logit biases of
// ±100 and small ones, NaN and ±inf logits, rows with no finite logit), each round with
// other filter combinations (SetFilters), half of the rows' logits rounded to integers or
// halves (ties at every cut), at the 65,536 vocabulary, at 1,000 and at 7 (fewer ids than
// threads). Tokens equal, log-probabilities within 1e-5; the filters change some draws
// (against the mirror without them).
class GpuSampleFilterTest : public testing::TestWithParam<int64_t> {};

TEST_P(GpuSampleFilterTest, HostGridFiltersAsSampleOnDeviceAndSampleToken) {
  c10::NoGradGuard no_grad;
  const int64_t vocab = GetParam();
  std::vector<Stream> streams = MakeStreams(vocab);
  const int64_t rows = static_cast<int64_t>(streams.size());
  std::mt19937_64 pick(53);
  for (size_t r = 0; r < streams.size(); ++r) {
    if (r % 3 != 2) continue;
    for (int j = 0; j < 1 + static_cast<int>(pick() % 3); ++j) {
      const int64_t id = (static_cast<int64_t>(pick() % 40) + 40 * j) % vocab;
      if (j > 0 && id <= streams[r].params.logit_bias.back().first) break;  // distinct ids
      const float value = j == 0 ? 100.0f : (j == 1 ? -100.0f : 1.5f);
      streams[r].params.logit_bias.emplace_back(id, value);
    }
  }
  std::mt19937 logits_rng(59);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int rounds = vocab > 10000 ? 6 : 40;
  int64_t filtered = 0, changed = 0;
  for (int round = 0; round < rounds; ++round) {
    torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = data + r * vocab;
      FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, row);
      if (r % 2 == 1) Quantize(r % 4 == 1 ? 1.0f : 0.5f, vocab, row);
      SetFilters(static_cast<size_t>(r), round, vocab, &streams[static_cast<size_t>(r)].params);
    }
    std::vector<RowDraw> batch(streams.size());
    size_t bias_width = 0;
    for (size_t r = 0; r < streams.size(); ++r) {
      batch[r].row = static_cast<int64_t>(r);
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      bias_width = std::max(bias_width, streams[r].params.logit_bias.size());
    }
    const Packed packed = Pack(batch, vocab);
    std::vector<int64_t> ids(static_cast<size_t>(rows) * bias_width, 0);
    std::vector<float> values(ids.size(), 0.0f);
    for (size_t r = 0; r < streams.size(); ++r) {
      const auto& bias = streams[r].params.logit_bias;
      for (size_t j = 0; j < bias.size(); ++j) {
        ids[r * bias_width + j] = bias[j].first;
        values[r * bias_width + j] = bias[j].second;
      }
    }
    const int64_t width = static_cast<int64_t>(bias_width);
    const torch::Tensor bias_index = torch::tensor(ids, torch::kInt64).view({rows, width});
    const torch::Tensor bias_value = torch::tensor(values, torch::kFloat32).view({rows, width});
    std::vector<double> out, plain_out;
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch, plain_scratch;
    fwmodel::kernels::SampleArgs plain = KernelArgs(logits, packed, &plain_out, &plain_scratch);
    plain.bias_width = width;
    plain.bias_index = ids.data();
    plain.bias_value = values.data();
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(plain));
    fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
    args.bias_width = width;
    args.bias_index = ids.data();
    args.bias_value = values.data();
    SetFilterColumns(packed, rows, &args);
    ASSERT_EQ(fwmodel::kernels::SampleLaunchChunks(args), 1);
    args.partials = nullptr;  // one block per row: no scratch
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor reference =
        fwserve::SampleOnDevice(logits, packed.column_tensor, packed.penalty_index,
                                packed.penalty_factor, /*filters=*/true, bias_index, bias_value);
    const double* expected = reference.data_ptr<double>();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const std::string where = absl::StrCat(
          "vocab ", vocab, ", round ", round, ", row ", r, ", top_k ", s.params.top_k, ", top_p ",
          s.params.top_p, ", min_p ", s.params.min_p, ", temperature ", s.params.temperature);
      const int64_t token = static_cast<int64_t>(out[2 * r]);
      ASSERT_EQ(token, static_cast<int64_t>(expected[2 * r])) << where;
      if (std::isinf(expected[2 * r + 1])) {
        EXPECT_EQ(out[2 * r + 1], expected[2 * r + 1]) << where;
      } else {
        EXPECT_NEAR(out[2 * r + 1], expected[2 * r + 1], 1e-5) << where;
      }
      if (s.kind != RowKind::kNoneFinite) {
        ASSERT_EQ(token, fwserve::SampleToken(data + static_cast<int64_t>(r) * vocab, vocab,
                                              s.params, s.host_rng, s.recent))
            << where;
      } else {
        EXPECT_EQ(token, 0) << where;
      }
      if (s.params.temperature != 0 && s.kind != RowKind::kNoneFinite &&
          fwserve::NeedsFilters(s.params, vocab)) {
        ++filtered;
        changed += out[2 * r] != plain_out[2 * r] ? 1 : 0;
      }
      s.recent.push_back(token);
    }
  }
  EXPECT_GT(filtered, rounds * 4);
  EXPECT_GT(changed, filtered / 8) << "of " << filtered << " filtered draws";
}

// 65,536: the RWKV world vocabulary; 1,000; 7: fewer ids than threads.
INSTANTIATE_TEST_SUITE_P(Vocab, GpuSampleFilterTest, testing::Values(65536, 1000, 7),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return absl::StrCat("V", info.param);
                         });

// The constraint mask (SampleArgs::allowed: one block per row, with or without the
// filters) on the CPU by the mirror draws what SampleOnDevice with `allowed` and
// SampleToken with the row's mask draw: 16 mixed rows (as above, biases included) × 20
// rounds at V = 1,000 and 3 at 65,536, each row's mask one of: none (all allowed), a
// random tenth of the ids, every id but the argmax's neighbourhood, only ids whose logit is
// −inf (no finite allowed: the first allowed id), nothing allowed (id 0, as SampleOnDevice;
// SampleToken then takes the argmax and is not compared). With filters (SetFilters) in
// odd rounds, without in even ones.
using MaskCase = std::tuple<int64_t, bool>;  // vocab, filters
class GpuSampleMaskTest : public testing::TestWithParam<MaskCase> {};

TEST_P(GpuSampleMaskTest, HostGridMasksAsSampleOnDeviceAndSampleToken) {
  c10::NoGradGuard no_grad;
  const auto [vocab, filters] = GetParam();
  std::vector<Stream> streams = MakeStreams(vocab);
  streams[2].params.logit_bias = {{3, 100.0f}, {17, -5.0f}};
  streams[9].params.logit_bias = {{1, 2.5f}};
  const int64_t rows = static_cast<int64_t>(streams.size());
  std::mt19937 logits_rng(71);
  std::mt19937_64 pick(73);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int rounds = vocab > 10000 ? 3 : 20;
  int64_t masked = 0, first_allowed_draws = 0;
  for (int round = 0; round < rounds; ++round) {
    torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    std::vector<uint8_t> mask(static_cast<size_t>(rows * vocab), 1);
    std::vector<int> kinds(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      float* row = data + r * vocab;
      uint8_t* allow = mask.data() + r * vocab;
      FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, row);
      if (r % 2 == 1) Quantize(1.0f, vocab, row);
      if (filters) {
        SetFilters(static_cast<size_t>(r), round, vocab, &streams[static_cast<size_t>(r)].params);
      }
      const int kind = static_cast<int>((static_cast<size_t>(r) + static_cast<size_t>(round)) % 5);
      kinds[static_cast<size_t>(r)] = kind;
      switch (kind) {
        case 0:  // all allowed
          break;
        case 1:  // a random tenth
          for (int64_t i = 0; i < vocab; ++i) allow[i] = pick() % 10 == 0 ? 1 : 0;
          allow[pick() % static_cast<uint64_t>(vocab)] = 1;
          break;
        case 2: {  // all but the raw argmax's neighbourhood
          const int64_t top = std::max_element(row, row + vocab) - row;
          for (int64_t i = std::max<int64_t>(0, top - 3); i < std::min(vocab, top + 4); ++i) {
            allow[i] = 0;
          }
          break;
        }
        case 3:  // only −inf logits: ids 2 and 5 at −inf
          std::fill(allow, allow + vocab, 0);
          row[std::min<int64_t>(2, vocab - 1)] = -kInf;
          row[std::min<int64_t>(5, vocab - 1)] = -kInf;
          allow[std::min<int64_t>(5, vocab - 1)] = 1;
          allow[std::min<int64_t>(2, vocab - 1)] = 1;
          break;
        default:  // nothing allowed
          std::fill(allow, allow + vocab, 0);
          break;
      }
    }
    std::vector<RowDraw> batch(streams.size());
    // SampleToken draws from a copy of the stream's state before this round's draw (it
    // draws nothing for a row that allows no finite logit, so the streams would part).
    std::vector<std::mt19937_64> host_rngs(streams.size());
    size_t bias_width = 0;
    for (size_t r = 0; r < streams.size(); ++r) {
      host_rngs[r] = streams[r].batch_rng;
      batch[r].row = static_cast<int64_t>(r);
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      bias_width = std::max(bias_width, streams[r].params.logit_bias.size());
    }
    const Packed packed = Pack(batch, vocab);
    std::vector<int64_t> ids(static_cast<size_t>(rows) * bias_width, 0);
    std::vector<float> values(ids.size(), 0.0f);
    for (size_t r = 0; r < streams.size(); ++r) {
      const auto& bias = streams[r].params.logit_bias;
      for (size_t j = 0; j < bias.size(); ++j) {
        ids[r * bias_width + j] = bias[j].first;
        values[r * bias_width + j] = bias[j].second;
      }
    }
    const int64_t width = static_cast<int64_t>(bias_width);
    const torch::Tensor bias_index = torch::tensor(ids, torch::kInt64).view({rows, width});
    const torch::Tensor bias_value = torch::tensor(values, torch::kFloat32).view({rows, width});
    const torch::Tensor allowed =
        torch::from_blob(mask.data(), {rows, vocab}, torch::kUInt8).to(torch::kBool);
    std::vector<double> out;
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
    fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
    args.bias_width = width;
    args.bias_index = ids.data();
    args.bias_value = values.data();
    if (filters) SetFilterColumns(packed, rows, &args);
    args.allowed = mask.data();
    args.partials = nullptr;  // one block per row: no scratch
    ASSERT_EQ(fwmodel::kernels::SampleLaunchChunks(args), 1);
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor reference =
        fwserve::SampleOnDevice(logits, packed.column_tensor, packed.penalty_index,
                                packed.penalty_factor, filters, bias_index, bias_value, allowed);
    const double* expected = reference.data_ptr<double>();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const uint8_t* allow = mask.data() + static_cast<int64_t>(r) * vocab;
      const std::string where =
          absl::StrCat("vocab ", vocab, ", round ", round, ", row ", r, ", mask kind ", kinds[r]);
      const int64_t token = static_cast<int64_t>(out[2 * r]);
      ASSERT_EQ(token, static_cast<int64_t>(expected[2 * r])) << where;
      if (std::isinf(expected[2 * r + 1])) {
        EXPECT_EQ(out[2 * r + 1], expected[2 * r + 1]) << where;
      } else {
        EXPECT_NEAR(out[2 * r + 1], expected[2 * r + 1], 1e-5) << where;
      }
      if (kinds[r] != 4) {
        EXPECT_NE(allow[token], 0) << where;
        ASSERT_EQ(token, fwserve::SampleToken(data + static_cast<int64_t>(r) * vocab, vocab,
                                              s.params, host_rngs[r], s.recent, allow))
            << where;
        masked += kinds[r] != 0 ? 1 : 0;
      } else {
        EXPECT_EQ(token, 0) << where;
      }
      first_allowed_draws += kinds[r] == 3 && token == std::min<int64_t>(2, vocab - 1) ? 1 : 0;
      s.recent.push_back(token);
    }
  }
  EXPECT_GT(masked, rounds * 8);
  EXPECT_GT(first_allowed_draws, rounds * 2);
}

INSTANTIATE_TEST_SUITE_P(VocabFilters, GpuSampleMaskTest,
                         testing::Combine(testing::Values(1000, 65536), testing::Bool()),
                         [](const testing::TestParamInfo<MaskCase>& info) {
                           return absl::StrCat("V", std::get<0>(info.param),
                                               std::get<1>(info.param) ? "Filters" : "Plain");
                         });

// One row of filtered draws on the mirror: flat or stepped logits, temperature 1.
struct FilterCase {
  std::vector<float> logits;
  double top_k, top_p, min_p;
};

double FilteredDraw(const FilterCase& c, double uniform) {
  const double temperature = 1.0;
  double out[2] = {-7.0, -7.0};
  fwmodel::kernels::SampleArgs args;
  args.rows = 1;
  args.vocab = static_cast<int64_t>(c.logits.size());
  args.logits = c.logits.data();
  args.temperature = &temperature;
  args.uniform = &uniform;
  args.top_k = &c.top_k;
  args.top_p = &c.top_p;
  args.min_p = &c.min_p;
  args.out = out;
  EXPECT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
  return out[0];
}

// The cuts among equal probabilities keep the lowest ids: a flat row of 1,000 ids with
// top_k 10 keeps ids 0-9 (each a tenth of the mass), with top_p 0.25 the first 250 ids
// (the running share 0.001 · m reaches 0.25 at m = 250, summed in order), with both the
// first 3 (top_p takes shares of top_k's kept mass: 0.1 each).
// Stepped logits (ids 500-599 one above the rest: p = 1 there, 1/e elsewhere): top_k 150
// keeps 500-599 and then 0-49 (the draw in id order: 0-49 first); top_k 1.5 (ranks < 1.5)
// the two lowest ids of the step; min_p 0.5 (> 1/e) the step, min_p = expf(−1) all (only
// a p below min_p goes); top_p 0.5 the step and then the
// m lowest ids of the rest whose share reaches half of T = 100 + 900/e.
TEST(GpuSampleArgsTest, FilterCutsAmongEqualsKeepTheLowestIds) {
  FilterCase flat{std::vector<float>(1000, 0.25f), 10.0, 1.0, 0.0};
  for (int j = 0; j < 10; ++j) EXPECT_EQ(FilteredDraw(flat, (j + 0.5) / 10), j) << j;
  flat.top_k = 1000.0;
  flat.top_p = 0.25;
  EXPECT_EQ(FilteredDraw(flat, 0.0), 0.0);
  EXPECT_EQ(FilteredDraw(flat, 0.999), 249.0);
  EXPECT_EQ(FilteredDraw(flat, 0.5), 125.0);
  flat.top_k = 10.0;
  EXPECT_EQ(FilteredDraw(flat, 0.999), 2.0);
  EXPECT_EQ(FilteredDraw(flat, 0.5), 1.0);
  FilterCase step{std::vector<float>(1000, 0.0f), 150.0, 1.0, 0.0};
  for (int i = 500; i < 600; ++i) step.logits[static_cast<size_t>(i)] = 1.0f;
  const double e = std::exp(1.0);
  double mass = 100.0 + 50.0 / e;
  EXPECT_EQ(FilteredDraw(step, 0.0), 0.0);
  EXPECT_EQ(FilteredDraw(step, 49.5 / e / mass), 49.0);
  EXPECT_EQ(FilteredDraw(step, (50.0 / e + 0.5) / mass), 500.0);
  EXPECT_EQ(FilteredDraw(step, 0.9999), 599.0);
  step.top_k = 1.5;  // ranks 0 and 1
  EXPECT_EQ(FilteredDraw(step, 0.4), 500.0);
  EXPECT_EQ(FilteredDraw(step, 0.6), 501.0);
  step.top_k = 1000.0;
  step.min_p = 0.5;
  EXPECT_EQ(FilteredDraw(step, 0.0), 500.0);
  EXPECT_EQ(FilteredDraw(step, 0.9999), 599.0);
  step.min_p = static_cast<double>(std::exp(-1.0f));  // the rest's p: not below, kept
  EXPECT_EQ(FilteredDraw(step, 0.0), 0.0);
  step.min_p = 0.0;
  step.top_p = 0.5;
  const double m = std::ceil((0.5 * (100.0 + 900.0 / e) - 100.0) * e);  // 315
  ASSERT_EQ(m, 315.0);
  mass = 100.0 + m / e;
  EXPECT_EQ(FilteredDraw(step, 0.0), 0.0);
  EXPECT_EQ(FilteredDraw(step, (m - 0.5) / e / mass), m - 1);
  EXPECT_EQ(FilteredDraw(step, (m + 0.5) / e / mass), 500.0);
}

#if defined(FWSERVE_CUDA_TESTS)
// On a GPU (built where LibTorch has CUDA; scripts/gpu/check.py runs *CudaEquivalence*):
// SampleOnDevice with filters = false on CUDA float32 logits (the sampling kernel where
// models/gpu built it) against the CPU mirror of its grid and against the LibTorch ops on
// the CPU (filters = true, every filter off: the same draws through the sort), 16 mixed rows
// × 10 rounds at V = 65,536 (chunked) and 1,000, with a penalty and a bias, and batches of
// 512 rows and of 1, 3 and 63 (chunked). The mirror's float64 sums are the kernel's; only expf
// differs (CUDA's against glibc's, an ulp or two), so at most one token in all may differ (a draw
// within rounding of a boundary) and the log-probabilities agree within 1e-5.
TEST(GpuSampleCudaEquivalenceTest, KernelDrawsWhatItsMirrorAndTheOpsDraw) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  int mismatches = 0, op_mismatches = 0, draws = 0;
  for (int64_t vocab : {int64_t{65536}, int64_t{1000}}) {
    std::vector<Stream> streams = MakeStreams(vocab);
    streams[2].params.logit_bias = {{3, 100.0f}, {17, -5.0f}};
    streams[6].params.logit_bias = {{1, 2.5f}};
    const int64_t rows = static_cast<int64_t>(streams.size());
    std::mt19937 logits_rng(41);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (int round = 0; round < 10; ++round) {
      torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
      float* data = logits.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, data + r * vocab);
      }
      std::vector<RowDraw> batch(streams.size());
      for (size_t r = 0; r < streams.size(); ++r) {
        batch[r].row = static_cast<int64_t>(r);
        batch[r].params = &streams[r].params;
        batch[r].recent = &streams[r].recent;
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      const Packed packed = Pack(batch, vocab);
      const int64_t bias_width = 2;
      std::vector<int64_t> ids(static_cast<size_t>(rows * bias_width), 0);
      std::vector<float> values(ids.size(), 0.0f);
      for (size_t r = 0; r < streams.size(); ++r) {
        const auto& bias = streams[r].params.logit_bias;
        for (size_t j = 0; j < bias.size(); ++j) {
          ids[r * bias_width + j] = bias[j].first;
          values[r * bias_width + j] = bias[j].second;
        }
      }
      std::vector<double> out;
      std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
      fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
      args.bias_width = bias_width;
      args.bias_index = ids.data();
      args.bias_value = values.data();
      ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
      const torch::Tensor bias_index =
          torch::tensor(ids, torch::kInt64).view({rows, bias_width}).to(cuda);
      const torch::Tensor bias_value =
          torch::tensor(values, torch::kFloat32).view({rows, bias_width}).to(cuda);
      const torch::Tensor columns = packed.column_tensor.to(cuda);
      torch::Tensor penalty_index, penalty_factor;
      if (packed.width > 0) {
        penalty_index = packed.penalty_index.to(cuda);
        penalty_factor = packed.penalty_factor.to(cuda);
      }
      const torch::Tensor on_cuda = logits.to(cuda);
      const torch::Tensor kernel =
          fwserve::SampleOnDevice(on_cuda, columns, penalty_index, penalty_factor,
                                  /*filters=*/false, bias_index, bias_value)
              .cpu();
      // The LibTorch ops on the CPU (on CUDA, filters = true is the kernel's too).
      const torch::Tensor ops = fwserve::SampleOnDevice(
          logits, packed.column_tensor, packed.penalty_index, packed.penalty_factor,
          /*filters=*/true, bias_index.cpu(), bias_value.cpu());
      const double* got = kernel.data_ptr<double>();
      const double* by_ops = ops.data_ptr<double>();
      for (int64_t r = 0; r < rows; ++r) {
        const std::string where = absl::StrCat("vocab ", vocab, ", round ", round, ", row ", r);
        ++draws;
        if (got[2 * r] != out[2 * r]) {
          ++mismatches;
          continue;
        }
        if (got[2 * r] != by_ops[2 * r]) ++op_mismatches;
        if (std::isinf(out[2 * r + 1])) {
          EXPECT_EQ(got[2 * r + 1], out[2 * r + 1]) << where;
        } else {
          EXPECT_NEAR(got[2 * r + 1], out[2 * r + 1], 1e-5) << where;
        }
        streams[static_cast<size_t>(r)].recent.push_back(static_cast<int64_t>(got[2 * r]));
      }
    }
  }
  EXPECT_LE(mismatches, 1) << "of " << draws << " draws against the mirror";
  EXPECT_LE(op_mismatches, 1) << "of " << draws << " draws against the LibTorch ops";
  // Batches of 512 rows (one block per row) and of 1, 3 and 63 rows (chunked: 32 blocks
  // per row, four launches) at V = 65,536, temperature 1 (every fifth row greedy), no
  // penalty.
  for (const int64_t rows : {int64_t{512}, int64_t{1}, int64_t{3}, int64_t{63}}) {
    const int64_t vocab = 65536;
    torch::Tensor logits = torch::randn({rows, vocab}, torch::kFloat32) * 3;
    std::vector<double> columns(static_cast<size_t>(fwserve::kSampleColumns * rows), 0.0);
    std::mt19937_64 rng(43 + rows);
    for (int64_t r = 0; r < rows; ++r) {
      columns[static_cast<size_t>(fwserve::kSampleTemperature * rows + r)] = r % 5 == 4 ? 0.0 : 1.0;
      columns[static_cast<size_t>(fwserve::kSampleUniform * rows + r)] =
          fwserve::CanonicalDraw(rng);
      columns[static_cast<size_t>(fwserve::kSampleTopK * rows + r)] = static_cast<double>(vocab);
      columns[static_cast<size_t>(fwserve::kSampleTopP * rows + r)] = 1.0;
      columns[static_cast<size_t>(fwserve::kSampleRow * rows + r)] = static_cast<double>(r);
    }
    std::vector<double> out(static_cast<size_t>(2 * rows));
    std::vector<fwmodel::kernels::SampleChunkPartial> scratch(
        static_cast<size_t>(rows * fwmodel::kernels::SampleChunksPerRow(rows, vocab)));
    fwmodel::kernels::SampleArgs args;
    args.rows = rows;
    args.vocab = vocab;
    args.logits = logits.data_ptr<float>();
    args.temperature = columns.data() + fwserve::kSampleTemperature * rows;
    args.uniform = columns.data() + fwserve::kSampleUniform * rows;
    args.out = out.data();
    args.partials = scratch.data();
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor column_tensor =
        torch::tensor(columns, torch::kFloat64).view({fwserve::kSampleColumns, rows}).to(cuda);
    const torch::Tensor kernel =
        fwserve::SampleOnDevice(logits.to(cuda), column_tensor, {}, {}, /*filters=*/false).cpu();
    const double* got = kernel.data_ptr<double>();
    int wide_mismatches = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (got[2 * r] != out[2 * r]) {
        ++wide_mismatches;
        continue;
      }
      EXPECT_NEAR(got[2 * r + 1], out[2 * r + 1], 1e-5) << "rows " << rows << ", row " << r;
    }
    EXPECT_LE(wide_mismatches, 1) << "of " << rows << " rows";
  }
}

// The filters on a GPU: SampleOnDevice with filters = true on CUDA float32 logits (the
// filtered kernel where models/gpu built it: one block per row) against the CPU mirror and
// against the LibTorch ops on the CPU (the stable sort), 16 mixed rows (SetFilters' top_k,
// top_p and min_p per round, half the rows' logits rounded to integers or halves: ties at
// the cuts, penalties, biases, non-finite logits; in odd rounds a constraint mask on a
// quarter of the rows) × 6 rounds at V = 65,536 and 1,000,
// then batches of 1, 3 (few rows: still one block per row) and 512 rows at V = 65,536
// with mixed filters. As above, expf differs (CUDA's against glibc's), so at most one
// token in each comparison may differ and the log-probabilities agree within 1e-5.
TEST(GpuSampleCudaEquivalenceTest, FilteredKernelDrawsWhatItsMirrorAndTheOpsDraw) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no usable CUDA device";
  c10::NoGradGuard no_grad;
  const torch::Device cuda(torch::kCUDA);
  int mismatches = 0, op_mismatches = 0, draws = 0;
  for (int64_t vocab : {int64_t{65536}, int64_t{1000}}) {
    std::vector<Stream> streams = MakeStreams(vocab);
    streams[2].params.logit_bias = {{3, 100.0f}, {17, -5.0f}};
    streams[6].params.logit_bias = {{1, 2.5f}};
    const int64_t rows = static_cast<int64_t>(streams.size());
    std::mt19937 logits_rng(61);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (int round = 0; round < 6; ++round) {
      torch::Tensor logits = torch::empty({rows, vocab}, torch::kFloat32);
      float* data = logits.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        float* row = data + r * vocab;
        FillRow(streams[static_cast<size_t>(r)].kind, vocab, normal, logits_rng, row);
        if (r % 2 == 1) Quantize(r % 4 == 1 ? 1.0f : 0.5f, vocab, row);
        SetFilters(static_cast<size_t>(r), round, vocab, &streams[static_cast<size_t>(r)].params);
      }
      std::vector<RowDraw> batch(streams.size());
      for (size_t r = 0; r < streams.size(); ++r) {
        batch[r].row = static_cast<int64_t>(r);
        batch[r].params = &streams[r].params;
        batch[r].recent = &streams[r].recent;
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
      const Packed packed = Pack(batch, vocab);
      const int64_t bias_width = 2;
      std::vector<int64_t> ids(static_cast<size_t>(rows * bias_width), 0);
      std::vector<float> values(ids.size(), 0.0f);
      for (size_t r = 0; r < streams.size(); ++r) {
        const auto& bias = streams[r].params.logit_bias;
        for (size_t j = 0; j < bias.size(); ++j) {
          ids[r * bias_width + j] = bias[j].first;
          values[r * bias_width + j] = bias[j].second;
        }
      }
      // Odd rounds: a mask, rows r % 4 == 3 allowing a random tenth of the ids.
      std::vector<uint8_t> mask(static_cast<size_t>(rows * vocab), 1);
      for (int64_t r = 3; r < rows; r += 4) {
        for (int64_t i = 0; i < vocab; ++i) {
          mask[static_cast<size_t>(r * vocab + i)] = logits_rng() % 10 == 0 ? 1 : 0;
        }
      }
      const torch::Tensor allowed =
          round % 2 == 1
              ? torch::from_blob(mask.data(), {rows, vocab}, torch::kUInt8).to(torch::kBool)
              : torch::Tensor();
      std::vector<double> out;
      std::vector<fwmodel::kernels::SampleChunkPartial> scratch;
      fwmodel::kernels::SampleArgs args = KernelArgs(logits, packed, &out, &scratch);
      args.bias_width = bias_width;
      args.bias_index = ids.data();
      args.bias_value = values.data();
      if (allowed.defined()) args.allowed = mask.data();
      SetFilterColumns(packed, rows, &args);
      ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
      const torch::Tensor bias_index = torch::tensor(ids, torch::kInt64).view({rows, bias_width});
      const torch::Tensor bias_value =
          torch::tensor(values, torch::kFloat32).view({rows, bias_width});
      torch::Tensor penalty_index, penalty_factor;
      if (packed.width > 0) {
        penalty_index = packed.penalty_index.to(cuda);
        penalty_factor = packed.penalty_factor.to(cuda);
      }
      const torch::Tensor kernel =
          fwserve::SampleOnDevice(logits.to(cuda), packed.column_tensor.to(cuda), penalty_index,
                                  penalty_factor, /*filters=*/true, bias_index.to(cuda),
                                  bias_value.to(cuda),
                                  allowed.defined() ? allowed.to(cuda) : torch::Tensor())
              .cpu();
      const torch::Tensor ops = fwserve::SampleOnDevice(
          logits, packed.column_tensor, packed.penalty_index, packed.penalty_factor,
          /*filters=*/true, bias_index, bias_value, allowed);
      const double* got = kernel.data_ptr<double>();
      const double* by_ops = ops.data_ptr<double>();
      for (int64_t r = 0; r < rows; ++r) {
        const std::string where = absl::StrCat("vocab ", vocab, ", round ", round, ", row ", r);
        ++draws;
        if (got[2 * r] != by_ops[2 * r]) ++op_mismatches;
        if (got[2 * r] != out[2 * r]) {
          ++mismatches;
          continue;
        }
        if (std::isinf(out[2 * r + 1])) {
          EXPECT_EQ(got[2 * r + 1], out[2 * r + 1]) << where;
        } else {
          EXPECT_NEAR(got[2 * r + 1], out[2 * r + 1], 1e-5) << where;
        }
        streams[static_cast<size_t>(r)].recent.push_back(static_cast<int64_t>(got[2 * r]));
      }
    }
  }
  EXPECT_LE(mismatches, 1) << "of " << draws << " draws against the mirror";
  EXPECT_LE(op_mismatches, 1) << "of " << draws << " draws against the LibTorch ops";
  for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{512}}) {
    const int64_t vocab = 65536;
    torch::Tensor logits = torch::randn({rows, vocab}, torch::kFloat32) * 3;
    logits.slice(0, 0, rows, 2).round_();  // ties in every other row
    std::vector<double> columns(static_cast<size_t>(fwserve::kSampleColumns * rows), 0.0);
    std::mt19937_64 rng(67 + rows);
    const double ks[] = {1, 2, 40, static_cast<double>(vocab)}, ps[] = {0.1, 0.5, 0.9, 1.0},
                 mins[] = {0.0, 0.05, 0.5};
    auto at = [&](int column, int64_t r) -> double& {
      return columns[static_cast<size_t>(column * rows + r)];
    };
    for (int64_t r = 0; r < rows; ++r) {
      at(fwserve::kSampleTemperature, r) = r % 5 == 4 ? 0.0 : 1.0;
      at(fwserve::kSampleUniform, r) = fwserve::CanonicalDraw(rng);
      at(fwserve::kSampleTopK, r) = ks[r % 4];
      at(fwserve::kSampleTopP, r) = static_cast<double>(static_cast<float>(ps[(r / 4) % 4]));
      at(fwserve::kSampleMinP, r) = static_cast<double>(static_cast<float>(mins[r % 3]));
      at(fwserve::kSampleRow, r) = static_cast<double>(r);
    }
    std::vector<double> out(static_cast<size_t>(2 * rows));
    fwmodel::kernels::SampleArgs args;
    args.rows = rows;
    args.vocab = vocab;
    args.logits = logits.data_ptr<float>();
    args.temperature = columns.data() + fwserve::kSampleTemperature * rows;
    args.uniform = columns.data() + fwserve::kSampleUniform * rows;
    args.top_k = columns.data() + fwserve::kSampleTopK * rows;
    args.top_p = columns.data() + fwserve::kSampleTopP * rows;
    args.min_p = columns.data() + fwserve::kSampleMinP * rows;
    args.out = out.data();
    ASSERT_TRUE(fwmodel::kernels::RunSampleOnHost(args));
    const torch::Tensor column_tensor =
        torch::tensor(columns, torch::kFloat64).view({fwserve::kSampleColumns, rows});
    const torch::Tensor kernel =
        fwserve::SampleOnDevice(logits.to(cuda), column_tensor.to(cuda), {}, {}, /*filters=*/true)
            .cpu();
    const double* got = kernel.data_ptr<double>();
    int wide_mismatches = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (got[2 * r] != out[2 * r]) {
        ++wide_mismatches;
        continue;
      }
      EXPECT_NEAR(got[2 * r + 1], out[2 * r + 1], 1e-5) << "rows " << rows << ", row " << r;
    }
    EXPECT_LE(wide_mismatches, 1) << "of " << rows << " rows";
  }
}
#endif

}  // namespace
