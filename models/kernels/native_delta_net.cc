#include "models/kernels/native_delta_net.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "models/architectures/native_math.h"
#include "models/kernels/delta_rule.h"
#include "models/kernels/native_parallel.h"
#include "models/kernels/native_weights.h"

namespace fwmodel {
namespace delta_net_kernel {

using native::Epilogue;
using native::Gemm;
using native::MakePanels;
using native::Panels;
using native::ParallelRows;
using native::RunGemms;

// Tokens per task of the row-wise norms and the embedding.
constexpr int64_t kTokenGrain = 16;
// Sessions per task of the convolutions, activations and norms (a token's work there is
// a few µs at the 340M shape).
constexpr int64_t kSessionGrain = 4;
// (session, value head) pairs per task of the recurrence (a 128 x 128 head's token: about
// 10 µs).
constexpr int64_t kHeadGrain = 2;
// Multiply-adds from which a stage's products are split over the threads. Lower than
// RWKV's (native_gemm.h): at the 340M shape every stage at batch 1 reads 4 to 12 MB of
// weights, and on the calling thread alone the step took twice as long as PyTorch's
// threaded gemv (docs/benchmarks.md, "DeltaNet at the 340M shape").
constexpr double kDeltaNetParallelMacs = 1 << 18;

// y = x / sqrt(mean(x²) + eps) ⊙ weight, per row of width d; y may be x.
FW_VECTOR_KERNEL
void RmsNormRows(const float* x, int64_t rows, int64_t d, const float* weight, float eps,
                 float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < d; ++c) squares += xr[c] * xr[c];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) yr[c] = xr[c] * inv * weight[c];
  }
}

// The activation of q and k (ModelConfig::qk_activation).
enum class Activation { kSilu, kRelu, kElu, kIdentity };

// out[c] = act(Σ_j w[j][c] · in_j[c]) over C channels, in_j the input W − 1 − j tokens
// back (the current token on the last tap); `w` [W, C]. Without a convolution (W = 0),
// out = act(current).
FW_VECTOR_KERNEL
void ConvActivateRow(int64_t C, int64_t W, const float* w, const float* const* inputs,
                     const float* current, Activation act, float* __restrict out) {
  if (W == 0) {
    std::memcpy(out, current, sizeof(float) * C);
  } else {
    const float* first = inputs[0];
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] = w[c] * first[c];
    for (int64_t j = 1; j < W; ++j) {
      const float* in = inputs[j];
      const float* wj = w + j * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] += wj[c] * in[c];
    }
  }
  switch (act) {
    case Activation::kSilu:
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = out[c] * native::Sigmoid(out[c]);
      break;
    case Activation::kRelu:
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = !(out[c] <= 0.0f) ? out[c] : 0.0f;
      break;
    case Activation::kElu:  // elu + 1
      for (int64_t c = 0; c < C; ++c) out[c] = out[c] > 0 ? out[c] + 1.0f : std::exp(out[c]);
      break;
    case Activation::kIdentity:
      break;
  }
}

// Each head's K values of x [heads·K] ← x / sqrt(Σx² + 1e-6) (l2) or x / Σx (sum), times
// scale.
FW_VECTOR_KERNEL
void NormaliseHeads(float* x, int64_t heads, int64_t K, bool l2, float scale) {
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * K;
    float sum = 0;
    if (l2) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < K; ++i) sum += xh[i] * xh[i];
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < K; ++i) sum += xh[i];
    }
    const float factor = (l2 ? 1.0f / std::sqrt(sum + 1e-6f) : 1.0f / sum) * scale;
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) xh[i] *= factor;
  }
}

// The recurrence of (session, value head) pairs [begin, end) over their T tokens.
FW_VECTOR_KERNEL
void RecurrenceItems(int64_t begin, int64_t end, int64_t T, int64_t HV, int64_t ratio, int64_t K,
                     int64_t V, const int64_t* rows, float* state, const float* q, const float* k,
                     const float* v, const float* beta, const float* decay, const float* o_norm,
                     float eps, const float* gate, float* o) {
  std::vector<float> read(static_cast<size_t>(V));
  const int64_t HK = HV / ratio * K, HVV = HV * V;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / HV, j = item % HV, qk_head = j / ratio;
    float* S = state + (rows[b] * HV + j) * K * V;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      float* out = o + i * HVV + j * V;
      kernels::DeltaRuleToken(K, V, S, q + i * HK + qk_head * K, k + i * HK + qk_head * K,
                              v + i * HVV + j * V, beta[i * HV + j],
                              decay != nullptr ? decay[i * HV + j] : 1.0f, out, read.data());
      kernels::DeltaNetOutputNorm(V, out, o_norm, eps,
                                  gate != nullptr ? gate + i * HVV + j * V : nullptr);
    }
  }
}

}  // namespace delta_net_kernel

