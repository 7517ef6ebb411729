// Mixer `fast_weight` (Schlag, Irie, Schmidhuber 2021): DPFP_ν feature maps and the
// delta rule with a per-head write strength β; state W [H, dh, d_phi] per layer.
//
// On CUDA float32 tensors (without autograd), with heads the kernel takes (d_head ≤
// kFastWeightMaxN, 2·ν·d_head ≤ kFastWeightMaxPhi), and where models/gpu built it
// (FWSERVE_CUDA_KERNELS), Step and Forward run the recurrence as one launch of the fused
// kernel (models/gpu/fast_weight.h: the T tokens in order per (session, head)) instead of
// LibTorch's ops (Step) and chunked products (Forward). Elsewhere LibTorch ops.
#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/gpu/fast_weight.h"
#endif

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
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::max(z[j], 0.0f);
    x[n + j] = std::max(-z[j], 0.0f);
  }
  float sum = 0;
  for (int64_t i = 1; i <= nu; ++i) {
    // part[j] = x[j] · x[(j - i) mod 2n]: the wrapped head, then the straight run.
    float* part = out + (i - 1) * two_n;
    const int64_t wrapped = std::min(i, two_n);
    for (int64_t j = 0; j < wrapped; ++j) {
      part[j] = x[j] * x[((j - i) % two_n + two_n) % two_n];
      sum += part[j];
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t j = wrapped; j < two_n; ++j) {
      part[j] = x[j] * x[j - i];
      sum += part[j];
    }
  }
  const float den = sum + eps;
#pragma omp simd
  for (int64_t j = 0; j < two_n * nu; ++j) out[j] /= den;
}

// One head's delta-rule write and read, fused into one pass over its W [dh, dphi]:
//   retrieved_i = W_i·fk, delta_i = beta (v_i - retrieved_i), W_i += delta_i fk,
//   y_i = W_i(new)·fq = W_i(old)·fq + delta_i (fk·fq),
// so each row of W is read once (both dot products share the load) and written once.
// `kq` is fk·fq. Rounding differs from the two-pass form by the order of additions only.
void DeltaHead(float* __restrict W, int64_t dh, int64_t dphi, const float* __restrict fk,
               const float* __restrict fq, const float* __restrict v, float beta, float kq,
               float* __restrict y) {
  for (int64_t i = 0; i < dh; ++i) {
    float* __restrict Wi = W + i * dphi;
    float retrieved = 0, read = 0;
    for (int64_t j = 0; j < dphi; ++j) {
      retrieved += Wi[j] * fk[j];
      read += Wi[j] * fq[j];
    }
    const float delta = beta * (v[i] - retrieved);
    for (int64_t j = 0; j < dphi; ++j) Wi[j] += delta * fk[j];
    y[i] = read + delta * kq;
  }
}

