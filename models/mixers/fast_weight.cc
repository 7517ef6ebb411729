// Mixer `fast_weight` (Schlag, Irie, Schmidhuber 2021): DPFP_ν feature maps and the
// delta rule with a per-head write strength β; state W [H, dh, d_phi] per layer.
#include <algorithm>

#include "models/mixers/mixer.h"
#include "models/mixers/native_math.h"

namespace fwmodel {
namespace {

// DPFP_nu(z) normalised to sum 1 over the last dimension.
torch::Tensor DpfpFeatures(const torch::Tensor& z, int64_t nu, double eps) {
  torch::Tensor x = torch::cat({torch::relu(z), torch::relu(-z)}, -1);
  std::vector<torch::Tensor> parts;
  parts.reserve(static_cast<size_t>(nu));
  for (int64_t i = 1; i <= nu; ++i) parts.push_back(x * torch::roll(x, {i}, {-1}));
  torch::Tensor features = nu == 1 ? parts[0] : torch::cat(parts, -1);
  return features / (features.sum(-1, /*keepdim=*/true) + eps);
}

// ---- Native row

// DPFP_nu(z) of z [n], normalised to sum 1: out [2·nu·n]. `x` is scratch [2n].
FW_VECTOR_KERNEL
void Dpfp(const float* z, int64_t n, int64_t nu, float eps, float* x, float* out) {
  const int64_t two_n = 2 * n;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::max(z[j], 0.0f);
    x[n + j] = std::max(-z[j], 0.0f);
  }
  float sum = 0;
  for (int64_t i = 1; i <= nu; ++i) {
    float* part = out + (i - 1) * two_n;
    for (int64_t j = 0; j < two_n; ++j) {
      part[j] = x[j] * x[(j - i + two_n * nu) % two_n];
      sum += part[j];
    }
  }
  const float den = sum + eps;
  for (int64_t j = 0; j < two_n * nu; ++j) out[j] /= den;
}

// One session's W [H, dh, d_phi] absorbs q|k|v|beta = pr[0..3d+H) by the delta rule.
FW_VECTOR_KERNEL
void FastWeightRow(const float* __restrict pr, float* __restrict W_all, int64_t H, int64_t dh,
                   int64_t nu, float eps, float* __restrict x, float* __restrict fq,
                   float* __restrict fk, float* __restrict y) {
  const int64_t d = H * dh, dphi = 2 * nu * dh;
  for (int64_t hd = 0; hd < H; ++hd) {
    const float* v = pr + 2 * d + hd * dh;
    const float beta = native::Sigmoid(pr[3 * d + hd]);
    Dpfp(pr + hd * dh, dh, nu, eps, x, fq);
    Dpfp(pr + d + hd * dh, dh, nu, eps, x, fk);
    for (int64_t i = 0; i < dh; ++i) {
      float* __restrict Wi = W_all + (hd * dh + i) * dphi;
      float retrieved = 0;
#pragma omp simd reduction(+ : retrieved)
      for (int64_t j = 0; j < dphi; ++j) retrieved += Wi[j] * fk[j];
      const float delta = beta * (v[i] - retrieved);
      float acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < dphi; ++j) {
        Wi[j] = Wi[j] + delta * fk[j];
        acc += Wi[j] * fq[j];
      }
      y[hd * dh + i] = acc;
    }
  }
}

class NativeFastWeight final : public NativeMixer {
 public:
  NativeFastWeight(int64_t H, int64_t dh, int64_t nu, float eps, std::vector<float> beta_w)
      : H_(H), dh_(dh), nu_(nu), eps_(eps), beta_w_(std::move(beta_w)) {}
  std::vector<float> ExtraProjection() const override { return beta_w_; }
  int64_t ScratchFloats() const override { return 2 * dh_ + 2 * (2 * nu_ * dh_); }
  void Absorb(const Tokens& t, int64_t begin, int64_t end, float* scratch) const override {
    const int64_t dphi = 2 * nu_ * dh_, d = H_ * dh_;
    float* dpfp_x = scratch;
    float* fq = dpfp_x + 2 * dh_;
    float* fk = fq + dphi;
    for (int64_t i = begin * t.steps; i < end * t.steps; ++i) {
      const int64_t row = t.rows[i / t.steps];
      FastWeightRow(t.proj + i * t.proj_width, t.state[0] + row * t.state_row[0], H_, dh_, nu_,
                    eps_, dpfp_x, fq, fk, t.y + i * d);
    }
  }

 private:
  const int64_t H_, dh_, nu_;
  const float eps_;
  const std::vector<float> beta_w_;  // [H, d]
};

// ---- Sequence form and step

class FastWeight final : public Mixer {
 public:
  FastWeight(const ModelConfig& config, const ModelOptions& options) : Mixer(config, options) {}

