// DeltaNet and Gated DeltaNet blocks; the math and the names are in delta_net.h.
//
// The sequence form runs the recurrence token by token (fla's fused_recurrent form, not its
// chunked one), so Forward over T tokens is T Steps up to rounding.
//
// On CUDA float32 tensors (without autograd) and where models/gpu built it
// (FWSERVE_CUDA_KERNELS), the recurrence over the T tokens with the output RMSNorm and gate
// runs as one launch of the fused kernel (models/gpu/delta_rule_cuda.h). Elsewhere
// LibTorch ops, token by token.
#include "models/architectures/delta_net.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>

#include "models/gpu/delta_rule_cuda.h"
#endif

namespace fwmodel {
namespace {

// The depthwise causal convolution over time, no bias. x [B, T, C]; weight [C, W]; history
// [B, W − 1, C], the previous W − 1 inputs. Returns y [B, T, C] (y_t = Σ_j weight[:, j] ⊙
// x_{t − W + 1 + j}: the current token on the last tap) and replaces *history with the
// last W − 1 inputs (a copy, so the state does not keep x alive).
torch::Tensor DeltaNetShortConv(const torch::Tensor& x, const torch::Tensor& weight,
                                torch::Tensor* history) {
  const int64_t width = weight.size(1), steps = x.size(1);
  torch::Tensor padded = torch::cat({*history, x}, 1);  // [B, W − 1 + T, C]
  torch::Tensor y = weight.select(1, 0) * padded.narrow(1, 0, steps);
  for (int64_t j = 1; j < width; ++j) y = y + weight.select(1, j) * padded.narrow(1, j, steps);
  *history = padded.narrow(1, steps, width - 1).clone();
  return y;
}

class DeltaNetBlock final : public Block {
 public:
  DeltaNetBlock(const ModelConfig& config, int layer)
      : Block(config, layer),
        gated_(config.architecture == Architecture::kGatedDeltaNet),
        heads_(config.n_heads),
        value_heads_(config.v_heads()),
        key_dim_(config.k_head_dim()),
        value_dim_(config.v_head_dim()) {}

  std::vector<std::pair<std::string, std::vector<int64_t>>> WeightShapes() const override {
    const int64_t d = config_.d_model, f = config_.d_ff, hk = heads_ * key_dim_,
                  hvv = value_heads_ * value_dim_, hv = value_heads_, w = config_.conv_size;
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"attn_norm.weight", {d}},
        {"attn.q_proj.weight", {hk, d}},
        {"attn.k_proj.weight", {hk, d}},
        {"attn.v_proj.weight", {hvv, d}},
        {"attn.o_norm.weight", {value_dim_}},
        {"attn.o_proj.weight", {d, hvv}},
        {"mlp_norm.weight", {d}},
        {"mlp.gate_proj.weight", {f, d}},
        {"mlp.up_proj.weight", {f, d}},
        {"mlp.down_proj.weight", {d, f}},
    };
    if (gated_ || config_.use_beta) shapes.push_back({"attn.b_proj.weight", {hv, d}});
    if (gated_) {
      shapes.push_back({"attn.a_proj.weight", {hv, d}});
      shapes.push_back({"attn.A_log", {hv}});
      shapes.push_back({"attn.dt_bias", {hv}});
    }
    if (config_.use_short_conv) {
      shapes.push_back({"attn.q_conv1d.weight", {hk, w}});
      shapes.push_back({"attn.k_conv1d.weight", {hk, w}});
      shapes.push_back({"attn.v_conv1d.weight", {hvv, w}});
    }
    if (config_.use_gate) shapes.push_back({"attn.g_proj.weight", {hvv, d}});
    return shapes;
  }

  // The projections, the MLP and the recurrence's three products per value head (S_jᵀk,
  // k uᵀ, S_jᵀq); not the convolutions, norms or gates (elementwise).
  int64_t MacsPerToken() const override {
    const int64_t d = config_.d_model, f = config_.d_ff, hk = heads_ * key_dim_,
                  hvv = value_heads_ * value_dim_, hv = value_heads_;
    int64_t macs = d * (2 * hk + hvv) + hvv * d + 3 * d * f;
    if (gated_ || config_.use_beta) macs += hv * d;
    if (gated_) macs += hv * d;
    if (config_.use_gate) macs += hvv * d;
    return macs + 3 * hv * key_dim_ * value_dim_;
  }

