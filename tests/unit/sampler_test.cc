#include "models/sampling/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
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

// logit_bias (issue 51): added after the repetition penalty; +100 forces, -100 bans, ids
// outside the vocabulary are skipped; Validate names the bad entry.
TEST(SamplerTest, LogitBiasIsAddedAfterThePenalty) {
  std::vector<float> logits = {2.0f, 1.0f, -1.0f, 0.5f};
  std::mt19937_64 rng(1);
  SamplingParams p;
  p.temperature = 0;
  p.logit_bias = {{2, 100.0f}};
  EXPECT_EQ(fwserve::SampleToken(logits.data(), 4, p, rng), 2);
  p.logit_bias = {{0, -100.0f}, {7, 100.0f}};  // 7 is outside: skipped
  EXPECT_EQ(fwserve::SampleToken(logits.data(), 4, p, rng), 1);
  // Penalty first: token 0's 2.0 / 4 = 0.5, then + 0.75 = 1.25 > token 1's 1.0.
  p.repetition_penalty = 4.0f;
  p.logit_bias = {{0, 0.75f}};
  EXPECT_EQ(fwserve::SampleToken(logits.data(), 4, p, rng, {0}), 0);
  p.logit_bias = {{0, 0.25f}};  // 0.75 < 1.0
  EXPECT_EQ(fwserve::SampleToken(logits.data(), 4, p, rng, {0}), 1);
  // Sampling: with -100 on every token but 3, token 3 is drawn every time.
  p = SamplingParams();
  p.logit_bias = {{0, -100.0f}, {1, -100.0f}, {2, -100.0f}};
  for (int i = 0; i < 200; ++i) EXPECT_EQ(fwserve::SampleToken(logits.data(), 4, p, rng), 3);
  // The raw logits are not changed.
  EXPECT_EQ(logits, (std::vector<float>{2.0f, 1.0f, -1.0f, 0.5f}));

  SamplingParams bad;
  bad.logit_bias = {{1, 101.0f}};
  EXPECT_NE(std::string(bad.Validate().message()).find("logit_bias"), std::string::npos);
  bad.logit_bias = {{-1, 1.0f}};
  EXPECT_FALSE(bad.Validate().ok());
  bad.logit_bias = {{3, 1.0f}, {3, 2.0f}};
  EXPECT_NE(std::string(bad.Validate().message()).find("distinct"), std::string::npos);
  bad.logit_bias.assign(SamplingParams::kMaxLogitBias + 1, {0, 0.0f});
  EXPECT_FALSE(bad.Validate().ok());
}

TEST(SamplerTest, AMaskLeavesOnlyItsTokens) {
  const std::vector<float> logits = {2.0f, 1.0f, -1.0f, 0.5f, 3.0f};
  std::mt19937_64 rng(5);
  SamplingParams p;
  p.temperature = 0;
  const std::vector<uint8_t> allowed = {0, 1, 1, 0, 0};
  EXPECT_EQ(SampleToken(logits.data(), 5, p, rng, {}, allowed.data()), 1);
  p.temperature = 1.5f;
  std::set<int64_t> drawn;
  for (int i = 0; i < 400; ++i)
    drawn.insert(SampleToken(logits.data(), 5, p, rng, {}, allowed.data()));
  EXPECT_EQ(drawn, (std::set<int64_t>{1, 2}));
  // A bias cannot bring a masked token back.
  p.logit_bias = {{4, 100.0f}};
  for (int i = 0; i < 50; ++i) {
    const int64_t t = SampleToken(logits.data(), 5, p, rng, {}, allowed.data());
    EXPECT_TRUE(t == 1 || t == 2) << t;
  }
  // Only non-finite logits allowed: the first allowed token.
  const std::vector<float> odd = {1.0f, -std::numeric_limits<float>::infinity(), 2.0f};
  const std::vector<uint8_t> only_second = {0, 1, 0};
  EXPECT_EQ(SampleToken(odd.data(), 3, p, rng, {}, only_second.data()), 1);
}

