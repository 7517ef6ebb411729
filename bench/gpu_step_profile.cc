// Where a CUDA decode step's time goes (issue 50): for each batch size, a model's step run
// eagerly (Model::StepUnchecked) and as the server runs it (an in-place GraphedStep that
// samples inside its replay), timed over many steps, then a few steps of each recorded by
// LibTorch's Kineto profiler into Chrome traces that scripts/gpu/profile_summary.py sums
// per kernel. Built only with a CUDA LibTorch (scripts/gpu/build.sh); run by
// scripts/gpu/profile.sh.
//
//   gpu_step_profile MODEL_DIR OUT_DIR [BATCH...]      (default batches: 1 64)
//
// Prints one line per (batch, form): mean wall time per step (host, synchronised) and
// the GraphedStep's device time; writes OUT_DIR/trace-{eager,graph}-B.json. Then the
// prefill the server runs on a GPU (Model::Prefill, one session, GPU_PROFILE_PREFILL
// tokens, 1,024 by default, 0 skips; in pieces of GPU_PROFILE_PREFILL_CHUNK, the
// server's --prefill-chunk-tokens, 256 by default): its tokens/s and
// OUT_DIR/trace-prefill.json. GPU_PROFILE_MATRICES=bf16 loads the model with its matrices
// in bf16 (--gpu-matrices; RWKV-7 only).
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "models/checkpoints/checkpoint.h"
#include "models/kernels/graphed_step.h"

namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

constexpr int kTimedSteps = 50;
constexpr int kTracedSteps = 5;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `step` kTimedSteps times (after 3 warm-up runs), then kTracedSteps under Kineto,
// saving the trace to `trace_path`. Returns the mean wall time of a timed step in ms.
template <typename StepFn>
double TimeAndTrace(StepFn step, const std::string& trace_path) {
  for (int i = 0; i < 3; ++i) step();
  torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kTimedSteps; ++i) step();
  torch::cuda::synchronize();
  const double ms = SecondsSince(start) * 1e3 / kTimedSteps;
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities = {ActivityType::CPU, ActivityType::CUDA};
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  for (int i = 0; i < kTracedSteps; ++i) step();
  torch::cuda::synchronize();
  profiler::disableProfiler()->save(trace_path);
  return ms;
}

int Run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: gpu_step_profile MODEL_DIR OUT_DIR [BATCH...]\n");
    return 2;
  }
  const std::string model_dir = argv[1];
  const std::string out_dir = argv[2];
  std::vector<int64_t> batches;
  for (int i = 3; i < argc; ++i) batches.push_back(std::stoll(argv[i]));
  if (batches.empty()) batches = {1, 64};
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "gpu_step_profile: no CUDA device\n");
    return 1;
  }
  fwmodel::ModelOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  const char* matrices = std::getenv("GPU_PROFILE_MATRICES");
  options.bf16_matrices = matrices != nullptr && std::string(matrices) == "bf16";
  auto loaded = fwmodel::LoadCheckpoint(model_dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "gpu_step_profile: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  const fwmodel::Model& model = loaded->model;
  c10::NoGradGuard no_grad;
  std::printf("steps per timing: %d, traced steps: %d\n", kTimedSteps, kTracedSteps);
  for (const int64_t batch : batches) {
    // Eager: the LibTorch step the graph captures, without sampling.
    fwmodel::State state = model.InitialState(batch);
    const torch::Tensor tokens =
        torch::full({batch}, 65, torch::TensorOptions().dtype(torch::kInt64).device(options.device));
    const double eager_ms =
        TimeAndTrace([&] { (void)model.StepUnchecked(tokens, &state); },
                     out_dir + "/trace-eager-" + std::to_string(batch) + ".json");
    // As served: in place on a pool of batch + 1 rows (the last one the pad row), each
    // step sampling every row at temperature 0.8 (fwbench's setting) inside the replay.
    fwmodel::State pool = model.InitialState(batch + 1);
    torch::Tensor pool_logits = torch::zeros(
        {batch + 1, model.config().vocab_size},
        torch::TensorOptions().dtype(torch::kFloat32).device(options.device));
    fwmodel::GraphedStepOptions graph_options;
    graph_options.buckets = {batch};
    auto graphed = fwmodel::GraphedStep::Create(
        model, graph_options, fwmodel::PoolBinding{&pool, &pool_logits, batch});
    if (!graphed.ok()) {
      std::fprintf(stderr, "gpu_step_profile: %s\n", graphed.status().ToString().c_str());
      return 1;
    }
    std::vector<int64_t> host_tokens(batch, 65);
    std::vector<int64_t> rows(batch);
    for (int64_t b = 0; b < batch; ++b) rows[b] = b;
    fwserve::SamplingParams params;
    params.temperature = 0.8;
    std::mt19937_64 rng(1);
    std::vector<fwmodel::RowDraw> draws(batch);
    double device_ms = 0;
    const double graph_ms = TimeAndTrace(
        [&] {
          for (auto& draw : draws) {
            draw.params = &params;
            draw.uniform = fwserve::CanonicalDraw(rng);
          }
          auto sampled = (*graphed)->StepInPlace(host_tokens, rows, draws);
          if (!sampled.ok()) {
            std::fprintf(stderr, "gpu_step_profile: %s\n", sampled.status().ToString().c_str());
            std::exit(1);
          }
          device_ms = absl::ToDoubleMilliseconds((*graphed)->last_step_time());
        },
        out_dir + "/trace-graph-" + std::to_string(batch) + ".json");
    std::printf(
        "batch %4lld: eager step %.3f ms (no sampling); graph step %.3f ms wall, %.3f ms "
        "device (sampling included, captured: %s)\n",
        static_cast<long long>(batch), eager_ms, graph_ms, device_ms,
        (*graphed)->captured() ? "yes" : "no");
    std::fflush(stdout);
  }
  const char* prefill_env = std::getenv("GPU_PROFILE_PREFILL");
  const char* chunk_env = std::getenv("GPU_PROFILE_PREFILL_CHUNK");
  const int64_t prefill_tokens = prefill_env != nullptr ? std::atoll(prefill_env) : 1024;
  const int64_t chunk = std::max<int64_t>(1, chunk_env != nullptr ? std::atoll(chunk_env) : 256);
  if (prefill_tokens > 0) {
    // Byte-like ids below every vocabulary's 256, as a prompt of text.
    torch::Tensor prompt = torch::randint(32, 127, {1, prefill_tokens},
                                          torch::TensorOptions().dtype(torch::kInt64));
    fwmodel::State state = model.InitialState(1);
    const double ms = TimeAndTrace(
        [&] {
          for (int64_t t0 = 0; t0 < prefill_tokens; t0 += chunk) {
            auto logits =
                model.Prefill(prompt.narrow(1, t0, std::min(chunk, prefill_tokens - t0)), &state);
            if (!logits.ok()) {
              std::fprintf(stderr, "gpu_step_profile: %s\n", logits.status().ToString().c_str());
              std::exit(1);
            }
          }
        },
        out_dir + "/trace-prefill.json");
    std::printf("prefill of %lld tokens in pieces of %lld: %.3f ms, %.0f tokens/s\n",
                static_cast<long long>(prefill_tokens), static_cast<long long>(chunk), ms,
                prefill_tokens / (ms / 1e3));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