#if defined(__x86_64__)
// DeltaHead with AVX2/FMA: 8 columns a vector, two accumulators per dot product.
__attribute__((target("avx2,fma"))) void DeltaHeadAvx2(float* __restrict W, int64_t dh,
                                                       int64_t dphi, const float* __restrict fk,
                                                       const float* __restrict fq,
                                                       const float* __restrict v, float beta,
                                                       float kq, float* __restrict y) {
  const int64_t vec_end = dphi & ~int64_t{7};
  for (int64_t i = 0; i < dh; ++i) {
    float* __restrict Wi = W + i * dphi;
    __m256 k0 = _mm256_setzero_ps(), k1 = _mm256_setzero_ps();
    __m256 q0 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= vec_end; j += 16) {
      const __m256 w0 = _mm256_loadu_ps(Wi + j), w1 = _mm256_loadu_ps(Wi + j + 8);
      k0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(fk + j), k0);
      k1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(fk + j + 8), k1);
      q0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(fq + j), q0);
      q1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(fq + j + 8), q1);
    }
    if (j < vec_end) {
      const __m256 w0 = _mm256_loadu_ps(Wi + j);
      k0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(fk + j), k0);
      q0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(fq + j), q0);
      j += 8;
    }
    // Both horizontal sums at once: [k, q, k, q] in the low lanes.
    const __m256 pairs = _mm256_hadd_ps(_mm256_add_ps(k0, k1), _mm256_add_ps(q0, q1));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
    sums = _mm_hadd_ps(sums, sums);
    float retrieved = _mm_cvtss_f32(sums);
    float read = _mm_cvtss_f32(_mm_shuffle_ps(sums, sums, 1));
    for (; j < dphi; ++j) {
      retrieved += Wi[j] * fk[j];
      read += Wi[j] * fq[j];
    }
    const float delta = beta * (v[i] - retrieved);
    const __m256 delta_v = _mm256_set1_ps(delta);
    j = 0;
    for (; j < vec_end; j += 8) {
      _mm256_storeu_ps(Wi + j,
                       _mm256_fmadd_ps(delta_v, _mm256_loadu_ps(fk + j), _mm256_loadu_ps(Wi + j)));
    }
    for (; j < dphi; ++j) Wi[j] += delta * fk[j];
    y[i] = read + delta * kq;
  }
}
#endif

using DeltaHeadFn = void (*)(float*, int64_t, int64_t, const float*, const float*, const float*,
                             float, float, float*);

// The CPU's best DeltaHead, chosen once.
DeltaHeadFn PickDeltaHead() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return DeltaHeadAvx2;
#endif
  return DeltaHead;
}

// One session's W [H, dh, d_phi] absorbs q|k|v|beta = pr[0..3d+H) by the delta rule.
void FastWeightRow(DeltaHeadFn delta_head, const float* __restrict pr, float* __restrict W_all,
                   int64_t H, int64_t dh, int64_t nu, float eps, float* __restrict x,
                   float* __restrict fq, float* __restrict fk, float* __restrict y) {
  const int64_t d = H * dh, dphi = 2 * nu * dh;
  for (int64_t hd = 0; hd < H; ++hd) {
    const float beta = native::Sigmoid(pr[3 * d + hd]);
    Dpfp(pr + hd * dh, dh, nu, eps, x, fq);
    Dpfp(pr + d + hd * dh, dh, nu, eps, x, fk);
    float kq = 0;
    for (int64_t j = 0; j < dphi; ++j) kq += fk[j] * fq[j];
    delta_head(W_all + hd * dh * dphi, dh, dphi, fk, fq, pr + 2 * d + hd * dh, beta, kq,
               y + hd * dh);
  }
}

class NativeFastWeight final : public NativeMixer {
 public:
  NativeFastWeight(int64_t H, int64_t dh, int64_t nu, float eps, std::vector<float> beta_w)
      : H_(H),
        dh_(dh),
        nu_(nu),
        eps_(eps),
        beta_w_(std::move(beta_w)),
        delta_head_(PickDeltaHead()) {}
  std::vector<float> ExtraProjection() const override { return beta_w_; }
  int64_t ScratchFloats() const override { return 2 * dh_ + 2 * (2 * nu_ * dh_); }
  void Absorb(const Tokens& t, int64_t begin, int64_t end, float* scratch) const override {
    const int64_t dphi = 2 * nu_ * dh_, d = H_ * dh_;
    float* dpfp_x = scratch;
    float* fq = dpfp_x + 2 * dh_;
    float* fk = fq + dphi;
    for (int64_t i = begin * t.steps; i < end * t.steps; ++i) {
      const int64_t row = t.rows[i / t.steps];
      FastWeightRow(delta_head_, t.proj + i * t.proj_width, t.state[0] + row * t.state_row[0], H_,
                    dh_, nu_, eps_, dpfp_x, fq, fk, t.y + i * d);
    }
  }

