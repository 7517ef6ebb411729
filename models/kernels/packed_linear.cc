#include "models/kernels/packed_linear.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 reports its own _mm512_undefined_* placeholders inside the intrinsics as
// maybe-uninitialized once they are inlined (GCC bug 105593): silenced for the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define FW_HAVE_AVX512_KERNEL 1
// The 16-bit direct kernel's instruction sets: compiled for them whatever the build's
// baseline, run only where the CPU has them (HasAvx512Kernel).
#define FW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#endif

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

// Zeros after a 16-bit Wᵀ: the AVX-512 kernel's unmasked loads of a last row's block
// read up to 127 values past it (DirectBlock).
constexpr int64_t kNarrowPadding = 128;

// ---- 16-bit values. Exact in both directions for values the format holds.

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// IEEE binary16 → float32, every value exactly (NaNs stay NaNs). Branch-free apart
// from the selects, so loops of it vectorise.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = 0x7f800000u | ((em & 0x3ffu) << 13);  // inf, NaN
  } else if (em >= 0x0400u) {
    bits = (em << 13) + (112u << 23);  // normal: exponent bias 15 → 127
  } else {
    bits = Bits(static_cast<float>(em) * 0x1p-24f);  // subnormal or zero: m · 2^-24
  }
  return FromBits(bits | sign);
}

// float32 → binary16, exact for the values binary16 holds; others are truncated or go
// to infinity (HalfToFloat of the result then differs from f, which ExactFormat uses).
inline uint16_t FloatToHalf(float f) {
  const uint32_t b = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7fffffffu;
  if (a >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16
  if (a >= 0x38800000u) return static_cast<uint16_t>(sign | ((a - 0x38000000u) >> 13));
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(FromBits(a) * 0x1p24f));
}

inline float BfloatToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

template <bool kF16>
inline float Widen(uint16_t h) {
  if constexpr (kF16) {
    return HalfToFloat(h);
  } else {
    return BfloatToFloat(h);
  }
}

// out[i] := the float32 value of w[i], i < n.
template <bool kF16>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void WidenPortable(
    const uint16_t* __restrict w, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Widen<kF16>(w[i]);
}

// y [rows, out] := x [rows, in] · W (+ bias), W = wt [in, out] 16-bit, y's rows ldy
// floats apart: the loop any CPU runs (auto-vectorised), by blocks of kBlock columns.
template <bool kF16>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void DirectPortable(
    const uint16_t* __restrict wt, int64_t in, int64_t out, const float* __restrict x, int64_t rows,
    const float* __restrict bias, float* __restrict y, int64_t ldy) {
  constexpr int64_t kBlock = 256;
  float acc[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < out; c0 += kBlock) {
      const int64_t width = std::min(kBlock, out - c0);
      for (int64_t c = 0; c < width; ++c) acc[c] = bias != nullptr ? bias[c0 + c] : 0.0f;
      for (int64_t k = 0; k < in; ++k) {
        const float xk = x[r * in + k];
        const uint16_t* __restrict row = wt + k * out + c0;
        for (int64_t c = 0; c < width; ++c) acc[c] += Widen<kF16>(row[c]) * xk;
      }
      std::memcpy(y + r * ldy + c0, acc, sizeof(float) * static_cast<size_t>(width));
    }
  }
}

