// y[rows, out] = x[rows, in] · W[out, in]ᵀ (+ bias[out]) with the weights laid out once
// at load, for the native step's small fixed-weight projections (rows: the batch, 1 to a
// few hundred; in, out: the model's widths). OpenBLAS cannot keep a packed operand: its
// sgemm repacks the weight matrix on every call (`sgemm_incopy`, a fifth of the engine
// thread's time at 64 streams, docs/benchmarks.md). With libxsmm (Debian's libxsmm-dev,
// found at build time: FWSERVE_HAVE_LIBXSMM) the product runs as JIT-compiled small-GEMM
// kernels on Wᵀ stored at load, in chunks of kChunkRows rows; builds or CPUs without
// libxsmm's JIT go to cblas_sgemm as before.
//
// 16-bit weights (WeightFormat kBf16, kF16): for weights that are exactly bf16 or f16
// values (real RWKV checkpoints ship in those and the loader widens them), only Wᵀ in
// 16 bits is kept, half the bytes a batch-1 product reads. Products still compute in
// float32 on float32 activations, each weight widened exactly: up to summation order
// they equal the float32 instance's. On CPUs with AVX-512 every product runs a
// hand-written kernel on the 16-bit Wᵀ; elsewhere up to kDirectRows rows run a portable
// loop, and more rows widen Wᵀ into a per-thread float32 scratch and run the float32
// path on it.
//
// Thread-safety: immutable after construction; Apply may run concurrently on disjoint
// outputs. Apply computes on the calling thread only when libxsmm serves it (16-bit
// instances: also on the AVX-512 kernel and the portable loop).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace fwmodel {

// How an instance keeps its weights. kBf16: the high half of each float32 (bfloat16);
// kF16: IEEE binary16 (converted with F16C where the CPU has it).
enum class WeightFormat { kF32, kBf16, kF16 };
const char* WeightFormatName(WeightFormat format);  // "f32", "bf16", "f16"
int WeightFormatBits(WeightFormat format);          // 32 or 16
// out[0, n) := in[0, n) widened from `format` (kBf16 or kF16), exactly.
void WidenValues(WeightFormat format, const uint16_t* in, int64_t n, float* out);

class PackedLinear {
 public:
  // Rows per libxsmm kernel call. A product of any number of rows runs as such calls on
  // the calling thread; the caller splits rows over threads (NativeStep). An earlier cut,
  // products over 128 rows to cblas_sgemm and its own threads, cost the server 6-7% at
  // 256 streams once the step was on libxsmm (docs/benchmarks.md).
  static constexpr int64_t kChunkRows = 64;
  // Products of at least kBlasMinRows rows over at least kBlasMinIn inputs go to
  // cblas_sgemm on the kept Wᵀ, libxsmm or not: at such sizes OpenBLAS's blocked kernels
  // ran the 340M DeltaNet's batch-64 step and prefill 1.6-1.8x faster than libxsmm's
  // unblocked JIT kernels (docs/benchmarks.md, "DeltaNet at the 340M shape"). The
  // shipped models (inputs of 128 to 512) stay on libxsmm.
  static constexpr int64_t kBlasMinRows = 16;
  static constexpr int64_t kBlasMinIn = 768;
  // Rows up to which a 16-bit instance on a CPU without the AVX-512 kernel runs the
  // portable loop on its 16-bit weights (the bandwidth-bound case); above it the
  // widened panel runs the float32 kernels (not measured: no such CPU here). The
  // AVX-512 kernel serves every row count: on this project's 2-core Zen 5 VM it beat
  // widening + libxsmm at 1 to 64 rows (docs/benchmarks.md).
  static constexpr int64_t kDirectRows = 4;

  // The narrowest format in which every one of w[0, n) is exactly representable
  // (bf16, else f16, else f32); NaNs make it f32.
  static WeightFormat ExactFormat(const float* w, int64_t n);