  std::vector<StateTensorSpec> StateSpec() const override {
    std::vector<StateTensorSpec> spec = {
        {"attn.recurrent_state", {value_heads_, key_dim_, value_dim_}}};
    if (config_.use_short_conv) {
      const int64_t history = config_.conv_size - 1;
      spec.push_back({"attn.conv_state_q", {history, heads_ * key_dim_}});
      spec.push_back({"attn.conv_state_k", {history, heads_ * key_dim_}});
      spec.push_back({"attn.conv_state_v", {history, value_heads_ * value_dim_}});
    }
    return spec;
  }

  torch::Tensor InitWeight(const std::string& name, const std::vector<int64_t>& shape,
                           at::Generator& generator) const override {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("norm.weight")) return torch::ones(shape, f32);
    if (name == "attn.A_log") {  // fla: A ~ U(0, 16), kept off 0 here
      return torch::log(torch::rand(shape, generator, f32) * 15.0 + 1.0);
    }
    if (name == "attn.dt_bias") {  // fla: softplus⁻¹ of dt, log-uniform in [0.001, 0.1]
      torch::Tensor dt = torch::exp(
          torch::rand(shape, generator, f32) * (std::log(0.1) - std::log(0.001)) + std::log(0.001));
      return dt + torch::log(-torch::expm1(-dt));
    }
    if (ends_with("_conv1d.weight")) {
      // The current input passed through, plus a little of the previous ones.
      torch::Tensor t = torch::randn(shape, generator, f32) * 0.02;
      t.select(1, shape[1] - 1).add_(1.0);
      return t;
    }
    double scale = 1.0 / std::sqrt(static_cast<double>(shape.back()));
    if (name == "attn.o_proj.weight" || name == "mlp.down_proj.weight") {
      scale /= std::sqrt(2.0 * config_.n_layers);  // the residual branches
    }
    return torch::randn(shape, generator, f32) * scale;
  }

  void Bind(const WeightGetter& get) override {
    attn_norm_ = get("attn_norm.weight");
    q_ = get("attn.q_proj.weight");
    k_ = get("attn.k_proj.weight");
    v_ = get("attn.v_proj.weight");
    if (gated_ || config_.use_beta) b_ = get("attn.b_proj.weight");
    if (gated_) {
      a_ = get("attn.a_proj.weight");
      a_log_ = get("attn.A_log");
      dt_bias_ = get("attn.dt_bias");
    }
    if (config_.use_short_conv) {
      conv_[0] = get("attn.q_conv1d.weight");
      conv_[1] = get("attn.k_conv1d.weight");
      conv_[2] = get("attn.v_conv1d.weight");
    }
    if (config_.use_gate) g_ = get("attn.g_proj.weight");
    o_norm_ = get("attn.o_norm.weight");
    o_ = get("attn.o_proj.weight");
    mlp_norm_ = get("mlp_norm.weight");
    gate_ = get("mlp.gate_proj.weight");
    up_ = get("mlp.up_proj.weight");
    down_ = get("mlp.down_proj.weight");
  }

  torch::Tensor Forward(const torch::Tensor& h, torch::Tensor* state,
                        torch::Tensor* v_first) const override {
    (void)v_first;
    const int64_t B = h.size(0), T = h.size(1), H = heads_, HV = value_heads_, K = key_dim_,
                  V = value_dim_;
    const double eps = config_.norm_eps;
    torch::Tensor x = RmsNorm(h, attn_norm_, eps);
    torch::Tensor q = torch::linear(x, q_), k = torch::linear(x, k_), v = torch::linear(x, v_);
    if (config_.use_short_conv) {
      q = DeltaNetShortConv(q, conv_[0], &state[1]);
      k = DeltaNetShortConv(k, conv_[1], &state[2]);
      v = DeltaNetShortConv(v, conv_[2], &state[3]);
    }
    q = QkActivation(q).view({B, T, H, K});
    k = QkActivation(k).view({B, T, H, K});
    v = torch::silu(v).view({B, T, HV, V});
    if (config_.qk_norm == "l2") {
      q = q / torch::sqrt(q.square().sum(-1, /*keepdim=*/true) + 1e-6);
      k = k / torch::sqrt(k.square().sum(-1, /*keepdim=*/true) + 1e-6);
    } else {  // "sum"
      q = q / q.sum(-1, /*keepdim=*/true);
      k = k / k.sum(-1, /*keepdim=*/true);
    }
    q = q * (1.0 / std::sqrt(static_cast<double>(K)));
    torch::Tensor beta = b_.defined() ? torch::sigmoid(torch::linear(x, b_))
                                      : torch::ones({B, T, HV}, h.options());  // [B, T, HV]
    if (config_.allow_neg_eigval) beta = beta * 2.0;
    torch::Tensor decay;  // [B, T, HV]
    if (gated_) {
      decay = torch::exp(-torch::exp(a_log_) * torch::softplus(torch::linear(x, a_) + dt_bias_));
    }
    torch::Tensor gate;  // [B, T, HV·V], before its silu
    if (g_.defined()) gate = torch::linear(x, g_);
    // ---- The recurrence, the output norm and the gate: o [B, T, HV, V]
    torch::Tensor o;
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies({&q, &k, &v, &beta, &decay, &gate, &state[0], &o_norm_})) {
      o = FusedDeltaRule(q, k, v, beta, decay, gate, &state[0]);
    }
