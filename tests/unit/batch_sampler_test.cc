// The batched sampler (models/sampling/batch_sampler.h), run on the CPU, draws what the host
// sampler (models/sampling/sampler.h) draws. The same seeds give the same tokens, row by row,
// over every filter and their combinations, and the same log-probabilities. Each
// stream's generator is consumed identically, so the streams agree over many rounds. The
// rows are picked out of a larger pool of logits by index, as the engine's are.
#include "models/sampling/batch_sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"

namespace {

using fwserve::RowDraw;
using fwserve::SampledToken;
using fwserve::SamplingParams;

constexpr int64_t kVocab = 256;

struct Stream {
  SamplingParams params;
  std::vector<int64_t> recent;
  std::mt19937_64 host_rng, batch_rng;
};

// 48 streams with parameters from every filter's range, combined.
std::vector<Stream> MakeStreams() {
  std::mt19937_64 pick(5);
  const float temperatures[] = {0.0f, 0.7f, 1.0f, 1.6f};
  const int32_t top_ks[] = {0, 1, 5, 40, 300};
  const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.05f};
  const float min_ps[] = {0.0f, 0.05f, 0.3f};
  const float penalties[] = {1.0f, 1.3f, 0.8f};
  std::vector<Stream> streams(48);
  for (size_t i = 0; i < streams.size(); ++i) {
    Stream& s = streams[i];
    s.params.temperature = temperatures[pick() % 4];
    s.params.top_k = top_ks[pick() % 5];
    s.params.top_p = top_ps[pick() % 4];
    s.params.min_p = min_ps[pick() % 3];
    s.params.repetition_penalty = penalties[pick() % 3];
    s.params.seed = 1000 + i;
    s.host_rng.seed(s.params.seed);
    s.batch_rng.seed(s.params.seed);
    // Repeats and ids outside the vocabulary, which the penalty skips.
    for (int j = 0; j < static_cast<int>(pick() % 12); ++j) {
      s.recent.push_back(j % 5 == 4 ? (j % 2 ? -1 : kVocab + 3)
                                    : static_cast<int64_t>(pick() % 20));
    }
  }
  return streams;
}

// [rows, kVocab] float32 logits drawn from `normal`.
torch::Tensor RandomLogits(int64_t rows, std::normal_distribution<float>& normal,
                           std::mt19937& rng) {
  torch::Tensor logits = torch::empty({rows, kVocab}, torch::kFloat32);
  float* data = logits.data_ptr<float>();
  for (int64_t i = 0; i < rows * kVocab; ++i) data[i] = normal(rng);
  return logits;
}

// One draw per stream, stream r on logits row r; each stream's batch generator advances
// as SampleToken advances its host one.
std::vector<RowDraw> DrawsInRowOrder(std::vector<Stream>& streams) {
  std::vector<RowDraw> batch(streams.size());
  for (size_t r = 0; r < streams.size(); ++r) {
    batch[r].row = static_cast<int64_t>(r);
    batch[r].params = &streams[r].params;
    batch[r].recent = &streams[r].recent;
    if (streams[r].params.temperature != 0) {
      batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
    }
  }
  return batch;
}

