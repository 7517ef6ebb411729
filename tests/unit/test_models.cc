#include "tests/unit/test_models.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "models/kernels/native_step.h"
#include "nlohmann/json.hpp"

namespace fwtest {

fwmodel::ModelConfig TinyConfig(fwmodel::Architecture arch, fwmodel::FfnKind ffn, int dconv_kernel,
                                int nu, bool tie) {
  fwmodel::ModelConfig c;
  c.architecture = arch;
  c.ffn = ffn;
  c.dconv_kernel = dconv_kernel;
  c.dpfp_nu = nu;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.d_ff = 24;
  c.tie_embeddings = tie;
  return c;
}

fwmodel::ModelConfig WithPkm(fwmodel::ModelConfig config, int layer) {
  config.pkm_layers = {layer};
  config.pkm_heads = 2;
  config.pkm_num_keys = 5;
  config.pkm_topk = 3;
  config.pkm_dim_key = 6;
  return config;
}

fwmodel::Model RandomModel(const fwmodel::ModelConfig& config, uint64_t seed,
                           torch::ScalarType dtype, double scale, torch::Device device) {
  auto generator = at::detail::createCPUGenerator(seed);
  std::map<std::string, torch::Tensor> weights;
  for (const auto& [name, shape] : fwmodel::ExpectedWeightShapes(config)) {
    torch::Tensor t = torch::randn(shape, generator, torch::kFloat32) * scale;
    if (name.find("norm") != std::string::npos && name.find(".weight") != std::string::npos) {
      t = t * 0.2 + 1.0;
    }
    if (name.find("running_var") != std::string::npos) t = t.abs() + 0.5;
    weights[name] = t;
  }
  fwmodel::ModelOptions options;
  options.dtype = dtype;
  options.device = device;
  options.attention_chunk = 5;  // small chunks: exercise the carry between chunks
  options.aft_chunk = 3;
  auto model = fwmodel::Model::Create(config, weights, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(*model);
}

torch::Tensor RandomTokens(int64_t batch, int64_t steps, int64_t vocab, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  return torch::randint(vocab, {batch, steps}, generator, torch::kInt64);
}

void ExpectNearRelative(const torch::Tensor& a, const torch::Tensor& b, double tolerance,
                        const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double magnitude = 1.0 + b.abs().max().item<double>();
  EXPECT_TRUE(torch::isfinite(a).all().item<bool>()) << what;
  EXPECT_LE(MaxAbsDiff(a, b), tolerance * magnitude) << what;
}

std::string ConfigCaseName(const testing::TestParamInfo<ConfigCase>& info) {
  return info.param.Name();
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

fwmodel::ModelConfig ConfigCase::Config() const {
  if (arch == fwmodel::Architecture::kRwkv7 || arch == fwmodel::Architecture::kRwkv4) {
    fwmodel::ModelConfig config;
    config.architecture = arch;
    config.d_model = d_model;
    config.n_layers = 2;
    config.n_heads = n_heads;
    config.d_ff = d_model * 3 / 2;
    config.vocab_size = 256;
    config.tie_embeddings = d_model < 64;
    if (arch == fwmodel::Architecture::kRwkv7) {
      config.decay_low_rank_dim = 9;
      config.a_low_rank_dim = 8;
      config.v_low_rank_dim = 5;
      config.gate_low_rank_dim = 12;
    }
    return config;
  }
  if (arch == fwmodel::Architecture::kDeltaNet || arch == fwmodel::Architecture::kGatedDeltaNet) {
    // fla's layout at a small width: short convolutions of width 4, the output gate,
    // SwiGLU; n_heads q/k heads of 8 and nu value heads per q/k head (num_v_heads).
    fwmodel::ModelConfig config;
    config.architecture = arch;
    config.ffn = fwmodel::FfnKind::kSwiglu;
    config.d_model = d_model;
    config.n_layers = 2;
    config.n_heads = n_heads;
    config.num_v_heads = n_heads * nu;
    config.head_k_dim = 8;
    config.head_v_dim = 8;
    config.d_ff = d_model * 2;
    config.vocab_size = 256;
    config.use_short_conv = dconv > 0;
    config.conv_size = dconv > 0 ? dconv : 4;
    config.use_gate = true;
    config.tie_embeddings = dconv == 0;
    return config;
  }
  fwmodel::ModelConfig config = TinyConfig(arch, ffn, dconv, nu, /*tie=*/dconv == 0);
  config.d_model = d_model;
  config.n_heads = n_heads;
  return pkm ? WithPkm(config) : config;
}

std::string ConfigCase::Name() const {
  if (arch == fwmodel::Architecture::kRwkv7 || arch == fwmodel::Architecture::kRwkv4) {
    return absl::StrCat(fwmodel::ArchitectureName(arch), "_d", d_model, "_heads", n_heads);
  }
  if (arch == fwmodel::Architecture::kDeltaNet || arch == fwmodel::Architecture::kGatedDeltaNet) {
    return absl::StrCat(fwmodel::ArchitectureName(arch), "_conv", dconv, "_heads", n_heads, "x",
                        nu);
  }
  return absl::StrCat(fwmodel::ArchitectureName(arch), "_", fwmodel::FfnKindName(ffn), "_dconv",
                      dconv, "_nu", nu, pkm ? "_pkm" : "",
                      d_model == 16 ? "" : absl::StrCat("_d", d_model),
                      n_heads == 2 ? "" : absl::StrCat("_heads", n_heads));
}

std::vector<ConfigCase> AllConfigCases() {
  using fwmodel::Architecture;
  using fwmodel::FfnKind;
  std::vector<ConfigCase> cases;
  for (Architecture arch :
       {Architecture::kLinearAttention, Architecture::kFastWeight, Architecture::kAft}) {
    for (FfnKind ffn : {FfnKind::kRelu, FfnKind::kSquaredRelu, FfnKind::kGeglu}) {
      for (int dconv : {0, 3}) {
        for (int nu : {1, 3}) {
          if (nu == 3 && arch != Architecture::kFastWeight) continue;
          cases.push_back({arch, ffn, dconv, nu});
        }
      }
    }
    for (int dconv : {0, 3}) cases.push_back({arch, FfnKind::kGeglu, dconv, 2, /*pkm=*/true});
  }
  return cases;
}

std::vector<ConfigCase> RwkvConfigCases() {
  using fwmodel::Architecture;
  using fwmodel::FfnKind;
  return {
      {Architecture::kRwkv7, FfnKind::kSquaredRelu, 0, 1, false, /*d_model=*/32, /*n_heads=*/4},
      {Architecture::kRwkv7, FfnKind::kSquaredRelu, 0, 1, false, /*d_model=*/64, /*n_heads=*/1},
      {Architecture::kRwkv4, FfnKind::kSquaredRelu, 0, 1, false, /*d_model=*/40, /*n_heads=*/1}};
}

std::vector<ConfigCase> DeltaNetConfigCases() {
  using fwmodel::Architecture;
  using fwmodel::FfnKind;
  return {{Architecture::kDeltaNet, FfnKind::kSwiglu, 4, 1, false, /*d_model=*/32, /*n_heads=*/2},
          {Architecture::kDeltaNet, FfnKind::kSwiglu, 0, 1, false, /*d_model=*/24, /*n_heads=*/3},
          {Architecture::kGatedDeltaNet, FfnKind::kSwiglu, 4, 2, false, /*d_model=*/32,
           /*n_heads=*/2},
          {Architecture::kGatedDeltaNet, FfnKind::kSwiglu, 3, 1, false, /*d_model=*/32,
           /*n_heads=*/4}};
}

void ExpectNativeStepEqualsModelStepRowByRow(const fwmodel::Model& model, int steps,
                                             double tolerance) {
  c10::NoGradGuard no_grad;
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  const int64_t capacity = 8, vocab = model.config().vocab_size;
  fwmodel::State pool = model.InitialState(capacity);
  const fwmodel::State fresh = model.InitialState(1);
  const std::vector<int64_t> session_rows = {6, 0, 3, 5, 1, 2};  // rows 4 and 7 stay unused
  std::vector<fwmodel::State> reference;
  for (size_t s = 0; s < session_rows.size(); ++s) reference.push_back(model.InitialState(1));
  std::mt19937_64 rng(11);
  std::vector<int> absorbed(session_rows.size(), 0);
  for (int step = 0; step < steps; ++step) {
    std::vector<int64_t> sessions;
    for (size_t s = 0; s < session_rows.size(); ++s) {
      if (step < 2 || rng() % 3 != 0) sessions.push_back(static_cast<int64_t>(s));
    }
    std::shuffle(sessions.begin(), sessions.end(), rng);
    std::vector<int64_t> tokens, rows;
    for (int64_t s : sessions) {
      tokens.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)));
      rows.push_back(session_rows[static_cast<size_t>(s)]);
    }
    std::vector<float> logits(tokens.size() * static_cast<size_t>(vocab));
    ASSERT_TRUE((*native)->Step(tokens, rows, &pool, logits.data()).ok());
    for (size_t i = 0; i < sessions.size(); ++i) {
      const size_t s = static_cast<size_t>(sessions[i]);
      auto expected = model.Step(torch::tensor({tokens[i]}, torch::kInt64), &reference[s]);
      ASSERT_TRUE(expected.ok()) << expected.status();
      torch::Tensor got =
          torch::from_blob(logits.data() + i * static_cast<size_t>(vocab), {1, vocab}).clone();
      ExpectNearRelative(got, *expected, tolerance,
                         absl::StrCat("logits, step ", step, ", session ", s));
      ++absorbed[s];
    }
  }
  for (size_t s = 0; s < session_rows.size(); ++s) {
    EXPECT_GT(absorbed[s], 2);
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      ExpectNearRelative(pool.tensors[t].narrow(0, session_rows[s], 1), reference[s].tensors[t],
                         tolerance,
                         absl::StrCat("state ", model.state_spec()[t].name, ", session ", s));
    }
  }
  for (int64_t unused : {4, 7}) {
    for (size_t t = 0; t < pool.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(pool.tensors[t].narrow(0, unused, 1), fresh.tensors[t]))
          << "row " << unused << " was written";
    }
  }
}