#endif
    if (!o.defined()) o = DeltaRule(q, k, v, beta, decay, gate, &state[0]);
    torch::Tensor out = h + torch::linear(o.reshape({B, T, HV * V}), o_);
    torch::Tensor y = RmsNorm(out, mlp_norm_, eps);
    return out + torch::linear(torch::silu(torch::linear(y, gate_)) * torch::linear(y, up_), down_);
  }

 private:
  // The recurrence in LibTorch ops, token by token, then the output norm and gate: q, k
  // [B, T, H, K] (activated, normalised, q scaled), v [B, T, HV, V], beta [B, T, HV], decay
  // [B, T, HV] (gated_deltanet; else undefined), gate [B, T, HV·V] (use_gate; else
  // undefined). Returns o [B, T, HV, V] and replaces *S [B, HV, K, V].
  torch::Tensor DeltaRule(torch::Tensor q, torch::Tensor k, const torch::Tensor& v,
                          const torch::Tensor& beta, const torch::Tensor& decay,
                          const torch::Tensor& gate, torch::Tensor* state) const {
    const int64_t B = v.size(0), T = v.size(1), H = heads_, HV = value_heads_, V = value_dim_;
    if (HV > H) {  // value head j reads q/k head j / (HV / H)
      q = q.repeat_interleave(HV / H, 2);
      k = k.repeat_interleave(HV / H, 2);
    }
    torch::Tensor S = *state;
    std::vector<torch::Tensor> outputs;
    outputs.reserve(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      if (gated_) S = S * decay.select(1, t).unsqueeze(-1).unsqueeze(-1);
      const torch::Tensor kt = k.select(1, t).unsqueeze(-2);        // [B, HV, 1, K]
      const torch::Tensor read = torch::matmul(kt, S).squeeze(-2);  // Sᵀk [B, HV, V]
      const torch::Tensor u = beta.select(1, t).unsqueeze(-1) * (v.select(1, t) - read);
      S = S + kt.transpose(-1, -2) * u.unsqueeze(-2);                                 // + k uᵀ
      outputs.push_back(torch::matmul(q.select(1, t).unsqueeze(-2), S).squeeze(-2));  // Sᵀq
    }
    *state = S;
    torch::Tensor o = RmsNorm(torch::stack(outputs, 1), o_norm_, config_.norm_eps);
    if (gate.defined()) o = o * torch::silu(gate.view({B, T, HV, V}));
    return o;
  }

