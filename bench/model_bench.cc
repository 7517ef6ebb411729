// Model-library microbenchmarks (Google Benchmark). Results: docs/benchmarks.md.
//
// Models have the shipped size (d=128, 4 layers, dconv 4) with random weights; speed
// does not depend on the values. Each family has its baseline in the same run:
//   BM_Step            batched recurrent step over B sessions (one token each)
//   BM_StepOneByOne    baseline: the same B sessions stepped one at a time
//   BM_NativeStep      the native step (models/kernels/native_step.h) over B rows of a pool of
//                      2B rows (every other row), state updated in place; baseline:
//                      BM_Step at the same B (LibTorch, which the server used before)
//   BM_NativeStepPkm   the same for aft with block 2's FFN a product-key memory (the
//                      shipped aft_pkm size); baseline BM_StepPkm
//   BM_Prefill         sequence form over a T-token prompt (one session)
//   BM_NativeAbsorb    the native prefill (NativeStep::Absorb) of a T-token prompt, one
//                      session, as the server's prefill thread runs it (T = its chunk);
//                      baseline: BM_Prefill at the same T
//   BM_PrefillByStep   baseline: the same prompt fed token by token
//   BM_Rwkv7NativeAbsorb RWKV-7 0.1B: a 256-token prompt through the native prefill
//                      (BM_Rwkv7NativeAbsorbBf16: on the bf16-rounded model)
//   BM_Rwkv7NativeStep RWKV-7 at the 0.1B G1 shape (random weights): the native step
//                      (models/kernels/native_rwkv.h) over B rows, as BM_NativeStep; counter
//                      "flops": the GEMMs' FLOP per second (head included), to compare
//                      with BM_SgemmPeak's; baseline BM_Rwkv7Step (LibTorch's step)
//   BM_DeltaNetStep, BM_DeltaNetNativeStep, BM_DeltaNetNativeAbsorb: DeltaNet and Gated
//                      DeltaNet at fla-hub's 340M shape (issue 49): LibTorch's step, the
//                      native step (counter "flops" against BM_SgemmPeak) and the native
//                      prefill of 256 tokens (against the native step at batch 1)
//   BM_Rwkv7NativeStepBf16 the same model with its weights rounded to bf16 (as real
//                      checkpoints ship): the kernel keeps them in 16 bits and computes
//                      in float32 (packed_linear.h); baseline BM_Rwkv7NativeStep
//
// Rates are per wall-clock second (UseRealTime): the native step and OpenBLAS run on
// worker threads too, whose CPU time the default (the main thread's CPU time) leaves
// out. Threads: LibTorch's intra-op count, which OMP_NUM_THREADS sets; unset, LibTorch
// picks the number of physical cores it detects (1 on some 2-vCPU VMs).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include "models/architectures/model.h"
#include "models/kernels/native_step.h"