TEST(BatchSamplerTest, DrawsWhatTheHostSamplerDrawsForTheSameSeeds) {
  std::vector<Stream> streams = MakeStreams();
  std::mt19937 logits_rng(3);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int64_t draws = 0, non_greedy = 0, distinct_tokens = 0;
  std::vector<bool> seen(kVocab, false);
  for (int round = 0; round < 40; ++round) {
    const int64_t rows = static_cast<int64_t>(streams.size());
    torch::Tensor logits = torch::empty({rows, kVocab}, torch::kFloat32);
    float* data = logits.data_ptr<float>();
    for (int64_t i = 0; i < rows * kVocab; ++i) data[i] = normal(logits_rng);
    // Some non-finite logits (treated as -inf), and exact ties for the top-k boundary.
    data[3] = std::numeric_limits<float>::quiet_NaN();
    data[kVocab + 7] = std::numeric_limits<float>::infinity();
    data[2 * kVocab + 9] = -std::numeric_limits<float>::infinity();
    data[3 * kVocab + 1] = data[3 * kVocab + 2] = data[3 * kVocab + 5] = 8.0f;
    std::vector<RowDraw> batch(streams.size());
    for (size_t r = 0; r < streams.size(); ++r) {
      batch[r].params = &streams[r].params;
      batch[r].recent = &streams[r].recent;
      if (streams[r].params.temperature != 0) {
        batch[r].uniform = fwserve::CanonicalDraw(streams[r].batch_rng);
      }
    }
    // The rows live in a larger pool, in reverse order after 3 unused rows.
    torch::Tensor pool = torch::full({rows + 3, kVocab}, 100.0f);
    for (int64_t r = 0; r < rows; ++r) pool[rows + 2 - r] = logits[r];
    for (size_t r = 0; r < batch.size(); ++r) batch[r].row = rows + 2 - static_cast<int64_t>(r);
    auto sampled = fwserve::SampleRows(pool, batch);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    ASSERT_EQ(sampled->size(), streams.size());
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const float* row = data + r * kVocab;
      const int64_t expected = fwserve::SampleToken(row, kVocab, s.params, s.host_rng, s.recent);
      const SampledToken& got = (*sampled)[r];
      ASSERT_EQ(got.token, expected) << "round " << round << ", row " << r;
      EXPECT_NEAR(got.logprob, fwserve::TokenLogProb(row, kVocab, expected), 1e-5)
          << "round " << round << ", row " << r;
      ++draws;
      non_greedy += s.params.temperature != 0;
      if (!seen[static_cast<size_t>(got.token)]) ++distinct_tokens;
      seen[static_cast<size_t>(got.token)] = true;
      s.recent.push_back(got.token);
    }
  }
  EXPECT_EQ(draws, 40 * 48);
  EXPECT_GT(non_greedy, 1000);
  EXPECT_GT(distinct_tokens, 50);  // it samples, not only argmaxes
  // Each stream's generator is where the host sampler's is.
  for (Stream& s : streams) EXPECT_EQ(s.host_rng(), s.batch_rng());
}

// Rows without the ranked filters (top_k off or past the vocabulary, top_p 1, min_p 0) are
// sampled without the sort (NeedsFilters false, SampleRows' plain path, the graph step's
// plain capture): the same tokens as the host sampler, and bit for bit what the filtered
// path gives on the same parameters.
TEST(BatchSamplerTest, RowsWithoutFiltersSkipTheSortAndDrawTheSame) {
  std::vector<Stream> streams = MakeStreams();
  for (Stream& s : streams) {
    s.params.top_k = s.params.top_k == 300 ? 300 : 0;
    s.params.top_p = 1.0f;
    s.params.min_p = 0.0f;
    EXPECT_FALSE(fwserve::NeedsFilters(s.params, kVocab));
  }
  SamplingParams filtered;
  filtered.top_k = 40;
  EXPECT_TRUE(fwserve::NeedsFilters(filtered, kVocab));
  filtered.top_k = 0;
  filtered.min_p = 0.1f;
  EXPECT_TRUE(fwserve::NeedsFilters(filtered, kVocab));
  std::mt19937 logits_rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = static_cast<int64_t>(streams.size());
  for (int round = 0; round < 20; ++round) {
    const torch::Tensor logits = RandomLogits(rows, normal, logits_rng);
    const float* data = logits.data_ptr<float>();
    const std::vector<RowDraw> batch = DrawsInRowOrder(streams);
    const int64_t width = fwserve::PenaltyWidth(batch);
    std::vector<double> columns(static_cast<size_t>(fwserve::kSampleColumns * rows));
    std::vector<int64_t> index(static_cast<size_t>(rows * width));
    std::vector<double> factor(static_cast<size_t>(rows));
    ASSERT_TRUE(
        fwserve::PackDraws(batch, kVocab, width, columns.data(), index.data(), factor.data()));
    const torch::Tensor column_tensor =
        torch::tensor(columns, torch::kFloat64).view({fwserve::kSampleColumns, rows});
    torch::Tensor penalty_index, penalty_factor;
    if (width > 0) {
      penalty_index = torch::tensor(index, torch::kInt64).view({rows, width});
      penalty_factor = torch::tensor(factor, torch::kFloat64).view({rows, 1});
    }
    const torch::Tensor with = fwserve::SampleOnDevice(logits, column_tensor, penalty_index,
                                                       penalty_factor, /*filters=*/true);
    const torch::Tensor without = fwserve::SampleOnDevice(logits, column_tensor, penalty_index,
                                                          penalty_factor, /*filters=*/false);
    ASSERT_TRUE(torch::equal(with, without)) << "round " << round;
    auto sampled = fwserve::SampleRows(logits, batch);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const int64_t expected =
          fwserve::SampleToken(data + r * kVocab, kVocab, s.params, s.host_rng, s.recent);
      ASSERT_EQ((*sampled)[r].token, expected) << "round " << round << ", row " << r;
      ASSERT_EQ(static_cast<int64_t>(without[static_cast<int64_t>(r)][0].item<double>()), expected);
      s.recent.push_back(expected);
    }
  }
}