void ExpectAbsorbEqualsSteppingTokenByToken(const fwmodel::Model& model, double tolerance) {
  c10::NoGradGuard no_grad;
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  const int64_t steps = 9, vocab = model.config().vocab_size;
  const std::vector<int64_t> rows = {3, 1};
  torch::Tensor tokens = fwtest::RandomTokens(2, steps + 1, vocab, 13);
  fwmodel::State pool = model.InitialState(5);
  fwmodel::State reference = model.InitialState(2);
  torch::Tensor expected;
  for (int64_t t = 0; t < steps; ++t) {
    auto logits = model.Step(tokens.select(1, t).contiguous(), &reference);
    ASSERT_TRUE(logits.ok()) << logits.status();
    expected = *logits;
  }
  torch::Tensor prompt = tokens.narrow(1, 0, steps).contiguous();
  std::vector<int64_t> flat(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + 2 * steps);
  std::vector<float> logits(2 * static_cast<size_t>(vocab));
  ASSERT_TRUE((*native)->Absorb(flat, steps, rows, &pool, logits.data()).ok());
  ExpectNearRelative(torch::from_blob(logits.data(), {2, vocab}).clone(), expected, tolerance,
                     "prefill logits");
  std::vector<int64_t> next = {tokens[0][steps].item<int64_t>(), tokens[1][steps].item<int64_t>()};
  ASSERT_TRUE((*native)->Step(next, rows, &pool, logits.data()).ok());
  auto step_expected = model.Step(tokens.select(1, steps).contiguous(), &reference);
  ASSERT_TRUE(step_expected.ok());
  ExpectNearRelative(torch::from_blob(logits.data(), {2, vocab}).clone(), *step_expected, tolerance,
                     "step logits");
  for (size_t t = 0; t < pool.tensors.size(); ++t) {
    for (int64_t b = 0; b < 2; ++b) {
      ExpectNearRelative(pool.tensors[t].narrow(0, rows[static_cast<size_t>(b)], 1),
                         reference.tensors[t].narrow(0, b, 1), tolerance,
                         absl::StrCat("state ", model.state_spec()[t].name, ", session ", b));
    }
  }
}

