// Mixer `aft` (Attention Free Transformer with a learned exponential time decay):
// per channel, the running weighted sums (alpha, beta) of v and 1 and their log scale
// p, state [3, d] per layer.
#include <algorithm>
#include <cmath>
#include <limits>

#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"

namespace fwmodel {
namespace {

// Stand-in for p0 = -inf of the aft recurrence: finite, so that p - t*w stays finite
// and exp(p - q) is exactly 0 in float32 and float64.
constexpr double kAftInitialLogScale = -1e30;

// ---- Native row

// One session's (alpha, beta, p) [3, d] absorbs r|k|v = pr[0..3d); y = r ⊙ wkv.
FW_VECTOR_KERNEL
void AftRow(const float* __restrict pr, float* __restrict st, const float* __restrict decay,
            const float* __restrict time_first, int64_t d, float* __restrict y) {
  using native::FastExp;
  float* __restrict alpha = st;
  float* __restrict beta = st + d;
  float* __restrict p = st + 2 * d;
#pragma omp simd
  for (int64_t ch = 0; ch < d; ++ch) {
    const float r = native::Sigmoid(pr[ch]), k = pr[d + ch], v = pr[2 * d + ch];
    const float u = time_first[ch], w = decay[ch], p0 = p[ch], a0 = alpha[ch], b0 = beta[ch];
    const float q = std::max(p0, u + k);
    float e1 = FastExp(p0 - q), e2 = FastExp(u + k - q);
    const float wkv = (e1 * a0 + e2 * v) / (e1 * b0 + e2);
    const float q2 = std::max(p0 - w, k);
    e1 = FastExp(p0 - w - q2);
    e2 = FastExp(k - q2);
    alpha[ch] = e1 * a0 + e2 * v;
    beta[ch] = e1 * b0 + e2;
    p[ch] = q2;
    y[ch] = r * wkv;
  }
}

class NativeAft final : public NativeMixer {
 public:
  NativeAft(int64_t d, std::vector<float> decay, torch::Tensor time_first)
      : d_(d), decay_(std::move(decay)), time_first_(std::move(time_first)) {}
  void Absorb(const Tokens& t, int64_t begin, int64_t end, float*) const override {
    const float* time_first = time_first_.data_ptr<float>();
    for (int64_t i = begin * t.steps; i < end * t.steps; ++i) {
      const int64_t row = t.rows[i / t.steps];
      AftRow(t.proj + i * t.proj_width, t.state[0] + row * t.state_row[0], decay_.data(),
             time_first, d_, t.y + i * d_);
    }
  }

 private:
  const int64_t d_;
  const std::vector<float> decay_;  // w = exp(time_decay)
  const torch::Tensor time_first_;  // u, contiguous float32
};

// ---- Sequence form and step

class Aft final : public Mixer {
 public:
  Aft(const ModelConfig& config, const ModelOptions& options) : Mixer(config, options) {}

  std::array<const char*, 3> ProjectionNames() const override { return {"r", "k", "v"}; }
  std::vector<std::pair<std::string, std::vector<int64_t>>> ExtraWeightShapes() const override {
    const int64_t d = config_.d_model;
    return {{"mixer.time_decay", {d}}, {"mixer.time_first", {d}}};
  }
  std::vector<StateTensorSpec> StateSpec() const override {
    return {{"wkv", {3, config_.d_model}}};
  }
  void Bind(const WeightGetter& get) override {
    time_decay_ = get("mixer.time_decay");
    time_first_ = get("mixer.time_first");
  }
  void InitState(torch::Tensor* state) const override {
    state[0].select(1, 2).fill_(kAftInitialLogScale);
  }

