// DeltaNet and Gated DeltaNet (docs/models.md, models/architectures/delta_net.h): the
// model against an independent float64 reference written here from the equations (per
// token, per head, plain loops), the sequence form equal to the steps, the config keys,
// and the strict loading of fla-layout directories.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/checkpoints/hf_checkpoint.h"
#include "models/checkpoints/safetensors.h"
#include "models/kernels/graphed_step.h"
#include "models/kernels/native_step.h"
#include "models/kernels/scoring.h"
#include "nlohmann/json.hpp"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_models.h"

namespace fwmodel {
namespace {

// ---------------------------------------------------------------------------
// The reference: the issue's equations, one session, one token at a time, in double.

// The shape of one model, as the reference reads it (not ModelConfig's accessors).
struct DnShape {
  bool gated = false;
  int64_t D = 0, L = 0, H = 0, HV = 0, K = 0, V = 0, F = 0, W = 0, vocab = 256;
  bool conv = true, gate = false, beta = true, neg = false, tied = false;
  std::string act = "silu", norm = "l2";
  double eps = 1e-5;
};

using DnVec = std::vector<double>;

// Weights as row-major doubles, by our names.
class DnWeights {
 public:
  explicit DnWeights(const std::map<std::string, torch::Tensor>& weights) {
    for (const auto& [name, t] : weights) {
      torch::Tensor c = t.detach().to(torch::kFloat64).contiguous();
      values_[name] = DnVec(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
    }
  }
  const DnVec& operator()(const std::string& name) const { return values_.at(name); }

 private:
  std::map<std::string, DnVec> values_;
};

// y = W x for W [rows, cols] row-major.
DnVec DnMatVec(const DnVec& w, const DnVec& x) {
  const size_t cols = x.size(), rows = w.size() / cols;
  DnVec y(rows, 0.0);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  }
  return y;
}

DnVec DnRms(const DnVec& x, const DnVec& w, double eps) {
  double squares = 0;
  for (double v : x) squares += v * v;
  const double inv = 1.0 / std::sqrt(squares / static_cast<double>(x.size()) + eps);
  DnVec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

double DnSilu(double x) { return x / (1.0 + std::exp(-x)); }
double DnSigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// One session's state: per layer S[j][a][b] (value head j, key channel a, value channel
// b) and the three convolutions' last W − 1 inputs, oldest first.
struct DnRefState {
  std::vector<DnVec> S;                  // per layer, [HV · K · V]
  std::vector<std::vector<DnVec>> hist;  // per layer, per q/k/v: [(W − 1) · C]
};

DnRefState DnFresh(const DnShape& s) {
  DnRefState state;
  for (int64_t l = 0; l < s.L; ++l) {
    state.S.push_back(DnVec(static_cast<size_t>(s.HV * s.K * s.V), 0.0));
    const int64_t widths[3] = {s.H * s.K, s.H * s.K, s.HV * s.V};
    std::vector<DnVec> hist;
    for (int64_t width : widths) {
      hist.push_back(DnVec(static_cast<size_t>(s.conv ? (s.W - 1) * width : 0), 0.0));
    }
    state.hist.push_back(hist);
  }
  return state;
}

// The causal depthwise convolution of the current input `x` with the history (the
// current token on the last tap); shifts x into the history.
DnVec DnConv(const DnVec& x, const DnVec& w, int64_t W, DnVec* hist) {
  const size_t C = x.size();
  DnVec y(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j + 1 < W; ++j) {
      y[c] += w[c * static_cast<size_t>(W) + static_cast<size_t>(j)] *
              (*hist)[static_cast<size_t>(j) * C + c];
    }
    y[c] += w[c * static_cast<size_t>(W) + static_cast<size_t>(W - 1)] * x[c];
  }
  for (int64_t j = 0; j + 2 < W; ++j) {
    for (size_t c = 0; c < C; ++c) {
      (*hist)[static_cast<size_t>(j) * C + c] = (*hist)[static_cast<size_t>(j + 1) * C + c];
    }
  }
  for (size_t c = 0; c < C; ++c) (*hist)[static_cast<size_t>(W - 2) * C + c] = x[c];
  return y;
}

double DnAct(const std::string& act, double x) {
  if (act == "silu") return DnSilu(x);
  if (act == "relu") return x > 0 ? x : 0.0;
  if (act == "elu") return (x > 0 ? x : std::expm1(x)) + 1.0;
  return x;
}

// The logits after `token`; advances `state`.
DnVec DnReferenceStep(const DnShape& s, const DnWeights& w, int64_t token, DnRefState* state) {
  const size_t D = static_cast<size_t>(s.D);
  DnVec h(w("embeddings.weight").begin() + static_cast<int64_t>(token * s.D),
          w("embeddings.weight").begin() + static_cast<int64_t>((token + 1) * s.D));
  for (int64_t l = 0; l < s.L; ++l) {
    const std::string p = absl::StrCat("blocks.", l, ".");
    const DnVec x = DnRms(h, w(p + "attn_norm.weight"), s.eps);
    DnVec q = DnMatVec(w(p + "attn.q_proj.weight"), x);
    DnVec k = DnMatVec(w(p + "attn.k_proj.weight"), x);
    DnVec v = DnMatVec(w(p + "attn.v_proj.weight"), x);
    if (s.conv) {
      q = DnConv(q, w(p + "attn.q_conv1d.weight"), s.W, &state->hist[l][0]);
      k = DnConv(k, w(p + "attn.k_conv1d.weight"), s.W, &state->hist[l][1]);
      v = DnConv(v, w(p + "attn.v_conv1d.weight"), s.W, &state->hist[l][2]);
    }
    for (double& e : q) e = DnAct(s.act, e);
    for (double& e : k) e = DnAct(s.act, e);
    for (double& e : v) e = DnSilu(e);
    for (int64_t i = 0; i < s.H; ++i) {  // per q/k head
      for (DnVec* qk : {&q, &k}) {
        double total = 0;
        for (int64_t a = 0; a < s.K; ++a) {
          const double e = (*qk)[static_cast<size_t>(i * s.K + a)];
          total += s.norm == "l2" ? e * e : e;
        }
        const double divisor = s.norm == "l2" ? std::sqrt(total + 1e-6) : total;
        for (int64_t a = 0; a < s.K; ++a) (*qk)[static_cast<size_t>(i * s.K + a)] /= divisor;
      }
      for (int64_t a = 0; a < s.K; ++a) {
        q[static_cast<size_t>(i * s.K + a)] /= std::sqrt(static_cast<double>(s.K));
      }
    }
    DnVec beta(static_cast<size_t>(s.HV), 1.0);
    if (s.beta) {
      const DnVec b = DnMatVec(w(p + "attn.b_proj.weight"), x);
      for (int64_t j = 0; j < s.HV; ++j) beta[static_cast<size_t>(j)] = DnSigmoid(b[j]);
    }
    if (s.neg) {
      for (double& b : beta) b *= 2.0;
    }
    DnVec gx;
    if (s.gate) gx = DnMatVec(w(p + "attn.g_proj.weight"), x);
    DnVec a_in;
    if (s.gated) a_in = DnMatVec(w(p + "attn.a_proj.weight"), x);
    DnVec o_all(static_cast<size_t>(s.HV * s.V));
    DnVec& S = state->S[static_cast<size_t>(l)];
    for (int64_t j = 0; j < s.HV; ++j) {
      const int64_t i = j / (s.HV / s.H);  // the q/k head of value head j
      auto Sat = [&](int64_t a, int64_t b) -> double& {
        return S[static_cast<size_t>((j * s.K + a) * s.V + b)];
      };
      if (s.gated) {
        const double z = a_in[static_cast<size_t>(j)] + w(p + "attn.dt_bias")[j];
        const double softplus = z > 20 ? z : std::log1p(std::exp(z));
        const double g = -std::exp(w(p + "attn.A_log")[j]) * softplus;
        for (int64_t a = 0; a < s.K; ++a) {
          for (int64_t b = 0; b < s.V; ++b) Sat(a, b) *= std::exp(g);
        }
      }
      const double* kh = &k[static_cast<size_t>(i * s.K)];
      const double* qh = &q[static_cast<size_t>(i * s.K)];
      const double* vh = &v[static_cast<size_t>(j * s.V)];
      DnVec u(static_cast<size_t>(s.V));
      for (int64_t b = 0; b < s.V; ++b) {
        double read = 0;  // (Sᵀk)_b
        for (int64_t a = 0; a < s.K; ++a) read += Sat(a, b) * kh[a];
        u[static_cast<size_t>(b)] = beta[static_cast<size_t>(j)] * (vh[b] - read);
      }
      for (int64_t a = 0; a < s.K; ++a) {
        for (int64_t b = 0; b < s.V; ++b) Sat(a, b) += kh[a] * u[static_cast<size_t>(b)];
      }
      DnVec o(static_cast<size_t>(s.V), 0.0);
      for (int64_t b = 0; b < s.V; ++b) {
        for (int64_t a = 0; a < s.K; ++a) o[static_cast<size_t>(b)] += Sat(a, b) * qh[a];
      }
      o = DnRms(o, w(p + "attn.o_norm.weight"), s.eps);
      for (int64_t b = 0; b < s.V; ++b) {
        double e = o[static_cast<size_t>(b)];
        if (s.gate) e *= DnSilu(gx[static_cast<size_t>(j * s.V + b)]);
        o_all[static_cast<size_t>(j * s.V + b)] = e;
      }
    }
    const DnVec attn = DnMatVec(w(p + "attn.o_proj.weight"), o_all);
    for (size_t c = 0; c < D; ++c) h[c] += attn[c];
    const DnVec y = DnRms(h, w(p + "mlp_norm.weight"), s.eps);
    DnVec gate = DnMatVec(w(p + "mlp.gate_proj.weight"), y);
    const DnVec up = DnMatVec(w(p + "mlp.up_proj.weight"), y);
    for (size_t f = 0; f < gate.size(); ++f) gate[f] = DnSilu(gate[f]) * up[f];
    const DnVec mlp = DnMatVec(w(p + "mlp.down_proj.weight"), gate);
    for (size_t c = 0; c < D; ++c) h[c] += mlp[c];
  }
  return DnMatVec(w(s.tied ? "embeddings.weight" : "lm_head.weight"),
                  DnRms(h, w("norm.weight"), s.eps));
}

// ---------------------------------------------------------------------------
// Cases

struct DnCase {
  std::string name;
  DnShape shape;
};

// gtest's name for a case in its messages.
void PrintTo(const DnCase& c, std::ostream* os) { *os << c.name; }

ModelConfig DnConfig(const DnShape& s) {
  ModelConfig c;
  c.architecture = s.gated ? Architecture::kGatedDeltaNet : Architecture::kDeltaNet;
  c.ffn = FfnKind::kSwiglu;
  c.vocab_size = static_cast<int>(s.vocab);
  c.d_model = static_cast<int>(s.D);
  c.n_layers = static_cast<int>(s.L);
  c.n_heads = static_cast<int>(s.H);
  c.num_v_heads = static_cast<int>(s.HV);
  c.head_k_dim = static_cast<int>(s.K);
  c.head_v_dim = static_cast<int>(s.V);
  c.d_ff = static_cast<int>(s.F);
  c.use_short_conv = s.conv;
  c.conv_size = static_cast<int>(s.W);
  c.use_gate = s.gate;
  c.use_beta = s.beta;
  c.allow_neg_eigval = s.neg;
  c.qk_activation = s.act;
  c.qk_norm = s.norm;
  c.norm_eps = s.eps;
  c.tie_embeddings = s.tied;
  return c;
}

std::vector<DnCase> DnCases() {
  std::vector<DnCase> cases;
  DnShape base;  // delta_net, fla's defaults but small
  base.D = 24, base.L = 2, base.H = 3, base.HV = 3, base.K = 8, base.V = 8, base.F = 40;
  base.W = 4;
  cases.push_back({"delta_net", base});
  DnShape gate = base;
  gate.gate = true, gate.V = 12, gate.act = "identity", gate.W = 2, gate.tied = true;
  cases.push_back({"delta_net_gate_identity_conv2_tied", gate});
  DnShape variant = base;  // elu + 1 keeps the sum norm away from 0
  variant.gate = true, variant.conv = false, variant.act = "elu", variant.norm = "sum";
  variant.beta = false, variant.neg = true;
  cases.push_back({"delta_net_gate_elu_sum_nobeta_negeig_noconv", variant});
  DnShape relu = base;
  relu.act = "relu", relu.eps = 1e-6;
  cases.push_back({"delta_net_relu", relu});
  DnShape gated = base;
  gated.gated = true, gated.gate = true, gated.H = 2, gated.HV = 2, gated.K = 8, gated.V = 16;
  cases.push_back({"gated_deltanet", gated});
  DnShape gva = gated;  // num_v_heads > num_heads
  gva.gate = false, gva.HV = 4, gva.V = 6, gva.W = 3;
  cases.push_back({"gated_deltanet_nogate_v4_of_2", gva});
  DnShape gva3 = gated;  // no convolution: the heads' mapping alone
  gva3.H = 2, gva3.HV = 6, gva3.conv = false, gva3.neg = true, gva3.K = 12, gva3.V = 8;
  cases.push_back({"gated_deltanet_v6_of_2_noconv_negeig", gva3});
  return cases;
}

// Every weight random (conv taps, gates and decays included), so that no part of the
// block is trivially the identity; norms around 1.
std::map<std::string, torch::Tensor> DnRandomWeights(const ModelConfig& config, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  std::map<std::string, torch::Tensor> weights;
  for (const auto& [name, shape] : ExpectedWeightShapes(config)) {
    torch::Tensor t = torch::randn(shape, generator, torch::kFloat32);
    if (name.find("norm.weight") != std::string::npos) {
      t = 1.0 + 0.2 * t;
    } else if (name.find("conv1d") != std::string::npos ||
               name.find("A_log") != std::string::npos ||
               name.find("dt_bias") != std::string::npos) {
      t = 0.5 * t;
    } else {
      t = t / std::sqrt(static_cast<double>(shape.back()));
    }
    weights[name] = t;
  }
  return weights;
}

Model DnModel(const ModelConfig& config, const std::map<std::string, torch::Tensor>& weights,
              torch::ScalarType dtype) {
  ModelOptions options;
  options.dtype = dtype;
  auto model = Model::Create(config, weights, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(*model);
}

torch::Tensor DnToTensor(const DnVec& v) {
  return torch::tensor(std::vector<double>(v), torch::kFloat64);
}

class DeltaNetReferenceTest : public testing::TestWithParam<DnCase> {};

// Two sessions with distinct tokens: a 7-token prompt by the sequence form from a fresh
// state, then 3 steps and a 4-token Forward continuing it; every position's logits against
// the reference (float32 within 1e-4, float64 within 1e-9, relative to the largest logit),
// and the states at the end.
TEST_P(DeltaNetReferenceTest, LogitsMatchTheReferenceFreshAndContinued) {
  const DnShape& s = GetParam().shape;
  const ModelConfig config = DnConfig(s);
  ASSERT_TRUE(config.Validate().ok()) << config.Validate();
  const auto weights = DnRandomWeights(config, 3);
  const DnWeights ref_weights(weights);
  const torch::Tensor prompt = fwtest::RandomTokens(2, 7, s.vocab, 5);
  const torch::Tensor more = fwtest::RandomTokens(2, 7, s.vocab, 6);
  // The reference, per session: logits [2, 14, vocab].
  std::vector<DnRefState> ref_states;
  std::vector<torch::Tensor> ref_rows;
  for (int64_t b = 0; b < 2; ++b) {
    DnRefState state = DnFresh(s);
    std::vector<torch::Tensor> logits;
    for (int64_t t = 0; t < 7; ++t) {
      logits.push_back(
          DnToTensor(DnReferenceStep(s, ref_weights, prompt[b][t].item<int64_t>(), &state)));
    }
    for (int64_t t = 0; t < 7; ++t) {
      logits.push_back(
          DnToTensor(DnReferenceStep(s, ref_weights, more[b][t].item<int64_t>(), &state)));
    }
    ref_states.push_back(state);
    ref_rows.push_back(torch::stack(logits));
  }
  const torch::Tensor ref = torch::stack(ref_rows);  // [2, 14, vocab]
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kFloat64}) {
    const double tolerance = dtype == torch::kFloat32 ? 1e-4 : 1e-9;
    const std::string what = torch::toString(dtype);
    c10::NoGradGuard no_grad;
    Model model = DnModel(config, weights, dtype);
    State state = model.InitialState(2);
    auto fresh = model.Forward(prompt, &state);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    fwtest::ExpectNearRelative(*fresh, ref.narrow(1, 0, 7), tolerance, what + " fresh prompt");
    for (int64_t t = 0; t < 3; ++t) {
      auto logits = model.Step(more.select(1, t).contiguous(), &state);
      ASSERT_TRUE(logits.ok()) << logits.status();
      fwtest::ExpectNearRelative(*logits, ref.select(1, 7 + t), tolerance,
                                 absl::StrCat(what, " continued step ", t));
    }
    auto rest = model.Forward(more.narrow(1, 3, 4), &state);
    ASSERT_TRUE(rest.ok()) << rest.status();
    fwtest::ExpectNearRelative(*rest, ref.narrow(1, 10, 4), tolerance, what + " continued form");
    // The state: recurrent_state [HV, K, V], then the conv histories [W − 1, C].
    for (int64_t l = 0; l < s.L; ++l) {
      const size_t first = static_cast<size_t>(l) * (s.conv ? 4 : 1);
      ASSERT_EQ(model.state_spec()[first].name,
                absl::StrCat("blocks.", l, ".attn.recurrent_state"));
      for (int64_t b = 0; b < 2; ++b) {
        fwtest::ExpectNearRelative(
            state.tensors[first][b].reshape({-1}),
            DnToTensor(ref_states[static_cast<size_t>(b)].S[static_cast<size_t>(l)]), tolerance,
            absl::StrCat(what, " state S, layer ", l));
        for (size_t c = 0; s.conv && c < 3; ++c) {
          fwtest::ExpectNearRelative(
              state.tensors[first + 1 + c][b].reshape({-1}),
              DnToTensor(ref_states[static_cast<size_t>(b)].hist[static_cast<size_t>(l)][c]),
              tolerance, absl::StrCat(what, " conv state ", c, ", layer ", l));
        }
      }
    }
  }
  // Not a constant function of the input.
  EXPECT_GT(fwtest::MaxAbsDiff(ref[0][6], ref[1][6]), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(DeltaNet, DeltaNetReferenceTest, testing::ValuesIn(DnCases()),
                         [](const testing::TestParamInfo<DnCase>& info) {
                           return info.param.name;
                         });

class DeltaNetFormsTest : public testing::TestWithParam<DnCase> {};

// A span processed whole, in pieces with the state carried (prefill, then more), and token
// by token gives the same logits and states (float64).
TEST_P(DeltaNetFormsTest, SequenceInPiecesEqualsSteps) {
  const ModelConfig config = DnConfig(GetParam().shape);
  Model model = DnModel(config, DnRandomWeights(config, 7), torch::kFloat64);
  c10::NoGradGuard no_grad;
  const torch::Tensor tokens = fwtest::RandomTokens(2, 9, config.vocab_size, 3);
  State whole = model.InitialState(2);
  auto all = model.Forward(tokens, &whole);
  ASSERT_TRUE(all.ok()) << all.status();
  State pieces = model.InitialState(2);
  auto first = model.Forward(tokens.narrow(1, 0, 4), &pieces);
  auto rest = model.Forward(tokens.narrow(1, 4, 5), &pieces);
  ASSERT_TRUE(first.ok() && rest.ok());
  fwtest::ExpectNearRelative(torch::cat({*first, *rest}, 1), *all, 1e-10, "pieces vs whole");
  State steps = model.InitialState(2);
  std::vector<torch::Tensor> step_logits;
  for (int64_t t = 0; t < 9; ++t) {
    auto logits = model.Step(tokens.select(1, t).contiguous(), &steps);
    ASSERT_TRUE(logits.ok()) << logits.status();
    step_logits.push_back(*logits);
  }
  fwtest::ExpectNearRelative(torch::stack(step_logits, 1), *all, 1e-10, "steps vs whole");
  for (size_t i = 0; i < whole.tensors.size(); ++i) {
    fwtest::ExpectNearRelative(steps.tensors[i], whole.tensors[i], 1e-10,
                               model.state_spec()[i].name);
    fwtest::ExpectNearRelative(pieces.tensors[i], whole.tensors[i], 1e-10,
                               model.state_spec()[i].name);
  }
}

// The graph kernel (eager on the CPU, as the server runs it on a GPU) equals Model::Step.
TEST_P(DeltaNetFormsTest, GraphedStepEqualsModelStep) {
  const ModelConfig config = DnConfig(GetParam().shape);
  Model model = DnModel(config, DnRandomWeights(config, 8), torch::kFloat64);
  c10::NoGradGuard no_grad;
  GraphedStepOptions options;
  options.buckets = {1, 2, 4};
  auto graphed = GraphedStep::Create(model, options);
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  State pool = model.InitialState(5);
  torch::Tensor row_logits = torch::zeros({5, config.vocab_size}, torch::kFloat32);
  std::vector<State> reference = {model.InitialState(1), model.InitialState(1),
                                  model.InitialState(1)};
  const std::vector<int64_t> rows = {3, 0, 4};
  for (int64_t step = 0; step < 4; ++step) {
    std::vector<int64_t> tokens = {(7 * step + 1) % 256, (11 * step + 5) % 256,
                                   (13 * step + 9) % 256};
    auto logits = (*graphed)->Step(tokens, rows, &pool, &row_logits);
    ASSERT_TRUE(logits.ok()) << logits.status();
    for (size_t i = 0; i < rows.size(); ++i) {
      auto expected = model.Step(torch::tensor({tokens[i]}, torch::kInt64), &reference[i]);
      ASSERT_TRUE(expected.ok());
      fwtest::ExpectNearRelative(logits->narrow(0, static_cast<int64_t>(i), 1), *expected, 1e-10,
                                 absl::StrCat("step ", step, ", row ", rows[i]));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DeltaNet, DeltaNetFormsTest, testing::ValuesIn(DnCases()),
                         [](const testing::TestParamInfo<DnCase>& info) {
                           return info.param.name;
                         });

// The native CPU kernel (models/kernels/native_delta_net.h) equals Model::Step (float32)
// within 1e-4 relative for every case: decode row by row in a pool, prefill against token
// by token, scoring against the sequence form, three threads against one.
class DeltaNetNativeTest : public testing::TestWithParam<DnCase> {};

TEST_P(DeltaNetNativeTest, StepAndPrefillEqualModelStep) {
  const ModelConfig config = DnConfig(GetParam().shape);
  Model model = DnModel(config, DnRandomWeights(config, 1), torch::kFloat32);
  auto native = NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  fwtest::ExpectNativeStepEqualsModelStepRowByRow(model, 8, 1e-4);
  fwtest::ExpectAbsorbEqualsSteppingTokenByToken(model, 1e-4);
}

TEST_P(DeltaNetNativeTest, ScoringEqualsTheSequenceForm) {
  const ModelConfig config = DnConfig(GetParam().shape);
  Model model = DnModel(config, DnRandomWeights(config, 2), torch::kFloat32);
  fwtest::ExpectNativeScoreEqualsSequenceForm(model, 1e-4);
}

TEST_P(DeltaNetNativeTest, ThreeThreadsEqualOne) {
  const ModelConfig config = DnConfig(GetParam().shape);
  Model model = DnModel(config, DnRandomWeights(config, 3), torch::kFloat32);
  fwtest::ExpectThreeThreadsEqualOne(model, 11, 12, {2, 7, 5}, 6, 1e-5, GetParam().name);
}

// Weights rounded to bf16 (fla's checkpoints): every projection keeps 16 bits, and the
// step and prefill equal the float32-weight kernel on the same values.
TEST_P(DeltaNetNativeTest, Bf16WeightsStayIn16BitsAndEqualFloat32Weights) {
  const ModelConfig config = DnConfig(GetParam().shape);
  auto weights = DnRandomWeights(config, 4);
  for (auto& [name, t] : weights) t = t.to(torch::kBFloat16).to(torch::kFloat32);
  Model model = DnModel(config, weights, torch::kFloat32);
  NativeStepOptions wide_options;
  wide_options.narrow_weights = false;
  auto narrow = NativeStep::Create(model);
  auto wide = NativeStep::Create(model, wide_options);
  ASSERT_TRUE(narrow.ok() && wide.ok());
  EXPECT_EQ((*narrow)->weight_format(), "bf16");
  EXPECT_EQ((*narrow)->weight_bits(), 16);
  EXPECT_EQ((*wide)->weight_format(), "f32");
  const int64_t vocab = config.vocab_size, batch = 3, steps = 5;
  State pool_narrow = model.InitialState(batch), pool_wide = model.InitialState(batch);
  const std::vector<int64_t> rows = {2, 0, 1};
  const torch::Tensor tokens = fwtest::RandomTokens(batch, steps, vocab, 5);
  std::vector<int64_t> flat(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + batch * steps);
  std::vector<float> a(static_cast<size_t>(batch * vocab)), b(a.size());
  ASSERT_TRUE((*narrow)->Absorb(flat, steps, rows, &pool_narrow, a.data()).ok());
  ASSERT_TRUE((*wide)->Absorb(flat, steps, rows, &pool_wide, b.data()).ok());
  ASSERT_TRUE((*narrow)->Step({1, 2, 3}, rows, &pool_narrow, a.data()).ok());
  ASSERT_TRUE((*wide)->Step({1, 2, 3}, rows, &pool_wide, b.data()).ok());
  fwtest::ExpectNearRelative(torch::from_blob(a.data(), {batch, vocab}),
                             torch::from_blob(b.data(), {batch, vocab}), 1e-5, "logits");
  for (size_t t = 0; t < pool_wide.tensors.size(); ++t) {
    fwtest::ExpectNearRelative(pool_narrow.tensors[t], pool_wide.tensors[t], 1e-5,
                               model.state_spec()[t].name);
  }
}

// Model::ReleaseMatrices, as the server does once the native kernel serves every path:
// the kernels (a decode instance and one sharing its weights, as the server's prefill)
// give the same bits as on an unreleased twin (decode, prefill, Score), and the model's
// LibTorch forms are refused, not wrong.
TEST_P(DeltaNetNativeTest, ReleasedMatricesChangeNothingForTheKernels) {
  c10::NoGradGuard no_grad;
  const ModelConfig config = DnConfig(GetParam().shape);
  const auto weights = DnRandomWeights(config, 6);
  const Model twin = DnModel(config, weights, torch::kFloat32);
  Model released = DnModel(config, weights, torch::kFloat32);
  auto decode_twin = NativeStep::Create(twin);
  auto decode = NativeStep::Create(released);
  ASSERT_TRUE(decode_twin.ok() && decode.ok());
  auto prefill = NativeStep::CreateSharing(**decode, {});
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const int64_t parameters = released.parameter_count();
  released.ReleaseMatrices();
  EXPECT_TRUE(released.matrices_released());
  EXPECT_EQ(released.parameter_count(), parameters);
  for (const auto& [name, t] : released.ExportWeights()) EXPECT_NE(t.dim(), 2) << name;
  const torch::Tensor one = torch::zeros({1}, torch::kInt64);
  State state = released.InitialState(1);
  EXPECT_EQ(released.Step(one, &state).status().code(), absl::StatusCode::kFailedPrecondition);

  const int64_t vocab = config.vocab_size;
  const torch::Tensor random = fwtest::RandomTokens(1, 20, vocab, 47);
  const std::vector<int64_t> tokens(random.data_ptr<int64_t>(), random.data_ptr<int64_t>() + 20);
  State pool = released.InitialState(3), pool_twin = twin.InitialState(3);
  std::vector<float> got(3 * static_cast<size_t>(vocab)), want(got.size());
  const std::vector<int64_t> rows = {2, 0};
  ASSERT_TRUE((*decode)->Step({tokens[0], tokens[1]}, rows, &pool, got.data()).ok());
  ASSERT_TRUE((*decode_twin)->Step({tokens[0], tokens[1]}, rows, &pool_twin, want.data()).ok());
  EXPECT_EQ(got, want) << "decode";
  const auto prompt = absl::MakeConstSpan(tokens).subspan(2, 18);
  ASSERT_TRUE((*prefill)->Absorb(prompt, 9, rows, &pool, got.data()).ok());
  ASSERT_TRUE((*decode_twin)->Absorb(prompt, 9, rows, &pool_twin, want.data()).ok());
  EXPECT_EQ(got, want) << "prefill";
  auto score = ScoreTokens(released, tokens, nullptr, 8, prefill->get());
  auto score_twin = ScoreTokens(twin, tokens, nullptr, 8, decode_twin->get());
  ASSERT_TRUE(score.ok() && score_twin.ok()) << score.status() << score_twin.status();
  EXPECT_EQ(*score, *score_twin) << "score";
  EXPECT_EQ(ScoreTokens(released, tokens).status().code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(DeltaNet, DeltaNetNativeTest, testing::ValuesIn(DnCases()),
                         [](const testing::TestParamInfo<DnCase>& info) {
                           return info.param.name;
                         });

// InitRandom (fwmodel init) and SaveCheckpoint write a model that loads back with the same
// fingerprint and logits; the state is HV·K·V + 3 (W − 1) widths floats a layer.
TEST(DeltaNetModelTest, RandomInitSavesAndLoads) {
  for (const DnCase& c : DnCases()) {
    auto model = Model::InitRandom(DnConfig(c.shape), 5);
    ASSERT_TRUE(model.ok()) << model.status();
    const DnShape& s = c.shape;
    const int64_t conv = s.conv ? (s.W - 1) * (2 * s.H * s.K + s.HV * s.V) : 0;
    EXPECT_EQ(model->state_bytes_per_session(), 4 * s.L * (s.HV * s.K * s.V + conv)) << c.name;
    const std::string dir = fwtest::MakeTempDir("delta-net-save");
    ASSERT_TRUE(SaveCheckpoint(*model, dir).ok());
    auto loaded = LoadCheckpoint(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->model.config(), model->config());
    EXPECT_EQ(loaded->fingerprint, Fingerprint(model->config(), model->ExportWeights()));
    c10::NoGradGuard no_grad;
    State a = model->InitialState(1), b = loaded->model.InitialState(1);
    const torch::Tensor tokens = fwtest::RandomTokens(1, 5, 256, 9);
    const torch::Tensor logits = *model->Forward(tokens, &a);
    EXPECT_EQ(fwtest::MaxAbsDiff(logits, *loaded->model.Forward(tokens, &b)), 0) << c.name;
    EXPECT_TRUE(torch::isfinite(logits).all().item<bool>()) << c.name;
    EXPECT_GT(FlopsPerToken(model->config()), 2 * s.vocab * s.D) << c.name;
  }
}

// ---------------------------------------------------------------------------
// Config

TEST(DeltaNetConfigTest, CanonicalJsonRoundTripsAndHoldsTheResolvedWidths) {
  auto c = ParseModelConfig(R"({"format_version": 1, "architecture": "gated_deltanet",
      "d_model": 64, "n_layers": 2, "n_heads": 3, "num_v_heads": 6, "head_k_dim": 16,
      "d_ff": 96})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ffn, FfnKind::kSwiglu);
  EXPECT_TRUE(c->use_gate);  // fla's default for gated_deltanet
  EXPECT_EQ(c->v_head_dim(), 16);
  const std::string json = ModelConfigToJson(*c);
  for (const char* key : {"\"num_v_heads\": 6", "\"head_k_dim\": 16", "\"head_v_dim\": 16",
                          "\"conv_size\": 4", "\"use_short_conv\": true", "\"ffn\": \"swiglu\""}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " in " << json;
  }
  EXPECT_EQ(json.find("qk_activation"), std::string::npos) << "delta_net's keys only";
  auto again = ParseModelConfig(json);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *c);
  EXPECT_EQ(ModelConfigToJson(*again), json);
  auto delta = ParseModelConfig(R"({"format_version": 1, "architecture": "delta_net",
      "d_model": 32, "n_layers": 1, "n_heads": 4})");
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_FALSE(delta->use_gate);
  EXPECT_EQ(delta->k_head_dim(), 8);
  EXPECT_NE(ModelConfigToJson(*delta).find("\"qk_norm\": \"l2\""), std::string::npos);
}

// The other architectures' canonical JSON (their fingerprints) has none of the new keys.
TEST(DeltaNetConfigTest, OtherArchitecturesJsonIsUnchanged) {
  for (Architecture arch : {Architecture::kAft, Architecture::kFastWeight}) {
    const std::string json = ModelConfigToJson(fwtest::TinyConfig(arch, FfnKind::kRelu, 0));
    for (const char* key : {"num_v_heads", "head_k_dim", "conv_size", "use_gate", "qk_norm",
                            "use_beta", "allow_neg_eigval", "use_short_conv"}) {
      EXPECT_EQ(json.find(key), std::string::npos) << key;
    }
  }
}

TEST(DeltaNetConfigTest, BadValuesAreRefusedNamingTheKey) {
  const std::string head = R"({"format_version": 1, "d_model": 32, "n_layers": 1, "n_heads": 2, )";
  const std::pair<std::string, std::string> cases[] = {
      {R"("architecture": "gated_deltanet", "num_v_heads": 3})", "key 'num_v_heads'"},
      {R"("architecture": "delta_net", "num_v_heads": 4})", "key 'num_v_heads'"},
      {R"("architecture": "delta_net", "conv_size": 1})", "key 'conv_size'"},
      {R"("architecture": "delta_net", "qk_activation": "tanh"})", "key 'qk_activation'"},
      {R"("architecture": "delta_net", "qk_norm": "l1"})", "key 'qk_norm'"},
      {R"("architecture": "gated_deltanet", "qk_norm": "sum"})", "key 'qk_norm'"},
      {R"("architecture": "delta_net", "ffn": "relu"})", "key 'ffn'"},
      {R"("architecture": "delta_net", "dconv_kernel": 3})", "key 'dconv_kernel'"},
      {R"("architecture": "aft", "use_gate": true})", "key 'use_gate'"},
      {R"("architecture": "aft", "ffn": "swiglu"})", "key 'ffn'"},
      {R"("architecture": "rwkv4", "conv_size": 3})", "key 'conv_size'"}};
  for (const auto& [tail, needle] : cases) {
    auto c = ParseModelConfig(head + tail);
    ASSERT_FALSE(c.ok()) << tail;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status();
  }
}

// fla's published configs: DeltaNet 1.3B's widths (expand_k = expand_v = 1, 16 heads of 128)
// and Gated DeltaNet's (6 heads of 256, values twice as wide), tokenizer from the directory.
TEST(DeltaNetConfigTest, FlaConfigsMapToOurs) {
  auto delta = ParseHuggingFaceDeltaNetConfig(R"({"model_type": "delta_net",
      "attn_mode": "chunk", "bos_token_id": 1, "conv_size": 4, "eos_token_id": 2,
      "expand_k": 1, "expand_v": 1, "fuse_cross_entropy": true, "hidden_act": "swish",
      "hidden_ratio": 4, "hidden_size": 2048, "initializer_range": 0.02,
      "intermediate_size": null, "max_position_embeddings": 2048, "norm_eps": 1e-06,
      "norm_first": false, "num_heads": 16, "num_hidden_layers": 24, "qk_activation": "silu",
      "qk_norm": "l2", "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.40.2", "use_beta": true, "use_cache": true, "use_gate": false,
      "use_output_norm": true, "use_short_conv": true, "vocab_size": 32000})",
                                              /*sentencepiece=*/true);
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_EQ(delta->architecture, Architecture::kDeltaNet);
  EXPECT_EQ(delta->k_head_dim(), 128);
  EXPECT_EQ(delta->v_head_dim(), 128);
  EXPECT_EQ(delta->d_ff, 5632);  // 2/3 · 4 · 2048 = 5461, up to a multiple of 256
  EXPECT_EQ(delta->tokenizer, "sentencepiece");
  EXPECT_EQ(delta->bos_token_id, 1);
  EXPECT_EQ(delta->eos_token_id, 2);
  EXPECT_EQ(delta->norm_eps, 1e-6);
  auto gated = ParseHuggingFaceDeltaNetConfig(R"({"model_type": "gated_deltanet",
      "hidden_size": 2048, "num_hidden_layers": 21, "num_heads": 6, "head_dim": 256,
      "expand_v": 2, "vocab_size": 32000, "attn": null, "fuse_norm": true,
      "fuse_swiglu": true})",
                                              /*sentencepiece=*/false);
  ASSERT_TRUE(gated.ok()) << gated.status();
  EXPECT_EQ(gated->v_heads(), 6);
  EXPECT_EQ(gated->v_head_dim(), 512);
  EXPECT_TRUE(gated->use_gate);
  EXPECT_EQ(gated->tokenizer, "bytes");
  EXPECT_EQ(gated->eos_token_id, -1);
  auto expand = ParseHuggingFaceDeltaNetConfig(R"({"model_type": "gated_deltanet",
      "hidden_size": 64, "num_hidden_layers": 1, "head_dim": 16, "expand_v": 1.3,
      "vocab_size": 256})",
                                               false);
  ASSERT_FALSE(expand.ok());
  EXPECT_NE(expand.status().message().find("key 'expand_v'"), std::string::npos);
  auto hybrid = ParseHuggingFaceDeltaNetConfig(R"({"model_type": "delta_net",
      "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 256,
      "attn": {"layers": [1], "num_heads": 2}})",
                                               false);
  ASSERT_FALSE(hybrid.ok());
  EXPECT_NE(hybrid.status().message().find("key 'attn'"), std::string::npos) << hybrid.status();
}

}  // namespace
}  // namespace fwmodel

