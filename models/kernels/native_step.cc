#include "models/kernels/native_step.h"

#include <cblas.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"
#include "models/kernels/native_delta_net.h"
#include "models/kernels/native_parallel.h"
#include "models/kernels/native_rows.h"
#include "models/kernels/native_rwkv.h"
#include "models/kernels/native_weights.h"
#include "models/kernels/packed_linear.h"

namespace fwmodel {
namespace native {

FW_VECTOR_KERNEL
void LayerNorm(const float* x, int64_t rows, int64_t d, const float* weight, const float* bias,
               float eps, float* y) {
  LayerNormRows(x, rows, d, weight, bias, eps, y);
}

FW_VECTOR_KERNEL
void AddInPlace(float* __restrict h, const float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
}

}  // namespace native
namespace {

using native::ParallelRows;

// Rows per task of the per-session loops; below it the loop stays on one thread.
constexpr int64_t kRowGrain = 8;
// And at least this many floats of state read and written per task (a layer's state
// per session times its tokens): a team's start and join cost more than a smaller share
// saves. aft's 1.5K floats a layer went 0.77x the tokens/s at 16 streams on two threads
// with 8 sessions a task (docs/benchmarks.md).
constexpr int64_t kStateFloatsPerTask = 32768;
// Rows per task of a projection (a libxsmm kernel call each): smaller products stay on
// the calling thread.
constexpr int64_t kGemmRowGrain = 32;
// Most state tensors a mixer has (linear_attention: S and z).
constexpr int kMaxMixerStates = 4;

using native::AddInPlace;
using native::LayerNorm;

// a[j] = relu(u[j]), or its square. Selects, not std::max: GCC compiled that to a branch
// per element, mispredicted on half of them (5% of the served RWKV-7 step in
// native_rwkv.cc's twin).
FW_VECTOR_KERNEL
void ReluRow(const float* __restrict u, float* __restrict a, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) a[j] = !(u[j] <= 0.0f) ? u[j] : 0.0f;  // NaN stays NaN
}

FW_VECTOR_KERNEL
void SquaredReluRow(const float* __restrict u, float* __restrict a, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) a[j] = !(u[j] <= 0.0f) ? u[j] * u[j] : 0.0f;
}

float Gelu(float z) { return 0.5f * z * (1.0f + std::erf(z * static_cast<float>(M_SQRT1_2))); }

// Causal depthwise conv of one projection row in[d] over its history [K-1, d] (oldest
// first), in place; the history then holds the last K-1 inputs. w_by_tap: the conv
// weight transposed, [K, d]. `saved` is scratch [d].
FW_VECTOR_KERNEL
void ConvRow(float* __restrict in, float* __restrict history, const float* __restrict w_by_tap,
             const float* __restrict bias, int64_t d, int64_t K, float* __restrict saved) {
  std::memcpy(saved, in, sizeof(float) * d);
  std::memcpy(in, bias, sizeof(float) * d);
  for (int64_t t = 0; t < K - 1; ++t) {
    const float* __restrict w = w_by_tap + t * d;
    const float* __restrict past = history + t * d;
#pragma omp simd
    for (int64_t ch = 0; ch < d; ++ch) in[ch] += w[ch] * past[ch];
  }
  const float* __restrict w = w_by_tap + (K - 1) * d;
#pragma omp simd
  for (int64_t ch = 0; ch < d; ++ch) in[ch] += w[ch] * saved[ch];
  std::memmove(history, history + d, sizeof(float) * (K - 2) * d);
  std::memcpy(history + (K - 2) * d, saved, sizeof(float) * d);
}

// linear.Apply over `rows` rows, split by rows over `threads` (each task writes its own
// rows of y).
void ParallelApply(int threads, const PackedLinear& linear, const float* x, int64_t rows,
                   const float* bias, float* y) {
  ParallelRows(threads, rows, kGemmRowGrain, [&](int64_t begin, int64_t end) {
    linear.Apply(x + begin * linear.in(), end - begin, bias, y + begin * linear.out());
  });
}

