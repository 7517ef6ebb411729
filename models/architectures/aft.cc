// Mixer `aft` (Attention Free Transformer with a learned exponential time decay):
// per channel, the running weighted sums (alpha, beta) of v and 1 and their log scale
// p, state [3, d] per layer.
//
// On CUDA float32 tensors (without autograd) and where models/gpu built it
// (FWSERVE_CUDA_KERNELS), Step and Forward run the recurrence as one launch of the fused
// kernel (models/gpu/aft.h: the T tokens in order per (session, channel)), instead of
// LibTorch's elementwise ops (Step) and chunked [B, n, n, d] products (Forward).
// Elsewhere LibTorch ops.
#include <algorithm>
#include <cmath>
#include <limits>

#include "models/architectures/mixer.h"
#include "models/architectures/native_math.h"
#include "models/gpu/aft.h"
#include "models/gpu/aft_host.h"
#include "models/gpu/aft_rule.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fwmodel {
namespace {

// Stand-in for p0 = -inf of the aft recurrence: finite, so that p - t*w stays finite
// and exp(p - q) is exactly 0 in float32 and float64.
constexpr double kAftInitialLogScale = -1e30;

// ---- Native row

// One session's (alpha, beta, p) [3, d] absorbs r|k|v = pr[0..3d); y = r ⊙ wkv. The body
// per channel is the CUDA kernel's (models/gpu/aft_rule.h).
FW_VECTOR_KERNEL
void AftRow(const float* __restrict pr, float* __restrict st, const float* __restrict decay,
            const float* __restrict time_first, int64_t d, float* __restrict y) {
  float* __restrict alpha = st;
  float* __restrict beta = st + d;
  float* __restrict p = st + 2 * d;
#pragma omp simd
  for (int64_t ch = 0; ch < d; ++ch) {
    kernels::AftChannelState s{alpha[ch], beta[ch], p[ch]};
    y[ch] =
        kernels::AftChannelToken(pr[ch], pr[d + ch], pr[2 * d + ch], time_first[ch], decay[ch], &s);
    alpha[ch] = s.alpha;
    beta[ch] = s.beta;
    p[ch] = s.p;
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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(proj, state[0])) return FusedRecurrence(proj, state);
#endif
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
#if defined(FWSERVE_CUDA_KERNELS)
    if (FusedApplies(proj, state[0])) return FusedRecurrence(proj, state);
#endif
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
#if defined(FWSERVE_CUDA_KERNELS)
  // Whether the fused kernel may run the recurrence: float32 CUDA projections ([B, d] or
  // [B, T, d]), state and weights, and no autograd graph to record (the kernel has no
  // backward).
  bool FusedApplies(const torch::Tensor proj[3], const torch::Tensor& state) const {
    return proj[0].is_cuda() &&
           KernelInputsOk(proj[0].device(),
                          {&proj[0], &proj[1], &proj[2], &state, &time_decay_, &time_first_});
  }

  // Step's (proj [B, d]) or Forward's (proj [B, T, d]) result by one launch of the fused
  // kernel (AftRecurrenceKernel); state[0] replaced by a new [B, 3, d] tensor (Mixer's
  // contract: replaced, not written).
  torch::Tensor FusedRecurrence(const torch::Tensor proj[3], torch::Tensor* state) const {
    return AftRecurrenceKernel(proj[0], proj[1], proj[2], time_decay_, time_first_, &state[0],
                               "aft");
  }
#endif

  torch::Tensor time_decay_, time_first_;  // [d] each
};

}  // namespace

torch::Tensor AftRecurrenceKernel(const torch::Tensor& r_raw, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& time_decay,
                                  const torch::Tensor& time_first, torch::Tensor* state,
                                  const char* what) {
  const int64_t d = r_raw.size(-1), B = r_raw.size(0);
  const int64_t T = r_raw.dim() == 3 ? r_raw.size(1) : 1;
  TORCH_CHECK((r_raw.dim() == 2 || r_raw.dim() == 3) && r_raw.numel() == B * T * d &&
                  k.sizes() == r_raw.sizes() && v.sizes() == r_raw.sizes() && state->dim() == 3 &&
                  state->size(0) == B && state->size(1) == 3 && state->size(2) == d &&
                  time_decay.numel() == d && time_first.numel() == d,
              what, ": projections ", r_raw.sizes(), " and state ", state->sizes(),
              " do not match");
  const torch::Tensor r = r_raw.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const torch::Tensor decay = torch::exp(time_decay).contiguous();  // w > 0
  const torch::Tensor first = time_first.contiguous();
  const torch::Tensor state_in = state->contiguous();
  torch::Tensor state_out = torch::empty_like(state_in, torch::MemoryFormat::Contiguous);
  torch::Tensor y = torch::empty_like(r, torch::MemoryFormat::Contiguous);
  kernels::AftArgs args;
  args.B = B;
  args.T = T;
  args.d = d;
  args.r = r.data_ptr<float>();
  args.k = kc.data_ptr<float>();
  args.v = vc.data_ptr<float>();
  args.decay = decay.data_ptr<float>();
  args.time_first = first.data_ptr<float>();
  args.state_in = state_in.data_ptr<float>();
  args.state_out = state_out.data_ptr<float>();
  args.y = y.data_ptr<float>();
  if (r.is_cuda()) {
#if defined(FWSERVE_CUDA_KERNELS)
    const c10::cuda::CUDAGuard device(r.device());
    const int error = kernels::LaunchAft(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, what,
                ": the fused recurrence kernel failed: ", kernels::AftErrorString(error));
#else
    TORCH_CHECK(false, what, ": no CUDA kernels in this build");
#endif
  } else {
    TORCH_CHECK(kernels::RunAftOnHost(args), what,
                ": the recurrence kernel's arguments were refused");
  }
  *state = state_out;
  return y;
}

std::unique_ptr<Mixer> MakeAftMixer(const ModelConfig& config, const ModelOptions& options) {
  return std::make_unique<Aft>(config, options);
}

}  // namespace fwmodel