// One row of x [in] times float32 Wᵀ [in, out] (+ bias) into y, by blocks of kBlock columns
// accumulated over every k: each Wᵀ row streams once, in order. At one row this reads the
// weights at the memory's speed where libxsmm's 1-row kernels did not (the 340M DeltaNet's
// batch-1 step, docs/benchmarks.md).
__attribute__((target_clones("arch=x86-64-v3", "default"))) void DirectFloatRow(
    const float* __restrict wt, int64_t in, int64_t out, const float* __restrict x,
    const float* __restrict bias, float* __restrict y) {
  constexpr int64_t kBlock = 128;
  alignas(64) float acc[kBlock];
  for (int64_t c0 = 0; c0 < out; c0 += kBlock) {
    const int64_t width = std::min(kBlock, out - c0);
    if (width == kBlock) {
      for (int64_t c = 0; c < kBlock; ++c) acc[c] = bias != nullptr ? bias[c0 + c] : 0.0f;
      for (int64_t k = 0; k < in; ++k) {
        const float xk = x[k];
        const float* __restrict row = wt + k * out + c0;
        for (int64_t c = 0; c < kBlock; ++c) acc[c] += row[c] * xk;
      }
    } else {
      for (int64_t c = 0; c < width; ++c) acc[c] = bias != nullptr ? bias[c0 + c] : 0.0f;
      for (int64_t k = 0; k < in; ++k) {
        const float xk = x[k];
        const float* __restrict row = wt + k * out + c0;
        for (int64_t c = 0; c < width; ++c) acc[c] += row[c] * xk;
      }
    }
    std::memcpy(y + c0, acc, sizeof(float) * static_cast<size_t>(width));
  }
}

#ifdef FW_HAVE_AVX512_KERNEL
// 16 values at p widened. Unmasked: masked 16-bit loads (vmovdqu16 {k}{z}) ran at a
// quarter of the speed on this project's VMs; the 16-bit storage is padded instead
// (kNarrowPadding), and lanes past a row's end are computed but never stored.
template <bool kF16>
FW_AVX512 inline __m512 Widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kF16) {
    return _mm512_cvtph_ps(h);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Columns [c0, c0 + 16·V) ∩ [0, out) of R rows: per k, V vectors of the panel's row
// widened once and FMA'd with the broadcast x[r, k] into R·V accumulators. Reads up to
// 16·V − 1 values past the last row's end (the padding).
template <int R, int V, bool kF16>
FW_AVX512 void DirectBlock(const uint16_t* wt, int64_t in, int64_t out, int64_t c0, const float* x,
                           const float* bias, float* y, int64_t ldy) {
  __mmask16 mask[V];
  for (int v = 0; v < V; ++v) {
    const int64_t left = out - c0 - 16 * v;
    mask[v] = left >= 16 ? static_cast<__mmask16>(0xffff)
                         : static_cast<__mmask16>(left <= 0 ? 0 : (1u << left) - 1);
  }
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      acc[r][v] = bias != nullptr ? _mm512_maskz_loadu_ps(mask[v], bias + c0 + 16 * v)
                                  : _mm512_setzero_ps();
    }
  }
  const uint16_t* row = wt + c0;
  for (int64_t k = 0; k < in; ++k, row += out) {
    __m512 xr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xr[r] = _mm512_set1_ps(x[r * in + k]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m512 w = Widen16<kF16>(row + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_fmadd_ps(w, xr[r], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(y + r * ldy + c0 + 16 * v, mask[v], acc[r][v]);
  }
}

// R rows, all columns: blocks of 16·V columns, the last one narrower where it fits
// (V / 2 vectors), so a narrow projection (a LoRA's 64 columns) computes no lanes for
// nothing.
template <int R, int V, bool kF16>
FW_AVX512 void DirectRows(const uint16_t* wt, int64_t in, int64_t out, const float* x,
                          const float* bias, float* y, int64_t ldy) {
  for (int64_t c0 = 0; c0 < out; c0 += 16 * V) {
    if (out - c0 <= 8 * V) {
      DirectBlock<R, V / 2, kF16>(wt, in, out, c0, x, bias, y, ldy);
      return;
    }
    DirectBlock<R, V, kF16>(wt, in, out, c0, x, bias, y, ldy);
  }
}

// Rows up to 3 at a time, 128 columns per pass (up to 24 accumulators, within the 32
// vector registers): a pass reads each k's 256 contiguous bytes of the panel (passes
// over 64 of the 128 columns, with the rows' stride, ran at a third of the speed).
template <bool kF16>
FW_AVX512 void DirectAvx512(const uint16_t* wt, int64_t in, int64_t out, const float* x,
                            int64_t rows, const float* bias, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows;) {
    const float* xr = x + r * in;
    float* yr = y + r * ldy;
    const int64_t left = rows - r;
    // 4 rows as 2 + 2, else as many as fit.
    const int64_t now = left == 4 ? 2 : std::min<int64_t>(3, left);
    switch (now) {
      case 1:
        DirectRows<1, 8, kF16>(wt, in, out, xr, bias, yr, ldy);
        break;
      case 2:
        DirectRows<2, 8, kF16>(wt, in, out, xr, bias, yr, ldy);
        break;
      default:
        DirectRows<3, 8, kF16>(wt, in, out, xr, bias, yr, ldy);
        break;
    }
    r += now;
  }
}

template <bool kF16>
FW_AVX512 void WidenAvx512(const uint16_t* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, Widen16<kF16>(w + i));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, mask, Widen16<kF16>(w + i));  // reads the padding
  }
}
#endif

}  // namespace