void ExpectNativeScoreEqualsSequenceForm(const fwmodel::Model& model, double tolerance) {
  c10::NoGradGuard no_grad;
  auto native = fwmodel::NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  const torch::Tensor random = fwtest::RandomTokens(1, 29, model.config().vocab_size, 17);
  const std::vector<int64_t> all(random.data_ptr<int64_t>(), random.data_ptr<int64_t>() + 29);
  const std::vector<int64_t> first(all.begin(), all.begin() + 23),
      then(all.begin() + 23, all.end());
  fwmodel::ScoringContext on_native, on_sequence;
  for (const std::vector<int64_t>* part : {&first, &then}) {
    auto got = fwmodel::ScoreTokens(model, *part, &on_native, /*chunk=*/7, native->get());
    auto want = fwmodel::ScoreTokens(model, *part, &on_sequence, /*chunk=*/7);
    ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
    ASSERT_EQ(got->size(), part == &first ? 22u : 6u);
    ASSERT_EQ(got->size(), want->size());
    for (size_t i = 0; i < got->size(); ++i) {
      EXPECT_NEAR((*got)[i], (*want)[i], tolerance) << "token " << i << " of " << got->size();
    }
    ExpectNearRelative(on_native.next_logits, on_sequence.next_logits, tolerance, "next logits");
    for (size_t t = 0; t < on_native.state.tensors.size(); ++t) {
      ExpectNearRelative(on_native.state.tensors[t], on_sequence.state.tensors[t], tolerance,
                         absl::StrCat("state ", model.state_spec()[t].name));
    }
  }
}

