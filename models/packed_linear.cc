#include "models/packed_linear.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

#ifdef FWSERVE_HAVE_LIBXSMM
#include <libxsmm.h>
#endif

namespace fwmodel {
namespace {

// Below this batch the cblas path is one sgemv per row: sgemm packs the whole weight
// matrix on every call, which costs as much as the product itself at batch 1.
constexpr int64_t kGemvBelow = 4;

#ifdef FWSERVE_HAVE_LIBXSMM
// Column-major C[out, n] (+)= A[out, in] · B[in, n]: y's rows are C's columns, x's rows
// B's, and Wᵀ stored row-major is A; C's columns ldc floats apart. Null when the JIT
// cannot serve this CPU or shape.
libxsmm_smmfunction Kernel(int64_t out, int64_t n, int64_t in, bool accumulate, int64_t ldc) {
  const float alpha = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  const libxsmm_blasint leading_c = static_cast<libxsmm_blasint>(ldc);
  return libxsmm_smmdispatch(static_cast<libxsmm_blasint>(out), static_cast<libxsmm_blasint>(n),
                             static_cast<libxsmm_blasint>(in), nullptr, nullptr, &leading_c, &alpha,
                             &beta, nullptr, nullptr);
}

bool JitAvailable() {
  static const bool available = [] {
    libxsmm_init();
    return Kernel(16, 16, 16, false, 16) != nullptr;
  }();
  return available;
}
#endif

}  // namespace

const char* PackedLinear::Backend() {
#ifdef FWSERVE_HAVE_LIBXSMM
  if (JitAvailable()) return "libxsmm";
#endif
  return "openblas";
}

PackedLinear::PackedLinear(const float* w, int64_t out, int64_t in, bool use_libxsmm)
    : in_(in), out_(out) {
#ifdef FWSERVE_HAVE_LIBXSMM
  if (use_libxsmm && JitAvailable()) {
    // Only Wᵀ is kept: the cblas fallback reads it too (Blas).
    transposed_.resize(static_cast<size_t>(in * out));
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < in; ++k) {
        transposed_[static_cast<size_t>(k * out + o)] = w[o * in + k];
      }
    }
    return;
  }
#else
  (void)use_libxsmm;
#endif
  weight_.assign(w, w + out * in);
}

void PackedLinear::Blas(const float* x, int64_t rows, bool accumulate, float* y,
                        int64_t ldy) const {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (weight_.empty()) {
    // Packed: Wᵀ [in, out] row-major.
    if (rows < kGemvBelow) {
      for (int64_t r = 0; r < rows; ++r) {
        cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<int>(in_), static_cast<int>(out_), 1.0f,
                    transposed_.data(), static_cast<int>(out_), x + r * in_, 1, beta, y + r * ldy,
                    1);
      }
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                static_cast<int>(out_), static_cast<int>(in_), 1.0f, x, static_cast<int>(in_),
                transposed_.data(), static_cast<int>(out_), beta, y, static_cast<int>(ldy));
    return;
  }
  if (rows < kGemvBelow) {
    for (int64_t r = 0; r < rows; ++r) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(out_), static_cast<int>(in_), 1.0f,
                  weight_.data(), static_cast<int>(in_), x + r * in_, 1, accumulate ? 1.0f : 0.0f,
                  y + r * ldy, 1);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
              static_cast<int>(out_), static_cast<int>(in_), 1.0f, x, static_cast<int>(in_),
              weight_.data(), static_cast<int>(in_), accumulate ? 1.0f : 0.0f, y,
              static_cast<int>(ldy));
}

void PackedLinear::Apply(const float* x, int64_t rows, const float* bias, float* y,
                         int64_t ldy) const {
  if (rows <= 0) return;
  const bool accumulate = bias != nullptr;
  if (accumulate) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * ldy, bias, sizeof(float) * out_);
  }
#ifdef FWSERVE_HAVE_LIBXSMM
  if (!transposed_.empty()) {
    for (int64_t first = 0; first < rows; first += kChunkRows) {
      const int64_t n = std::min(kChunkRows, rows - first);
      const libxsmm_smmfunction kernel = Kernel(out_, n, in_, accumulate, ldy);
      if (kernel == nullptr) {
        Blas(x + first * in_, n, accumulate, y + first * ldy, ldy);
        continue;
      }
      kernel(transposed_.data(), x + first * in_, y + first * ldy);
    }
    return;
  }
#endif
  Blas(x, rows, accumulate, y, ldy);
}

}  // namespace fwmodel