const char* WeightFormatName(WeightFormat format) {
  switch (format) {
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kF16:
      return "f16";
    case WeightFormat::kF32:
      break;
  }
  return "f32";
}

int WeightFormatBits(WeightFormat format) { return format == WeightFormat::kF32 ? 32 : 16; }

void WidenValues(WeightFormat format, const uint16_t* in, int64_t n, float* out) {
  if (format == WeightFormat::kF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = BfloatToFloat(in[i]);
  }
}

WeightFormat PackedLinear::ExactFormat(const float* w, int64_t n) {
  bool bf16 = true, f16 = true;
  for (int64_t i = 0; i < n && (bf16 || f16); ++i) {
    const float v = w[i];
    if (std::isnan(v)) return WeightFormat::kF32;
    const uint32_t bits = Bits(v);
    bf16 = bf16 && (bits & 0xffffu) == 0;
    f16 = f16 && Bits(HalfToFloat(FloatToHalf(v))) == bits;
  }
  if (bf16) return WeightFormat::kBf16;
  return f16 ? WeightFormat::kF16 : WeightFormat::kF32;
}

bool PackedLinear::HasAvx512Kernel() {
#ifdef FW_HAVE_AVX512_KERNEL
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

const char* PackedLinear::Backend() {
#ifdef FWSERVE_HAVE_LIBXSMM
  if (JitAvailable()) return "libxsmm";
#endif
  return "openblas";
}

PackedLinear::PackedLinear(const float* w, int64_t out, int64_t in, bool use_libxsmm,
                           WeightFormat format)
    : in_(in), out_(out), format_(format) {
#ifdef FWSERVE_HAVE_LIBXSMM
  libxsmm_ = use_libxsmm && JitAvailable();
#else
  (void)use_libxsmm;
#endif
  if (format != WeightFormat::kF32) {
    narrow_.assign(static_cast<size_t>(in * out + kNarrowPadding), 0);
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < in; ++k) {
        const float v = w[o * in + k];
        narrow_[static_cast<size_t>(k * out + o)] =
            format == WeightFormat::kF16 ? FloatToHalf(v) : static_cast<uint16_t>(Bits(v) >> 16);
      }
    }
    return;
  }
  if (libxsmm_) {
    // Only Wᵀ is kept: the cblas fallback reads it too (Blas).
    transposed_.resize(static_cast<size_t>(in * out));
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < in; ++k) {
        transposed_[static_cast<size_t>(k * out + o)] = w[o * in + k];
      }
    }
    return;
  }
  weight_.assign(w, w + out * in);
}

int64_t PackedLinear::weight_bytes() const {
  return static_cast<int64_t>(sizeof(float) * (weight_.size() + transposed_.size()) +
                              sizeof(uint16_t) * (narrow_.empty() ? 0 : in_ * out_));
}

const float* PackedLinear::Widened() const {
  thread_local std::vector<float> scratch;
  const int64_t n = in_ * out_;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(static_cast<size_t>(n));
  const bool f16 = format_ == WeightFormat::kF16;
#ifdef FW_HAVE_AVX512_KERNEL
  if (HasAvx512Kernel()) {
    (f16 ? WidenAvx512<true> : WidenAvx512<false>)(narrow_.data(), n, scratch.data());
    return scratch.data();
  }
#endif
  (f16 ? WidenPortable<true> : WidenPortable<false>)(narrow_.data(), n, scratch.data());
  return scratch.data();
}

