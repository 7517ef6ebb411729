// RWKV-7 "Goose" (x070): the block of BlinkDL's RWKV-LM `RWKV-v7/rwkv_v7_demo_rnn.py`,
// equal to fla's `fla/layers/rwkv7.py` and rwkv.cpp's `rwkv_att_v7`/`rwkv_ffn_v7`.
//
// Per block, with x = LN(h; ln1) and x' the previous token's x (token shift):
//   x_p = x + (x' - x) ⊙ x_p            p in r, w, k, v, a, g
//   r = x_r·Rᵀ,  k = x_k·Kᵀ,  v = x_v·Vᵀ
//   w = exp(−e^{−1/2} · sigmoid(w0 + tanh(x_w·w1ᵀ)·w2ᵀ))      decay, in (0, 1)
//   a = sigmoid(a0 + (x_a·a1ᵀ)·a2ᵀ)                           in-context learning rate
//   g = sigmoid(x_g·g1ᵀ)·g2ᵀ                                   output gate
//   kk = normalise_per_head(k ⊙ k_k);  k ← k ⊙ (1 + (a − 1) ⊙ k_a)
//   v ← v + (v_first − v) ⊙ sigmoid(v0 + (x_v·v1ᵀ)·v2ᵀ)   (block 0: v_first = v)
//   per head, S ∈ R^{N×N} (rows: value channel i, columns: key channel j):
//     S ← S·diag(w) + (S·(−kk)) (kk ⊙ a)ᵀ + v kᵀ;   y = S r
//   y = GroupNorm_H(y; ln_x, eps = d_head · norm_eps) + Σ_head(r ⊙ k ⊙ r_k) · v
//   h += (y ⊙ g)·Oᵀ
// then the channel mix, with x = LN(h; ln2) and its own shift:
//   h += relu((x + (x' − x) ⊙ x_k)·keyᵀ)² · valueᵀ
//
// On CUDA float32 tensors (without autograd) and where models/gpu built it
// (FWSERVE_CUDA_KERNELS), everything of the time mix between the projections and O runs
// as one launch of the fused kernel (models/gpu/rwkv7_wkv.h): w's and a's activations,
// kk, the key's and the value's adjustments, the recurrence over the T tokens, the
// GroupNorm, the bonus and the gate. There too the block's inputs are one launch each
// (models/gpu/rwkv7_mix.h): ln1, the token shift, the new att_shift and the six x_p into
// one [6, B, T, d] buffer; ln2, the shift, the new ffn_shift and x_k; and relu(·)² after
// the FFN's key. Elsewhere LibTorch ops, token by token.
//
// There too, with at most kGemvMaxRows tokens in the call (B·T: decode), the block's
// products are five launches of the grouped GEMV kernel (models/gpu/gemv.h) instead of 14
// torch::linear calls and five elementwise ops: r, k, v and the LoRAs' first products
// (w1, a1, g1, v1); their second products (tanh before w2, sigmoid before g2; the biases
// w0, a0, v0); h + (y ⊙ g)·Oᵀ; relu(x_k·keyᵀ)² (the separate relu² launch then is not
// made); out + key·valueᵀ. The same path runs on CPU float32 tensors with the kernel's
// CPU mirror (gemv_host.h) when a test asks for it (SetRwkv7HostGemvForTesting). Larger
// calls keep torch::linear.
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/gemv_launch.h"
#include "models/architectures/mixer.h"
#include "models/architectures/rwkv_block.h"
#include "models/gpu/gemv.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/gpu/rwkv7_mix.h"
#include "models/gpu/rwkv7_wkv.h"
#endif

namespace fwmodel {

// Whether RWKV-7 blocks run their grouped-GEMV path (rwkv7.cc's header) on CPU float32
// tensors too, with the kernel's CPU mirror: for tests only (slow). Thread-safe; read at
// each Forward. Declared here (and in the tests that use it), not in a header: no
// production caller.
void SetRwkv7HostGemvForTesting(bool on);

namespace {

// SetRwkv7HostGemvForTesting's switch.
std::atomic<bool> rwkv7_host_gemv_for_testing{false};

constexpr const char* kWhat = "an rwkv7 block";

constexpr const char* kShiftNames[6] = {"att.x_r", "att.x_w", "att.x_k",
                                        "att.x_v", "att.x_a", "att.x_g"};

class Rwkv7Block final : public RwkvBlock {
 public:
  Rwkv7Block(const ModelConfig& config, int layer) : RwkvBlock(config, layer) {}