using delta_net_kernel::Activation;

struct NativeDeltaNet::Layer {
  const float *attn_norm = nullptr, *mlp_norm = nullptr, *o_norm = nullptr;
  native::Panels q, k, v, b, a, g, o, gate, up, down;  // b, a, g: out 0 when absent
  // The convolutions' weights transposed, [W, C] (q, k, v); empty without them.
  std::vector<float> conv[3];
  std::vector<float> neg_a;  // −exp(A_log) [HV] (gated_deltanet)
  const float* dt_bias = nullptr;
  int recurrent = -1, conv_state[3] = {-1, -1, -1};  // indices in State::tensors
};

struct NativeDeltaNet::Weights {
  std::vector<Layer> layers;
  std::vector<torch::Tensor> kept;  // contiguous views the raw pointers read
  NativeEmbedding emb;
  const float* norm = nullptr;
  native::Panels head;
  WeightFormatCounts formats;  // of the projections
};

NativeDeltaNet::NativeDeltaNet(const Model& model) : model_(model) {}
NativeDeltaNet::~NativeDeltaNet() = default;

std::unique_ptr<NativeDeltaNet> NativeDeltaNet::SharingWeights(const NativeDeltaNet& other) {
  std::unique_ptr<NativeDeltaNet> step(new NativeDeltaNet(other.model_));
  step->weights_ = other.weights_;
  return step;
}

std::string NativeDeltaNet::weight_format() const { return weights_->formats.Names(); }

int NativeDeltaNet::weight_bits() const { return weights_->formats.Bits(); }

absl::StatusOr<std::unique_ptr<NativeDeltaNet>> NativeDeltaNet::Create(const Model& model,
                                                                       bool packed_gemm,
                                                                       bool narrow_weights) {
  const ModelConfig& c = model.config();
  if (!c.is_delta_net() || !model.options().device.is_cpu() ||
      model.options().dtype != torch::kFloat32) {
    return absl::FailedPreconditionError(
        "the native delta_net step needs a float32 delta_net or gated_deltanet model on the CPU");
  }
  using native::MakePanels;
  using native::Panels;
  const bool gated = c.architecture == Architecture::kGatedDeltaNet;
  std::unique_ptr<NativeDeltaNet> step(new NativeDeltaNet(model));
  auto weights = std::make_shared<Weights>();
  try {
    NativeWeightReader read(model, &weights->kept);
    auto weight = [&](const std::string& name) { return read.Kept(name); };
    auto panels = [&](const std::string& name) {
      torch::Tensor t = read.Tensor(name);
      Panels p = MakePanels(t.data_ptr<float>(), t.size(0), t.size(1), packed_gemm, narrow_weights);
      weights->formats.Add(p.format);
      return p;
    };
    for (int i = 0; i < c.n_layers; ++i) {
      const std::string p = absl::StrCat("blocks.", i, ".");
      Layer l;
      l.attn_norm = weight(p + "attn_norm.weight");
      l.mlp_norm = weight(p + "mlp_norm.weight");
      l.o_norm = weight(p + "attn.o_norm.weight");
      l.q = panels(p + "attn.q_proj.weight");
      l.k = panels(p + "attn.k_proj.weight");
      l.v = panels(p + "attn.v_proj.weight");
      l.o = panels(p + "attn.o_proj.weight");
      l.gate = panels(p + "mlp.gate_proj.weight");
      l.up = panels(p + "mlp.up_proj.weight");
      l.down = panels(p + "mlp.down_proj.weight");
      if (gated || c.use_beta) l.b = panels(p + "attn.b_proj.weight");
      if (gated) {
        l.a = panels(p + "attn.a_proj.weight");
        const torch::Tensor neg_a = -torch::exp(read.Tensor(p + "attn.A_log"));
        l.neg_a.assign(neg_a.data_ptr<float>(), neg_a.data_ptr<float>() + neg_a.numel());
        l.dt_bias = weight(p + "attn.dt_bias");
      }
      if (c.use_gate) l.g = panels(p + "attn.g_proj.weight");
      l.recurrent = read.StateIndex(i, "attn.recurrent_state");
      if (l.recurrent < 0) return absl::InternalError("native delta_net step: no recurrent state");
      if (c.use_short_conv) {
        static constexpr const char* kConv[3] = {"q", "k", "v"};
        for (int m = 0; m < 3; ++m) {
          const torch::Tensor w =
              read.Tensor(absl::StrCat(p, "attn.", kConv[m], "_conv1d.weight")).t().contiguous();
          l.conv[m].assign(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
          l.conv_state[m] = read.StateIndex(i, absl::StrCat("attn.conv_state_", kConv[m]).c_str());
          if (l.conv_state[m] < 0) {
            return absl::InternalError("native delta_net step: no convolution state");
          }
        }
      }
      weights->layers.push_back(std::move(l));
    }
    weights->emb = NativeEmbedding::Read(read, "embeddings.weight", narrow_weights);
    weights->norm = weight("norm.weight");
    weights->head = panels(c.tie_embeddings ? "embeddings.weight" : "lm_head.weight");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("native delta_net step: ", e.what()));
  }
  step->weights_ = std::move(weights);
  return step;
}