  torch::Tensor Forward(const torch::Tensor& a, const torch::Tensor proj[3],
                        torch::Tensor* state) const override {
    const int64_t T = a.size(1), d = config_.d_model;
    torch::Tensor r = torch::sigmoid(proj[0]);
    const torch::Tensor& k = proj[1];
    const torch::Tensor& v = proj[2];
    torch::Tensor& packed = state[0];  // [B, 3, d]
    torch::Tensor alpha = packed.select(1, 0), beta = packed.select(1, 1);
    torch::Tensor scale = packed.select(1, 2).detach();   // p: a reference scale only
    const torch::Tensor decay = torch::exp(time_decay_);  // w > 0, [d]
    const torch::Tensor bonus = time_first_;              // u, [d]
    auto opts = a.options();
    std::vector<torch::Tensor> outputs;
    for (int64_t t0 = 0; t0 < T; t0 += options_.aft_chunk) {
      const int64_t n = std::min(options_.aft_chunk, T - t0);
      torch::Tensor kc = k.narrow(1, t0, n), vc = v.narrow(1, t0, n);
      torch::Tensor tt = torch::arange(n, opts);
      // Log weight of token s in the output at t (both chunk-relative), [n, n, d]:
      // -(t-1-s) w for s < t, u for s = t, -inf for s > t; plus k_s.
      torch::Tensor lag = (tt.unsqueeze(1) - 1 - tt.unsqueeze(0)).unsqueeze(-1);  // [n, n, 1]
      torch::Tensor past = -lag * decay;
      torch::Tensor diagonal = torch::eye(n, opts.dtype(torch::kBool)).unsqueeze(-1);
      torch::Tensor future = (lag < -1);
      torch::Tensor pair_bias = torch::where(diagonal, bonus.expand({n, n, d}), past)
                                    .masked_fill(future, -std::numeric_limits<double>::infinity());
      torch::Tensor log_w = kc.unsqueeze(1) + pair_bias.unsqueeze(0);               // [B, n, n, d]
      torch::Tensor state_log_w = scale.unsqueeze(1) - tt.view({1, n, 1}) * decay;  // [B, n, d]
      torch::Tensor m = torch::maximum(std::get<0>(log_w.max(2)), state_log_w).detach();
      torch::Tensor e = torch::exp(log_w - m.unsqueeze(2));
      torch::Tensor e_state = torch::exp(state_log_w - m);
      torch::Tensor num = (e * vc.unsqueeze(1)).sum(2) + e_state * alpha.unsqueeze(1);
      torch::Tensor den = e.sum(2) + e_state * beta.unsqueeze(1);
      outputs.push_back(num / den);
      // Carry the state past the chunk: token s weighs k_s - (n-1-s) w, the old
      // state p - n w.
      torch::Tensor end_log_w = kc - (n - 1 - tt).view({1, n, 1}) * decay;     // [B, n, d]
      torch::Tensor end_state_log_w = scale - static_cast<double>(n) * decay;  // [B, d]
      torch::Tensor new_scale =
          torch::maximum(std::get<0>(end_log_w.max(1)), end_state_log_w).detach();
      torch::Tensor e_end = torch::exp(end_log_w - new_scale.unsqueeze(1));
      torch::Tensor e_end_state = torch::exp(end_state_log_w - new_scale);
      alpha = (e_end * vc).sum(1) + e_end_state * alpha;
      beta = e_end.sum(1) + e_end_state * beta;
      scale = new_scale;
    }
    packed = torch::stack({alpha, beta, scale}, 1);
    torch::Tensor wkv = outputs.size() == 1 ? outputs[0] : torch::cat(outputs, 1);
    return r * wkv;
  }

  torch::Tensor Step(const torch::Tensor& a, const torch::Tensor proj[3],
                     torch::Tensor* state) const override {
    (void)a;
    torch::Tensor r = torch::sigmoid(proj[0]);
    const torch::Tensor& k = proj[1];
    const torch::Tensor& v = proj[2];
    torch::Tensor& packed = state[0];
    torch::Tensor alpha = packed.select(1, 0), beta = packed.select(1, 1), p = packed.select(1, 2);
    const torch::Tensor decay = torch::exp(time_decay_);
    const torch::Tensor& bonus = time_first_;
    torch::Tensor q = torch::maximum(p, bonus + k);
    torch::Tensor e1 = torch::exp(p - q), e2 = torch::exp(bonus + k - q);
    torch::Tensor wkv = (e1 * alpha + e2 * v) / (e1 * beta + e2);
    torch::Tensor q2 = torch::maximum(p - decay, k);
    e1 = torch::exp(p - decay - q2);
    e2 = torch::exp(k - q2);
    packed = torch::stack({e1 * alpha + e2 * v, e1 * beta + e2, q2}, 1);
    return r * wkv;
  }

  std::unique_ptr<NativeMixer> MakeNative() const override {
    torch::Tensor w = time_decay_.detach().contiguous();
    std::vector<float> decay(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
    for (float& x : decay) x = std::exp(x);
    return std::make_unique<NativeAft>(config_.d_model, std::move(decay),
                                       time_first_.detach().contiguous());
  }

 private:
  torch::Tensor time_decay_, time_first_;  // [d] each
};

}  // namespace

std::unique_ptr<Mixer> MakeAftMixer(const ModelConfig& config, const ModelOptions& options) {
  return std::make_unique<Aft>(config, options);
}

}  // namespace fwmodel
