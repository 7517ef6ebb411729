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
#include <cmath>

#include "models/architectures/rwkv_block.h"

namespace fwmodel {
namespace {

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
    const int64_t T = h.size(1), d = config_.d_model;
    // ---- Time mix
    torch::Tensor x = torch::layer_norm(h, {d}, ln1_w_, ln1_b_, config_.norm_eps);
    torch::Tensor prev = TokenShift(x, &state[0]);
    auto mix = [&](const torch::Tensor& m) { return x * m + prev * (1 - m); };
    torch::Tensor r = torch::sigmoid(torch::linear(mix(mix_r_), r_));
    torch::Tensor k = torch::linear(mix(mix_k_), k_);
    torch::Tensor v = torch::linear(mix(mix_v_), v_);
    torch::Tensor alpha = state[1].select(1, 0), beta = state[1].select(1, 1),
                  p = state[1].select(1, 2);
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
    state[1] = torch::stack({alpha, beta, p}, 1);
    torch::Tensor out = h + torch::linear(r * torch::stack(wkvs, 1), o_);
    // ---- Channel mix
    torch::Tensor xf = torch::layer_norm(out, {d}, ln2_w_, ln2_b_, config_.norm_eps);
    torch::Tensor prev_f = TokenShift(xf, &state[2]);
    torch::Tensor xk = xf * ffn_mix_k_ + prev_f * (1 - ffn_mix_k_);
    torch::Tensor xr = xf * ffn_mix_r_ + prev_f * (1 - ffn_mix_r_);
    torch::Tensor kf = torch::relu(torch::linear(xk, ffn_key_)).square();
    return out + torch::sigmoid(torch::linear(xr, ffn_r_)) * torch::linear(kf, ffn_value_);
  }

 private:
  torch::Tensor ln1_w_, ln1_b_, ln2_w_, ln2_b_;
  torch::Tensor time_decay_, first_, mix_k_, mix_v_, mix_r_, k_, v_, r_, o_;
  torch::Tensor ffn_mix_k_, ffn_mix_r_, ffn_key_, ffn_value_, ffn_r_;
};

}  // namespace

std::unique_ptr<RwkvBlock> MakeRwkv4Block(const ModelConfig& config, int layer) {
  return std::make_unique<Rwkv4Block>(config, layer);
}

}  // namespace fwmodel