  std::vector<std::pair<std::string, std::vector<int64_t>>> WeightShapes() const override {
    const int64_t d = config_.d_model, f = config_.d_ff, H = config_.n_heads, N = config_.d_head();
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"ln1.weight", {d}},
        {"ln1.bias", {d}},
        {"ln2.weight", {d}},
        {"ln2.bias", {d}},
        {"att.receptance.weight", {d, d}},
        {"att.key.weight", {d, d}},
        {"att.value.weight", {d, d}},
        {"att.output.weight", {d, d}},
        {"att.k_k", {d}},
        {"att.k_a", {d}},
        {"att.r_k", {H, N}},
        {"att.ln_x.weight", {d}},
        {"att.ln_x.bias", {d}},
        {"ffn.x_k", {d}},
        {"ffn.key.weight", {f, d}},
        {"ffn.value.weight", {d, f}},
    };
    for (const char* name : kShiftNames) shapes.push_back({name, {d}});
    auto lora = [&](const char* p, int64_t rank, bool bias) {
      if (bias) shapes.push_back({absl::StrCat("att.", p, "0"), {d}});
      shapes.push_back({absl::StrCat("att.", p, "1"), {rank, d}});
      shapes.push_back({absl::StrCat("att.", p, "2"), {d, rank}});
    };
    lora("w", config_.decay_low_rank_dim, true);
    lora("a", config_.a_low_rank_dim, true);
    if (layer_ > 0) lora("v", config_.v_low_rank_dim, true);
    lora("g", config_.gate_low_rank_dim, false);
    if (layer_ == 0) {
      shapes.push_back({"ln0.weight", {d}});
      shapes.push_back({"ln0.bias", {d}});
    }
    return shapes;
  }

  int64_t MacsPerToken() const override {
    const int64_t d = config_.d_model, f = config_.d_ff;
    int64_t lora = config_.decay_low_rank_dim + config_.a_low_rank_dim + config_.gate_low_rank_dim;
    if (layer_ > 0) lora += config_.v_low_rank_dim;
    const int64_t N = config_.d_head();
    return 4 * d * d + 2 * d * lora + 2 * d * f + 3 * d * N;  // + the state's S·kk, S·r, update
  }

  std::vector<StateTensorSpec> StateSpec() const override {
    const int64_t d = config_.d_model, H = config_.n_heads, N = config_.d_head();
    return {{"att_shift", {d}}, {"wkv", {H, N, N}}, {"ffn_shift", {d}}};
  }