// ---------------------------------------------------------------------------
// fla-layout directories

namespace fwmodel {
namespace {

std::string DnReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A random model written as fla writes it: fla's config.json keys, "model." names, the
// convolutions as Conv1d weights [C, 1, W]; in F32 or BF16, whole or in shards.
class FlaDeltaNetLayoutTest : public ::testing::Test {
 protected:
  void Use(const DnShape& shape, bool bf16 = false) {
    shape_ = shape;
    config_ = DnConfig(shape);
    config_.bos_token_id = 1;  // as fla's config.json says, so that the fingerprints agree
    weights_ = DnRandomWeights(config_, 21);
    if (bf16) {
      for (auto& [name, t] : weights_) t = t.to(torch::kBFloat16).to(torch::kFloat32);
    }
    bf16_ = bf16;
    tensors_.clear();
    for (const auto& [name, t] : weights_) {
      tensors_[FlaDeltaNetTensorName(name)] =
          name.find("conv1d") != std::string::npos ? t.unsqueeze(1) : t;
    }
    fla_config_ = {
        {"model_type", shape.gated ? "gated_deltanet" : "delta_net"},
        {"hidden_size", shape.D},
        {"num_hidden_layers", shape.L},
        {"num_heads", shape.H},
        {"intermediate_size", nullptr},
        {"hidden_ratio", 4},
        {"hidden_act", "swish"},
        {"use_gate", shape.gate},
        {"use_short_conv", shape.conv},
        {"conv_size", shape.W},
        {"allow_neg_eigval", shape.neg},
        {"norm_eps", shape.eps},
        {"norm_first", false},
        {"attn", nullptr},
        {"attn_mode", "chunk"},
        {"vocab_size", shape.vocab},
        {"tie_word_embeddings", shape.tied},
        {"bos_token_id", 1},
        {"eos_token_id", 2},
        {"pad_token_id", nullptr},
        {"fuse_norm", true},
        {"fuse_swiglu", true},
        {"fuse_cross_entropy", true},
        {"initializer_range", 0.02},
        {"max_position_embeddings", 2048},
        {"use_cache", true},
        {"torch_dtype", bf16 ? "bfloat16" : "float32"},
        {"transformers_version", "4.53.0"},
        {"architectures", {shape.gated ? "GatedDeltaNetForCausalLM" : "DeltaNetForCausalLM"}}};
    if (shape.gated) {
      fla_config_["head_dim"] = shape.K;
      fla_config_["expand_v"] = static_cast<double>(shape.V) / static_cast<double>(shape.K);
      fla_config_["num_v_heads"] = shape.HV;
    } else {
      fla_config_["expand_k"] = static_cast<double>(shape.H * shape.K) / shape.D;
      fla_config_["expand_v"] = static_cast<double>(shape.H * shape.V) / shape.D;
      fla_config_["use_beta"] = shape.beta;
      fla_config_["qk_activation"] = shape.act;
      fla_config_["qk_norm"] = shape.norm;
      fla_config_["use_output_norm"] = true;
    }
  }