  std::vector<std::pair<std::string, std::vector<int64_t>>> ExtraWeightShapes() const override {
    return {{"mixer.beta.weight", {config_.n_heads, config_.d_model}}};
  }
  int64_t MacsPerToken() const override {
    return Mixer::MacsPerToken() + int64_t{config_.n_heads} * config_.d_model;  // beta
  }
  std::vector<StateTensorSpec> StateSpec() const override {
    return {{"W", {config_.n_heads, config_.d_head(), config_.d_phi()}}};
  }
  void Bind(const WeightGetter& get) override { beta_w_ = get("mixer.beta.weight"); }

  torch::Tensor Forward(const torch::Tensor& a, const torch::Tensor proj[3],
                        torch::Tensor* state) const override {
    const ModelConfig& c = config_;
    const int64_t B = a.size(0), T = a.size(1), d = c.d_model, H = c.n_heads, dh = c.d_head();
    auto heads = [&](const torch::Tensor& x) { return x.view({B, T, H, dh}).transpose(1, 2); };
    torch::Tensor q = heads(proj[0]), k = heads(proj[1]), v = heads(proj[2]);  // [B, H, T, dh]
    std::vector<torch::Tensor> outputs;
    torch::Tensor fq = DpfpFeatures(q, c.dpfp_nu, c.attn_eps);
    torch::Tensor fk = DpfpFeatures(k, c.dpfp_nu, c.attn_eps);  // [B, H, T, dphi]
    torch::Tensor beta = torch::sigmoid(torch::linear(a, beta_w_)).transpose(1, 2);  // [B,H,T]
    torch::Tensor& W = state[0];  // [B, H, dh, dphi]
    for (int64_t t0 = 0; t0 < T; t0 += options_.attention_chunk) {
      const int64_t n = std::min(options_.attention_chunk, T - t0);
      torch::Tensor qc = fq.narrow(2, t0, n), kc = fk.narrow(2, t0, n), vc = v.narrow(2, t0, n);
      torch::Tensor bc = beta.narrow(2, t0, n).unsqueeze(-1);  // [B, H, n, 1]
      // Delta-rule updates u_t solve (I + diag(beta) strict_tril(K K^T)) U =
      // diag(beta) (V - K W0^T); then W_t = W0 + sum_{s<=t} u_s k_s^T.
      torch::Tensor rhs = bc * (vc - torch::matmul(kc, W.transpose(-1, -2)));
      torch::Tensor system =
          bc * torch::matmul(kc, kc.transpose(-1, -2)).tril(-1) + torch::eye(n, a.options());
      torch::Tensor updates = torch::linalg_solve_triangular(system, rhs, /*upper=*/false,
                                                             /*left=*/true, /*unitriangular=*/true);
      torch::Tensor scores = torch::matmul(qc, kc.transpose(-1, -2)).tril();
      outputs.push_back(torch::matmul(qc, W.transpose(-1, -2)) + torch::matmul(scores, updates));
      W = W + torch::matmul(updates.transpose(-1, -2), kc);
    }
    return MergeChunkHeads(outputs, B, T, d);
  }

  torch::Tensor Step(const torch::Tensor& a, const torch::Tensor proj[3],
                     torch::Tensor* state) const override {
    const ModelConfig& c = config_;
    const int64_t B = a.size(0), d = c.d_model, H = c.n_heads, dh = c.d_head();
    torch::Tensor q = proj[0].view({B, H, dh}), k = proj[1].view({B, H, dh}),
                  v = proj[2].view({B, H, dh});
    torch::Tensor fq = DpfpFeatures(q, c.dpfp_nu, c.attn_eps);
    torch::Tensor fk = DpfpFeatures(k, c.dpfp_nu, c.attn_eps);                 // [B, H, dphi]
    torch::Tensor beta = torch::sigmoid(torch::linear(a, beta_w_));            // [B, H]
    torch::Tensor& W = state[0];                                               // [B, H, dh, dphi]
    torch::Tensor retrieved = torch::matmul(W, fk.unsqueeze(-1)).squeeze(-1);  // [B, H, dh]
    W = W + (beta.unsqueeze(-1) * (v - retrieved)).unsqueeze(-1) * fk.unsqueeze(-2);
    return torch::matmul(W, fq.unsqueeze(-1)).squeeze(-1).reshape({B, d});
  }

  std::unique_ptr<NativeMixer> MakeNative() const override {
    torch::Tensor w = beta_w_.detach().contiguous();
    return std::make_unique<NativeFastWeight>(
        config_.n_heads, config_.d_head(), config_.dpfp_nu, static_cast<float>(config_.attn_eps),
        std::vector<float>(w.data_ptr<float>(), w.data_ptr<float>() + w.numel()));
  }

 private:
  torch::Tensor beta_w_;  // [H, d]
};

}  // namespace

std::unique_ptr<Mixer> MakeFastWeightMixer(const ModelConfig& config, const ModelOptions& options) {
  return std::make_unique<FastWeight>(config, options);
}

}  // namespace fwmodel