// Indices of the k largest of s[0..n), largest first, ties toward the lower index (the
// contract's top-k; NaN ranks lowest). `order` is scratch [n].
void TopK(const float* s, int64_t n, int64_t k, std::vector<int64_t>* order) {
  order->resize(static_cast<size_t>(n));
  std::iota(order->begin(), order->end(), int64_t{0});
  auto key = [s](int64_t i) {
    return std::isnan(s[i]) ? -std::numeric_limits<float>::infinity() : s[i];
  };
  std::partial_sort(order->begin(), order->begin() + k, order->end(), [&](int64_t x, int64_t y) {
    const float sx = key(x), sy = key(y);
    return sx > sy || (sx == sy && x < y);
  });
}

}  // namespace

struct NativeStep::Layer {
  const float *norm1_w, *norm1_b, *norm2_w, *norm2_b;
  PackedLinear in_proj;  // [q|r, k, v (, beta)] stacked: [3d (+H), d]
  int64_t proj_width = 0;
  std::vector<float> conv_w[3];  // [K, d]: the conv weight [d, K] transposed
  const float* conv_b[3] = {nullptr, nullptr, nullptr};
  PackedLinear o;
  const float* o_b = nullptr;
  std::unique_ptr<NativeMixer> mixer;
  bool pkm = false;
  PackedLinear up, down, query;
  const float *up_b = nullptr, *down_b = nullptr;
  const float *keys = nullptr, *values = nullptr;
  std::vector<float> bn_mean, bn_denominator, bn_w, bn_b;  // denominator = sqrt(var + eps)
  int mixer_state = -1;  // index in State::tensors of the mixer's first state tensor
  int mixer_states = 0;  // how many it has (consecutive)
  int conv_state = -1;
};

NativeStep::NativeStep(const Model& model, int32_t threads) : model_(model), threads_(threads) {}

int NativeStep::Threads() const { return threads_ > 0 ? threads_ : at::get_num_threads(); }
NativeStep::~NativeStep() = default;

std::string NativeStep::weight_format() const {
  if (rwkv_ != nullptr) return rwkv_->weight_format();
  return delta_net_ != nullptr ? delta_net_->weight_format() : "f32";
}

int NativeStep::weight_bits() const {
  if (rwkv_ != nullptr) return rwkv_->weight_bits();
  return delta_net_ != nullptr ? delta_net_->weight_bits() : 32;
}

absl::StatusOr<std::unique_ptr<NativeStep>> NativeStep::CreateSharing(
    const NativeStep& other, const NativeStepOptions& options) {
  if (other.rwkv_ == nullptr && other.delta_net_ == nullptr) return Create(other.model_, options);
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be >= 0 (0: LibTorch's count), got ", options.threads));
  }
  std::unique_ptr<NativeStep> step(new NativeStep(other.model_, options.threads));
  if (other.rwkv_ != nullptr) step->rwkv_ = NativeRwkv::SharingWeights(*other.rwkv_);
  if (other.delta_net_ != nullptr) {
    step->delta_net_ = NativeDeltaNet::SharingWeights(*other.delta_net_);
  }
  return step;
}

