#include "models/kernels/native_rwkv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "models/architectures/native_math.h"
#include "models/gpu/rwkv7_mix_rule.h"
#include "models/gpu/rwkv7_rule.h"
#include "models/kernels/native_gemm.h"
#include "models/kernels/native_parallel.h"
#include "models/kernels/native_rows.h"
#include "models/kernels/native_weights.h"

namespace fwmodel {
namespace {

using native::FastExp;
using native::ParallelRows;

// Sessions per task of the norm and token-shift loop.
constexpr int64_t kRwkvRowGrain = 16;
// (session, head) pairs per task of the recurrence (a 64-wide head's token: ~5 µs).
constexpr int64_t kHeadGrain = 16;

using native::Epilogue;
using native::Gemm;
using native::MakePanels;
using native::RunGemms;

using native::LayerNorm;

// out = x + (previous − x) ⊙ mix, the token shift's interpolation (rwkv7.cc's addcmul;
// the CUDA shift-mix kernel's body, rwkv7_mix_rule.h).
FW_VECTOR_KERNEL
void ShiftMix(const float* __restrict x, const float* __restrict previous,
              const float* __restrict mix, int64_t d, float* __restrict out) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) out[c] = kernels::Rwkv7ShiftMix(x[c], previous[c], mix[c]);
}

// out = x ⊙ mix + previous ⊙ (1 − mix), RWKV-4's token shift (rwkv4.cc's form).
FW_VECTOR_KERNEL
void ShiftMix4(const float* __restrict x, const float* __restrict previous,
               const float* __restrict mix, int64_t d, float* __restrict out) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) out[c] = x[c] * mix[c] + previous[c] * (1 - mix[c]);
}

// RWKV-4's time mix of one token over d channels (rwkv4.cc's header): the state α, β,
// p [d each] advanced in place; y = r ⊙ wkv, with r already through its sigmoid and
// w = −exp(time_decay), u = time_first.
FW_VECTOR_KERNEL
void Rwkv4Token(int64_t d, float* __restrict alpha, float* __restrict beta, float* __restrict p,
                const float* __restrict k, const float* __restrict v, const float* __restrict r,
                const float* __restrict u, const float* __restrict w, float* __restrict y) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) {
    const float uk = u[c] + k[c];
    float q = std::max(p[c], uk);
    float e1 = FastExp(p[c] - q), e2 = FastExp(uk - q);
    y[c] = r[c] * ((e1 * alpha[c] + e2 * v[c]) / (e1 * beta[c] + e2));
    const float pw = p[c] + w[c];
    q = std::max(pw, k[c]);
    e1 = FastExp(pw - q);
    e2 = FastExp(k[c] - q);
    alpha[c] = e1 * alpha[c] + e2 * v[c];
    beta[c] = e1 * beta[c] + e2;
    p[c] = q;
  }
}

// One token of one head (width n): its slices of the projections in, y out.
struct HeadToken {
  const float* r;      // receptance
  const float* w_raw;  // w0 + tanh(x_w·w1ᵀ)·w2ᵀ
  const float* a_raw;  // a0 + (x_a·a1ᵀ)·a2ᵀ
  float* k;            // key; becomes k ⊙ (1 + (a − 1) ⊙ k_a)
  float* v;            // value; becomes the value residual's mix (blocks > 0)
  const float* v_raw;  // v0 + (x_v·v1ᵀ)·v2ᵀ; null in block 0
  float* v_first;      // block 0 writes v, later blocks read it
  const float* g;      // gate
  float* y;            // out: GroupNorm(S·r) + bonus, gated
};

// The head's weights' slices (width n) and the GroupNorm's epsilon.
struct HeadWeights {
  const float *k_k, *k_a, *r_k, *ln_w, *ln_b;
  float eps;
};