TEST(SamplerTest, TopLogProbsAreTheMostLikelyInOrderWithTheirLogProbs) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(1000);
  for (float& v : logits) v = normal(rng);
  logits[17] = logits[18] = 30.0f;  // a tie: the lower id first
  logits[3] = std::numeric_limits<float>::quiet_NaN();
  const auto top = fwserve::TopLogProbs(logits.data(), 1000, 20);
  ASSERT_EQ(top.size(), 20u);
  EXPECT_EQ(top[0].first, 17);
  EXPECT_EQ(top[1].first, 18);
  std::vector<int64_t> order;
  for (int64_t i = 0; i < 1000; ++i) {
    if (std::isfinite(logits[i])) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  for (size_t i = 0; i < top.size(); ++i) {
    EXPECT_EQ(top[i].first, order[i]) << i;
    EXPECT_NEAR(top[i].second, fwserve::TokenLogProb(logits.data(), 1000, order[i]), 1e-5);
  }
  EXPECT_TRUE(fwserve::TopLogProbs(logits.data(), 1000, 0).empty());
  EXPECT_EQ(fwserve::TopLogProbs(logits.data(), 4, 20).size(), 3u);  // the NaN is never listed
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

namespace {

// SampleToken as first written (one scalar pass per stage, a full sort for top_p),
// frozen here as the reference the reworked sampler must equal draw for draw: same
// logits, parameters and generator state give the same token and leave the generator
// in the same state.
int64_t ReferenceSampleToken(const float* raw_logits, int64_t vocab, const SamplingParams& params,
                             std::mt19937_64& rng, const std::vector<int64_t>& recent) {
  const float* logits = raw_logits;
  std::vector<float> penalized;
  if (params.repetition_penalty != 1.0f && !recent.empty()) {
    penalized.assign(raw_logits, raw_logits + vocab);
    std::vector<bool> seen(static_cast<size_t>(vocab), false);
    for (int64_t t : recent) {
      if (t < 0 || t >= vocab || seen[static_cast<size_t>(t)]) continue;
      seen[static_cast<size_t>(t)] = true;
      float& v = penalized[static_cast<size_t>(t)];
      v = v > 0 ? v / params.repetition_penalty : v * params.repetition_penalty;
    }
    logits = penalized.data();
  }
  auto value = [&](int64_t i) {
    return std::isfinite(logits[i]) ? logits[i] : -std::numeric_limits<float>::infinity();
  };
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (value(i) > value(best)) best = i;
  }
  if (params.temperature == 0 || !std::isfinite(value(best))) return best;
  const double top = value(best);
  std::vector<double> probs(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = value(i);
    probs[static_cast<size_t>(i)] = std::isfinite(v) ? (v - top) / params.temperature
                                                     : -std::numeric_limits<double>::infinity();
  }
  fwserve::ExpInPlace(probs.data(), probs.size());
  if (params.top_k > 0 && params.top_k < vocab) {
    std::vector<double> sorted = probs;
    const auto kth = sorted.begin() + (params.top_k - 1);
    std::nth_element(sorted.begin(), kth, sorted.end(), std::greater<double>());
    const double threshold = *kth;
    int64_t above = 0;
    for (double p : probs) above += p > threshold ? 1 : 0;
    int64_t ties_kept = params.top_k - above;
    for (double& p : probs) {
      if (p > threshold) continue;
      if (p == threshold && ties_kept > 0) {
        --ties_kept;
      } else {
        p = 0;
      }
    }
  }
  if (params.min_p > 0) {
    for (double& p : probs) {
      if (p < params.min_p) p = 0;
    }
  }
  if (params.top_p < 1) {
    std::vector<int64_t> order;
    double kept_total = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (probs[static_cast<size_t>(i)] > 0) {
        order.push_back(i);
        kept_total += probs[static_cast<size_t>(i)];
      }
    }
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const double pa = probs[static_cast<size_t>(a)], pb = probs[static_cast<size_t>(b)];
      return pa != pb ? pa > pb : a < b;
    });
    double cumulative = 0;
    size_t cut = order.size();
    for (size_t i = 0; i < order.size(); ++i) {
      cumulative += probs[static_cast<size_t>(order[i])] / kept_total;
      if (cumulative >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
    for (size_t i = cut; i < order.size(); ++i) probs[static_cast<size_t>(order[i])] = 0;
  }
  double mass = 0;
  for (double p : probs) mass += p;
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  double acc = 0;
  int64_t last = best;
  for (int64_t i = 0; i < vocab; ++i) {
    const double p = probs[static_cast<size_t>(i)];
    if (p <= 0) continue;
    acc += p;
    last = i;
    if (u < acc) return i;
  }
  return last;
}