void ExpectThreeThreadsEqualOne(const fwmodel::Model& model, int64_t sessions, int64_t capacity,
                                const std::vector<int64_t>& prompt_rows, int64_t prompt_tokens,
                                double tolerance, const std::string& label) {
  c10::NoGradGuard no_grad;
  fwmodel::NativeStepOptions one, three;
  one.threads = 1;
  three.threads = 3;
  auto serial = fwmodel::NativeStep::Create(model, one);
  auto parallel = fwmodel::NativeStep::Create(model, three);
  ASSERT_TRUE(serial.ok() && parallel.ok());
  const int64_t vocab = model.config().vocab_size;
  const int64_t prompts = static_cast<int64_t>(prompt_rows.size());
  fwmodel::State pool_serial = model.InitialState(capacity);
  std::mt19937_64 rng(5);
  std::vector<int64_t> rows(static_cast<size_t>(sessions)), tokens(rows.size());
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  for (int64_t& t : tokens) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  std::vector<int64_t> prompt(static_cast<size_t>(prompts * prompt_tokens));
  for (int64_t& t : prompt) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  // Some history first, so the step reads non-initial states.
  std::vector<float> warm(static_cast<size_t>(sessions * vocab));
  ASSERT_TRUE((*serial)->Step(tokens, rows, &pool_serial, warm.data()).ok());
  fwmodel::State pool_parallel = pool_serial.Clone();
  std::vector<float> logits_serial(warm.size()), logits_parallel(warm.size());
  ASSERT_TRUE((*serial)->Step(tokens, rows, &pool_serial, logits_serial.data()).ok());
  ASSERT_TRUE((*parallel)->Step(tokens, rows, &pool_parallel, logits_parallel.data()).ok());
  auto as_tensor = [&](std::vector<float>& v, int64_t n) {
    return torch::from_blob(v.data(), {n, vocab}).clone();
  };
  ExpectNearRelative(as_tensor(logits_parallel, sessions), as_tensor(logits_serial, sessions),
                     tolerance, label + "step logits");
  ASSERT_TRUE((*serial)
                  ->Absorb(prompt, prompt_tokens, prompt_rows, &pool_serial, logits_serial.data())
                  .ok());
  ASSERT_TRUE(
      (*parallel)
          ->Absorb(prompt, prompt_tokens, prompt_rows, &pool_parallel, logits_parallel.data())
          .ok());
  ExpectNearRelative(as_tensor(logits_parallel, prompts), as_tensor(logits_serial, prompts),
                     tolerance, label + "prefill logits");
  for (size_t t = 0; t < pool_serial.tensors.size(); ++t) {
    ExpectNearRelative(pool_parallel.tensors[t], pool_serial.tensors[t], tolerance,
                       label + "state " + model.state_spec()[t].name);
  }
}

void WriteHuggingFaceSafetensors(const std::string& dir,
                                 const std::map<std::string, torch::Tensor>& tensors, int shards,
                                 fwmodel::DType dtype) {
  const bool bf16 = dtype == fwmodel::DType::kBF16;
  std::vector<std::vector<fwmodel::TensorBlob>> files(static_cast<size_t>(shards));
  nlohmann::json weight_map = nlohmann::json::object();
  size_t i = 0;
  for (const auto& [name, t] : tensors) {
    const torch::Tensor c = t.to(torch::kFloat32).contiguous();
    const size_t shard = i++ % static_cast<size_t>(shards);
    fwmodel::TensorBlob blob{
        name, bf16 ? fwmodel::DType::kBF16 : fwmodel::DType::kF32, c.sizes().vec(), {}};
    const float* values = c.data_ptr<float>();
    if (bf16) {
      blob.bytes.resize(static_cast<size_t>(c.numel()) * 2);
      for (int64_t k = 0; k < c.numel(); ++k) {
        const uint16_t half = fwmodel::FloatToBFloat16(values[k]);
        std::memcpy(&blob.bytes[static_cast<size_t>(2 * k)], &half, 2);
      }
    } else {
      blob.bytes.assign(reinterpret_cast<const char*>(values),
                        static_cast<size_t>(c.numel()) * sizeof(float));
    }
    files[shard].push_back(std::move(blob));
    weight_map[name] = absl::StrCat("model-0000", shard + 1, "-of-0000", shards, ".safetensors");
  }
  for (int s = 0; s < shards; ++s) {
    auto bytes = fwmodel::SerializeSafetensors(files[static_cast<size_t>(s)], {{"format", "pt"}});
    EXPECT_TRUE(bytes.ok());
    if (!bytes.ok()) return;
    const std::string name =
        shards == 1 ? std::string("model.safetensors")
                    : absl::StrCat("model-0000", s + 1, "-of-0000", shards, ".safetensors");
    std::ofstream(dir + "/" + name, std::ios::binary) << *bytes;
  }
  if (shards > 1) {
    std::ofstream(dir + "/model.safetensors.index.json")
        << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump();
  }
}

}  // namespace fwtest
