#include "models/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace {

using fwserve::SampleToken;
using fwserve::SamplingParams;

TEST(SamplerTest, ZeroTemperatureIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f};
  SamplingParams p;
  p.temperature = 0;
  std::mt19937_64 rng(1);
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng), 1);
}

TEST(SamplerTest, TopKOneIsGreedy) {
  std::vector<float> logits = {0.1f, 0.2f, 3.0f, 0.0f};
  SamplingParams p;
  p.top_k = 1;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(SampleToken(logits.data(), 4, p, rng), 2);
}

TEST(SamplerTest, FrequenciesFollowSoftmax) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  std::mt19937_64 rng(7);
  std::map<int64_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[SampleToken(logits.data(), 3, p, rng)];
  EXPECT_NEAR(counts[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(counts[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(counts[2] / double(n), 0.2, 0.02);
}

TEST(SamplerTest, TopPKeepsTheSmallestNucleus) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  p.top_p = 0.75f;  // 0.5 + 0.3 reaches it: token 2 is never drawn
  std::mt19937_64 rng(3);
  std::map<int64_t, int> counts;
  for (int i = 0; i < 5000; ++i) ++counts[SampleToken(logits.data(), 3, p, rng)];
  EXPECT_EQ(counts[2], 0);
  EXPECT_NEAR(counts[0] / 5000.0, 0.5 / 0.8, 0.03);
}

TEST(SamplerTest, SameSeedSameTokens) {
  std::vector<float> logits(256);
  for (int i = 0; i < 256; ++i) logits[i] = std::sin(i * 0.37f);
  SamplingParams p;
  std::mt19937_64 a(42), b(42);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(SampleToken(logits.data(), 256, p, a), SampleToken(logits.data(), 256, p, b));
  }
}

TEST(SamplerTest, NonFiniteLogitsAreNeverDrawn) {
  std::vector<float> logits = {NAN, 0.0f, INFINITY, 0.0f};
  SamplingParams p;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 200; ++i) {
    int64_t t = SampleToken(logits.data(), 4, p, rng);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_NE(p.Validate().message().find("temperature"), std::string::npos);
  p = SamplingParams();
  p.top_p = 0;
  EXPECT_NE(p.Validate().message().find("top_p"), std::string::npos);
  p = SamplingParams();
  p.top_k = -2;
  EXPECT_NE(p.Validate().message().find("top_k"), std::string::npos);
  EXPECT_TRUE(SamplingParams().Validate().ok());
}

// Draws n tokens and returns their frequencies.
std::map<int64_t, double> Frequencies(const std::vector<float>& logits, const SamplingParams& p,
                                      const std::vector<int64_t>& recent = {}, int n = 20000) {
  std::mt19937_64 rng(11);
  std::map<int64_t, double> out;
  for (int i = 0; i < n; ++i) {
    out[SampleToken(logits.data(), static_cast<int64_t>(logits.size()), p, rng, recent)] += 1.0 / n;
  }
  return out;
}

TEST(SamplerTest, MinPDropsTokensBelowTheFractionOfTheTop) {
  std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  SamplingParams p;
  p.min_p = 0.25f;  // 0.1 / 0.6 < 0.25 <= 0.3 / 0.6
  auto f = Frequencies(logits, p);
  EXPECT_EQ(f.count(2), 0u);
  EXPECT_NEAR(f[0], 2.0 / 3.0, 0.02);
  EXPECT_NEAR(f[1], 1.0 / 3.0, 0.02);
}

TEST(SamplerTest, TopKKeepsTheLowestIdsAmongTies) {
  std::vector<float> logits = {1.0f, 1.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.top_k = 2;
  auto f = Frequencies(logits, p);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[0], 0.5, 0.02);
  EXPECT_NEAR(f[1], 0.5, 0.02);
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveLogitsOfRecentTokens) {
  std::vector<float> logits = {2.0f, 2.0f, -1.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  // Token 0 -> logit 1; token 2 (negative) -> -2; token 1 unchanged.
  auto f = Frequencies(logits, p, {0, 2, 0});
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(-2.0);
  EXPECT_NEAR(f[0], std::exp(1.0) / z, 0.02);
  EXPECT_NEAR(f[1], std::exp(2.0) / z, 0.02);
  EXPECT_NEAR(f[2], std::exp(-2.0) / z, 0.01);
}

TEST(SamplerTest, RepetitionPenaltyActsOnlyOnTheRecentTokensAndOncePerToken) {
  // The engine passes the last repetition_window tokens as `recent`: a token in it is
  // penalised, one outside it (absent from `recent`) is not.
  std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 4.0f;
  std::mt19937_64 rng(1);
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {}), 0);
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {2, 3}), 0);  // 0 is outside: unchanged
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {0}), 1);     // 3 / 4 < 2
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {0, 1}), 2);  // 0.75, 0.5 < 1
  // Repeats in the window do not compound: 3 / 4 = 0.75 beats 0.5 whether token 0
  // appears once or many times (3 / 4^3 would not).
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {1, 2, 0, 0, 0}), 0);
  // Out-of-range ids in `recent` are ignored.
  EXPECT_EQ(SampleToken(logits.data(), 4, p, rng, {-1, 4, 1000}), 0);
}

TEST(SamplerTest, TokenLogProbIsLogSoftmax) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  EXPECT_NEAR(fwserve::TokenLogProb(logits.data(), 3, 1), std::log(0.3), 1e-6);
  EXPECT_EQ(fwserve::TokenLogProb(logits.data(), 3, 7), -std::numeric_limits<double>::infinity());
}

}  // namespace

namespace {

// The sampler's exp (vectorised where the CPU allows) against std::exp: within 4 ulp
// over the range sampling uses (x <= 0), with -inf giving exactly 0 and every length,
// not only multiples of the vector width.
TEST(SamplerTest, ExpInPlaceMatchesStdExp) {
  for (size_t n : {0u, 1u, 3u, 4u, 7u, 256u, 1001u}) {
    std::vector<double> values(n), expected(n);
    for (size_t i = 0; i < n; ++i) {
      values[i] = i % 97 == 5 ? -std::numeric_limits<double>::infinity()
                              : -700.0 * static_cast<double>(i) / static_cast<double>(n + 1) -
                                    1e-3 * static_cast<double>(i % 7);
      expected[i] = std::exp(values[i]);
    }
    fwserve::ExpInPlace(values.data(), n);
    for (size_t i = 0; i < n; ++i) {
      if (expected[i] == 0) {
        EXPECT_EQ(values[i], 0.0) << "n=" << n << " i=" << i;
        continue;
      }
      EXPECT_NEAR(values[i], expected[i], 4 * std::numeric_limits<double>::epsilon() * expected[i])
          << "n=" << n << " i=" << i;
    }
  }
}

}  // namespace