  // fla's older GatedMLP: one gate_proj [2F, D], the gate's rows then up's.
  void FuseMlps() {
    for (int64_t l = 0; l < shape_.L; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".mlp.");
      tensors_[p + "gate_proj.weight"] =
          torch::cat({tensors_[p + "gate_proj.weight"], tensors_[p + "up_proj.weight"]}, 0);
      tensors_.erase(p + "up_proj.weight");
    }
  }

  std::string Write(int shards = 1) {
    const std::string dir = fwtest::MakeTempDir("fla-delta-net");
    std::ofstream(dir + "/config.json") << fla_config_.dump(2);
    fwtest::WriteHuggingFaceSafetensors(dir, tensors_, shards, bf16_ ? DType::kBF16 : DType::kF32);
    return dir;
  }

  // Loads `dir` and expects the model the weights came from: the config, the fingerprint
  // and the logits, bit for bit.
  void ExpectSameModel(const std::string& dir) {
    auto loaded = LoadCheckpoint(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(ModelConfigToJson(loaded->model.config()), ModelConfigToJson(config_));
    EXPECT_EQ(loaded->fingerprint, Fingerprint(config_, weights_));
    Model reference = DnModel(config_, weights_, torch::kFloat32);
    c10::NoGradGuard no_grad;
    const torch::Tensor tokens = fwtest::RandomTokens(2, 6, shape_.vocab, 4);
    State a = reference.InitialState(2), b = loaded->model.InitialState(2);
    EXPECT_EQ(
        fwtest::MaxAbsDiff(*reference.Forward(tokens, &a), *loaded->model.Forward(tokens, &b)), 0);
  }

  void ExpectRefused(const std::string& dir, const std::string& needle) {
    auto loaded = LoadCheckpoint(dir);
    ASSERT_FALSE(loaded.ok()) << "accepted; expected an error naming " << needle;
    EXPECT_NE(loaded.status().message().find(needle), std::string::npos) << loaded.status();
    EXPECT_EQ(loaded.status().message().find(dir), std::string::npos) << "leaks the path";
  }

  DnShape shape_;
  ModelConfig config_;
  bool bf16_ = false;
  std::map<std::string, torch::Tensor> weights_;  // ours
  std::map<std::string, torch::Tensor> tensors_;  // fla's, as written
  nlohmann::json fla_config_;
};

DnShape DnCaseShape(const std::string& name) {
  for (const DnCase& c : DnCases()) {
    if (c.name == name) return c.shape;
  }
  ADD_FAILURE() << name;
  return {};
}

TEST_F(FlaDeltaNetLayoutTest, F32Bf16AndShardedLoadAsTheSameModel) {
  for (const DnCase& c : DnCases()) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c.name, bf16 ? " bf16" : " f32"));
      Use(c.shape, bf16);
      ExpectSameModel(Write());
    }
    SCOPED_TRACE(c.name + " sharded");
    Use(c.shape);
    ExpectSameModel(Write(3));
  }
}