 private:
  const int64_t H_, dh_, nu_;
  const float eps_;
  const std::vector<float> beta_w_;  // [H, d]
  const DeltaHeadFn delta_head_;
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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(a, proj, state)) return FusedRecurrence(a, proj, state);
#endif
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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(a, proj, state)) return FusedRecurrence(a, proj, state);
#endif
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
#if defined(FWSERVE_CUDA_KERNELS)
  // Whether the fused kernel may run the recurrence: float32 CUDA input a, projections
  // ([B, d] or [B, T, d]), β's weight and state, heads the kernel takes, and no autograd
  // graph to record (the kernel has no backward).
  bool FusedApplies(const torch::Tensor& a, const torch::Tensor proj[3],
                    const torch::Tensor* state) const {
    const int64_t dh = config_.d_head();
    if (dh > kernels::kFastWeightMaxN ||
        kernels::FastWeightPhi(dh, config_.dpfp_nu) > kernels::kFastWeightMaxPhi) {
      return false;
    }
    return a.is_cuda() &&
           KernelInputsOk(a.device(), {&a, &proj[0], &proj[1], &proj[2], &beta_w_, &state[0]});
  }

  // Step's (a, proj [B, d]) or Forward's (a, proj [B, T, d]) result by one launch of the
  // fused kernel on the current stream of the projections' device (after β's logits, one
  // product): y of proj's shape, and state[0] (W) replaced by a new tensor (Mixer's
  // contract: replaced, not written). Contiguous inputs (the projections already are;
  // anything else is copied), no host synchronisation, so it runs inside CUDA Graph
  // capture as the ops around it.
  torch::Tensor FusedRecurrence(const torch::Tensor& a, const torch::Tensor proj[3],
                                torch::Tensor* state) const {
    const c10::cuda::CUDAGuard device(proj[0].device());
    const int64_t B = proj[0].size(0), T = proj[0].dim() == 3 ? proj[0].size(1) : 1,
                  d = config_.d_model, H = config_.n_heads, dh = config_.d_head(),
                  dphi = config_.d_phi();
    TORCH_CHECK(proj[0].numel() == B * T * d && proj[0].size(-1) == d &&
                    proj[1].sizes() == proj[0].sizes() && proj[2].sizes() == proj[0].sizes() &&
                    a.size(0) == B && a.numel() == B * T * a.size(-1) &&
                    state[0].sizes() == torch::IntArrayRef({B, H, dh, dphi}),
                "fast_weight: input ", a.sizes(), ", projections ", proj[0].sizes(), " and state ",
                state[0].sizes(), " do not match d = ", d, ", H = ", H);
    const torch::Tensor q = proj[0].contiguous(), k = proj[1].contiguous(),
                        v = proj[2].contiguous();
    const torch::Tensor beta = torch::linear(a, beta_w_).contiguous();  // [B, (T,) H] logits
    const torch::Tensor W_in = state[0].contiguous();
    torch::Tensor W_out = torch::empty_like(W_in, torch::MemoryFormat::Contiguous);
    torch::Tensor y = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    kernels::FastWeightArgs args;
    args.B = B;
    args.T = T;
    args.H = H;
    args.N = dh;
    args.nu = config_.dpfp_nu;
    args.q = q.data_ptr<float>();
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
    args.beta = beta.data_ptr<float>();
    args.W_in = W_in.data_ptr<float>();
    args.W_out = W_out.data_ptr<float>();
    args.y = y.data_ptr<float>();
    args.eps = static_cast<float>(config_.attn_eps);
    const int error = kernels::LaunchFastWeight(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "fast_weight: the fused recurrence kernel failed: ",
                kernels::FastWeightErrorString(error));
    state[0] = W_out;
    return y;
  }
#endif

  torch::Tensor beta_w_;  // [H, d]
};

}  // namespace

std::unique_ptr<Mixer> MakeFastWeightMixer(const ModelConfig& config, const ModelOptions& options) {
  return std::make_unique<FastWeight>(config, options);
}

}  // namespace fwmodel