// Advances the head's state S [n (value i), n (key j)] past one token, in place:
//   S ← S·diag(w) + (S·(−kk)) (kk ⊙ a)ᵀ + v kᵀ;  y = S·r
// then y = (GroupNorm(y) + (r · (k ⊙ r_k)) v) ⊙ g. The per-element bodies are
// models/gpu/rwkv7_rule.h's, which the CUDA kernel runs too; the reductions are this
// loop's (vectorised). `scratch`: 3n floats.
FW_VECTOR_KERNEL
void HeadStep(int64_t n, float* __restrict S, const HeadToken& t, const HeadWeights& hw,
              float* __restrict scratch) {
  using kernels::Rwkv7Channel;
  float* __restrict w = scratch;
  float* __restrict neg_kk = scratch + n;
  float* __restrict kk_a = scratch + 2 * n;
  float* __restrict k = t.k;
  float* __restrict v = t.v;
  float squares = 0;
  FW_SIMD_SUM(squares)
  for (int64_t j = 0; j < n; ++j) {
    const float kk = kernels::Rwkv7KkRaw(k[j], hw.k_k[j]);
    neg_kk[j] = kk;
    squares += kk * kk;
  }
  const float norm = kernels::Rwkv7KkNorm(squares);
  FW_SIMD
  for (int64_t j = 0; j < n; ++j) {
    const Rwkv7Channel c =
        kernels::Rwkv7PrepareChannel(t.w_raw[j], t.a_raw[j], neg_kk[j], norm, k[j], hw.k_a[j]);
    w[j] = c.w;
    neg_kk[j] = c.neg_kk;
    kk_a[j] = c.kk_a;
    k[j] = c.k;
  }
  if (t.v_raw == nullptr) {
    std::memcpy(t.v_first, v, sizeof(float) * n);
  } else {
    const float* __restrict v_first = t.v_first;
    const float* __restrict v_raw = t.v_raw;
    FW_SIMD
    for (int64_t i = 0; i < n; ++i) v[i] = kernels::Rwkv7ValueMix(v[i], v_first[i], v_raw[i]);
  }
  const float* __restrict r = t.r;
  float* __restrict y = t.y;
  for (int64_t i = 0; i < n; ++i) {
    y[i] = kernels::Rwkv7RowUpdate(n, S + i * n, w, neg_kk, kk_a, k, r, v[i]);
  }
  // ln_x: this head's group.
  float sum = 0;
  FW_SIMD_SUM(sum)
  for (int64_t i = 0; i < n; ++i) sum += y[i];
  const float mean = kernels::Rwkv7GroupNormMean(sum, n);
  float centered = 0;
  FW_SIMD_SUM(centered)
  for (int64_t i = 0; i < n; ++i) centered += (y[i] - mean) * (y[i] - mean);
  const float inv = kernels::Rwkv7GroupNormInv(centered, n, hw.eps);
  float bonus = 0;
  FW_SIMD_SUM(bonus)
  for (int64_t j = 0; j < n; ++j) bonus += kernels::Rwkv7BonusTerm(r[j], k[j], hw.r_k[j]);
  FW_SIMD
  for (int64_t i = 0; i < n; ++i) {
    y[i] = kernels::Rwkv7Output(y[i], mean, inv, hw.ln_w[i], hw.ln_b[i], bonus, v[i], t.g[i]);
  }
}

}  // namespace

struct NativeRwkv::Layer {
  const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
  Panels r, k, v, o, key, value;
  // rwkv7
  const float* mix[6];  // x_r, x_w, x_k, x_v, x_a, x_g
  Panels w1, w2, a1, a2, v1, v2, g1, g2;
  const float *w0, *a0, *v0 = nullptr;  // v0: blocks > 0
  const float *k_k, *k_a, *r_k, *ln_x_w, *ln_x_b, *ffn_x_k;
  // rwkv4
  const float* mix4[3];                          // time_mix_k, _v, _r
  const float* ffn_mix4[2];                      // ffn.time_mix_k, _r
  std::vector<float> decay;                      // w = −exp(time_decay)
  const float* first;                            // u = time_first
  Panels ffn_r;                                  // ffn.receptance
  int att_shift = -1, wkv = -1, ffn_shift = -1;  // indices in State::tensors
};

NativeRwkv::NativeRwkv(const Model& model) : model_(model) {}
NativeRwkv::~NativeRwkv() = default;
NativeRwkv::Weights::~Weights() = default;

std::unique_ptr<NativeRwkv> NativeRwkv::SharingWeights(const NativeRwkv& other) {
  std::unique_ptr<NativeRwkv> step(new NativeRwkv(other.model_));
  step->weights_ = other.weights_;
  return step;
}

std::string NativeRwkv::weight_format() const { return weights_->formats.Names(); }

int NativeRwkv::weight_bits() const { return weights_->formats.Bits(); }