TEST_F(FlaDeltaNetLayoutTest, FusedMlpAndUnusedDOfOlderFilesLoad) {
  Use(DnCaseShape("gated_deltanet_nogate_v4_of_2"));
  FuseMlps();
  for (int64_t l = 0; l < shape_.L; ++l) {
    tensors_[absl::StrCat("model.layers.", l, ".attn.D")] = torch::ones({shape_.H});
  }
  ExpectSameModel(Write());
  Use(DnCaseShape("delta_net"));
  FuseMlps();
  fla_config_["intermediate_size"] = shape_.F;
  ExpectSameModel(Write(2));
}

TEST_F(FlaDeltaNetLayoutTest, TiedHeadLoadsWithoutLmHeadAndRefusesOne) {
  Use(DnCaseShape("delta_net_gate_identity_conv2_tied"));
  ASSERT_EQ(tensors_.count("lm_head.weight"), 0u);
  ExpectSameModel(Write());
  tensors_["lm_head.weight"] = torch::zeros({shape_.vocab, shape_.D});
  ExpectRefused(Write(), "tensor 'lm_head.weight' is present but tie_word_embeddings is true");
}

TEST_F(FlaDeltaNetLayoutTest, SentencePieceTokenizerModelSetsTheTokenizer) {
  Use(DnCaseShape("gated_deltanet"));
  const std::string dir = Write();
  std::ofstream(dir + "/tokenizer.model") << "not read by the model loader";
  std::ofstream(dir + "/tokenizer.json") << "{}";
  auto loaded = LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model.config().tokenizer, "sentencepiece");
  EXPECT_EQ(loaded->model.config().bos_token_id, 1);
  EXPECT_EQ(loaded->model.config().eos_token_id, 2);
}