  torch::Tensor InitWeight(const std::string& name, const std::vector<int64_t>& shape,
                           at::Generator& generator) const override {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    const int64_t d = config_.d_model;
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("ln0.weight") ||
        ends_with("ln_x.weight")) {
      return torch::ones(shape, f32);
    }
    if (ends_with(".bias")) return torch::zeros(shape, f32);
    if (name.rfind("att.x_", 0) == 0 || name == "ffn.x_k") {
      return torch::rand(shape, generator, f32);  // mix fractions in [0, 1)
    }
    if (name == "att.w0") return torch::linspace(-6.0, -1.0, d, f32);  // slow to fast decay
    if (name == "att.a0") return torch::zeros(shape, f32);
    if (name == "att.v0") return torch::ones(shape, f32);
    if (name == "att.k_k") return torch::full(shape, 0.85, f32);
    if (name == "att.k_a") return torch::ones(shape, f32);
    if (name == "att.r_k") return torch::randn(shape, generator, f32) * 0.1;
    const double scale = 1.0 / std::sqrt(static_cast<double>(shape.back()));
    return torch::randn(shape, generator, f32) * scale;
  }

  void Bind(const WeightGetter& get) override {
    for (int p = 0; p < 6; ++p) mix_[p] = get(kShiftNames[p]);
    ln1_w_ = get("ln1.weight");
    ln1_b_ = get("ln1.bias");
    ln2_w_ = get("ln2.weight");
    ln2_b_ = get("ln2.bias");
    r_ = get("att.receptance.weight");
    k_ = get("att.key.weight");
    v_ = get("att.value.weight");
    o_ = get("att.output.weight");
    w0_ = get("att.w0");
    w1_ = get("att.w1");
    w2_ = get("att.w2");
    a0_ = get("att.a0");
    a1_ = get("att.a1");
    a2_ = get("att.a2");
    if (layer_ > 0) {
      v0_ = get("att.v0");
      v1_ = get("att.v1");
      v2_ = get("att.v2");
    }
    g1_ = get("att.g1");
    g2_ = get("att.g2");
    k_k_ = get("att.k_k");
    k_a_ = get("att.k_a");
    r_k_ = get("att.r_k");
    ln_x_w_ = get("att.ln_x.weight");
    ln_x_b_ = get("att.ln_x.bias");
    ffn_x_k_ = get("ffn.x_k");
    ffn_key_ = get("ffn.key.weight");
    ffn_value_ = get("ffn.value.weight");
  }

  torch::Tensor Forward(const torch::Tensor& h, torch::Tensor* state,
                        torch::Tensor* v_first) const override {
    const int64_t d = config_.d_model;
    // ---- Time mix: x = LN(h; ln1), the token shift and the mixes, then the projections
    torch::Tensor xp[6];
#if defined(FWSERVE_CUDA_KERNELS)
    if (ShiftMixApplies(
            h, state[0],
            {&ln1_w_, &ln1_b_, &mix_[0], &mix_[1], &mix_[2], &mix_[3], &mix_[4], &mix_[5]})) {
      const torch::Tensor mixed = FusedShiftMix(h, ln1_w_, ln1_b_, mix_, 6, &state[0]);
      for (int p = 0; p < 6; ++p) xp[p] = mixed.select(0, p);
    }
#endif
    if (!xp[0].defined()) {
      torch::Tensor x = torch::layer_norm(h, {d}, ln1_w_, ln1_b_, config_.norm_eps);
      torch::Tensor delta = TokenShift(x, &state[0]) - x;
      for (int p = 0; p < 6; ++p) xp[p] = torch::addcmul(x, delta, mix_[p]);
    }
    const bool gemv = GemvApplies(h, xp);
    Projections pr;
    if (gemv) {
      GemvProjections(xp, &pr);
    } else {
      pr.r = Linear(xp[0], r_);
      pr.w_raw = Linear(torch::tanh(Linear(xp[1], w1_)), w2_, w0_);
      pr.k = Linear(xp[2], k_);
      pr.v = Linear(xp[3], v_);
      pr.a_raw = Linear(Linear(xp[4], a1_), a2_, a0_);
      pr.g = Linear(torch::sigmoid(Linear(xp[5], g1_)), g2_);
      if (layer_ > 0) pr.v_raw = Linear(Linear(xp[3], v1_), v2_, v0_);
    }
    // ---- The recurrence, GroupNorm, bonus and gate
    torch::Tensor y;  // [B, T, d], gated
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(h, state)) y = FusedTimeMix(pr, state, v_first);
#endif
    if (!y.defined()) y = TimeMix(pr, state, v_first);
    const torch::Tensor out =
        gemv ? GemvLinear(y, o_, nullptr, kernels::GemvEpilogue::kResidual, &h, kWhat)
             : h + Linear(y, o_);
    // ---- Channel mix: xk from LN(out; ln2) and its shift, then relu(xk·keyᵀ)²·valueᵀ
    torch::Tensor xk, key;
#if defined(FWSERVE_CUDA_KERNELS)
    if (ShiftMixApplies(out, state[2], {&ln2_w_, &ln2_b_, &ffn_x_k_})) {
      xk = FusedShiftMix(out, ln2_w_, ln2_b_, &ffn_x_k_, 1, &state[2]).select(0, 0);
    }
#endif
    if (!xk.defined()) {
      torch::Tensor xf = torch::layer_norm(out, {d}, ln2_w_, ln2_b_, config_.norm_eps);
      xk = torch::addcmul(xf, TokenShift(xf, &state[2]) - xf, ffn_x_k_);
    }
    if (gemv) {
      key = GemvLinear(xk, ffn_key_, nullptr, kernels::GemvEpilogue::kSquaredRelu, nullptr, kWhat);
      return GemvLinear(key, ffn_value_, nullptr, kernels::GemvEpilogue::kResidual, &out, kWhat);
    }
    key = Linear(xk, ffn_key_);
#if defined(FWSERVE_CUDA_KERNELS)
    if (SquaredReluApplies(key)) {
      FusedSquaredReluInPlace(key);
    } else {
      key = torch::relu(key).square();
    }
#else
    key = torch::relu(key).square();