absl::StatusOr<std::unique_ptr<NativeRwkv>> NativeRwkv::Create(const Model& model, bool packed_gemm,
                                                               bool narrow_weights) {
  const ModelConfig& c = model.config();
  if (!c.is_rwkv() || !model.options().device.is_cpu() ||
      model.options().dtype != torch::kFloat32) {
    return absl::FailedPreconditionError(
        "the native rwkv step needs a float32 rwkv7 or rwkv4 model on the CPU");
  }
  const bool v7 = c.architecture == Architecture::kRwkv7;
  std::unique_ptr<NativeRwkv> step(new NativeRwkv(model));
  auto weights = std::make_shared<Weights>();
  try {
    NativeWeightReader read(model, &weights->kept);
    auto tensor = [&](const std::string& name) { return read.Tensor(name); };
    auto weight = [&](const std::string& name) { return read.Kept(name); };
    auto panels = [&](const std::string& name) {
      torch::Tensor t = tensor(name);
      Panels p = MakePanels(t.data_ptr<float>(), t.size(0), t.size(1), packed_gemm, narrow_weights);
      weights->formats.Add(p.format);
      return p;
    };
    auto state_index = [&](int layer, const char* suffix) {
      return read.StateIndex(layer, suffix);
    };
    static constexpr const char* kMixNames[6] = {"att.x_r", "att.x_w", "att.x_k",
                                                 "att.x_v", "att.x_a", "att.x_g"};
    for (int i = 0; i < c.n_layers; ++i) {
      const std::string p = absl::StrCat("blocks.", i, ".");
      Layer l;
      l.ln1_w = weight(p + "ln1.weight");
      l.ln1_b = weight(p + "ln1.bias");
      l.ln2_w = weight(p + "ln2.weight");
      l.ln2_b = weight(p + "ln2.bias");
      l.r = panels(p + "att.receptance.weight");
      l.k = panels(p + "att.key.weight");
      l.v = panels(p + "att.value.weight");
      l.o = panels(p + "att.output.weight");
      l.key = panels(p + "ffn.key.weight");
      l.value = panels(p + "ffn.value.weight");
      l.att_shift = state_index(i, "att_shift");
      l.wkv = state_index(i, "wkv");
      l.ffn_shift = state_index(i, "ffn_shift");
      if (l.att_shift < 0 || l.wkv < 0 || l.ffn_shift < 0) {
        return absl::InternalError("native rwkv step: unexpected state layout");
      }
      if (!v7) {
        l.mix4[0] = weight(p + "att.time_mix_k");
        l.mix4[1] = weight(p + "att.time_mix_v");
        l.mix4[2] = weight(p + "att.time_mix_r");
        l.ffn_mix4[0] = weight(p + "ffn.time_mix_k");
        l.ffn_mix4[1] = weight(p + "ffn.time_mix_r");
        l.first = weight(p + "att.time_first");
        const torch::Tensor decay = -torch::exp(tensor(p + "att.time_decay"));
        l.decay.assign(decay.data_ptr<float>(), decay.data_ptr<float>() + decay.numel());
        l.ffn_r = panels(p + "ffn.receptance.weight");
        weights->layers.push_back(std::move(l));
        continue;
      }
      for (int m = 0; m < 6; ++m) l.mix[m] = weight(p + kMixNames[m]);
      l.w1 = panels(p + "att.w1");
      l.w2 = panels(p + "att.w2");
      l.w0 = weight(p + "att.w0");
      l.a1 = panels(p + "att.a1");
      l.a2 = panels(p + "att.a2");
      l.a0 = weight(p + "att.a0");
      if (i > 0) {
        l.v1 = panels(p + "att.v1");
        l.v2 = panels(p + "att.v2");
        l.v0 = weight(p + "att.v0");
      }
      l.g1 = panels(p + "att.g1");
      l.g2 = panels(p + "att.g2");
      l.k_k = weight(p + "att.k_k");
      l.k_a = weight(p + "att.k_a");
      l.r_k = weight(p + "att.r_k");
      l.ln_x_w = weight(p + "att.ln_x.weight");
      l.ln_x_b = weight(p + "att.ln_x.bias");
      l.ffn_x_k = weight(p + "ffn.x_k");
      weights->layers.push_back(std::move(l));
    }
    // The embedding in 16 bits when every value is exact in them, as the projections:
    // its own copy, so that the model may release its float32 one (Model::ReleaseMatrices).
    weights->emb = NativeEmbedding::Read(read, "emb.weight", narrow_weights);
    weights->ln0_w = weight("blocks.0.ln0.weight");
    weights->ln0_b = weight("blocks.0.ln0.bias");
    weights->ln_out_w = weight("ln_out.weight");
    weights->ln_out_b = weight("ln_out.bias");
    weights->head = panels(c.tie_embeddings ? "emb.weight" : "head.weight");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("native rwkv step: ", e.what()));
  }
  step->weights_ = std::move(weights);
  return step;
}