absl::StatusOr<std::unique_ptr<NativeStep>> NativeStep::Create(const Model& model,
                                                               const NativeStepOptions& options) {
  if (!model.options().device.is_cpu() || model.options().dtype != torch::kFloat32) {
    return absl::FailedPreconditionError("the native decode step needs a float32 model on the CPU");
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be >= 0 (0: LibTorch's count), got ", options.threads));
  }
  std::unique_ptr<NativeStep> step(new NativeStep(model, options.threads));
  if (model.config().is_delta_net()) {
    auto delta_net = NativeDeltaNet::Create(model, options.packed_gemm, options.narrow_weights);
    if (!delta_net.ok()) return delta_net.status();
    step->delta_net_ = std::move(*delta_net);
    return step;
  }
  if (model.config().is_rwkv()) {
    auto rwkv = NativeRwkv::Create(model, options.packed_gemm, options.narrow_weights);
    if (!rwkv.ok()) return rwkv.status();
    step->rwkv_ = std::move(*rwkv);
    return step;
  }
  const ModelConfig& c = model.config();
  const int64_t d = c.d_model;
  try {
    NativeWeightReader read(model, &step->kept_);
    auto tensor = [&](const std::string& name) { return read.Tensor(name); };
    auto weight = [&](const std::string& name) { return read.Kept(name); };
    auto copy = [&](const std::string& name) {
      torch::Tensor t = tensor(name);
      return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    };
    auto linear = [&](const std::string& name) {
      torch::Tensor t = tensor(name);
      return PackedLinear(t.data_ptr<float>(), t.size(0), t.size(1), options.packed_gemm);
    };
    auto state_index = [&](int layer, const char* suffix) {
      return read.StateIndex(layer, suffix);
    };
    for (int i = 0; i < c.n_layers; ++i) {
      Layer l;
      const Mixer& mixer = model.mixer(i);
      const auto names = mixer.ProjectionNames();
      l.mixer = mixer.MakeNative();
      const std::string p = absl::StrCat("blocks.", i, ".");
      l.norm1_w = weight(p + "norm1.weight");
      l.norm1_b = weight(p + "norm1.bias");
      l.norm2_w = weight(p + "norm2.weight");
      l.norm2_b = weight(p + "norm2.bias");
      std::vector<float> in_proj;
      for (int j = 0; j < 3; ++j) {
        std::vector<float> w = copy(absl::StrCat(p, "mixer.", names[j], ".weight"));
        in_proj.insert(in_proj.end(), w.begin(), w.end());
        if (c.has_dconv()) {
          std::vector<float> w = copy(absl::StrCat(p, "mixer.", names[j], "_conv.weight"));
          const int64_t K = c.dconv_kernel;
          l.conv_w[j].resize(w.size());
          for (int64_t ch = 0; ch < d; ++ch) {
            for (int64_t t = 0; t < K; ++t) l.conv_w[j][t * d + ch] = w[ch * K + t];
          }
          l.conv_b[j] = weight(absl::StrCat(p, "mixer.", names[j], "_conv.bias"));
        }
      }
      const std::vector<float> extra = l.mixer->ExtraProjection();
      in_proj.insert(in_proj.end(), extra.begin(), extra.end());
      l.proj_width = static_cast<int64_t>(in_proj.size()) / d;
      l.in_proj = PackedLinear(in_proj.data(), l.proj_width, d, options.packed_gemm);
      l.o = linear(p + "mixer.o.weight");
      l.o_b = weight(p + "mixer.o.bias");
      const std::vector<StateTensorSpec> mixer_spec = mixer.StateSpec();
      l.mixer_state = state_index(i, mixer_spec.front().name.c_str());
      l.mixer_states = static_cast<int>(mixer_spec.size());
      if (l.mixer_state < 0 || l.mixer_states > kMaxMixerStates) {
        return absl::InternalError("native decode step: unexpected mixer state layout");
      }
      if (c.has_dconv()) l.conv_state = state_index(i, "conv");
      l.pkm = c.is_pkm_layer(i);
      if (l.pkm) {
        l.query = linear(p + "ffn.query.weight");
        l.keys = weight(p + "ffn.keys");
        l.values = weight(p + "ffn.values.weight");
        l.bn_mean = copy(p + "ffn.query_norm.running_mean");
        l.bn_denominator = copy(p + "ffn.query_norm.running_var");
        for (float& v : l.bn_denominator) v = std::sqrt(v + static_cast<float>(c.pkm_bn_eps));
        l.bn_w = copy(p + "ffn.query_norm.weight");
        l.bn_b = copy(p + "ffn.query_norm.bias");
      } else {
        l.up = linear(p + "ffn.up.weight");
        l.up_b = weight(p + "ffn.up.bias");
        l.down = linear(p + "ffn.down.weight");
        l.down_b = weight(p + "ffn.down.bias");
      }
      step->layers_.push_back(std::move(l));
    }
    if (c.has_pkm()) step->pkm_pairs_ = PkmCandidatePairs(c.pkm_topk);
    step->embed_ = weight("embed.weight");
    step->norm_f_w_ = weight("norm_f.weight");
    step->norm_f_b_ = weight("norm_f.bias");
    step->head_ = linear(c.tie_embeddings ? "embed.weight" : "head.weight");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("native decode step: ", e.what()));
  }
  return step;
}