  PackedLinear() = default;
  // Copies w [out, in] row-major (the caller's buffer may go away). use_libxsmm false:
  // every product goes to cblas_sgemm (the A/B baseline, --native-gemm openblas).
  // format kBf16 or kF16 keeps Wᵀ in 16 bits only; every value of w must then be exact
  // in it (ExactFormat): others are truncated.
  PackedLinear(const float* w, int64_t out, int64_t in, bool use_libxsmm = true,
               WeightFormat format = WeightFormat::kF32);

  // y [rows, out] := x [rows, in] · Wᵀ (+ bias [out] when not null). Row-major,
  // contiguous, y not aliasing x; rows >= 0.
  void Apply(const float* x, int64_t rows, const float* bias, float* y) const {
    Apply(x, rows, bias, y, out_);
  }
  // The same with y's rows ldy >= out() floats apart: this product's columns of a wider
  // output (a panel of a larger projection, native_rwkv.cc). Only y's first out()
  // floats of each row are written.
  void Apply(const float* x, int64_t rows, const float* bias, float* y, int64_t ldy) const;

  // Apply through cblas whatever the backend: the path a libxsmm instance takes for a
  // shape the JIT declines (it reads the packed Wᵀ then). For tests.
  void ApplyWithBlas(const float* x, int64_t rows, float* y) const;
  // Apply (contiguous y) as a CPU without the AVX-512 kernel runs it: the portable
  // loop up to kDirectRows rows, the widened float32 path above. Plain Apply for float32
  // instances. For tests.
  void ApplyPortable(const float* x, int64_t rows, const float* bias, float* y) const;

  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  // "libxsmm" when small products run on libxsmm's JIT kernels in this build on this
  // CPU, else "openblas".
  static const char* Backend();
  // Whether this instance runs its small products on libxsmm.
  bool packed() const { return libxsmm_; }
  WeightFormat format() const { return format_; }
  // Whether rows <= kDirectRows run the AVX-512 16-bit kernel on this CPU (16-bit
  // instances; else the portable loop).
  static bool HasAvx512Kernel();
  // Bytes of weights this instance keeps (out · in · 4 or 2, without padding).
  int64_t weight_bytes() const;

 private:
  // y [rows, out] (+)= x · Wᵀ over float32 weights `w`: Wᵀ [in, out] when transposed,
  // else W [out, in]; libxsmm when this instance uses it (Wᵀ only), else cblas
  // (accumulate: beta 1); y's rows ldy floats apart.
  void Product(const float* w, bool transposed, const float* x, int64_t rows, bool accumulate,
               float* y, int64_t ldy) const;
  // Apply's work; avx512: whether 16-bit products may run the AVX-512 kernel.
  void Run(const float* x, int64_t rows, const float* bias, float* y, int64_t ldy,
           bool avx512) const;
  void Blas(const float* w, bool transposed, const float* x, int64_t rows, bool accumulate,
            float* y, int64_t ldy) const;
  // The 16-bit Wᵀ widened into this thread's scratch (valid until the thread's next call).
  const float* Widened() const;
  // The weights as Product and Blas take them, whichever layout is kept: (Wᵀ, true) when
  // transposed or 16-bit (then widened, as Widened), else (W, false).
  std::pair<const float*, bool> FloatWeights() const;

  int64_t in_ = 0;
  int64_t out_ = 0;
  WeightFormat format_ = WeightFormat::kF32;
  bool libxsmm_ = false;
  // Exactly one is kept: W [out, in] as given (cblas, float32), Wᵀ [in, out] row-major
  // (float32 with libxsmm: its column-major A; cblas reads it too when the JIT declines
  // a shape), or Wᵀ [in, out] in 16 bits (format_ kBf16 or kF16), then zeros the
  // AVX-512 kernel may read past its end (packed_linear.cc, kNarrowPadding).
  std::vector<float> weight_;
  std::vector<float> transposed_;
  std::vector<uint16_t> narrow_;
};

}  // namespace fwmodel
