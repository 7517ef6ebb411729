// models/packed_linear.h: both backends equal a float64 reference on the shapes the
// native step uses and on ragged ones (rows across the 64-row chunks and the 256-row
// switch to cblas, widths off the vector width), with and without a bias; and where the
// build has libxsmm on an AVX2 CPU, the small products really run on it.
#include "models/packed_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace {

using fwmodel::PackedLinear;

struct Product {
  std::vector<float> w, x, bias;
  int64_t out, in, rows;
};

Product RandomProduct(int64_t out, int64_t in, int64_t rows, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal;
  Product p{{}, {}, {}, out, in, rows};
  p.w.resize(static_cast<size_t>(out * in));
  p.x.resize(static_cast<size_t>(rows * in));
  p.bias.resize(static_cast<size_t>(out));
  for (float& v : p.w) v = normal(generator);
  for (float& v : p.x) v = normal(generator);
  for (float& v : p.bias) v = normal(generator);
  return p;
}

// Largest |y - reference| over the sum of the terms' magnitudes (float32's error bound
// scales with it), the reference in float64. A term dropped or counted twice gives about
// 1/in of that; float32 rounding about 1e-7·sqrt(in).
double RelativeError(const Product& p, bool with_bias, const std::vector<float>& y) {
  double worst = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t o = 0; o < p.out; ++o) {
      double sum = with_bias ? p.bias[static_cast<size_t>(o)] : 0.0;
      double magnitude = std::abs(sum);
      for (int64_t k = 0; k < p.in; ++k) {
        const double term = static_cast<double>(p.x[static_cast<size_t>(r * p.in + k)]) *
                            p.w[static_cast<size_t>(o * p.in + k)];
        sum += term;
        magnitude += std::abs(term);
      }
      const double got = y[static_cast<size_t>(r * p.out + o)];
      if (std::isnan(got)) return INFINITY;
      worst = std::max(worst, std::abs(got - sum) / magnitude);
    }
  }
  return worst;
}

class PackedLinearTest : public testing::TestWithParam<bool> {};

TEST_P(PackedLinearTest, EqualsTheReferenceOnEveryShape) {
  const bool use_libxsmm = GetParam();
  const int64_t shapes[][2] = {{384, 128}, {128, 128}, {512, 128}, {128, 512}, {256, 128},
                               {65, 128},  {17, 33},   {1, 7},     {200, 3}};
  const int64_t row_counts[] = {1, 3, 4, 5, 63, 64, 65, 130, 256, 257, 300};
  uint32_t seed = 1;
  for (const auto& shape : shapes) {
    for (int64_t rows : row_counts) {
      const Product p = RandomProduct(shape[0], shape[1], rows, seed++);
      const PackedLinear linear(p.w.data(), p.out, p.in, use_libxsmm);
      for (bool with_bias : {false, true}) {
        // NaN where nothing is written: every output must be computed, none kept.
        std::vector<float> y(static_cast<size_t>(rows * p.out), std::nanf(""));
        linear.Apply(p.x.data(), rows, with_bias ? p.bias.data() : nullptr, y.data());
        EXPECT_LE(RelativeError(p, with_bias, y), 2e-6)
            << absl::StrCat("out ", p.out, " in ", p.in, " rows ", rows, " bias ", with_bias);
      }
    }
  }
}

TEST_P(PackedLinearTest, ZeroRowsWriteNothing) {
  const Product p = RandomProduct(32, 16, 0, 7);
  const PackedLinear linear(p.w.data(), 32, 16, GetParam());
  float sentinel = 42.0f;
  linear.Apply(p.x.data(), 0, p.bias.data(), &sentinel);
  EXPECT_EQ(sentinel, 42.0f);
}

// A product into a wider output (y's rows ldy floats apart, native_rwkv.cc's panels)
// writes its own columns, equal to the contiguous product's, and no other float.
TEST_P(PackedLinearTest, StridedOutputWritesOnlyItsColumns) {
  const int64_t ldy = 300, first = 128;
  for (int64_t rows : {1, 5, 64, 70}) {
    const Product p = RandomProduct(44, 96, rows, 40 + static_cast<uint32_t>(rows));
    const PackedLinear linear(p.w.data(), p.out, p.in, GetParam());
    for (bool with_bias : {false, true}) {
      const float* bias = with_bias ? p.bias.data() : nullptr;
      std::vector<float> contiguous(static_cast<size_t>(rows * p.out));
      linear.Apply(p.x.data(), rows, bias, contiguous.data());
      std::vector<float> wide(static_cast<size_t>(rows * ldy), 42.0f);
      linear.Apply(p.x.data(), rows, bias, wide.data() + first, ldy);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < ldy; ++c) {
          const float got = wide[static_cast<size_t>(r * ldy + c)];
          if (c < first || c >= first + p.out) {
            ASSERT_EQ(got, 42.0f) << "row " << r << " column " << c << " written";
          } else {
            ASSERT_EQ(got, contiguous[static_cast<size_t>(r * p.out + c - first)])
                << "rows " << rows << " row " << r << " column " << c;
          }
        }
      }
    }
  }
}

// The cblas path equals the reference on either backend: a libxsmm instance keeps only
// Wᵀ, and its fallback for shapes the JIT declines reads that (sgemv below 4 rows).
TEST_P(PackedLinearTest, TheBlasPathReadsWhicheverLayoutIsKept) {
  uint32_t seed = 90;
  for (int64_t rows : {1, 3, 4, 65}) {
    const Product p = RandomProduct(130, 72, rows, seed++);
    const PackedLinear linear(p.w.data(), p.out, p.in, GetParam());
    std::vector<float> y(static_cast<size_t>(rows * p.out), std::nanf(""));
    linear.ApplyWithBlas(p.x.data(), rows, y.data());
    EXPECT_LE(RelativeError(p, false, y), 2e-6) << "rows " << rows;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PackedLinearTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? "Libxsmm" : "OpenBlas";
                         });

TEST(PackedLinearBackendTest, TheBuildsLibxsmmServesThisCpu) {
  const Product p = RandomProduct(16, 16, 4, 3);
  const PackedLinear plain(p.w.data(), 16, 16, /*use_libxsmm=*/false);
  EXPECT_FALSE(plain.packed());
#ifdef FWSERVE_EXPECT_LIBXSMM
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "skip: no AVX2, libxsmm's JIT not used";
  EXPECT_STREQ(PackedLinear::Backend(), "libxsmm");
  const PackedLinear packed(p.w.data(), 16, 16);
  EXPECT_TRUE(packed.packed());
#else
  EXPECT_STREQ(PackedLinear::Backend(), "openblas");
#endif
}

}  // namespace