absl::Status NativeStep::CheckArguments(absl::Span<const int64_t> tokens, int64_t steps,
                                        absl::Span<const int64_t> rows, const State& pool) const {
  const ModelConfig& c = model_.config();
  if (steps < 1 || tokens.size() != rows.size() * static_cast<size_t>(steps)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens (", tokens.size(), ") and rows (",
                                                   rows.size(), ") differ in size (steps ", steps,
                                                   ")"));
  }
  const auto& spec = model_.state_spec();
  if (pool.tensors.size() != spec.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has ", pool.tensors.size(), " tensors, expected ", spec.size()));
  }
  const int64_t capacity = pool.tensors.empty() ? 0 : pool.tensors[0].size(0);
  for (size_t i = 0; i < spec.size(); ++i) {
    const torch::Tensor& t = pool.tensors[i];
    std::vector<int64_t> shape = {capacity};
    shape.insert(shape.end(), spec[i].shape.begin(), spec[i].shape.end());
    if (t.sizes().vec() != shape || t.scalar_type() != torch::kFloat32 || !t.device().is_cpu() ||
        !t.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state tensor '", spec[i].name, "' is not a contiguous float32 CPU pool of this model"));
    }
  }
  for (int64_t token : tokens) {
    if (token < 0 || token >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", token, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  std::vector<int64_t> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", sorted[i], " is outside the pool [0, ", capacity, ")"));
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("row ", sorted[i], " appears twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status NativeStep::Step(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                              State* pool, float* logits) {
  return Absorb(tokens, 1, rows, pool, logits);
}

absl::Status NativeStep::Absorb(absl::Span<const int64_t> tokens, int64_t steps,
                                absl::Span<const int64_t> rows, State* pool, float* logits) {
  return AbsorbTokens(tokens, steps, rows, pool, logits, /*every_position=*/false);
}

absl::Status NativeStep::AbsorbEveryPosition(absl::Span<const int64_t> tokens, int64_t steps,
                                             absl::Span<const int64_t> rows, State* pool,
                                             float* logits) {
  return AbsorbTokens(tokens, steps, rows, pool, logits, /*every_position=*/true);
}

