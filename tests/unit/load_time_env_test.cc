// common/load_time_env.h: the OpenBLAS core that fwserve, fwmodel and fwtrain set at
// start when Debian's OpenBLAS 0.3.21 detected the CPU as a weaker core, decided from
// the detected core's name and the CPU's features.
#include "common/load_time_env.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace {

using fwserve::BetterOpenBlasCore;
using fwserve::CpuFeatures;

CpuFeatures Sse() { return CpuFeatures(); }

CpuFeatures Avx() {
  CpuFeatures cpu;
  cpu.avx = true;
  return cpu;
}

CpuFeatures Avx2() {
  CpuFeatures cpu = Avx();
  cpu.avx2 = true;
  cpu.fma = true;
  return cpu;
}

CpuFeatures Avx512() {
  CpuFeatures cpu = Avx2();
  cpu.avx512f = cpu.avx512bw = cpu.avx512vl = cpu.avx512dq = cpu.avx512cd = true;
  return cpu;
}

TEST(OpenBlasCoreTest, PrescottOnAnAvx512CpuRunsSkylakeX) {
  // Intel Xeon family 6 model 207 (Emerald Rapids), as OpenBLAS 0.3.21 reported it.
  EXPECT_EQ(BetterOpenBlasCore("Prescott", Avx512()), std::optional<std::string>("SkylakeX"));
}

TEST(OpenBlasCoreTest, HaswellOnAnAvx512CpuRunsSkylakeX) {
  EXPECT_EQ(BetterOpenBlasCore("Haswell", Avx512()), std::optional<std::string>("SkylakeX"));
}

TEST(OpenBlasCoreTest, AnOldCoreOnAnAvx2CpuRunsHaswell) {
  EXPECT_EQ(BetterOpenBlasCore("Prescott", Avx2()), std::optional<std::string>("Haswell"));
  EXPECT_EQ(BetterOpenBlasCore("Nehalem", Avx2()), std::optional<std::string>("Haswell"));
  EXPECT_EQ(BetterOpenBlasCore("Sandybridge", Avx2()), std::optional<std::string>("Haswell"));
}

TEST(OpenBlasCoreTest, AnSseCoreOnAnAvxCpuRunsSandybridge) {
  EXPECT_EQ(BetterOpenBlasCore("Core2", Avx()), std::optional<std::string>("Sandybridge"));
}

TEST(OpenBlasCoreTest, ACorrectDetectionIsLeftAlone) {
  EXPECT_EQ(BetterOpenBlasCore("SkylakeX", Avx512()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("Cooperlake", Avx512()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("SapphireRapids", Avx512()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("Haswell", Avx2()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("Zen", Avx2()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("Sandybridge", Avx()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("Prescott", Sse()), std::nullopt);
}

TEST(OpenBlasCoreTest, AStrongerCoreThanTheCpuIsLeftAlone) {
  // Not ours to second-guess (a user's OPENBLAS_CORETYPE is never looked at anyway).
  EXPECT_EQ(BetterOpenBlasCore("SkylakeX", Avx2()), std::nullopt);
}

TEST(OpenBlasCoreTest, AnAvx512CpuWithoutEveryExtensionSkylakeXNeedsRunsHaswell) {
  CpuFeatures cpu = Avx512();
  cpu.avx512bw = false;  // Xeon Phi (Knights Landing) has F and CD, not BW, VL, DQ
  EXPECT_EQ(BetterOpenBlasCore("Prescott", cpu), std::optional<std::string>("Haswell"));
  EXPECT_EQ(BetterOpenBlasCore("Haswell", cpu), std::nullopt);
}

TEST(OpenBlasCoreTest, AnUnknownNameIsLeftAlone) {
  EXPECT_EQ(BetterOpenBlasCore("", Avx512()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("ARMV8", Avx512()), std::nullopt);
  EXPECT_EQ(BetterOpenBlasCore("prescott", Avx512()), std::nullopt);
}

TEST(OpenBlasCoreTest, DetectedFeaturesAreConsistent) {
  const CpuFeatures cpu = fwserve::DetectCpuFeatures();
  // Every CPU with AVX2 has AVX, and AVX-512 BW/VL come only with AVX-512 F.
  EXPECT_TRUE(!cpu.avx2 || cpu.avx);
  EXPECT_TRUE(!(cpu.avx512bw || cpu.avx512vl) || cpu.avx512f);
  EXPECT_TRUE(!cpu.avx512f || cpu.avx2);
}

}  // namespace
