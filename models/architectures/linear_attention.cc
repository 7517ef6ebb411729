// Mixer `linear_attention` (Katharopoulos et al. 2020): φ = elu + 1 feature maps,
// state S [H, dh, dh] and normaliser z [H, dh] per layer.
#include <algorithm>

#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"

namespace fwmodel {
namespace {

torch::Tensor EluPlusOne(const torch::Tensor& z) { return torch::elu(z) + 1.0; }

// ---- Native row

inline float EluPlusOne(float z) { return z > 0 ? z + 1.0f : native::FastExp(z); }

// One session's S [H, dh, dh] and z [H, dh] absorb q|k|v = pr[0..3d); y [d].
FW_VECTOR_KERNEL
void LinearAttentionRow(const float* __restrict pr, float* __restrict S_all,
                        float* __restrict z_all, int64_t H, int64_t dh, float eps,
                        float* __restrict fq, float* __restrict fk, float* __restrict y) {
  const int64_t d = H * dh;
  for (int64_t hd = 0; hd < H; ++hd) {
    const float* q = pr + hd * dh;
    const float* k = pr + d + hd * dh;
    const float* __restrict v = pr + 2 * d + hd * dh;
    float* __restrict z = z_all + hd * dh;
    float* __restrict out = y + hd * dh;
#pragma omp simd
    for (int64_t i = 0; i < dh; ++i) {
      fq[i] = EluPlusOne(q[i]);
      fk[i] = EluPlusOne(k[i]);
    }
    float den = 0;
#pragma omp simd reduction(+ : den)
    for (int64_t i = 0; i < dh; ++i) {
      z[i] = z[i] + fk[i];
      den += fq[i] * z[i];
    }
    den += eps;
    std::fill(out, out + dh, 0.0f);
    for (int64_t i = 0; i < dh; ++i) {
      float* __restrict Si = S_all + (hd * dh + i) * dh;
      const float fki = fk[i], fqi = fq[i];
#pragma omp simd
      for (int64_t j = 0; j < dh; ++j) {
        Si[j] = Si[j] + fki * v[j];
        out[j] += fqi * Si[j];
      }
    }
    for (int64_t j = 0; j < dh; ++j) out[j] /= den;
  }
}

class NativeLinearAttention final : public NativeMixer {
 public:
  NativeLinearAttention(int64_t H, int64_t dh, float eps) : H_(H), dh_(dh), eps_(eps) {}
  int64_t ScratchFloats() const override { return 2 * dh_; }
  void Absorb(const Tokens& t, int64_t begin, int64_t end, float* scratch) const override {
    float* fq = scratch;
    float* fk = scratch + dh_;
    const int64_t d = H_ * dh_;
    for (int64_t i = begin * t.steps; i < end * t.steps; ++i) {
      const int64_t row = t.rows[i / t.steps];
      LinearAttentionRow(t.proj + i * t.proj_width, t.state[0] + row * t.state_row[0],
                         t.state[1] + row * t.state_row[1], H_, dh_, eps_, fq, fk, t.y + i * d);
    }
  }

 private:
  const int64_t H_, dh_;
  const float eps_;
};

// ---- Sequence form and step

class LinearAttention final : public Mixer {
 public:
  LinearAttention(const ModelConfig& config, const ModelOptions& options)
      : Mixer(config, options) {}

  std::vector<StateTensorSpec> StateSpec() const override {
    const int64_t H = config_.n_heads, dh = config_.d_head();
    return {{"S", {H, dh, dh}}, {"z", {H, dh}}};
  }

  torch::Tensor Forward(const torch::Tensor& a, const torch::Tensor proj[3],
                        torch::Tensor* state) const override {
    const ModelConfig& c = config_;
    const int64_t B = a.size(0), T = a.size(1), d = c.d_model, H = c.n_heads, dh = c.d_head();
    auto heads = [&](const torch::Tensor& x) { return x.view({B, T, H, dh}).transpose(1, 2); };
    torch::Tensor q = heads(proj[0]), k = heads(proj[1]), v = heads(proj[2]);  // [B, H, T, dh]
    std::vector<torch::Tensor> outputs;
    torch::Tensor fq = EluPlusOne(q), fk = EluPlusOne(k);
    torch::Tensor& S = state[0];  // [B, H, dh, dh]
    torch::Tensor& z = state[1];  // [B, H, dh]
    for (int64_t t0 = 0; t0 < T; t0 += options_.attention_chunk) {
      const int64_t n = std::min(options_.attention_chunk, T - t0);
      torch::Tensor qc = fq.narrow(2, t0, n), kc = fk.narrow(2, t0, n), vc = v.narrow(2, t0, n);
      torch::Tensor scores = torch::matmul(qc, kc.transpose(-1, -2)).tril();  // [B, H, n, n]
      torch::Tensor num = torch::matmul(qc, S) + torch::matmul(scores, vc);
      torch::Tensor den =
          torch::matmul(qc, z.unsqueeze(-1)).squeeze(-1) + scores.sum(-1) + c.attn_eps;
      outputs.push_back(num / den.unsqueeze(-1));
      S = S + torch::matmul(kc.transpose(-1, -2), vc);
      z = z + kc.sum(2);
    }
    return MergeChunkHeads(outputs, B, T, d);
  }

  torch::Tensor Step(const torch::Tensor& a, const torch::Tensor proj[3],
                     torch::Tensor* state) const override {
    const ModelConfig& c = config_;
    const int64_t B = a.size(0), d = c.d_model, H = c.n_heads, dh = c.d_head();
    torch::Tensor q = proj[0].view({B, H, dh}), k = proj[1].view({B, H, dh}),
                  v = proj[2].view({B, H, dh});
    torch::Tensor fq = EluPlusOne(q), fk = EluPlusOne(k);
    torch::Tensor& S = state[0];
    torch::Tensor& z = state[1];
    S = S + fk.unsqueeze(-1) * v.unsqueeze(-2);
    z = z + fk;
    torch::Tensor num = torch::matmul(fq.unsqueeze(-2), S).squeeze(-2);  // [B, H, dh]
    torch::Tensor den = (fq * z).sum(-1, /*keepdim=*/true) + c.attn_eps;
    return (num / den).reshape({B, d});
  }

  std::unique_ptr<NativeMixer> MakeNative() const override {
    return std::make_unique<NativeLinearAttention>(config_.n_heads, config_.d_head(),
                                                   static_cast<float>(config_.attn_eps));
  }
};

}  // namespace

std::unique_ptr<Mixer> MakeLinearAttentionMixer(const ModelConfig& config,
                                                const ModelOptions& options) {
  return std::make_unique<LinearAttention>(config, options);
}

}  // namespace fwmodel