void NativeRwkv::Absorb(absl::Span<const int64_t> tokens, int64_t steps,
                        absl::Span<const int64_t> rows, State* pool, int threads, float* logits,
                        bool every_position) {
  const ModelConfig& c = model_.config();
  const int64_t B = static_cast<int64_t>(rows.size());
  if (B == 0) return;
  // Token i = b·T + t: session b's t-th token. The projections run over all n tokens at
  // once; the recurrence per (session, head), its tokens in order.
  const int64_t T = steps, n = B * T;
  const int64_t d = c.d_model, H = c.n_heads, N = c.d_head(), f = c.d_ff;
  const int64_t Rw = c.decay_low_rank_dim, Ra = c.a_low_rank_dim, Rv = c.v_low_rank_dim,
                Rg = c.gate_low_rank_dim;
  const float eps = static_cast<float>(c.norm_eps);
  auto fit = [](std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
  };
  for (std::vector<float>* v : {&h_, &x_, &r_, &k_, &v_, &v_first_, &w_, &a_, &vmix_, &g_, &y_}) {
    fit(*v, n * d);
  }
  fit(mixed_, 6 * n * d);
  fit(lora_, n * (Rw + Ra + Rv + Rg));
  fit(ffn_, n * f);
  float *h = h_.data(), *x = x_.data(), *r = r_.data(), *k = k_.data(), *v = v_.data(),
        *v_first = v_first_.data(), *w_raw = w_.data(), *a_raw = a_.data(), *v_raw = vmix_.data(),
        *g = g_.data(), *y = y_.data(), *ffn = ffn_.data();
  float* mixed[6];
  for (int m = 0; m < 6; ++m) mixed[m] = mixed_.data() + m * n * d;
  float* w_low = lora_.data();
  float* a_low = w_low + n * Rw;
  float* v_low = a_low + n * Ra;
  float* g_low = v_low + n * Rv;

  ParallelRows(threads, B, kRwkvRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * T; i < end * T; ++i) {
      const int64_t token = tokens[static_cast<size_t>(i)];
      weights_->emb.Row(token, d, h + i * d);
    }
    LayerNorm(h + begin * T * d, (end - begin) * T, d, weights_->ln0_w, weights_->ln0_b, eps,
              h + begin * T * d);
  });
  // x = LN(h), then out_m[i] = x[i] + (x[i − 1] − x[i]) ⊙ mix_m (RWKV-4: x[i] ⊙ mix_m +
  // x[i − 1] ⊙ (1 − mix_m)), x[−1] the session's shift state, which then holds its last
  // token's x.
  const bool v7 = c.architecture == Architecture::kRwkv7;
  auto norm_and_shift = [&](const float* weight, const float* bias, float* state, int count,
                            const float* const* mix, float* const* out) {
    ParallelRows(threads, B, kRwkvRowGrain, [&](int64_t begin, int64_t end) {
      LayerNorm(h + begin * T * d, (end - begin) * T, d, weight, bias, eps, x + begin * T * d);
      for (int64_t b = begin; b < end; ++b) {
        float* last = state + rows[static_cast<size_t>(b)] * d;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t i = b * T + t;
          const float* previous = t == 0 ? last : x + (i - 1) * d;
          for (int m = 0; m < count; ++m) {
            (v7 ? ShiftMix : ShiftMix4)(x + i * d, previous, mix[m], d, out[m] + i * d);
          }
        }
        std::memcpy(last, x + (b * T + T - 1) * d, sizeof(float) * d);
      }
    });
  };

  for (size_t li = 0; li < weights_->layers.size(); ++li) {
    const Layer& l = weights_->layers[li];
    if (!v7) {  // RWKV-4 (rwkv4.cc)
      norm_and_shift(l.ln1_w, l.ln1_b, pool->tensors[l.att_shift].data_ptr<float>(), 3, l.mix4,
                     mixed);
      RunGemms(threads, n,
               {Gemm{&l.k, mixed[0], nullptr, k}, Gemm{&l.v, mixed[1], nullptr, v},
                Gemm{&l.r, mixed[2], nullptr, r, Epilogue::kSigmoid}});
      float* wkv = pool->tensors[l.wkv].data_ptr<float>();  // [capacity, 3 (α, β, p), d]
      ParallelRows(threads, B, kRwkvRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          float* state = wkv + rows[static_cast<size_t>(b)] * 3 * d;
          for (int64_t t = 0; t < T; ++t) {
            const int64_t o = (b * T + t) * d;
            Rwkv4Token(d, state, state + d, state + 2 * d, k + o, v + o, r + o, l.first,
                       l.decay.data(), y + o);
          }
        }
      });
      RunGemms(threads, n, {Gemm{&l.o, y, nullptr, x, Epilogue::kAddToResidual, h}});
      norm_and_shift(l.ln2_w, l.ln2_b, pool->tensors[l.ffn_shift].data_ptr<float>(), 2, l.ffn_mix4,
                     mixed);
      RunGemms(threads, n,
               {Gemm{&l.key, mixed[0], nullptr, ffn, Epilogue::kSquaredRelu},
                Gemm{&l.ffn_r, mixed[1], nullptr, g, Epilogue::kSigmoid}});
      RunGemms(threads, n, {Gemm{&l.value, ffn, nullptr, x, Epilogue::kGatedAddToResidual, h, g}});
      continue;
    }
    const bool first = li == 0;
    // ---- Time mix
    norm_and_shift(l.ln1_w, l.ln1_b, pool->tensors[l.att_shift].data_ptr<float>(), 6, l.mix, mixed);
    std::vector<Gemm> stage = {
        {&l.r, mixed[0], nullptr, r},      {&l.w1, mixed[1], nullptr, w_low, Epilogue::kTanh},
        {&l.k, mixed[2], nullptr, k},      {&l.v, mixed[3], nullptr, v},
        {&l.a1, mixed[4], nullptr, a_low}, {&l.g1, mixed[5], nullptr, g_low, Epilogue::kSigmoid}};
    if (!first) stage.push_back({&l.v1, mixed[3], nullptr, v_low});
    RunGemms(threads, n, stage);
    stage = {{&l.w2, w_low, l.w0, w_raw}, {&l.a2, a_low, l.a0, a_raw}, {&l.g2, g_low, nullptr, g}};
    if (!first) stage.push_back({&l.v2, v_low, l.v0, v_raw});
    RunGemms(threads, n, stage);

    float* wkv = pool->tensors[l.wkv].data_ptr<float>();
    const float group_eps = static_cast<float>(static_cast<double>(N) * c.norm_eps);
    ParallelRows(threads, B * H, kHeadGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(3 * N));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / H, head = item % H, at = head * N;
        float* S = wkv + (rows[static_cast<size_t>(b)] * H + head) * N * N;
        const HeadWeights hw{l.k_k + at,    l.k_a + at,    l.r_k + at,
                             l.ln_x_w + at, l.ln_x_b + at, group_eps};
        for (int64_t t = 0; t < T; ++t) {
          const int64_t o = (b * T + t) * d + at;
          const HeadToken token{r + o,       w_raw + o, a_raw + o,
                                k + o,       v + o,     first ? nullptr : v_raw + o,
                                v_first + o, g + o,     y + o};
          HeadStep(N, S, token, hw, scratch.data());
        }
      }
    });
    RunGemms(threads, n, {Gemm{&l.o, y, nullptr, x, Epilogue::kAddToResidual, h}});

    // ---- Channel mix
    norm_and_shift(l.ln2_w, l.ln2_b, pool->tensors[l.ffn_shift].data_ptr<float>(), 1, &l.ffn_x_k,
                   mixed);
    RunGemms(threads, n, {Gemm{&l.key, mixed[0], nullptr, ffn, Epilogue::kSquaredRelu}});
    RunGemms(threads, n, {Gemm{&l.value, ffn, nullptr, x, Epilogue::kAddToResidual, h}});
  }
  if (every_position) {
    LayerNorm(h, n, d, weights_->ln_out_w, weights_->ln_out_b, eps, x);
    RunGemms(threads, n, {Gemm{&weights_->head, x, nullptr, logits}});
    return;
  }
  // Logits of each session's last token only.
  for (int64_t b = 0; b < B; ++b) {
    LayerNorm(h + ((b + 1) * T - 1) * d, 1, d, weights_->ln_out_w, weights_->ln_out_b, eps,
              x + b * d);
  }
  RunGemms(threads, B, {Gemm{&weights_->head, x, nullptr, logits}});
}

}  // namespace fwmodel