// logit_bias (issue 51): rows with biases (some ±100, ids outside the vocabulary skipped),
// with and without the other filters, draw what the host sampler draws.
TEST(BatchSamplerTest, LogitBiasDrawsWhatTheHostSamplerDraws) {
  std::vector<Stream> streams = MakeStreams();
  std::mt19937_64 pick(17);
  for (size_t i = 0; i < streams.size(); ++i) {
    if (i % 3 == 0) continue;  // some rows without a bias, in the same batch
    std::set<int64_t> ids;
    while (ids.size() < 1 + pick() % 6) ids.insert(static_cast<int64_t>(pick() % (kVocab + 4)));
    for (int64_t id : ids) {
      const float value = pick() % 5 == 0 ? (pick() % 2 ? 100.0f : -100.0f)
                                          : static_cast<float>(pick() % 1000) / 100.0f - 5.0f;
      streams[i].params.logit_bias.emplace_back(id, value);
    }
    ASSERT_TRUE(streams[i].params.Validate().ok());
  }
  std::mt19937 logits_rng(21);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = static_cast<int64_t>(streams.size());
  for (int round = 0; round < 20; ++round) {
    const torch::Tensor logits = RandomLogits(rows, normal, logits_rng);
    const float* data = logits.data_ptr<float>();
    const std::vector<RowDraw> batch = DrawsInRowOrder(streams);
    auto sampled = fwserve::SampleRows(logits, batch);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const float* row = data + r * kVocab;
      const int64_t expected = fwserve::SampleToken(row, kVocab, s.params, s.host_rng, s.recent);
      ASSERT_EQ((*sampled)[r].token, expected) << "round " << round << ", row " << r;
      EXPECT_NEAR((*sampled)[r].logprob, fwserve::TokenLogProb(row, kVocab, expected), 1e-5);
      s.recent.push_back(expected);
    }
  }
}