// Over a real vocabulary's width (blocks of the vectorised exp, a partial last block)
// and with non-finite logits, equal to the log-softmax summed with std::exp.
TEST(SamplerTest, TokenLogProbOverAWideVocabularyIsLogSoftmax) {
  const int64_t vocab = 65536 + 77;
  std::mt19937_64 maker(5);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& v : logits) v = normal(maker);
  logits[10] = std::numeric_limits<float>::quiet_NaN();
  logits[2000] = -std::numeric_limits<float>::infinity();
  logits[vocab - 1] = std::numeric_limits<float>::infinity();
  double top = -std::numeric_limits<double>::infinity();
  for (float v : logits) {
    if (std::isfinite(v)) top = std::max<double>(top, v);
  }
  double total = 0;
  for (float v : logits) {
    if (std::isfinite(v)) total += std::exp(static_cast<double>(v) - top);
  }
  for (int64_t token : {int64_t{0}, int64_t{1234}, vocab - 2}) {
    const double expected =
        static_cast<double>(logits[static_cast<size_t>(token)]) - top - std::log(total);
    EXPECT_NEAR(fwserve::TokenLogProb(logits.data(), vocab, token), expected, 1e-9) << token;
  }
  for (int64_t token : {int64_t{10}, int64_t{2000}, vocab - 1, vocab, int64_t{-1}}) {
    EXPECT_EQ(fwserve::TokenLogProb(logits.data(), vocab, token),
              -std::numeric_limits<double>::infinity())
        << token;
  }
}

TEST(SamplerTest, EveryDrawEqualsTheFirstVersions) {
  std::mt19937_64 maker(2024);
  int64_t compared = 0, distinct_tokens = 0;
  for (int64_t vocab : {1, 3, 7, 8, 9, 33, 256, 1000, 65536}) {
    for (int trial = 0; trial < (vocab >= 65536 ? 12 : 40); ++trial) {
      // Logits of several shapes: flat, peaked, with ties, with non-finite values.
      std::normal_distribution<float> normal(0.0f, trial % 3 == 0 ? 0.5f : 4.0f);
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (float& v : logits) v = normal(maker);
      if (trial % 4 == 1) {
        for (size_t i = 0; i < logits.size(); i += 3) logits[i] = logits[0];  // ties
      }
      if (trial % 5 == 2) {
        logits[maker() % logits.size()] = std::numeric_limits<float>::quiet_NaN();
        logits[maker() % logits.size()] = std::numeric_limits<float>::infinity();
        logits[maker() % logits.size()] = -std::numeric_limits<float>::infinity();
      }
      if (trial % 11 == 7) {
        for (float& v : logits) v = std::numeric_limits<float>::quiet_NaN();  // none finite
      }
      SamplingParams params;
      const int mode = trial % 8;
      params.temperature = mode == 0 ? 0.0f : mode == 1 ? 0.7f : mode == 2 ? 1e-20f : 1.0f;
      if (mode == 3) {
        // Both ways of finding the k-th largest: a heap (k <= 4096) and a selection.
        params.top_k =
            static_cast<int32_t>(trial / 8 % 2 == 0 ? 1 + maker() % 50 : 4000 + maker() % 200);
      }
      if (mode == 4) params.top_p = 0.05f + 0.9f * static_cast<float>(trial % 10) / 10;
      if (mode == 5) params.min_p = 0.05f;
      if (mode == 6) {
        params.top_k = 40;
        params.top_p = 0.9f;
        params.min_p = 0.01f;
        params.temperature = 1.3f;
      }
      std::vector<int64_t> recent;
      if (mode == 7 || trial % 3 == 1) {
        params.repetition_penalty = trial % 2 == 0 ? 1.3f : 0.8f;
        for (int i = 0; i < 20; ++i) recent.push_back(static_cast<int64_t>(maker() % vocab));
        recent.push_back(recent.front());  // a repeat
        recent.push_back(-1);              // out of range: ignored
      }
      const uint64_t seed = maker();
      std::mt19937_64 mine(seed), reference(seed);
      std::set<int64_t> tokens;
      for (int draw = 0; draw < 8; ++draw) {
        const int64_t expected =
            ReferenceSampleToken(logits.data(), vocab, params, reference, recent);
        ASSERT_EQ(SampleToken(logits.data(), vocab, params, mine, recent), expected)
            << "vocab " << vocab << " trial " << trial << " draw " << draw;
        ASSERT_EQ(mine, reference)
            << "the generators diverged: vocab " << vocab << " trial " << trial;
        tokens.insert(expected);
        ++compared;
      }
      distinct_tokens += static_cast<int64_t>(tokens.size());
    }
  }
  // The cases drew real variety, not one token each.
  EXPECT_GT(distinct_tokens, compared / 4);
}

}  // namespace
