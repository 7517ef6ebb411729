// y[rows, out] = x[rows, in] · W[out, in]ᵀ (+ bias[out]) with the weights laid out once
// at load, for the native step's small fixed-weight projections (rows: the batch, 1 to a
// few hundred; in, out: the model's widths). OpenBLAS cannot keep a packed operand: its
// sgemm repacks the weight matrix on every call (`sgemm_incopy`, a fifth of the engine
// thread's time at 64 streams, docs/benchmarks.md). With libxsmm (Debian's libxsmm-dev,
// found at build time: FWSERVE_HAVE_LIBXSMM) the product runs as JIT-compiled small-GEMM
// kernels on Wᵀ stored at load, in chunks of kChunkRows rows; builds or CPUs without
// libxsmm's JIT go to cblas_sgemm as before.
//
// Thread-safety: immutable after construction; Apply may run concurrently on disjoint
// outputs. Apply computes on the calling thread only when libxsmm serves it.
#pragma once

#include <cstdint>
#include <vector>

namespace fwmodel {

class PackedLinear {
 public:
  // Rows per libxsmm kernel call. A product of any number of rows runs as such calls on
  // the calling thread; the caller splits rows over threads (NativeStep). An earlier cut,
  // products over 128 rows to cblas_sgemm and its own threads, cost the server 6-7% at
  // 256 streams once the step was on libxsmm (docs/benchmarks.md).
  static constexpr int64_t kChunkRows = 64;

  PackedLinear() = default;
  // Copies w [out, in] row-major (the caller's buffer may go away). use_libxsmm false:
  // every product goes to cblas_sgemm (the A/B baseline, --native-gemm openblas).
  PackedLinear(const float* w, int64_t out, int64_t in, bool use_libxsmm = true);

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
  void ApplyWithBlas(const float* x, int64_t rows, float* y) const {
    Blas(x, rows, false, y, out_);
  }

  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  // "libxsmm" when small products run on libxsmm's JIT kernels in this build on this
  // CPU, else "openblas".
  static const char* Backend();
  // Whether this instance runs its small products on libxsmm.
  bool packed() const { return !transposed_.empty(); }

 private:
  // y [rows, out] (+)= x · Wᵀ through cblas_sgemm (accumulate: beta 1), y's rows ldy
  // floats apart.
  void Blas(const float* x, int64_t rows, bool accumulate, float* y, int64_t ldy) const;

  int64_t in_ = 0;
  int64_t out_ = 0;
  // Exactly one is kept: W [out, in] as given (cblas), or, when libxsmm serves this
  // instance, Wᵀ [in, out] row-major (libxsmm's column-major A; cblas reads it too
  // when the JIT declines a shape).
  std::vector<float> weight_;
  std::vector<float> transposed_;
};

}  // namespace fwmodel
