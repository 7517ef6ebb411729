#include "models/kernels/native_gemm.h"

#include <algorithm>
#include <cmath>

#include "models/architectures/native_math.h"
#include "models/kernels/native_rows.h"

namespace fwmodel::native {
namespace {

FW_VECTOR_KERNEL
void GatedAddInPlace(float* __restrict h, const float* __restrict gate, const float* __restrict y,
                     int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] += gate[i] * y[i];
}

FW_VECTOR_KERNEL
void MultiplyInPlace(float* __restrict y, const float* __restrict gate, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= gate[i];
}

FW_VECTOR_KERNEL
void SquaredRelu(float* v, int64_t n) {
#pragma omp simd
  // A select, not std::max: GCC compiled that to a branch per element, mispredicted on
  // half of them (5% of the served RWKV-7 step).
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    v[i] = !(x <= 0.0f) ? x * x : 0.0f;  // NaN stays NaN, as std::max(NaN, 0) and torch
  }
}

FW_VECTOR_KERNEL
void SigmoidInPlace(float* v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = Sigmoid(v[i]);
}

FW_VECTOR_KERNEL
void SiluInPlace(float* v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * Sigmoid(v[i]);
}

void TanhInPlace(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = std::tanh(v[i]);
}

}  // namespace

Panels MakePanels(const float* w, int64_t out, int64_t in, bool packed, bool narrow) {
  Panels p;
  p.in = in;
  p.out = out;
  p.format = narrow ? PackedLinear::ExactFormat(w, out * in) : WeightFormat::kF32;
  for (int64_t first = 0; first < out; first += Panels::kPanelColumns) {
    const int64_t width = std::min(Panels::kPanelColumns, out - first);
    p.panels.emplace_back(w + first * in, width, in, packed, p.format);
  }
  return p;
}

void RunGemms(int threads, int64_t rows, absl::Span<const Gemm> gemms, double min_parallel_macs) {
  struct Item {
    const Gemm* gemm;
    int64_t panel;
    double end;  // multiply-adds per row of the items up to this one, inclusive
  };
  std::vector<Item> items;
  double total = 0;
  for (const Gemm& g : gemms) {
    for (size_t p = 0; p < g.w->panels.size(); ++p) {
      total += static_cast<double>(g.w->panels[p].out() * g.w->in);
      items.push_back({&g, static_cast<int64_t>(p), total});
    }
  }
  auto run = [&](const Item& item) {
    const Gemm& g = *item.gemm;
    const PackedLinear& panel = g.w->panels[static_cast<size_t>(item.panel)];
    const int64_t first = item.panel * Panels::kPanelColumns, width = panel.out(), out = g.w->out;
    panel.Apply(g.x, rows, g.bias != nullptr ? g.bias + first : nullptr, g.y + first, out);
    for (int64_t r = 0; r < rows && g.epilogue != Epilogue::kNone; ++r) {
      float* y = g.y + r * out + first;
      switch (g.epilogue) {
        case Epilogue::kNone:
          break;
        case Epilogue::kTanh:
          TanhInPlace(y, width);
          break;
        case Epilogue::kSigmoid:
          SigmoidInPlace(y, width);
          break;
        case Epilogue::kSilu:
          SiluInPlace(y, width);
          break;
        case Epilogue::kSquaredRelu:
          SquaredRelu(y, width);
          break;
        case Epilogue::kMultiply:
          MultiplyInPlace(y, g.gate + r * out + first, width);
          break;
        case Epilogue::kAddToResidual:
          AddInPlace(g.residual + r * out + first, y, width);
          break;
        case Epilogue::kGatedAddToResidual:
          GatedAddInPlace(g.residual + r * out + first, g.gate + r * out + first, y, width);
          break;
      }
    }
  };
  const int64_t tasks = total * static_cast<double>(rows) < min_parallel_macs
                            ? 1
                            : std::min<int64_t>(threads, static_cast<int64_t>(items.size()));
  if (tasks <= 1) {
    for (const Item& item : items) run(item);
    return;
  }
  const int team = static_cast<int>(tasks);
#pragma omp parallel for num_threads(team) schedule(static, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    // Item i belongs to the task whose share of the total holds its midpoint.
    const double begin = total * static_cast<double>(task) / static_cast<double>(tasks);
    const double end = total * static_cast<double>(task + 1) / static_cast<double>(tasks);
    double start = 0;
    for (const Item& item : items) {
      const double middle = (start + item.end) / 2;
      start = item.end;
      if (middle >= begin && middle < end) run(item);
    }
  }
}

}  // namespace fwmodel::native