TEST_F(FlaDeltaNetLayoutTest, TokenizerJsonAloneIsRefused) {
  Use(DnCaseShape("delta_net"));
  const std::string dir = Write();
  std::ofstream(dir + "/tokenizer.json") << "{}";
  ExpectRefused(dir, "tokenizer.json");
  ExpectRefused(dir, "needs its SentencePiece tokenizer.model");
}

TEST_F(FlaDeltaNetLayoutTest, DefectsAreRefusedNamingTheKeyOrTensor) {
  Use(DnCaseShape("gated_deltanet"));
  tensors_["model.layers.1.attn.x_x"] = torch::zeros({4});
  ExpectRefused(Write(), "unknown tensor 'model.layers.1.attn.x_x'");
  Use(DnCaseShape("delta_net"));
  tensors_["model.layers.0.attn.D"] = torch::ones({shape_.H});  // only Gated DeltaNet's
  ExpectRefused(Write(), "unknown tensor 'model.layers.0.attn.D'");
  Use(DnCaseShape("gated_deltanet"));
  tensors_["model.layers.1.attn.A_log"] = torch::zeros({3});
  ExpectRefused(Write(), "tensor 'model.layers.1.attn.A_log' has shape [3], expected [2]");
  Use(DnCaseShape("gated_deltanet"));
  tensors_.erase("model.layers.0.attn.k_conv1d.weight");
  ExpectRefused(Write(), "missing tensor 'model.layers.0.attn.k_conv1d.weight'");
  Use(DnCaseShape("gated_deltanet"));
  fla_config_["attn"] = {{"layers", {1}}, {"num_heads", 2}};
  ExpectRefused(Write(), "key 'attn' sets hybrid attention layers");
  Use(DnCaseShape("delta_net"));
  fla_config_["head_dim"] = 8;  // Gated DeltaNet's key
  ExpectRefused(Write(), "key 'head_dim' is unknown");
  Use(DnCaseShape("delta_net"));
  fla_config_["norm_first"] = true;
  ExpectRefused(Write(), "key 'norm_first' must be false");
  Use(DnCaseShape("delta_net"));
  fla_config_["hidden_act"] = "powlu";
  ExpectRefused(Write(), "key 'hidden_act'");
  Use(DnCaseShape("delta_net"));
  fla_config_["intermediate_size"] = shape_.F + 1;
  ExpectRefused(Write(), "tensor 'model.layers.0.mlp.down_proj.weight' has shape");
}

TEST_F(FlaDeltaNetLayoutTest, ShardTensorNotInTheIndexIsRefused) {
  Use(DnCaseShape("delta_net"));
  const std::string dir = Write(2);
  nlohmann::json index = nlohmann::json::parse(DnReadAll(dir + "/model.safetensors.index.json"));
  index["weight_map"].erase("model.norm.weight");
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  ExpectRefused(dir, "tensor 'model.norm.weight' is not listed for this shard");
}

}  // namespace
}  // namespace fwmodel
