// The native CPU kernels' projections (native_rwkv.cc, native_delta_net.cc): each weight
// matrix cut into panels of output columns (each a PackedLinear), and a stage's products
// run together, their panels split over the threads by multiply-adds, each followed by an
// elementwise epilogue on the columns its task computed. Each task reads only its own
// panels' weights, which is what bounds a step at batch 1 (a 0.1B model's head alone is
// 200 MB). Stages under kParallelMacs multiply-adds stay on the calling thread.
//
// Include only from files compiled with -fopenmp (models/CMakeLists.txt); torch-free.
// Thread-safety: Panels are immutable after MakePanels; RunGemms may run concurrently
// on disjoint outputs.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "models/kernels/packed_linear.h"

namespace fwmodel::native {

// A projection W [out, in] as panels of at most kPanelColumns output columns.
struct Panels {
  static constexpr int64_t kPanelColumns = 128;
  int64_t in = 0, out = 0;
  WeightFormat format = WeightFormat::kF32;  // every panel's
  std::vector<PackedLinear> panels;          // panel p: columns [p · kPanelColumns, ...)
};

// w [out, in] row-major as panels (copied). packed: libxsmm where the build has it
// (PackedLinear's use_libxsmm). narrow: keep the weights in 16 bits when every value of
// the projection is exact in them (the decision is the whole projection's).
Panels MakePanels(const float* w, int64_t out, int64_t in, bool packed, bool narrow);

// Multiply-adds below which a stage's products stay on the calling thread: waking the
// workers costs more than it saves there, and on a loaded machine much more (a worker
// waits for a time slice; a batch-1 step split everywhere ran 20x slower at load 8 on
// 2 cores).
constexpr double kParallelMacs = 4.0 * (1 << 20);

// What a product does to its output columns once they are computed (by the same task).
enum class Epilogue {
  kNone,
  kTanh,
  kSigmoid,
  kSilu,
  kSquaredRelu,
  kMultiply,           // y ⊙= gate
  kAddToResidual,      // residual += y
  kGatedAddToResidual  // residual += gate ⊙ y
};

// One product of a stage: y [rows, out] := x [rows, in] · Wᵀ (+ bias [out] when not null),
// then the epilogue; residual and gate are [rows, out] like y.
struct Gemm {
  const Panels* w;
  const float* x;
  const float* bias;
  float* y;
  Epilogue epilogue = Epilogue::kNone;
  float* residual = nullptr;
  const float* gate = nullptr;
};

// The products over `rows` rows, all their panels split over at most `threads` tasks of
// about equal multiply-adds (contiguous runs of panels: each task reads only its own),
// or on the calling thread below min_parallel_macs (rows included). A stage's products
// must not read each other's outputs.
void RunGemms(int threads, int64_t rows, absl::Span<const Gemm> gemms,
              double min_parallel_macs = kParallelMacs);

}  // namespace fwmodel::native
