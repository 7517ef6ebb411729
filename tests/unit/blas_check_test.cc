// models/base/blas_check.h: the reference-BLAS warning that fwserve, fwmodel and fwtrain print
// at start (docs/serving.md), decided from a /proc/PID/maps text and the target of the
// system's libblas.so.3 alternatives link.
#include "models/base/blas_check.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace {

using fwmodel::SlowBlasWarning;

constexpr char kReference[] = "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0";
constexpr char kOpenBlas[] = "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3";

// A maps text with libc, `library` (if any) and the anonymous and [heap] lines around.
std::string Maps(const std::string& library) {
  std::string maps =
      "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n"
      "7f2a1c000000-7f2a1c021000 rw-p 00000000 00:00 0 \n"
      "7f2a1e200000-7f2a1e228000 r--p 00000000 08:01 1311 "
      "/usr/lib/x86_64-linux-gnu/libc.so.6\n";
  if (!library.empty()) {
    maps += "7f2a1e400000-7f2a1e40e000 r--p 00000000 08:01 2044 " + library + "\n";
    maps += "7f2a1e40e000-7f2a1e4a0000 r-xp 0000e000 08:01 2044 " + library + "\n";
  }
  maps += "7ffd5e3c1000-7ffd5e3e2000 rw-p 00000000 00:00 0                          [stack]\n";
  return maps;
}

TEST(BlasCheckTest, AMappedReferenceBlasWarnsNamingItsPath) {
  auto warning = SlowBlasWarning(Maps(kReference), std::string(kOpenBlas));
  ASSERT_TRUE(warning.has_value());
  EXPECT_NE(warning->find("reference BLAS"), std::string::npos) << *warning;
  EXPECT_NE(warning->find(std::string("(") + kReference + ")"), std::string::npos) << *warning;
  EXPECT_NE(warning->find("libopenblas0-openmp"), std::string::npos) << *warning;
}

TEST(BlasCheckTest, AMappedOptimisedBlasDoesNotWarnWhateverTheLinkSays) {
  for (const char* optimised :
       {kOpenBlas, "/opt/intel/mkl/lib/libblas.so.3", "/usr/lib/x86_64-linux-gnu/blis/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/atlas/libblas.so.3"}) {
    SCOPED_TRACE(optimised);
    EXPECT_EQ(SlowBlasWarning(Maps(optimised), std::string(kReference)), std::nullopt);
    EXPECT_EQ(SlowBlasWarning(Maps(optimised), std::nullopt), std::nullopt);
  }
}

TEST(BlasCheckTest, WhenNoBlasIsMappedTheAlternativesLinkDecides) {
  auto warning = SlowBlasWarning(Maps(""), std::string(kReference));
  ASSERT_TRUE(warning.has_value());
  EXPECT_NE(warning->find(std::string("(") + kReference + ")"), std::string::npos) << *warning;
  EXPECT_EQ(SlowBlasWarning(Maps(""), std::string(kOpenBlas)), std::nullopt);
  // Nothing mapped and no link: nothing can be told.
  EXPECT_EQ(SlowBlasWarning(Maps(""), std::nullopt), std::nullopt);
  EXPECT_EQ(SlowBlasWarning("", std::nullopt), std::nullopt);
}

TEST(BlasCheckTest, OtherLibrariesNamedLikeBlasDoNotCount) {
  // Only a libblas.so counts: CUDA's cuBLAS is not the BLAS of LibTorch's CPU kernels.
  EXPECT_EQ(SlowBlasWarning(Maps("/usr/lib/x86_64-linux-gnu/libcublasLt.so.12"), std::nullopt),
            std::nullopt);
}

}  // namespace
