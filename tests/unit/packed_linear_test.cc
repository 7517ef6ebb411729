// models/kernels/packed_linear.h: both backends equal a float64 reference on the shapes the
// native step uses and on ragged ones (rows across the 64-row chunks and the 256-row
// switch to cblas, widths off the vector width), with and without a bias; and where the
// build has libxsmm on an AVX2 CPU, the small products really run on it. 16-bit
// instances (bf16, f16 weights, exact in them): ExactFormat finds the narrowest exact
// format, and their products equal the float32 instance's within summation order on
// every row count either side of kDirectRows, through the AVX-512 kernel, the portable
// loop and the widened float32 path, keeping half the bytes.
#include "models/kernels/packed_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace {

using fwmodel::PackedLinear;
using fwmodel::WeightFormat;

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

// Round to the nearest bf16 value (ties to even), kept in float32.
float RoundToBf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// Values exact in f16 and (but for a few) not in bf16: m · 2^-12, |m| < 2048 (11 bits).
float RandomF16(std::mt19937& generator) {
  return static_cast<float>(static_cast<int>(generator() % 4095) - 2047) * 0x1p-12f;
}

TEST(PackedLinearFormatTest, ExactFormatIsTheNarrowestExactOne) {
  std::mt19937 generator(3);
  std::normal_distribution<float> normal;
  std::vector<float> w(500);
  for (float& v : w) v = RoundToBf16(normal(generator));
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kBf16);
  for (float& v : w) v = RandomF16(generator);
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kF16);
  for (float& v : w) v = normal(generator);
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kF32);
  // binary16's edges are exact: subnormals, the largest finite value, zeros, infinities.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> edges = {0x1p-24f,       -0x1p-24f, 1023 * 0x1p-24f, 0x1p-14f, 65504.0f,
                                    -65504.0f,      0.0f,      -0.0f,           inf,      -inf,
                                    1.5f + 0x1p-10f};
  EXPECT_EQ(PackedLinear::ExactFormat(edges.data(), static_cast<int64_t>(edges.size())),
            WeightFormat::kF16);
  // Each of these is not: past the largest finite value, below the smallest subnormal,
  // one bit too many, a subnormal's bit too many; a NaN keeps float32 whatever it is.
  for (float v : {65520.0f, 0x1p-25f, 1.0f + 0x1p-11f, 0x1p-15f + 0x1p-25f,
                  std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> one = edges;
    one.push_back(v);
    EXPECT_EQ(PackedLinear::ExactFormat(one.data(), static_cast<int64_t>(one.size())),
              WeightFormat::kF32)
        << v;
  }
  // One value off bf16 makes the whole range f16 where it is exact there, else f32.
  std::uniform_real_distribution<float> uniform(0.5f, 2.0f);
  for (float& v : w) v = RoundToBf16(uniform(generator));  // 8 bits, f16's range: exact
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kBf16);
  w[250] = 1.0f + 0x1p-10f;
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kF16);
  w[499] = 1.0f + 0x1p-11f;
  EXPECT_EQ(PackedLinear::ExactFormat(w.data(), 500), WeightFormat::kF32);
}

struct Narrow {
  WeightFormat format;
  bool libxsmm;
};

class PackedLinearNarrowTest : public testing::TestWithParam<Narrow> {};