#endif
    return out + Linear(key, ffn_value_);
  }

 private:
  // x·wᵀ (+ bias) by torch::linear; a bf16 matrix (ModelOptions::bf16_matrices) is widened
  // to x's float32 first (exact), so the product is the float32 one over the bf16 values.
  static torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& bias = {}) {
    if (w.scalar_type() == x.scalar_type()) return torch::linear(x, w, bias);
    return torch::linear(x, w.to(x.scalar_type()), bias);
  }

  // The time mix's projections of x_p, [B, T, d] each; v_raw (v0 + (x_v·v1ᵀ)·v2ᵀ) in
  // blocks > 0 only.
  struct Projections {
    torch::Tensor r, w_raw, k, v, a_raw, g, v_raw;
  };

  // The time mix after the projections in LibTorch ops: returns y ⊙ g [B, T, d] and
  // replaces state[1] (the wkv state) and, in block 0, *v_first.
  torch::Tensor TimeMix(const Projections& pr, torch::Tensor* state, torch::Tensor* v_first) const {
    const int64_t B = pr.r.size(0), T = pr.r.size(1), d = config_.d_model, H = config_.n_heads,
                  N = config_.d_head();
    torch::Tensor w = torch::exp(torch::sigmoid(pr.w_raw) * -std::exp(-0.5));
    torch::Tensor k = pr.k, v = pr.v;
    torch::Tensor a = torch::sigmoid(pr.a_raw);
    // F.normalize(p=2, dim=-1, eps=1e-12), as LibTorch's functional computes it.
    torch::Tensor kk = (k * k_k_).view({B, T, H, N});
    kk = kk / kk.norm(2.0, -1, /*keepdim=*/true).clamp_min(1e-12).expand_as(kk);
    k = k * (1 + (a - 1) * k_a_);
    if (layer_ == 0) {
      *v_first = v;
    } else {
      v = v + (*v_first - v) * torch::sigmoid(pr.v_raw);
    }
    // The generalised delta rule, token by token; state [B, H, N(v), N(k)].
    torch::Tensor rh = pr.r.view({B, T, H, N}), wh = w.view({B, T, H, N}),
                  kh = k.view({B, T, H, N}), vh = v.view({B, T, H, N});
    torch::Tensor bh = kk * a.view({B, T, H, N});
    torch::Tensor S = state[1];
    std::vector<torch::Tensor> ys;
    ys.reserve(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      torch::Tensor sa = torch::matmul(S, -kk.select(1, t).unsqueeze(-1));  // [B, H, N, 1]
      S = S * wh.select(1, t).unsqueeze(-2) + sa * bh.select(1, t).unsqueeze(-2) +
          vh.select(1, t).unsqueeze(-1) * kh.select(1, t).unsqueeze(-2);
      ys.push_back(torch::matmul(S, rh.select(1, t).unsqueeze(-1)).squeeze(-1));  // [B, H, N]
    }
    state[1] = S;
    torch::Tensor y = torch::stack(ys, 1);  // [B, T, H, N]
    // GroupNorm per head (biased variance), then the per-head bonus r·(k ⊙ r_k) v.
    torch::Tensor mean = y.mean(-1, /*keepdim=*/true);
    torch::Tensor var = (y - mean).square().mean(-1, /*keepdim=*/true);
    y = (y - mean) * torch::rsqrt(var + static_cast<double>(N) * config_.norm_eps);
    y = y.reshape({B, T, d}) * ln_x_w_ + ln_x_b_;
    torch::Tensor bonus = (rh * kh * r_k_).sum(-1, /*keepdim=*/true) * vh;  // [B, T, H, N]
    y = y + bonus.reshape({B, T, d});
    return y * pr.g;
  }

  // Whether this call's products run as grouped GEMV launches (rwkv7.cc's header): B·T
  // in 1..kGemvMaxRows, float32 h, x_p and weights, no autograd graph to record (the
  // kernel has no backward), and h on a CUDA device where the kernels were built, or on
  // the CPU where a test asked for the CPU mirror (SetRwkv7HostGemvForTesting).
  bool GemvApplies(const torch::Tensor& h, const torch::Tensor* xp) const {
    if (h.dim() != 3 || h.scalar_type() != torch::kFloat32 || h.size(0) * h.size(1) < 1 ||
        h.size(0) * h.size(1) > kernels::kGemvMaxRows || h.size(2) != config_.d_model) {
      return false;
    }
    if (!(h.is_cuda() && GemvCudaKernelsBuilt()) &&
        !(h.is_cpu() && rwkv7_host_gemv_for_testing.load())) {
      return false;
    }
    if (!KernelInputsOk(h.device(),
                        {&h, &xp[0], &xp[1], &xp[2], &xp[3], &xp[4], &xp[5], &w0_, &a0_, &v0_})) {
      return false;
    }
    for (const torch::Tensor* t : {&w0_, &a0_, &v0_}) {
      if (t->defined() && t->numel() != config_.d_model) return false;
    }
    // The matrices: all float32 or all bf16 (ModelOptions::bf16_matrices): a launch has
    // one weight type.
    const std::initializer_list<const torch::Tensor*> matrices = {
        &r_, &k_, &v_, &o_, &w1_, &w2_, &a1_, &a2_, &v1_, &v2_, &g1_, &g2_, &ffn_key_, &ffn_value_};
    for (const torch::Tensor* t : matrices) {
      if (!t->defined()) continue;  // v1, v2 in block 0
      if (t->dim() != 2 || t->scalar_type() != r_.scalar_type()) return false;
    }
    return KernelInputsOk(h.device(), matrices, /*bf16_ok=*/true);
  }

  // The time mix's projections in two grouped launches: r, k, v and the LoRAs' first
  // products, then the LoRAs' second products (tanh before w2, sigmoid before g2; the
  // biases w0, a0 and, in blocks > 0, v0).
  void GemvProjections(const torch::Tensor* xp, Projections* pr) const {
    using kernels::GemvEpilogue;
    using kernels::GemvInput;
    constexpr GemvEpilogue kPlain = GemvEpilogue::kNone;
    GemvLaunch first;
    pr->r = first.Add(xp[0], r_, GemvInput::kNone, nullptr, kPlain, nullptr);
    pr->k = first.Add(xp[2], k_, GemvInput::kNone, nullptr, kPlain, nullptr);
    pr->v = first.Add(xp[3], v_, GemvInput::kNone, nullptr, kPlain, nullptr);
    const torch::Tensor w_low = first.Add(xp[1], w1_, GemvInput::kNone, nullptr, kPlain, nullptr);
    const torch::Tensor a_low = first.Add(xp[4], a1_, GemvInput::kNone, nullptr, kPlain, nullptr);
    const torch::Tensor g_low = first.Add(xp[5], g1_, GemvInput::kNone, nullptr, kPlain, nullptr);
    torch::Tensor v_low;
    if (layer_ > 0) v_low = first.Add(xp[3], v1_, GemvInput::kNone, nullptr, kPlain, nullptr);
    first.Run(xp[0], "an rwkv7 block's projections");
    GemvLaunch second;
    pr->w_raw = second.Add(w_low, w2_, GemvInput::kTanh, &w0_, kPlain, nullptr);
    pr->a_raw = second.Add(a_low, a2_, GemvInput::kNone, &a0_, kPlain, nullptr);
    pr->g = second.Add(g_low, g2_, GemvInput::kSigmoid, nullptr, kPlain, nullptr);
    if (layer_ > 0) pr->v_raw = second.Add(v_low, v2_, GemvInput::kNone, &v0_, kPlain, nullptr);
    second.Run(xp[0], "an rwkv7 block's LoRA products");
  }