// Structured output's path on a GPU: a constraint's mask goes up with the draw's
// parameters (SampleRows), and the rows draw what SampleToken draws with the same mask,
// beside rows without one, with every filter and bias in play.
TEST(BatchSamplerTest, AConstraintMaskDrawsWhatTheHostSamplerDraws) {
  std::vector<Stream> streams = MakeStreams();
  std::mt19937_64 pick(29);
  std::vector<std::vector<uint8_t>> masks(streams.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    if (i % 4 == 1) continue;  // rows without a mask, in the same batch
    masks[i].assign(kVocab, 0);
    const int allowed = 1 + static_cast<int>(pick() % 12);
    for (int j = 0; j < allowed; ++j) masks[i][pick() % kVocab] = 1;
    if (i % 5 == 0)
      streams[i].params.logit_bias = {{static_cast<int64_t>(pick() % kVocab), 100.0f}};
  }
  std::mt19937 logits_rng(31);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = static_cast<int64_t>(streams.size());
  for (int round = 0; round < 20; ++round) {
    const torch::Tensor logits = RandomLogits(rows, normal, logits_rng);
    const float* data = logits.data_ptr<float>();
    std::vector<RowDraw> batch = DrawsInRowOrder(streams);
    for (size_t r = 0; r < streams.size(); ++r) {
      if (!masks[r].empty()) batch[r].allowed = masks[r].data();
    }
    auto sampled = fwserve::SampleRows(logits, batch);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    for (size_t r = 0; r < streams.size(); ++r) {
      Stream& s = streams[r];
      const float* row = data + r * kVocab;
      const uint8_t* mask = masks[r].empty() ? nullptr : masks[r].data();
      const int64_t expected =
          fwserve::SampleToken(row, kVocab, s.params, s.host_rng, s.recent, mask);
      ASSERT_EQ((*sampled)[r].token, expected) << "round " << round << ", row " << r;
      if (mask != nullptr) {
        EXPECT_EQ(mask[expected], 1) << "round " << round << ", row " << r;
      }
      EXPECT_NEAR((*sampled)[r].logprob, fwserve::TokenLogProb(row, kVocab, expected), 1e-5);
      s.recent.push_back(expected);
    }
  }
}

TEST(BatchSamplerTest, EdgeRowsFollowTheHostRules) {
  SamplingParams sample;  // temperature 1
  SamplingParams greedy;
  greedy.temperature = 0;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  torch::Tensor logits = torch::full({3, 4}, -inf);
  logits[0][2] = nan;                                   // every logit non-finite: id 0
  logits[1] = torch::tensor({1.0f, 5.0f, 5.0f, 2.0f});  // greedy tie: the lowest id
  logits[2] = torch::tensor({-inf, 3.0f, -inf, -inf});  // one finite logit: always it
  std::vector<RowDraw> draws = {
      {-1, &sample, 0.5, nullptr}, {-1, &greedy, 0, nullptr}, {-1, &sample, 0.999, nullptr}};
  auto sampled = fwserve::SampleRows(logits, draws);
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_EQ((*sampled)[0].token, 0);
  EXPECT_TRUE(std::isinf((*sampled)[0].logprob));
  EXPECT_EQ((*sampled)[1].token, 1);
  EXPECT_NEAR((*sampled)[1].logprob, std::log(1.0 / (std::exp(-4.0) + 2 + std::exp(-3.0))), 1e-6);
  EXPECT_EQ((*sampled)[2].token, 1);
  EXPECT_NEAR((*sampled)[2].logprob, 0.0, 1e-7);
}

TEST(BatchSamplerTest, BadArgumentsAreRefused) {
  SamplingParams params;
  std::vector<RowDraw> two = {{-1, &params, 0.1, nullptr}, {-1, &params, 0.2, nullptr}};
  EXPECT_EQ(fwserve::SampleRows(torch::zeros({3, 8}), two).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fwserve::SampleRows(torch::zeros({8}), two).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<RowDraw> outside = {{3, &params, 0.1, nullptr}};
  auto bad_row = fwserve::SampleRows(torch::zeros({3, 8}), outside);
  EXPECT_EQ(bad_row.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_row.status().message().find("draw 0: row 3 is not a row of logits [3, vocab]"),
            std::string::npos)
      << bad_row.status();
  std::vector<RowDraw> missing = {{-1, nullptr, 0.1, nullptr}};
  auto refused = fwserve::SampleRows(torch::zeros({1, 8}), missing);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("draw 0 has no sampling params"), std::string::npos);
  auto empty = fwserve::SampleRows(torch::zeros({0, 8}), {});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

}  // namespace
