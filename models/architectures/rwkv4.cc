// RWKV-4: the block of BlinkDL's RWKV-LM `RWKV-v4/src/model_run.py`, equal to rwkv.cpp's
// `rwkv_att_v4`/`rwkv_ffn_v4_v5`. Its time mix is the contract's `aft` recurrence (the
// running α, β and max exponent p) after a token shift; its channel mix is gated.
//
// Per block, with x = LN(h; ln1) and x' the previous token's x:
//   x_p = x ⊙ time_mix_p + x' ⊙ (1 − time_mix_p)          p in k, v, r
//   r = sigmoid(x_r·Rᵀ),  k = x_k·Kᵀ,  v = x_v·Vᵀ
//   with w = −exp(time_decay), u = time_first, per channel (state α, β, p; p₀ = −1e30):
//     q = max(p, u + k);  wkv = (e^{p−q} α + e^{u+k−q} v) / (e^{p−q} β + e^{u+k−q})
//     q' = max(p + w, k); α ← e^{p+w−q'} α + e^{k−q'} v;  β ← e^{p+w−q'} β + e^{k−q'};  p ← q'
//   h += (r ⊙ wkv)·Oᵀ
// then, with x = LN(h; ln2) and its own shift:
//   h += sigmoid(x_r·R_fᵀ) ⊙ (relu(x_k·keyᵀ)² · valueᵀ)
//
// The recurrence is aft's, so it runs as the aft kernel (models/gpu/aft.h: one launch for
// the T tokens, sigmoid(r) ⊙ wkv out) on CUDA float32 tensors without autograd where the
// kernels were built (FWSERVE_CUDA_KERNELS), and on the CPU through the kernel's mirror
// when a test asks (SetRwkv4HostWkvForTesting); elsewhere the LibTorch loop over T.
#include <atomic>
#include <cmath>

#include "models/architectures/gemv_launch.h"
#include "models/architectures/mixer.h"
#include "models/architectures/rwkv_block.h"

namespace fwmodel {

// Whether RWKV-4 blocks run their recurrence through the aft kernel's CPU mirror on CPU
// float32 tensors: for tests only. Thread-safe; read at each Forward. Declared here (and in
// the tests that use it), not in a header: no production caller.
void SetRwkv4HostWkvForTesting(bool on);

namespace {

std::atomic<bool> rwkv4_host_wkv_for_testing{false};

class Rwkv4Block final : public RwkvBlock {
 public:
  Rwkv4Block(const ModelConfig& config, int layer) : RwkvBlock(config, layer) {}

  std::vector<std::pair<std::string, std::vector<int64_t>>> WeightShapes() const override {
    const int64_t d = config_.d_model, f = config_.d_ff;
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"ln1.weight", {d}},           {"ln1.bias", {d}},
        {"ln2.weight", {d}},           {"ln2.bias", {d}},
        {"att.time_decay", {d}},       {"att.time_first", {d}},
        {"att.time_mix_k", {d}},       {"att.time_mix_v", {d}},
        {"att.time_mix_r", {d}},       {"att.key.weight", {d, d}},
        {"att.value.weight", {d, d}},  {"att.receptance.weight", {d, d}},
        {"att.output.weight", {d, d}}, {"ffn.time_mix_k", {d}},
        {"ffn.time_mix_r", {d}},       {"ffn.key.weight", {f, d}},
        {"ffn.value.weight", {d, f}},  {"ffn.receptance.weight", {d, d}},
    };
    if (layer_ == 0) {
      shapes.push_back({"ln0.weight", {d}});
      shapes.push_back({"ln0.bias", {d}});
    }
    return shapes;
  }

  int64_t MacsPerToken() const override {
    const int64_t d = config_.d_model, f = config_.d_ff;
    return 5 * d * d + 2 * d * f;
  }

  std::vector<StateTensorSpec> StateSpec() const override {
    const int64_t d = config_.d_model;
    return {{"att_shift", {d}}, {"wkv", {3, d}}, {"ffn_shift", {d}}};
  }