#if defined(FWSERVE_CUDA_KERNELS)
  // Whether the fused kernel may run this block: float32 CUDA tensors, a head the
  // kernel takes, and no autograd graph to record (the kernel has no backward).
  bool FusedApplies(const torch::Tensor& h, const torch::Tensor* state) const {
    if (!h.is_cuda() || h.scalar_type() != torch::kFloat32 ||
        state[1].scalar_type() != torch::kFloat32 ||
        config_.d_head() > fwmodel::kernels::kRwkv7WkvMaxN) {
      return false;
    }
    if (c10::GradMode::is_enabled()) {
      for (const torch::Tensor* t :
           {&h,   &state[1], &r_,  &k_,  &v_,  &w0_,  &w1_,  &w2_,  &a0_,     &a1_,    &a2_,
            &v0_, &v1_,      &v2_, &g1_, &g2_, &k_k_, &k_a_, &r_k_, &ln_x_w_, &ln_x_b_}) {
        if (t->defined() && t->requires_grad()) return false;
      }
    }
    return true;
  }

  // TimeMix's result by one launch of the fused kernel on the current stream of h's
  // device. Contiguous float32 inputs (the projections already are; anything else is
  // copied), a new state tensor (state[1] is replaced, not written: Block's contract),
  // no host synchronisation, so it runs inside CUDA Graph capture as the ops around it.
  torch::Tensor FusedTimeMix(const Projections& pr, torch::Tensor* state,
                             torch::Tensor* v_first) const {
    const int64_t B = pr.r.size(0), T = pr.r.size(1), H = config_.n_heads, N = config_.d_head();
    if (layer_ == 0) *v_first = pr.v;
    const c10::cuda::CUDAGuard device(pr.r.device());
    auto dense = [](const torch::Tensor& t) { return t.contiguous(); };
    const torch::Tensor r = dense(pr.r), w_raw = dense(pr.w_raw), k = dense(pr.k), v = dense(pr.v),
                        a_raw = dense(pr.a_raw), g = dense(pr.g);
    torch::Tensor v_raw, first;
    if (layer_ > 0) {
      v_raw = dense(pr.v_raw);
      first = dense(*v_first);
    }
    const torch::Tensor k_k = dense(k_k_), k_a = dense(k_a_), r_k = dense(r_k_),
                        ln_w = dense(ln_x_w_), ln_b = dense(ln_x_b_);
    const torch::Tensor S_in = dense(state[1]);
    torch::Tensor S_out = torch::empty_like(S_in, torch::MemoryFormat::Contiguous);
    torch::Tensor y = torch::empty_like(r, torch::MemoryFormat::Contiguous);
    fwmodel::kernels::Rwkv7WkvArgs args;
    args.B = B;
    args.T = T;
    args.H = H;
    args.N = N;
    args.r = r.data_ptr<float>();
    args.w_raw = w_raw.data_ptr<float>();
    args.a_raw = a_raw.data_ptr<float>();
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
    args.g = g.data_ptr<float>();
    if (layer_ > 0) {
      args.v_raw = v_raw.data_ptr<float>();
      args.v_first = first.data_ptr<float>();
    }
    args.k_k = k_k.data_ptr<float>();
    args.k_a = k_a.data_ptr<float>();
    args.r_k = r_k.data_ptr<float>();
    args.ln_w = ln_w.data_ptr<float>();
    args.ln_b = ln_b.data_ptr<float>();
    args.state_in = S_in.data_ptr<float>();
    args.state_out = S_out.data_ptr<float>();
    args.y = y.data_ptr<float>();
    args.eps = static_cast<float>(static_cast<double>(N) * config_.norm_eps);
    args.first_layer = layer_ == 0;
    // Prefill: the split-phase path's scratch (the caching allocator's, on the launch's
    // stream; no synchronisation, so graph capture stays valid).
    torch::Tensor scratch;
    if (T > 1) {
      scratch = torch::empty({fwmodel::kernels::Rwkv7WkvScratchFloats(B, T, H, N)}, r.options());
      args.scratch = scratch.data_ptr<float>();
    }
    const int error =
        fwmodel::kernels::LaunchRwkv7Wkv(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "rwkv7 block ", layer_, ": the fused time-mix kernel failed: ",
                fwmodel::kernels::Rwkv7WkvErrorString(error));
    state[1] = S_out;
    return y;
  }

  // Whether the fused shift-mix kernel may take x ([B, T, d], h or the time mix's out) and
  // its shift state with these weights: float32 CUDA tensors of matching shapes ([B, d]
  // shift, [d] weights), at least one token, and no autograd graph to record (the kernel
  // has no backward).
  static bool ShiftMixApplies(const torch::Tensor& x, const torch::Tensor& shift,
                              std::initializer_list<const torch::Tensor*> weights) {
    if (!x.is_cuda() || x.scalar_type() != torch::kFloat32 || x.dim() != 3 || x.size(1) < 1 ||
        !shift.is_cuda() || shift.scalar_type() != torch::kFloat32 || shift.dim() != 2 ||
        shift.size(0) != x.size(0) || shift.size(1) != x.size(2)) {
      return false;
    }
    for (const torch::Tensor* t : weights) {
      if (t->scalar_type() != torch::kFloat32 || t->numel() != x.size(2)) return false;
    }
    if (c10::GradMode::is_enabled()) {
      if (x.requires_grad() || shift.requires_grad()) return false;
      for (const torch::Tensor* t : weights) {
        if (t->requires_grad()) return false;
      }
    }
    return true;
  }

  // LN(x; ln_w, ln_b), the token shift with *shift and the `count` (1 or 6) interpolations
  // x + (x' − x) ⊙ mixes[p], as [count, B, T, d], by one launch on the current stream of
  // x's device; *shift is replaced by a new tensor holding the last token's LN(x) (Block's
  // contract). No host synchronisation: it runs inside CUDA Graph capture.
  torch::Tensor FusedShiftMix(const torch::Tensor& x, const torch::Tensor& ln_w,
                              const torch::Tensor& ln_b, const torch::Tensor* mixes, int count,
                              torch::Tensor* shift) const {
    const int64_t B = x.size(0), T = x.size(1), d = config_.d_model;
    const c10::cuda::CUDAGuard device(x.device());
    const torch::Tensor in = x.contiguous(), w = ln_w.contiguous(), b = ln_b.contiguous();
    const torch::Tensor shift_in = shift->contiguous();
    torch::Tensor mix[fwmodel::kernels::kRwkv7MixMaxCount];
    for (int p = 0; p < count; ++p) mix[p] = mixes[p].contiguous();
    torch::Tensor shift_out = torch::empty_like(shift_in, torch::MemoryFormat::Contiguous);
    torch::Tensor out = torch::empty({count, B, T, d}, in.options());
    fwmodel::kernels::Rwkv7ShiftMixArgs args;
    args.B = B;
    args.T = T;
    args.d = d;
    args.h = in.data_ptr<float>();
    args.ln_w = w.data_ptr<float>();
    args.ln_b = b.data_ptr<float>();
    args.eps = static_cast<float>(config_.norm_eps);
    args.shift_in = shift_in.data_ptr<float>();
    args.shift_out = shift_out.data_ptr<float>();
    args.count = count;
    for (int p = 0; p < count; ++p) args.mix[p] = mix[p].data_ptr<float>();
    args.out = out.data_ptr<float>();
    const int error =
        fwmodel::kernels::LaunchRwkv7ShiftMix(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "rwkv7 block ", layer_, ": the fused shift-mix kernel failed: ",
                fwmodel::kernels::Rwkv7MixErrorString(error));
    *shift = shift_out;
    return out;
  }

  // Whether relu(key)² may run as the fused elementwise kernel: a contiguous float32 CUDA
  // tensor (torch::linear's output) without autograd to record.
  static bool SquaredReluApplies(const torch::Tensor& key) {
    return key.is_cuda() && key.scalar_type() == torch::kFloat32 && key.is_contiguous() &&
           !(c10::GradMode::is_enabled() && key.requires_grad());
  }

  // key ← relu(key)², in place (key is the block's own fresh linear output), one launch
  // on the current stream.
  void FusedSquaredReluInPlace(torch::Tensor& key) const {
    const c10::cuda::CUDAGuard device(key.device());
    float* data = key.data_ptr<float>();
    const int error = fwmodel::kernels::LaunchSquaredRelu(
        data, data, key.numel(), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "rwkv7 block ", layer_,
                ": the fused relu² kernel failed: ", fwmodel::kernels::Rwkv7MixErrorString(error));
  }
#endif

  torch::Tensor mix_[6];
  torch::Tensor ln1_w_, ln1_b_, ln2_w_, ln2_b_;
  torch::Tensor r_, k_, v_, o_;
  torch::Tensor w0_, w1_, w2_, a0_, a1_, a2_, v0_, v1_, v2_, g1_, g2_;
  torch::Tensor k_k_, k_a_, r_k_, ln_x_w_, ln_x_b_;
  torch::Tensor ffn_x_k_, ffn_key_, ffn_value_;
};

}  // namespace

void SetRwkv7HostGemvForTesting(bool on) { rwkv7_host_gemv_for_testing.store(on); }

std::unique_ptr<RwkvBlock> MakeRwkv7Block(const ModelConfig& config, int layer) {
  return std::make_unique<Rwkv7Block>(config, layer);
}

torch::Tensor TokenShift(const torch::Tensor& x, torch::Tensor* shift) {
  const int64_t T = x.size(1);
  torch::Tensor previous =
      T == 1 ? shift->unsqueeze(1) : torch::cat({shift->unsqueeze(1), x.narrow(1, 0, T - 1)}, 1);
  *shift = x.select(1, T - 1).clone();  // a copy: the state must not keep x alive
  return previous;
}

}  // namespace fwmodel