absl::Status NativeStep::AbsorbTokens(absl::Span<const int64_t> tokens, int64_t steps,
                                      absl::Span<const int64_t> rows, State* pool, float* logits,
                                      bool every_position) {
  if (absl::Status s = CheckArguments(tokens, steps, rows, *pool); !s.ok()) return s;
  if (rwkv_ != nullptr) {
    rwkv_->Absorb(tokens, steps, rows, pool, Threads(), logits, every_position);
    return absl::OkStatus();
  }
  if (delta_net_ != nullptr) {
    delta_net_->Absorb(tokens, steps, rows, pool, Threads(), logits, every_position);
    return absl::OkStatus();
  }
  const ModelConfig& c = model_.config();
  const int64_t B = static_cast<int64_t>(rows.size());
  if (B == 0) return absl::OkStatus();
  // Activations of all B·T tokens go through each projection as one matrix; only the
  // recurrences run token by token (per session, in order).
  const int64_t T = steps, N = B * T;
  const int threads = Threads();
  const int64_t d = c.d_model;
  const int64_t K = c.has_dconv() ? c.dconv_kernel : 0;
  const float norm_eps = static_cast<float>(c.norm_eps);
  const int64_t hidden_width = c.ffn == FfnKind::kGeglu ? 2 * static_cast<int64_t>(c.d_ff) : c.d_ff;
  int64_t widest_proj = 0;
  for (const Layer& l : layers_) widest_proj = std::max(widest_proj, l.proj_width);
  const int64_t query_width = static_cast<int64_t>(c.pkm_heads) * c.pkm_dim_key;
  auto fit = [](std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  };
  fit(h_, N * d);
  fit(x_, N * d);
  fit(y_, N * d);
  fit(proj_, N * widest_proj);
  fit(hidden_, N * hidden_width);
  fit(act_, N * c.d_ff);
  if (c.has_pkm()) {
    fit(pkm_query_, N * query_width);
    fit(pkm_scores_, N * 2 * c.pkm_heads * c.pkm_num_keys);
  }
  float *h = h_.data(), *x = x_.data(), *y = y_.data(), *proj = proj_.data();

  for (int64_t i = 0; i < N; ++i) {
    std::memcpy(h + i * d, embed_ + tokens[i] * d, sizeof(float) * d);
  }
  for (const Layer& l : layers_) {
    const int64_t P = l.proj_width;
    LayerNorm(h, N, d, l.norm1_w, l.norm1_b, norm_eps, x);
    ParallelApply(threads, l.in_proj, x, N, nullptr, proj);
    float* mixer_base[kMaxMixerStates];
    int64_t mixer_row[kMaxMixerStates];
    for (int j = 0; j < l.mixer_states; ++j) {
      mixer_base[j] = pool->tensors[l.mixer_state + j].data_ptr<float>();
      mixer_row[j] = pool->tensors[l.mixer_state + j].stride(0);
    }
    NativeMixer::Tokens batch;
    batch.proj = proj;
    batch.proj_width = P;
    batch.y = y;
    batch.rows = rows.data();
    batch.steps = T;
    batch.state = mixer_base;
    batch.state_row = mixer_row;
    const int64_t mixer_scratch = l.mixer->ScratchFloats();
    float* conv_base = l.conv_state >= 0 ? pool->tensors[l.conv_state].data_ptr<float>() : nullptr;
    const int64_t conv_row = l.conv_state >= 0 ? pool->tensors[l.conv_state].stride(0) : 0;

    int64_t state_floats = l.conv_state >= 0 ? conv_row : 0;
    for (int j = 0; j < l.mixer_states; ++j) state_floats += mixer_row[j];
    const int64_t sessions_per_task =
        std::max(kRowGrain, kStateFloatsPerTask / std::max<int64_t>(1, state_floats * T));
    ParallelRows(threads, B, sessions_per_task, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(d + mixer_scratch));
      if (K >= 2) {  // the dconv of every token first: it does not depend on the mixer
        float* saved = scratch.data();
        for (int64_t i = begin * T; i < end * T; ++i) {
          float* pr = proj + i * P;
          float* conv = conv_base + rows[i / T] * conv_row;  // [3, K-1, d]
          for (int j = 0; j < 3; ++j) {
            ConvRow(pr + j * d, conv + j * (K - 1) * d, l.conv_w[j].data(), l.conv_b[j], d, K,
                    saved);
          }
        }
      }
      l.mixer->Absorb(batch, begin, end, scratch.data() + d);  // one call per layer and task
    });
    ParallelApply(threads, l.o, y, N, l.o_b, x);
    AddInPlace(h, x, N * d);

    LayerNorm(h, N, d, l.norm2_w, l.norm2_b, norm_eps, x);
    if (l.pkm) {
      PkmFfn(l, x, N, threads, y);
    } else {
      const int64_t f = c.d_ff;
      float* u = hidden_.data();
      ParallelApply(threads, l.up, x, N, l.up_b, u);
      float* a = act_.data();
      for (int64_t b = 0; b < N; ++b) {
        const float* ub = u + b * hidden_width;
        float* ab = a + b * f;
        switch (c.ffn) {
          case FfnKind::kRelu:
            ReluRow(ub, ab, f);
            break;
          case FfnKind::kSquaredRelu:
            SquaredReluRow(ub, ab, f);
            break;
          case FfnKind::kGeglu:
            for (int64_t j = 0; j < f; ++j) ab[j] = ub[j] * Gelu(ub[f + j]);
            break;
          case FfnKind::kSwiglu:  // DeltaNet's, never here: Create declines those models
            break;
        }
      }
      ParallelApply(threads, l.down, a, N, l.down_b, y);
    }
    AddInPlace(h, y, N * d);
  }
  if (every_position) {
    LayerNorm(h, N, d, norm_f_w_, norm_f_b_, norm_eps, x);
    ParallelApply(threads, head_, x, N, nullptr, logits);
    return absl::OkStatus();
  }
  // Logits of each session's last token only.
  for (int64_t b = 0; b < B; ++b) {
    LayerNorm(h + ((b + 1) * T - 1) * d, 1, d, norm_f_w_, norm_f_b_, norm_eps, x + b * d);
  }
  ParallelApply(threads, head_, x, B, nullptr, logits);
  return absl::OkStatus();
}

