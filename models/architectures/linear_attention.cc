// Mixer `linear_attention` (Katharopoulos et al. 2020): φ = elu + 1 feature maps,
// state S [H, dh, dh] and normaliser z [H, dh] per layer.
//
// On CUDA float32 tensors (without autograd), with heads of at most kLinearAttentionMaxN
// channels, and where models/gpu built it (FWSERVE_CUDA_KERNELS), Step and Forward run the
// recurrence as one launch of the fused kernel (models/gpu/linear_attention.h: the T
// tokens in order per (session, head)) instead of LibTorch's ops (Step) and chunked
// products (Forward). Elsewhere LibTorch ops.
#include <algorithm>

#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/gpu/linear_attention.h"
#endif

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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(proj, state)) return FusedRecurrence(proj, state);
#endif
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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(proj, state)) return FusedRecurrence(proj, state);
#endif
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

#if defined(FWSERVE_CUDA_KERNELS)
 private:
  // Whether the fused kernel may run the recurrence: float32 CUDA projections ([B, d] or
  // [B, T, d]) and state, heads the kernel takes, and no autograd graph to record (the
  // kernel has no backward).
  bool FusedApplies(const torch::Tensor proj[3], const torch::Tensor* state) const {
    return config_.d_head() <= kernels::kLinearAttentionMaxN && proj[0].is_cuda() &&
           KernelInputsOk(proj[0].device(), {&proj[0], &proj[1], &proj[2], &state[0], &state[1]});
  }

  // Step's (proj [B, d]) or Forward's (proj [B, T, d]) result by one launch of the fused
  // kernel on the current stream of the projections' device: y of proj's shape, and
  // state[0] (S) and state[1] (z) replaced by new tensors (Mixer's contract: replaced, not
  // written). Contiguous inputs (the projections already are; anything else is copied), no
  // host synchronisation, so it runs inside CUDA Graph capture as the ops around it.
  torch::Tensor FusedRecurrence(const torch::Tensor proj[3], torch::Tensor* state) const {
    const c10::cuda::CUDAGuard device(proj[0].device());
    const int64_t B = proj[0].size(0), T = proj[0].dim() == 3 ? proj[0].size(1) : 1,
                  d = config_.d_model, H = config_.n_heads, dh = config_.d_head();
    TORCH_CHECK(proj[0].numel() == B * T * d && proj[0].size(-1) == d &&
                    proj[1].sizes() == proj[0].sizes() && proj[2].sizes() == proj[0].sizes() &&
                    state[0].sizes() == torch::IntArrayRef({B, H, dh, dh}) &&
                    state[1].sizes() == torch::IntArrayRef({B, H, dh}),
                "linear_attention: projections ", proj[0].sizes(), " and state ", state[0].sizes(),
                ", ", state[1].sizes(), " do not match d = ", d, ", H = ", H);
    const torch::Tensor q = proj[0].contiguous(), k = proj[1].contiguous(),
                        v = proj[2].contiguous();
    const torch::Tensor S_in = state[0].contiguous(), z_in = state[1].contiguous();
    torch::Tensor S_out = torch::empty_like(S_in, torch::MemoryFormat::Contiguous);
    torch::Tensor z_out = torch::empty_like(z_in, torch::MemoryFormat::Contiguous);
    torch::Tensor y = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    kernels::LinearAttentionArgs args;
    args.B = B;
    args.T = T;
    args.H = H;
    args.N = dh;
    args.q = q.data_ptr<float>();
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
    args.S_in = S_in.data_ptr<float>();
    args.S_out = S_out.data_ptr<float>();
    args.z_in = z_in.data_ptr<float>();
    args.z_out = z_out.data_ptr<float>();
    args.y = y.data_ptr<float>();
    args.eps = static_cast<float>(config_.attn_eps);
    const int error =
        kernels::LaunchLinearAttention(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "linear_attention: the fused recurrence kernel failed: ",
                kernels::LinearAttentionErrorString(error));
    state[0] = S_out;
    state[1] = z_out;
    return y;
  }
#endif
};

}  // namespace

std::unique_ptr<Mixer> MakeLinearAttentionMixer(const ModelConfig& config,
                                                const ModelOptions& options) {
  return std::make_unique<LinearAttention>(config, options);
}

}  // namespace fwmodel