void NativeDeltaNet::Absorb(absl::Span<const int64_t> tokens, int64_t steps,
                            absl::Span<const int64_t> rows, State* pool, int threads, float* logits,
                            bool every_position) {
  using delta_net_kernel::kDeltaNetParallelMacs;
  using delta_net_kernel::kHeadGrain;
  using delta_net_kernel::kSessionGrain;
  using delta_net_kernel::kTokenGrain;
  using delta_net_kernel::RmsNormRows;
  using native::Epilogue;
  using native::Gemm;
  using native::ParallelRows;
  using native::RunGemms;
  const ModelConfig& c = model_.config();
  const int64_t B = static_cast<int64_t>(rows.size());
  if (B == 0) return;
  // Token i = b·T + t: session b's t-th token. Projections run over all n tokens at once;
  // the convolutions and the recurrence per session, its tokens in order.
  const int64_t T = steps, n = B * T;
  const int64_t D = c.d_model, H = c.n_heads, HV = c.v_heads(), K = c.k_head_dim(),
                V = c.v_head_dim(), F = c.d_ff, HK = H * K, HVV = HV * V, ratio = HV / H;
  const int64_t W = c.use_short_conv ? c.conv_size : 0;
  const float eps = static_cast<float>(c.norm_eps);
  const bool gated = c.architecture == Architecture::kGatedDeltaNet;
  const Activation act = c.qk_activation == "silu"   ? Activation::kSilu
                         : c.qk_activation == "relu" ? Activation::kRelu
                         : c.qk_activation == "elu"  ? Activation::kElu
                                                     : Activation::kIdentity;
  const bool l2 = c.qk_norm == "l2";
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(K));
  const float beta_scale = c.allow_neg_eigval ? 2.0f : 1.0f;
  auto fit = [](std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
  };
  fit(h_, n * D);
  fit(x_, n * D);
  for (std::vector<float>* v : {&q_raw_, &k_raw_, &q_, &k_}) fit(*v, n * HK);
  for (std::vector<float>* v : {&v_raw_, &v_, &g_, &o_}) fit(*v, n * HVV);
  fit(beta_, n * HV);
  fit(decay_, n * HV);
  fit(gate_, n * F);
  fit(up_, n * F);
  float *h = h_.data(), *x = x_.data(), *q_raw = q_raw_.data(), *k_raw = k_raw_.data(),
        *v_raw = v_raw_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data(),
        *beta = beta_.data(), *decay = decay_.data(), *g = g_.data(), *o = o_.data(),
        *gate = gate_.data(), *up = up_.data();
  const Weights& wt = *weights_;

  ParallelRows(threads, n, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      wt.emb.Row(tokens[static_cast<size_t>(i)], D, h + i * D);
    }
  });
  auto rms_norm = [&](const float* weight) {
    ParallelRows(threads, n, kTokenGrain, [&](int64_t begin, int64_t end) {
      RmsNormRows(h + begin * D, end - begin, D, weight, eps, x + begin * D);
    });
  };

  for (const Layer& l : wt.layers) {
    // ---- Attention: projections
    rms_norm(l.attn_norm);
    std::vector<Gemm> stage = {
        {&l.q, x, nullptr, q_raw}, {&l.k, x, nullptr, k_raw}, {&l.v, x, nullptr, v_raw}};
    if (l.b.out > 0) stage.push_back({&l.b, x, nullptr, beta, Epilogue::kSigmoid});
    if (l.a.out > 0) stage.push_back({&l.a, x, nullptr, decay});
    if (l.g.out > 0) stage.push_back({&l.g, x, nullptr, g});
    RunGemms(threads, n, stage, kDeltaNetParallelMacs);

    // ---- Convolutions, activations, norms, β and the decay, per session in token order
    float* conv_state[3] = {nullptr, nullptr, nullptr};
    for (int m = 0; m < 3 && W > 0; ++m)
      conv_state[m] = pool->tensors[l.conv_state[m]].data_ptr<float>();
    ParallelRows(threads, B, kSessionGrain, [&](int64_t begin, int64_t end) {
      const float* inputs[64];  // conv_size <= 64 (ModelConfig::Validate)
      const float* raw[3] = {q_raw, k_raw, v_raw};
      float* out[3] = {q, k, v};
      const int64_t width[3] = {HK, HK, HVV};
      for (int64_t b = begin; b < end; ++b) {
        const int64_t row = rows[static_cast<size_t>(b)];
        for (int m = 0; m < 3; ++m) {
          const int64_t C = width[m];
          float* history = W > 0 ? conv_state[m] + row * (W - 1) * C : nullptr;
          for (int64_t t = 0; t < T; ++t) {
            const int64_t i = b * T + t;
            for (int64_t j = 0; j < W; ++j) {  // position t − W + 1 + j
              const int64_t position = t - W + 1 + j;
              inputs[j] = position >= 0 ? raw[m] + (b * T + position) * C
                                        : history + (W - 1 + position) * C;
            }
            delta_net_kernel::ConvActivateRow(C, W, W > 0 ? l.conv[m].data() : nullptr, inputs,
                                              raw[m] + i * C, m == 2 ? Activation::kSilu : act,
                                              out[m] + i * C);
          }
          // The history becomes the last W − 1 inputs (old entries read before written).
          for (int64_t r = 0; r + 1 < W; ++r) {
            const int64_t position = T - W + 1 + r;
            const float* source =
                position >= 0 ? raw[m] + (b * T + position) * C : history + (W - 1 + position) * C;
            std::memmove(history + r * C, source, sizeof(float) * C);
          }
        }
        for (int64_t t = 0; t < T; ++t) {
          const int64_t i = b * T + t;
          delta_net_kernel::NormaliseHeads(q + i * HK, H, K, l2, q_scale);
          delta_net_kernel::NormaliseHeads(k + i * HK, H, K, l2, 1.0f);
          for (int64_t j = 0; j < HV; ++j) {
            float& bj = beta[i * HV + j];
            bj = (l.b.out > 0 ? bj : 1.0f) * beta_scale;
            if (gated) {
              const float z = decay[i * HV + j] + l.dt_bias[j];
              const float softplus = z > 20.0f ? z : std::log1p(std::exp(z));
              decay[i * HV + j] = std::exp(l.neg_a[static_cast<size_t>(j)] * softplus);
            }
          }
        }
      }
    });

    // ---- The delta rule per (session, value head), the output norm and gate
    float* state = pool->tensors[l.recurrent].data_ptr<float>();
    ParallelRows(threads, B * HV, kHeadGrain, [&](int64_t begin, int64_t end) {
      delta_net_kernel::RecurrenceItems(begin, end, T, HV, ratio, K, V, rows.data(), state, q, k, v,
                                        beta, gated ? decay : nullptr, l.o_norm, eps,
                                        l.g.out > 0 ? g : nullptr, o);
    });
    RunGemms(threads, n, {Gemm{&l.o, o, nullptr, x, Epilogue::kAddToResidual, h}},
             kDeltaNetParallelMacs);

    // ---- MLP: h += down(silu(gate x) ⊙ up x)
    rms_norm(l.mlp_norm);
    RunGemms(threads, n, {Gemm{&l.gate, x, nullptr, gate, Epilogue::kSilu}}, kDeltaNetParallelMacs);
    RunGemms(threads, n, {Gemm{&l.up, x, nullptr, up, Epilogue::kMultiply, nullptr, gate}},
             kDeltaNetParallelMacs);
    RunGemms(threads, n, {Gemm{&l.down, up, nullptr, x, Epilogue::kAddToResidual, h}},
             kDeltaNetParallelMacs);
  }
  if (every_position) {
    rms_norm(wt.norm);
    RunGemms(threads, n, {Gemm{&wt.head, x, nullptr, logits}}, kDeltaNetParallelMacs);
    return;
  }
  for (int64_t b = 0; b < B; ++b) {
    RmsNormRows(h + ((b + 1) * T - 1) * D, 1, D, wt.norm, eps, x + b * D);
  }
  RunGemms(threads, B, {Gemm{&wt.head, x, nullptr, logits}}, kDeltaNetParallelMacs);
}

}  // namespace fwmodel