namespace {

using fwmodel::Architecture;

fwmodel::Model MakeModel(int64_t arch_index) {
  static const Architecture kArch[] = {Architecture::kLinearAttention, Architecture::kFastWeight,
                                       Architecture::kAft};
  fwmodel::ModelConfig c;
  c.architecture = kArch[arch_index];
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = 4;
  c.d_ff = 512;
  c.dconv_kernel = 4;
  return std::move(*fwmodel::Model::InitRandom(c, 1));
}

void SetLabel(benchmark::State& state) {
  static const char* kNames[] = {"linear_attention", "fast_weight", "aft"};
  state.SetLabel(kNames[state.range(0)]);
}

// Model::Step (LibTorch) over `batch` sessions, one token each per iteration.
void RunLibTorchStep(benchmark::State& state, const fwmodel::Model& model, int64_t batch) {
  c10::NoGradGuard no_grad;
  fwmodel::State s = model.InitialState(batch);
  torch::Tensor tokens = torch::full({batch}, 65, torch::kInt64);
  for (auto _ : state) {
    torch::Tensor logits = model.StepUnchecked(tokens, &s);
    benchmark::DoNotOptimize(logits.data_ptr<float>());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

void BM_Step(benchmark::State& state) {
  fwmodel::Model model = MakeModel(state.range(0));
  RunLibTorchStep(state, model, state.range(1));
  SetLabel(state);
}

fwmodel::Model MakePkmModel() {
  fwmodel::ModelConfig c;
  c.architecture = Architecture::kAft;
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = 4;
  c.d_ff = 512;
  c.dconv_kernel = 4;
  c.pkm_layers = {2};
  return std::move(*fwmodel::Model::InitRandom(c, 1));
}

void RunNativeStep(benchmark::State& state, const fwmodel::Model& model, int64_t batch,
                   bool packed_gemm = true) {
  c10::NoGradGuard no_grad;
  fwmodel::NativeStepOptions options;
  options.packed_gemm = packed_gemm;
  auto native = fwmodel::NativeStep::Create(model, options);
  if (!native.ok()) return state.SkipWithError("native step unavailable");
  fwmodel::State pool = model.InitialState(2 * batch);
  std::vector<int64_t> tokens(static_cast<size_t>(batch), 65), rows;
  for (int64_t b = 0; b < batch; ++b) rows.push_back(2 * b + 1);
  std::vector<float> logits(static_cast<size_t>(batch * model.config().vocab_size));
  for (auto _ : state) {
    if (!(*native)->Step(tokens, rows, &pool, logits.data()).ok()) {
      return state.SkipWithError("step failed");
    }
    benchmark::DoNotOptimize(logits.data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

void BM_NativeStep(benchmark::State& state) {
  fwmodel::Model model = MakeModel(state.range(0));
  RunNativeStep(state, model, state.range(1));
  SetLabel(state);
}

// The same step with every projection on cblas_sgemm (--native-gemm openblas): the
// baseline of the libxsmm kernels (models/kernels/packed_linear.h).
void BM_NativeStepOpenBlas(benchmark::State& state) {
  fwmodel::Model model = MakeModel(state.range(0));
  RunNativeStep(state, model, state.range(1), /*packed_gemm=*/false);
  SetLabel(state);
}

void BM_NativeStepPkm(benchmark::State& state) {
  fwmodel::Model model = MakePkmModel();
  RunNativeStep(state, model, state.range(0));
  state.SetLabel("aft_pkm");
}

void BM_StepPkm(benchmark::State& state) {
  fwmodel::Model model = MakePkmModel();
  RunLibTorchStep(state, model, state.range(0));
  state.SetLabel("aft_pkm");
}

void BM_StepOneByOne(benchmark::State& state) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = MakeModel(state.range(0));
  const int64_t batch = state.range(1);
  std::vector<fwmodel::State> sessions;
  for (int64_t i = 0; i < batch; ++i) sessions.push_back(model.InitialState(1));
  torch::Tensor token = torch::full({1}, 65, torch::kInt64);
  for (auto _ : state) {
    for (auto& s : sessions) {
      torch::Tensor logits = model.StepUnchecked(token, &s);
      benchmark::DoNotOptimize(logits.data_ptr<float>());
    }
  }
  state.SetItemsProcessed(state.iterations() * batch);
  SetLabel(state);
}

void BM_Prefill(benchmark::State& state) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = MakeModel(state.range(0));
  const int64_t steps = state.range(1);
  torch::Tensor tokens = torch::randint(256, {1, steps}, torch::kInt64);
  for (auto _ : state) {
    fwmodel::State s = model.InitialState(1);
    torch::Tensor logits = model.ForwardUnchecked(tokens, &s);
    benchmark::DoNotOptimize(logits.data_ptr<float>());
  }
  state.SetItemsProcessed(state.iterations() * steps);
  SetLabel(state);
}

// One session of `model` absorbs a prompt of `steps` tokens through the native prefill
// (NativeStep::Absorb); items = prompt tokens.
void RunNativeAbsorb(benchmark::State& state, const fwmodel::Model& model, int64_t steps,
                     bool packed_gemm) {
  c10::NoGradGuard no_grad;
  fwmodel::NativeStepOptions options;
  options.packed_gemm = packed_gemm;
  auto native = fwmodel::NativeStep::Create(model, options);
  if (!native.ok()) return state.SkipWithError("native step unavailable");
  fwmodel::State pool = model.InitialState(1);
  const int64_t vocab = model.config().vocab_size;
  std::vector<int64_t> tokens(static_cast<size_t>(steps)), rows = {0};
  for (int64_t t = 0; t < steps; ++t) tokens[static_cast<size_t>(t)] = (t * 977) % vocab;
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (auto _ : state) {
    if (!(*native)->Absorb(tokens, steps, rows, &pool, logits.data()).ok()) {
      return state.SkipWithError("absorb failed");
    }
    benchmark::DoNotOptimize(logits.data());
  }
  state.SetItemsProcessed(state.iterations() * steps);
}

void BM_NativeAbsorb(benchmark::State& state) {
  fwmodel::Model model = MakeModel(state.range(0));
  RunNativeAbsorb(state, model, state.range(1), /*packed_gemm=*/true);
  SetLabel(state);
}
void BM_NativeAbsorbOpenBlas(benchmark::State& state) {
  fwmodel::Model model = MakeModel(state.range(0));
  RunNativeAbsorb(state, model, state.range(1), /*packed_gemm=*/false);
  SetLabel(state);
}

void BM_PrefillByStep(benchmark::State& state) {
  c10::NoGradGuard no_grad;
  fwmodel::Model model = MakeModel(state.range(0));
  const int64_t steps = state.range(1);
  torch::Tensor tokens = torch::randint(256, {steps}, torch::kInt64);
  for (auto _ : state) {
    fwmodel::State s = model.InitialState(1);
    for (int64_t t = 0; t < steps; ++t) {
      torch::Tensor logits = model.StepUnchecked(tokens.narrow(0, t, 1), &s);
      benchmark::DoNotOptimize(logits.data_ptr<float>());
    }
  }
  state.SetItemsProcessed(state.iterations() * steps);
  SetLabel(state);
}

// RWKV-7 at the 0.1B G1 shape (L 12, C 768, heads of 64, vocabulary 65,536, LoRA ranks
// 64/64/32/128: scripts/bench_mb_sessions.py's "0.1b"), random weights, made once.
const fwmodel::Model& Rwkv7Model() {
  static const fwmodel::Model* const model = [] {
    fwmodel::ModelConfig c;
    c.architecture = Architecture::kRwkv7;
    c.vocab_size = 65536;
    c.tokenizer = "rwkv_world";
    c.bos_token_id = 0;
    c.d_model = 768;
    c.n_layers = 12;
    c.n_heads = 12;
    c.d_ff = 3072;
    c.decay_low_rank_dim = 64;
    c.a_low_rank_dim = 64;
    c.v_low_rank_dim = 32;
    c.gate_low_rank_dim = 128;
    return new fwmodel::Model(std::move(*fwmodel::Model::InitRandom(c, 1)));
  }();
  return *model;
}

// Rwkv7Model with every weight rounded to the nearest bf16 value (held in float32, as
// the loader widens a bf16 checkpoint), made once.
const fwmodel::Model& Rwkv7Bf16Model() {
  static const fwmodel::Model* const model = [] {
    const fwmodel::Model& f32 = Rwkv7Model();
    auto weights = f32.ExportWeights();
    for (auto& [name, t] : weights) t = t.to(torch::kBFloat16).to(torch::kFloat32);
    return new fwmodel::Model(std::move(*fwmodel::Model::Create(f32.config(), std::move(weights))));
  }();
  return *model;
}

// FLOP of the GEMMs of one token's step: every weight matrix multiplied (the head
// included; not the embedding lookup, nor the state's products).
double Rwkv7GemmFlopsPerToken(const fwmodel::Model& model) {
  double macs = 0;
  for (const auto& [name, t] : model.weights()) {
    if (t.dim() == 2 && name != "emb.weight" && name.find("r_k") == std::string::npos) {
      macs += static_cast<double>(t.numel());
    }
  }
  if (model.config().tie_embeddings)
    macs += static_cast<double>(model.weights().at("emb.weight").numel());
  return 2 * macs;
}

void SetRwkv7Counters(benchmark::State& state, int64_t batch) {
  state.SetItemsProcessed(state.iterations() * batch);
  state.counters["flops"] = benchmark::Counter(
      Rwkv7GemmFlopsPerToken(Rwkv7Model()) * batch * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
  state.SetLabel("rwkv7_0.1b");
}

void BM_Rwkv7Step(benchmark::State& state) {
  RunLibTorchStep(state, Rwkv7Model(), state.range(0));
  SetRwkv7Counters(state, state.range(0));
}

void BM_Rwkv7NativeStep(benchmark::State& state) {
  RunNativeStep(state, Rwkv7Model(), state.range(0));
  SetRwkv7Counters(state, state.range(0));
}

// The same with every projection on cblas_sgemm (--native-gemm openblas).
void BM_Rwkv7NativeStepOpenBlas(benchmark::State& state) {
  RunNativeStep(state, Rwkv7Model(), state.range(0), /*packed_gemm=*/false);
  SetRwkv7Counters(state, state.range(0));
}

void BM_Rwkv7NativeStepBf16(benchmark::State& state) {
  RunNativeStep(state, Rwkv7Bf16Model(), state.range(0));
  SetRwkv7Counters(state, state.range(0));
  state.SetLabel("rwkv7_0.1b_bf16");
}

// RWKV-7 at the 0.1B shape: one session absorbs a prompt of range(0) tokens through the
// native prefill (NativeStep::Absorb: every projection once over the prompt); items =
// prompt tokens, against BM_Rwkv7NativeStep/1's one token a step (issue 38: prefill
// >= 8x batch-1 decode).
void BM_Rwkv7NativeAbsorb(benchmark::State& state) {
  RunNativeAbsorb(state, Rwkv7Model(), state.range(0), /*packed_gemm=*/true);
}
// The same on the bf16-rounded model (against BM_Rwkv7NativeStepBf16/1).
void BM_Rwkv7NativeAbsorbBf16(benchmark::State& state) {
  RunNativeAbsorb(state, Rwkv7Bf16Model(), state.range(0), /*packed_gemm=*/true);
}

// DeltaNet at fla-hub's 340M shape (hidden 1024, 24 layers, 8 heads of 128, SwiGLU of
// 2,816, short convolutions of 4, untied head over 32,000 tokens: scripts/gpu/check.py's
// "delta_net-340m"), random weights, made once; Gated: gated_deltanet at the same widths
// with the output gate.
const fwmodel::Model& DeltaNetModel(bool gated) {
  static const fwmodel::Model* models[2] = {nullptr, nullptr};
  const fwmodel::Model*& model = models[gated ? 1 : 0];
  if (model == nullptr) {
    fwmodel::ModelConfig c;
    c.architecture = gated ? Architecture::kGatedDeltaNet : Architecture::kDeltaNet;
    c.ffn = fwmodel::FfnKind::kSwiglu;
    c.vocab_size = 32000;
    c.bos_token_id = 1;
    c.d_model = 1024;
    c.n_layers = 24;
    c.n_heads = 8;
    c.num_v_heads = 8;
    c.head_k_dim = 128;
    c.head_v_dim = 128;
    c.d_ff = 2816;
    c.use_short_conv = true;
    c.conv_size = 4;
    c.use_gate = gated;
    c.norm_eps = 1e-6;
    model = new fwmodel::Model(std::move(*fwmodel::Model::InitRandom(c, 1)));
  }
  return *model;
}

// FLOP of one token's GEMMs (every weight matrix but the embedding, the head included).
double DeltaNetGemmFlopsPerToken(const fwmodel::Model& model) {
  double macs = 0;
  for (const auto& [name, t] : model.weights()) {
    if (t.dim() == 2 && name != "embeddings.weight" && name.find("conv1d") == std::string::npos) {
      macs += static_cast<double>(t.numel());
    }
  }
  return 2 * macs;
}

void SetDeltaNetCounters(benchmark::State& state, bool gated, int64_t batch) {
  state.SetItemsProcessed(state.iterations() * batch);
  state.counters["flops"] = benchmark::Counter(DeltaNetGemmFlopsPerToken(DeltaNetModel(gated)) *
                                                   batch * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate);
  state.SetLabel(gated ? "gated_deltanet_340m" : "delta_net_340m");
}

// range(0): 0 delta_net, 1 gated_deltanet; range(1): batch. LibTorch's Model::Step (the
// baseline) and the native step (models/kernels/native_delta_net.h) over B rows of a
// pool of 2B; counter "flops" against BM_SgemmPeak's.
void BM_DeltaNetStep(benchmark::State& state) {
  RunLibTorchStep(state, DeltaNetModel(state.range(0) == 1), state.range(1));
  SetDeltaNetCounters(state, state.range(0) == 1, state.range(1));
}

void BM_DeltaNetNativeStep(benchmark::State& state) {
  RunNativeStep(state, DeltaNetModel(state.range(0) == 1), state.range(1));
  SetDeltaNetCounters(state, state.range(0) == 1, state.range(1));
}

// One session absorbs a range(1)-token prompt through the native prefill; items = prompt
// tokens, against BM_DeltaNetNativeStep/x/1 (issue 49: prefill >= 8x batch-1 decode).
void BM_DeltaNetNativeAbsorb(benchmark::State& state) {
  RunNativeAbsorb(state, DeltaNetModel(state.range(0) == 1), state.range(1), /*packed_gemm=*/true);
  SetDeltaNetCounters(state, state.range(0) == 1, state.range(1));
}

// The same two with every projection on cblas_sgemm (--native-gemm openblas).
void BM_DeltaNetNativeStepOpenBlas(benchmark::State& state) {
  RunNativeStep(state, DeltaNetModel(state.range(0) == 1), state.range(1), /*packed_gemm=*/false);
  SetDeltaNetCounters(state, state.range(0) == 1, state.range(1));
}

void BM_DeltaNetNativeAbsorbOpenBlas(benchmark::State& state) {
  RunNativeAbsorb(state, DeltaNetModel(state.range(0) == 1), state.range(1), /*packed_gemm=*/false);
  SetDeltaNetCounters(state, state.range(0) == 1, state.range(1));
}

// This machine's sgemm roof (issue 24's target 3): one n x n x n product through
// libblas.so.3 (OpenBLAS, its default threads). Counter "flops": FLOP per second.
void BM_SgemmPeak(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["flops"] = benchmark::Counter(
      2.0 * n * n * n * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_SgemmPeak)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Step)
    ->ArgsProduct({{0, 1, 2}, {1, 8, 32, 64, 128}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_NativeStep)
    ->ArgsProduct({{0, 1, 2}, {1, 8, 32, 64, 128}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_NativeStepOpenBlas)
    ->ArgsProduct({{0, 1, 2}, {1, 8, 32, 64, 128}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_StepPkm)->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_NativeStepPkm)->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_StepOneByOne)
    ->ArgsProduct({{0, 1, 2}, {8, 32}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_Prefill)
    ->ArgsProduct({{0, 1, 2}, {64, 256, 512}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_NativeAbsorb)
    ->ArgsProduct({{0, 1, 2}, {256}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_NativeAbsorbOpenBlas)
    ->ArgsProduct({{0, 1, 2}, {256}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_PrefillByStep)
    ->ArgsProduct({{0, 1, 2}, {64}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

BENCHMARK(BM_Rwkv7Step)->Arg(1)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Rwkv7NativeStep)
    ->Arg(1)
    ->Arg(16)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Rwkv7NativeStepBf16)
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DeltaNetStep)
    ->ArgsProduct({{0, 1}, {1, 64}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DeltaNetNativeStep)
    ->ArgsProduct({{0, 1}, {1, 64}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DeltaNetNativeAbsorb)
    ->ArgsProduct({{0, 1}, {256}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DeltaNetNativeStepOpenBlas)
    ->ArgsProduct({{0, 1}, {64}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DeltaNetNativeAbsorbOpenBlas)
    ->ArgsProduct({{0, 1}, {256}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Rwkv7NativeStepOpenBlas)
    ->Arg(16)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Rwkv7NativeAbsorb)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Rwkv7NativeAbsorbBf16)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