void PackedLinear::ApplyPortable(const float* x, int64_t rows, const float* bias, float* y) const {
  Run(x, rows, bias, y, out_, /*avx512=*/false);
}

std::pair<const float*, bool> PackedLinear::FloatWeights() const {
  if (!narrow_.empty()) return {Widened(), true};
  if (!transposed_.empty()) return {transposed_.data(), true};
  return {weight_.data(), false};
}

void PackedLinear::ApplyWithBlas(const float* x, int64_t rows, float* y) const {
  const auto [w, transposed] = FloatWeights();
  Blas(w, transposed, x, rows, false, y, out_);
}

void PackedLinear::Blas(const float* w, bool transposed, const float* x, int64_t rows,
                        bool accumulate, float* y, int64_t ldy) const {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (transposed) {
    // Packed: Wᵀ [in, out] row-major.
    if (rows < kGemvBelow) {
      for (int64_t r = 0; r < rows; ++r) {
        cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<int>(in_), static_cast<int>(out_), 1.0f,
                    w, static_cast<int>(out_), x + r * in_, 1, beta, y + r * ldy, 1);
      }
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                static_cast<int>(out_), static_cast<int>(in_), 1.0f, x, static_cast<int>(in_), w,
                static_cast<int>(out_), beta, y, static_cast<int>(ldy));
    return;
  }
  if (rows < kGemvBelow) {
    for (int64_t r = 0; r < rows; ++r) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(out_), static_cast<int>(in_), 1.0f,
                  w, static_cast<int>(in_), x + r * in_, 1, accumulate ? 1.0f : 0.0f, y + r * ldy,
                  1);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
              static_cast<int>(out_), static_cast<int>(in_), 1.0f, x, static_cast<int>(in_), w,
              static_cast<int>(in_), accumulate ? 1.0f : 0.0f, y, static_cast<int>(ldy));
}

void PackedLinear::Apply(const float* x, int64_t rows, const float* bias, float* y,
                         int64_t ldy) const {
  Run(x, rows, bias, y, ldy, HasAvx512Kernel());
}

void PackedLinear::Run(const float* x, int64_t rows, const float* bias, float* y, int64_t ldy,
                       bool avx512) const {
  if (rows <= 0) return;
  if (!narrow_.empty()) {
    const bool f16 = format_ == WeightFormat::kF16;
#ifdef FW_HAVE_AVX512_KERNEL
    if (avx512) {
      (f16 ? DirectAvx512<true> : DirectAvx512<false>)(narrow_.data(), in_, out_, x, rows, bias, y,
                                                       ldy);
      return;
    }
#else
    (void)avx512;
#endif
    if (rows <= kDirectRows) {
      (f16 ? DirectPortable<true> : DirectPortable<false>)(narrow_.data(), in_, out_, x, rows, bias,
                                                           y, ldy);
      return;
    }
  }
  if (rows == 1 && !transposed_.empty()) {
    DirectFloatRow(transposed_.data(), in_, out_, x, bias, y);
    return;
  }
  const bool accumulate = bias != nullptr;
  if (accumulate) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * ldy, bias, sizeof(float) * out_);
  }
  const auto [w, transposed] = FloatWeights();
  Product(w, transposed, x, rows, accumulate, y, ldy);
}

void PackedLinear::Product(const float* w, bool transposed, const float* x, int64_t rows,
                           bool accumulate, float* y, int64_t ldy) const {
#ifdef FWSERVE_HAVE_LIBXSMM
  if (libxsmm_ && !(rows >= kBlasMinRows && in_ >= kBlasMinIn)) {
    for (int64_t first = 0; first < rows; first += kChunkRows) {
      const int64_t n = std::min(kChunkRows, rows - first);
      const libxsmm_smmfunction kernel = Kernel(out_, n, in_, accumulate, ldy);
      if (kernel == nullptr) {
        Blas(w, transposed, x + first * in_, n, accumulate, y + first * ldy, ldy);
        continue;
      }
      kernel(w, x + first * in_, y + first * ldy);
    }
    return;
  }
#endif
  Blas(w, transposed, x, rows, accumulate, y, ldy);
}

}  // namespace fwmodel