void NativeStep::PkmFfn(const Layer& l, const float* x, int64_t B, int threads, float* out) {
  const ModelConfig& c = model_.config();
  const int64_t d = c.d_model, Hm = c.pkm_heads, nk = c.pkm_num_keys, k = c.pkm_topk,
                dk = c.pkm_dim_key, half = dk / 2, width = Hm * dk;
  float* q = pkm_query_.data();
  l.query.Apply(x, B, nullptr, q);
  for (int64_t b = 0; b < B; ++b) {
    float* qb = q + b * width;
    for (int64_t ch = 0; ch < width; ++ch) {
      qb[ch] = (qb[ch] - l.bn_mean[ch]) / l.bn_denominator[ch] * l.bn_w[ch] + l.bn_b[ch];
    }
  }
  // scores[b, h, p, :] = keys[h, :, p, :] · q[b, h, p]: one sgemm per (head, half).
  float* scores = pkm_scores_.data();
  for (int64_t hd = 0; hd < Hm; ++hd) {
    for (int64_t p = 0; p < 2; ++p) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(B),
                  static_cast<int>(nk), static_cast<int>(half), 1.0f, q + hd * dk + p * half,
                  static_cast<int>(width), l.keys + hd * nk * dk + p * half, static_cast<int>(dk),
                  0.0f, scores + (hd * 2 + p) * nk, static_cast<int>(2 * Hm * nk));
    }
  }
  const std::vector<int64_t>& pairs = pkm_pairs_;
  const int64_t num_pairs = static_cast<int64_t>(pairs.size() / 2);
  ParallelRows(threads, B, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order1, order2, candidate_order;
    std::vector<float> a(static_cast<size_t>(k)), bsc(static_cast<size_t>(k));
    std::vector<float> candidate(static_cast<size_t>(num_pairs)), weight(static_cast<size_t>(k));
    for (int64_t b = begin; b < end; ++b) {
      float* ob = out + b * d;
      std::fill(ob, ob + d, 0.0f);
      for (int64_t hd = 0; hd < Hm; ++hd) {
        const float* s1 = scores + b * 2 * Hm * nk + (hd * 2) * nk;
        const float* s2 = s1 + nk;
        TopK(s1, nk, k, &order1);
        TopK(s2, nk, k, &order2);
        for (int64_t m = 0; m < k; ++m) {
          a[m] = s1[order1[m]];
          bsc[m] = s2[order2[m]];
        }
        for (int64_t pi = 0; pi < num_pairs; ++pi) {
          candidate[pi] = a[pairs[2 * pi]] + bsc[pairs[2 * pi + 1]];
        }
        TopK(candidate.data(), num_pairs, k, &candidate_order);
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t m = 0; m < k; ++m) top = std::max(top, candidate[candidate_order[m]]);
        float sum = 0;
        for (int64_t m = 0; m < k; ++m) {
          weight[m] = std::exp(candidate[candidate_order[m]] - top);
          sum += weight[m];
        }
        for (int64_t m = 0; m < k; ++m) {
          const int64_t pi = candidate_order[m];
          const int64_t slot = order1[pairs[2 * pi]] * nk + order2[pairs[2 * pi + 1]];
          const float w = weight[m] / sum;
          const float* value = l.values + slot * d;
          for (int64_t ch = 0; ch < d; ++ch) ob[ch] += w * value[ch];
        }
      }
    }
  });
}

}  // namespace fwmodel