  torch::Tensor InitWeight(const std::string& name, const std::vector<int64_t>& shape,
                           at::Generator& generator) const override {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    const int64_t d = config_.d_model;
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("ln0.weight")) {
      return torch::ones(shape, f32);
    }
    if (ends_with(".bias")) return torch::zeros(shape, f32);
    if (name.find("time_mix") != std::string::npos) return torch::rand(shape, generator, f32);
    if (name == "att.time_decay") return torch::linspace(-3.0, 1.0, d, f32);
    if (name == "att.time_first") return torch::full(shape, 0.5, f32);
    const double scale = 1.0 / std::sqrt(static_cast<double>(shape.back()));
    return torch::randn(shape, generator, f32) * scale;
  }

  void Bind(const WeightGetter& get) override {
    ln1_w_ = get("ln1.weight");
    ln1_b_ = get("ln1.bias");
    ln2_w_ = get("ln2.weight");
    ln2_b_ = get("ln2.bias");
    time_decay_ = get("att.time_decay");
    first_ = get("att.time_first");
    mix_k_ = get("att.time_mix_k");
    mix_v_ = get("att.time_mix_v");
    mix_r_ = get("att.time_mix_r");
    k_ = get("att.key.weight");
    v_ = get("att.value.weight");
    r_ = get("att.receptance.weight");
    o_ = get("att.output.weight");
    ffn_mix_k_ = get("ffn.time_mix_k");
    ffn_mix_r_ = get("ffn.time_mix_r");
    ffn_key_ = get("ffn.key.weight");
    ffn_value_ = get("ffn.value.weight");
    ffn_r_ = get("ffn.receptance.weight");
  }

  void InitState(torch::Tensor* state) const override {
    state[1].select(1, 2).fill_(-1e30);  // p₀ = −∞, as rwkv.cpp stores it
  }

  torch::Tensor Forward(const torch::Tensor& h, torch::Tensor* state,
                        torch::Tensor* v_first) const override {
    (void)v_first;
    const int64_t d = config_.d_model;
    // ---- Time mix
    torch::Tensor x = torch::layer_norm(h, {d}, ln1_w_, ln1_b_, config_.norm_eps);
    torch::Tensor prev = TokenShift(x, &state[0]);
    auto mix = [&](const torch::Tensor& m) { return x * m + prev * (1 - m); };
    torch::Tensor r_raw = torch::linear(mix(mix_r_), r_);
    torch::Tensor k = torch::linear(mix(mix_k_), k_);
    torch::Tensor v = torch::linear(mix(mix_v_), v_);
    torch::Tensor out;
    if (FusedApplies(r_raw, k, v, state[1])) {
      out = h + torch::linear(FusedWkv(r_raw, k, v, &state[1]), o_);
    } else {
      out = h + torch::linear(torch::sigmoid(r_raw) * Wkv(k, v, &state[1]), o_);
    }
    // ---- Channel mix
    torch::Tensor xf = torch::layer_norm(out, {d}, ln2_w_, ln2_b_, config_.norm_eps);
    torch::Tensor prev_f = TokenShift(xf, &state[2]);
    torch::Tensor xk = xf * ffn_mix_k_ + prev_f * (1 - ffn_mix_k_);
    torch::Tensor xr = xf * ffn_mix_r_ + prev_f * (1 - ffn_mix_r_);
    torch::Tensor kf = torch::relu(torch::linear(xk, ffn_key_)).square();
    return out + torch::sigmoid(torch::linear(xr, ffn_r_)) * torch::linear(kf, ffn_value_);
  }

 private:
  // wkv [B, T, d] of the T tokens by LibTorch ops, token by token; *wkv_state ([B, 3, d])
  // replaced by the state after them.
  torch::Tensor Wkv(const torch::Tensor& k, const torch::Tensor& v,
                    torch::Tensor* wkv_state) const {
    const int64_t T = k.size(1);
    torch::Tensor alpha = wkv_state->select(1, 0), beta = wkv_state->select(1, 1),
                  p = wkv_state->select(1, 2);
    const torch::Tensor decay = -torch::exp(time_decay_);
    std::vector<torch::Tensor> wkvs;
    wkvs.reserve(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      torch::Tensor kt = k.select(1, t), vt = v.select(1, t);
      torch::Tensor uk = first_ + kt;
      torch::Tensor q = torch::maximum(p, uk);
      torch::Tensor e1 = torch::exp(p - q), e2 = torch::exp(uk - q);
      wkvs.push_back((e1 * alpha + e2 * vt) / (e1 * beta + e2));
      torch::Tensor pw = p + decay;
      q = torch::maximum(pw, kt);
      e1 = torch::exp(pw - q);
      e2 = torch::exp(kt - q);
      alpha = e1 * alpha + e2 * vt;
      beta = e1 * beta + e2;
      p = q;
    }
    *wkv_state = torch::stack({alpha, beta, p}, 1);
    return torch::stack(wkvs, 1);
  }

  // Whether the recurrence runs as the aft kernel: float32 tensors without autograd to
  // record, on CUDA where the kernels were built, or on the CPU where a test asked for
  // the kernel's mirror (SetRwkv4HostWkvForTesting).
  bool FusedApplies(const torch::Tensor& r_raw, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& wkv_state) const {
    const bool cuda = r_raw.is_cuda() && GemvCudaKernelsBuilt();
    if (!cuda && !(r_raw.is_cpu() && rwkv4_host_wkv_for_testing.load())) return false;
    return KernelInputsOk(r_raw.device(), {&r_raw, &k, &v, &wkv_state, &time_decay_, &first_});
  }

  // sigmoid(r) ⊙ wkv [B, T, d] by one launch of the aft kernel (aft's recurrence with w =
  // exp(time_decay): RWKV-4's p + (−exp(time_decay)) is aft's p − w), or its CPU mirror;
  // *wkv_state replaced by a new [B, 3, d] tensor. No host synchronisation on CUDA, so it
  // runs inside CUDA Graph capture.
  torch::Tensor FusedWkv(const torch::Tensor& r_raw, const torch::Tensor& k, const torch::Tensor& v,
                         torch::Tensor* wkv_state) const {
    return AftRecurrenceKernel(r_raw, k, v, time_decay_, first_, wkv_state, "an rwkv4 block");
  }

  torch::Tensor ln1_w_, ln1_b_, ln2_w_, ln2_b_;
  torch::Tensor time_decay_, first_, mix_k_, mix_v_, mix_r_, k_, v_, r_, o_;
  torch::Tensor ffn_mix_k_, ffn_mix_r_, ffn_key_, ffn_value_, ffn_r_;
};

}  // namespace

void SetRwkv4HostWkvForTesting(bool on) { rwkv4_host_wkv_for_testing.store(on); }

std::unique_ptr<RwkvBlock> MakeRwkv4Block(const ModelConfig& config, int layer) {
  return std::make_unique<Rwkv4Block>(config, layer);
}

}  // namespace fwmodel