// The 16-bit instance against the float32 instance on the same (exact) weights and
// the float64 reference, on rows either side of kDirectRows and the 64-row chunks,
// panel widths 128 and ragged, with and without a bias, into a strided output.
TEST_P(PackedLinearNarrowTest, EqualsTheFloat32InstanceOnEveryShape) {
  const Narrow n = GetParam();
  const int64_t shapes[][2] = {{128, 768}, {128, 128}, {44, 96}, {17, 33}, {1, 7}, {200, 3}};
  const int64_t row_counts[] = {1, 2, 3, 4, 5, 7, 16, 64, 65, 130};
  const int64_t ldy_extra = 21;
  uint32_t seed = 100;
  for (const auto& shape : shapes) {
    for (int64_t rows : row_counts) {
      Product p = RandomProduct(shape[0], shape[1], rows, seed++);
      std::mt19937 generator(seed);
      for (float& v : p.w)
        v = n.format == WeightFormat::kBf16 ? RoundToBf16(v) : RandomF16(generator);
      ASSERT_EQ(PackedLinear::ExactFormat(p.w.data(), p.out * p.in), n.format);
      const PackedLinear narrow(p.w.data(), p.out, p.in, n.libxsmm, n.format);
      const PackedLinear wide(p.w.data(), p.out, p.in, n.libxsmm);
      ASSERT_EQ(narrow.format(), n.format);
      ASSERT_EQ(narrow.weight_bytes() * 2, wide.weight_bytes());
      const int64_t ldy = p.out + ldy_extra;
      for (bool with_bias : {false, true}) {
        const std::string what =
            absl::StrCat("out ", p.out, " in ", p.in, " rows ", rows, " bias ", with_bias);
        const float* bias = with_bias ? p.bias.data() : nullptr;
        std::vector<float> want(static_cast<size_t>(rows * p.out));
        wide.Apply(p.x.data(), rows, bias, want.data());
        // NaN where nothing is written: every output computed; the extra columns stay.
        std::vector<float> got(static_cast<size_t>(rows * ldy), std::nanf(""));
        narrow.Apply(p.x.data(), rows, bias, got.data(), ldy);
        std::vector<float> packed(static_cast<size_t>(rows * p.out));
        double worst = 0, scale = 1;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < ldy; ++c) {
            const float g = got[static_cast<size_t>(r * ldy + c)];
            if (c >= p.out) {
              ASSERT_TRUE(std::isnan(g)) << what << ": column " << c << " written";
              continue;
            }
            const float w = want[static_cast<size_t>(r * p.out + c)];
            packed[static_cast<size_t>(r * p.out + c)] = g;
            worst = std::max(worst, std::isnan(g) ? INFINITY : std::abs(double{g} - w));
            scale = std::max(scale, std::abs(double{w}));
          }
        }
        EXPECT_LE(worst / scale, 1e-5) << what;
        EXPECT_LE(RelativeError(p, with_bias, packed), 2e-6) << what;
        std::vector<float> portable(static_cast<size_t>(rows * p.out), std::nanf(""));
        narrow.ApplyPortable(p.x.data(), rows, bias, portable.data());
        EXPECT_LE(RelativeError(p, with_bias, portable), 2e-6) << what << " (portable)";
      }
      std::vector<float> blas(static_cast<size_t>(rows * p.out), std::nanf(""));
      narrow.ApplyWithBlas(p.x.data(), rows, blas.data());
      EXPECT_LE(RelativeError(p, false, blas), 2e-6) << "blas rows " << rows;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, PackedLinearNarrowTest,
                         testing::Values(Narrow{WeightFormat::kBf16, true},
                                         Narrow{WeightFormat::kF16, true},
                                         Narrow{WeightFormat::kBf16, false},
                                         Narrow{WeightFormat::kF16, false}),
                         [](const testing::TestParamInfo<Narrow>& info) {
                           return absl::StrCat(fwmodel::WeightFormatName(info.param.format),
                                               info.param.libxsmm ? "Libxsmm" : "OpenBlas");
                         });

// Where the CPU has AVX-512 (this project's VMs do), up to kDirectRows rows run the
// hand-written kernel: its result differs from the portable loop's only in rounding.
// The AVX-512 kernel serves exactly the CPUs that have AVX-512 (BW and VL): offered on
// them, never on the others (whose narrow products run the AVX2 or scalar kernel). Both
// answers are checked, so the test runs, and can fail, on either kind of CPU.
TEST(PackedLinearNarrowKernelTest, TheAvx512KernelServesThisCpu) {
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(PackedLinear::HasAvx512Kernel(), has_avx512);
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