#if defined(FWSERVE_CUDA_KERNELS)
  // Whether the fused kernel may run this block's recurrence on these tensors (the
  // undefined ones, decay and gate, are absent): float32 CUDA tensors, heads the kernel
  // takes, and no autograd graph to record (the kernel has no backward).
  bool FusedApplies(std::initializer_list<const torch::Tensor*> tensors) const {
    if (key_dim_ > fwmodel::kernels::kDeltaRuleMaxK ||
        value_dim_ > fwmodel::kernels::kDeltaRuleMaxV) {
      return false;
    }
    for (const torch::Tensor* t : tensors) {
      if (!t->defined()) continue;
      if (!t->is_cuda() || t->scalar_type() != torch::kFloat32 || t->requires_grad()) return false;
    }
    return true;
  }

  // DeltaRule's result by one launch of the fused kernel on the current stream of q's
  // device. Contiguous float32 inputs (anything else is copied), a new state tensor (*state
  // is replaced, not written: Block's contract), no host synchronisation, so it runs inside
  // CUDA Graph capture as the ops around it.
  torch::Tensor FusedDeltaRule(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& beta,
                               const torch::Tensor& decay, const torch::Tensor& gate,
                               torch::Tensor* state) const {
    const c10::cuda::CUDAGuard device(q.device());
    auto dense = [](const torch::Tensor& t) { return t.contiguous(); };
    const torch::Tensor q_in = dense(q), k_in = dense(k), v_in = dense(v), beta_in = dense(beta),
                        norm_weight = dense(o_norm_);
    torch::Tensor decay_in, gate_in;
    if (decay.defined()) decay_in = dense(decay);
    if (gate.defined()) gate_in = dense(gate);
    const torch::Tensor S_in = dense(*state);
    torch::Tensor S_out = torch::empty_like(S_in, torch::MemoryFormat::Contiguous);
    torch::Tensor o = torch::empty_like(v_in, torch::MemoryFormat::Contiguous);
    fwmodel::kernels::DeltaRuleArgs args;
    args.B = v_in.size(0);
    args.T = v_in.size(1);
    args.H = heads_;
    args.HV = value_heads_;
    args.K = key_dim_;
    args.V = value_dim_;
    args.q = q_in.data_ptr<float>();
    args.k = k_in.data_ptr<float>();
    args.v = v_in.data_ptr<float>();
    args.beta = beta_in.data_ptr<float>();
    if (decay_in.defined()) args.decay = decay_in.data_ptr<float>();
    if (gate_in.defined()) args.gate = gate_in.data_ptr<float>();
    args.norm_weight = norm_weight.data_ptr<float>();
    args.state_in = S_in.data_ptr<float>();
    args.state_out = S_out.data_ptr<float>();
    args.o = o.data_ptr<float>();
    args.eps = static_cast<float>(config_.norm_eps);
    const int error =
        fwmodel::kernels::LaunchDeltaRule(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "delta_net block ", layer_, ": the fused delta-rule kernel failed: ",
                fwmodel::kernels::DeltaRuleErrorString(error));
    *state = S_out;
    return o;
  }
#endif

  torch::Tensor QkActivation(const torch::Tensor& x) const {
    const std::string& act = config_.qk_activation;
    if (act == "silu") return torch::silu(x);
    if (act == "relu") return torch::relu(x);
    if (act == "elu") return torch::elu(x) + 1.0;
    return x;  // "identity"
  }

  const bool gated_;
  const int64_t heads_, value_heads_, key_dim_, value_dim_;
  torch::Tensor attn_norm_, q_, k_, v_, b_, a_, a_log_, dt_bias_, conv_[3], g_, o_norm_, o_;
  torch::Tensor mlp_norm_, gate_, up_, down_;
};

}  // namespace

std::unique_ptr<Block> MakeDeltaNetBlock(const ModelConfig& config, int layer) {
  return std::make_unique<DeltaNetBlock>(config, layer);
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return x * torch::rsqrt(x.square().mean(-1, /*keepdim=*/true) + eps) * weight;
}

}  // namespace fwmodel
