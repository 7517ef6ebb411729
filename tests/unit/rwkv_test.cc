// RWKV-7 and RWKV-4 (docs/models.md): exact against rwkv.cpp's tiny trained models
// (tests/data/rwkv, converted by tools/convert_rwkv_cpp.py), the sequence form equal to
// the steps, and the strict loading of their directories.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/architectures/rwkv_block.h"
#include "models/checkpoints/checkpoint.h"
#include "models/checkpoints/hf_checkpoint.h"
#include "models/checkpoints/safetensors.h"
#include "models/kernels/native_step.h"
#include "nlohmann/json.hpp"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_models.h"

namespace fwmodel {

void SetRwkv4HostWkvForTesting(bool on);  // rwkv4.cc: the aft kernel's mirror on the CPU

namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Converts tests/data/rwkv/tiny-rwkv-<name>.bin with tools/convert_rwkv_cpp.py.
std::string ConvertTiny(const std::string& name) {
  const std::string out = fwtest::MakeTempDir("rwkv-" + name);
  const std::string command = std::string(FWSERVE_PYTHON3) + " " + FWSERVE_SOURCE_DIR +
                              "/tools/convert_rwkv_cpp.py " + FWSERVE_SOURCE_DIR +
                              "/tests/data/rwkv/tiny-rwkv-" + name + ".bin " + out + " >/dev/null";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return out;
}

torch::Tensor ExpectedLogits(const std::string& version) {
  const std::string bytes = ReadAll(std::string(FWSERVE_SOURCE_DIR) +
                                    "/tests/data/rwkv/expected-logits-" + version + ".bin");
  EXPECT_EQ(bytes.size(), 256 * sizeof(float));
  return torch::from_blob(const_cast<char*>(bytes.data()), {256}, torch::kFloat32)
      .clone()
      .to(torch::kFloat64);
}

struct TinyCase {
  std::string version;  // "7v0-834K"
  std::string format;   // "FP32"
  Architecture arch;
  // rwkv.cpp's tests/test_tiny_rwkv.c: the bound on |Σ (logit − expected)|, times 1.05.
  double difference_sum;
  // Ours, per logit: max |logit − expected|.
  double max_difference;
  // The native kernel's NativeStep::weight_format for the file.
  std::string native_weights;
};

class RwkvCppTinyTest : public ::testing::TestWithParam<TinyCase> {};

// The logits after `"in` from a fresh state, by steps and by the sequence form, in
// float32 (served) and float64, against rwkv.cpp's expected logits.
TEST_P(RwkvCppTinyTest, LogitsAfterQuoteInMatchRwkvCpp) {
  const TinyCase& c = GetParam();
  const std::string dir = ConvertTiny(c.version + "-" + c.format);
  const torch::Tensor expected = ExpectedLogits(c.version);
  const std::vector<int64_t> prompt = {34, 105, 110};  // "in
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kFloat64}) {
    ModelOptions options;
    options.dtype = dtype;
    auto loaded = LoadCheckpoint(dir, options);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const Model& model = loaded->model;
    ASSERT_EQ(model.config().architecture, c.arch);
    c10::NoGradGuard no_grad;
    State state = model.InitialState(1);
    torch::Tensor step_logits;
    for (int64_t token : prompt) {
      auto logits = model.Step(torch::tensor({token}, torch::kInt64), &state);
      ASSERT_TRUE(logits.ok()) << logits.status();
      step_logits = logits->squeeze(0).to(torch::kFloat64);
    }
    State fresh = model.InitialState(1);
    auto sequence = model.Forward(torch::tensor(prompt, torch::kInt64).unsqueeze(0), &fresh);
    ASSERT_TRUE(sequence.ok()) << sequence.status();
    const torch::Tensor sequence_logits = (*sequence)[0][2].to(torch::kFloat64);
    for (const auto& [what, logits] : {std::pair<const char*, torch::Tensor>{"steps", step_logits},
                                       {"sequence", sequence_logits}}) {
      const double sum = (logits - expected).sum().item<double>();
      const double max = (logits - expected).abs().max().item<double>();
      EXPECT_LE(std::abs(sum), std::abs(c.difference_sum) * 1.05)
          << what << " " << torch::toString(dtype) << ": difference sum " << sum;
      EXPECT_LE(max, c.max_difference) << what << " " << torch::toString(dtype);
      std::printf("%s-%s %s %s: difference sum %.6f, max %.3g\n", c.version.c_str(),
                  c.format.c_str(), what, torch::toString(dtype), sum, max);
    }
    // The two forms leave the same state.
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      EXPECT_LE(fwtest::MaxAbsDiff(state.tensors[i], fresh.tensors[i]),
                dtype == torch::kFloat64 ? 1e-12 : 1e-4)
          << model.state_spec()[i].name;
    }
  }
}

// The same logits through the native CPU step (NativeStep, models/kernels/native_rwkv.h), the
// server's default decode kernel: "in stepped token by token, and absorbed as a prompt.
class RwkvCppTinyNativeTest : public ::testing::TestWithParam<TinyCase> {};

TEST_P(RwkvCppTinyNativeTest, NativeStepLogitsMatchRwkvCpp) {
  const TinyCase& c = GetParam();
  const std::string dir = ConvertTiny(c.version + "-" + c.format);
  const torch::Tensor expected = ExpectedLogits(c.version);
  auto loaded = LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = loaded->model;
  auto native = NativeStep::Create(model);
  ASSERT_TRUE(native.ok()) << native.status();
  // The kernel keeps 16-bit weights: rwkv.cpp's FP16 files hold f16 matrices (exact in
  // bf16 too where their values allow), and the 7v0 FP32 file's values are all bf16.
  EXPECT_EQ((*native)->weight_format(), c.native_weights);
  EXPECT_EQ((*native)->weight_bits(), c.native_weights == "f32" ? 32 : 16);
  const std::vector<int64_t> prompt = {34, 105, 110};  // "in
  const int64_t vocab = model.config().vocab_size;
  ASSERT_EQ(vocab, 256);
  State pool = model.InitialState(3);
  std::vector<float> stepped(static_cast<size_t>(vocab)), absorbed(stepped.size());
  for (int64_t token : prompt) {
    ASSERT_TRUE((*native)->Step({token}, {2}, &pool, stepped.data()).ok());
  }
  ASSERT_TRUE((*native)->Absorb(prompt, 3, {0}, &pool, absorbed.data()).ok());
  for (const auto& [what, values] :
       {std::pair<const char*, std::vector<float>*>{"steps", &stepped}, {"absorb", &absorbed}}) {
    const torch::Tensor logits =
        torch::from_blob(values->data(), {vocab}, torch::kFloat32).to(torch::kFloat64);
    const double sum = (logits - expected).sum().item<double>();
    const double max = (logits - expected).abs().max().item<double>();
    EXPECT_LE(std::abs(sum), std::abs(c.difference_sum) * 1.05)
        << what << ": difference sum " << sum;
    EXPECT_LE(max, c.max_difference) << what;
    std::printf("%s-%s native %s: difference sum %.6f, max %.3g\n", c.version.c_str(),
                c.format.c_str(), what, sum, max);
  }
}

std::string TinyCaseName(const ::testing::TestParamInfo<TinyCase>& info) {
  return "v" + info.param.version.substr(0, 1) + "_" + info.param.format;
}

const std::vector<TinyCase> kTinyCases = {
    {"7v0-834K", "FP32", Architecture::kRwkv7, 0.001, 1e-5, "bf16"},
    {"7v0-834K", "FP16", Architecture::kRwkv7, 0.005766, 1e-5, "bf16"},
    {"4v0-660K", "FP32", Architecture::kRwkv4, 0.001, 2e-5, "f32"},
    {"4v0-660K", "FP16", Architecture::kRwkv4, 0.013652, 5e-3, "bf16+f16"}};

INSTANTIATE_TEST_SUITE_P(Tiny, RwkvCppTinyTest, ::testing::ValuesIn(kTinyCases), TinyCaseName);
INSTANTIATE_TEST_SUITE_P(Tiny, RwkvCppTinyNativeTest, ::testing::ValuesIn(kTinyCases),
                         TinyCaseName);

ModelConfig SmallRwkvConfig(Architecture arch) {
  ModelConfig c;
  c.architecture = arch;
  c.d_model = 32;
  c.n_layers = 3;
  c.n_heads = arch == Architecture::kRwkv7 ? 4 : 1;
  c.d_ff = 48;
  if (arch == Architecture::kRwkv7) {
    c.decay_low_rank_dim = 5;
    c.a_low_rank_dim = 6;
    c.v_low_rank_dim = 3;
    c.gate_low_rank_dim = 7;
  }
  return c;
}

// RWKV-4's recurrence as the aft kernel runs it on a GPU (rwkv4.cc's FusedWkv), here
// through the kernel's CPU mirror: the rwkv.cpp tiny RWKV-4 files still give rwkv.cpp's
// logits after `"in` (steps and the sequence form, float32), and a random RWKV-4 model's
// sequence form (T = 1, 5, 17) and steps equal the LibTorch loop's within 1e-4, states too.
TEST(Rwkv4FusedWkvTest, KernelMirrorEqualsLibTorchLoopAndRwkvCpp) {
  c10::NoGradGuard no_grad;
  struct Reset {
    ~Reset() { SetRwkv4HostWkvForTesting(false); }
  } reset;
  for (const TinyCase& c : kTinyCases) {
    if (c.arch != Architecture::kRwkv4) continue;
    SCOPED_TRACE(c.version + "-" + c.format);
    const std::string dir = ConvertTiny(c.version + "-" + c.format);
    auto loaded = LoadCheckpoint(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const torch::Tensor expected = ExpectedLogits(c.version);
    const torch::Tensor prompt = torch::tensor({34, 105, 110}, torch::kInt64);  // "in
    SetRwkv4HostWkvForTesting(true);
    State state = loaded->model.InitialState(1);
    torch::Tensor step_logits;
    for (int64_t t = 0; t < 3; ++t) {
      auto logits = loaded->model.Step(prompt.narrow(0, t, 1), &state);
      ASSERT_TRUE(logits.ok()) << logits.status();
      step_logits = logits->squeeze(0).to(torch::kFloat64);
    }
    State fresh = loaded->model.InitialState(1);
    auto sequence = loaded->model.Forward(prompt.unsqueeze(0), &fresh);
    ASSERT_TRUE(sequence.ok());
    SetRwkv4HostWkvForTesting(false);
    for (const torch::Tensor& logits : {step_logits, (*sequence)[0][2].to(torch::kFloat64)}) {
      EXPECT_LE(std::abs((logits - expected).sum().item<double>()),
                std::abs(c.difference_sum) * 1.05);
      EXPECT_LE((logits - expected).abs().max().item<double>(), c.max_difference);
    }
  }
  const ModelConfig config = SmallRwkvConfig(Architecture::kRwkv4);
  const Model model = fwtest::RandomModel(config, 5, torch::kFloat32);
  for (const int64_t T : {int64_t{1}, int64_t{5}, int64_t{17}}) {
    SCOPED_TRACE(absl::StrCat("T = ", T));
    const torch::Tensor tokens = fwtest::RandomTokens(2, T, config.vocab_size, 7);
    const torch::Tensor next = fwtest::RandomTokens(2, 1, config.vocab_size, 8).view({2});
    torch::Tensor logits[2], step[2];
    State states[2];
    for (int fused = 0; fused < 2; ++fused) {
      SetRwkv4HostWkvForTesting(fused == 1);
      states[fused] = model.InitialState(2);
      auto forward = model.Forward(tokens, &states[fused]);
      ASSERT_TRUE(forward.ok()) << forward.status();
      logits[fused] = *forward;
      auto stepped = model.Step(next, &states[fused]);
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      step[fused] = *stepped;
    }
    SetRwkv4HostWkvForTesting(false);
    fwtest::ExpectNearRelative(logits[1], logits[0], 1e-4, "sequence form");
    fwtest::ExpectNearRelative(step[1], step[0], 1e-4, "step after it");
    for (size_t i = 0; i < states[0].tensors.size(); ++i) {
      fwtest::ExpectNearRelative(states[1].tensors[i], states[0].tensors[i], 1e-4,
                                 model.state_spec()[i].name);
    }
    // The mirror ran: its exponentials are not LibTorch's, so some bits differ.
    EXPECT_FALSE(torch::equal(logits[1], logits[0]));
  }
}

class RwkvFormsTest : public ::testing::TestWithParam<Architecture> {};

// A span processed whole, in pieces with the state carried, and token by token gives
// the same logits and state (float64), for a batch of sessions with distinct tokens.
TEST_P(RwkvFormsTest, SequenceInPiecesEqualsSteps) {
  ModelOptions float64;
  float64.dtype = torch::kFloat64;
  auto model = Model::InitRandom(SmallRwkvConfig(GetParam()), 7, float64);
  ASSERT_TRUE(model.ok()) << model.status();
  c10::NoGradGuard no_grad;
  const torch::Tensor tokens = fwtest::RandomTokens(2, 9, 256, 3);
  State whole = model->InitialState(2);
  auto all = model->Forward(tokens, &whole);
  ASSERT_TRUE(all.ok()) << all.status();
  State pieces = model->InitialState(2);
  auto first = model->Forward(tokens.narrow(1, 0, 4), &pieces);
  auto rest = model->Forward(tokens.narrow(1, 4, 5), &pieces);
  ASSERT_TRUE(first.ok() && rest.ok());
  fwtest::ExpectNearRelative(torch::cat({*first, *rest}, 1), *all, 1e-10, "pieces vs whole");
  State steps = model->InitialState(2);
  std::vector<torch::Tensor> step_logits;
  for (int64_t t = 0; t < 9; ++t) {
    auto logits = model->Step(tokens.select(1, t).contiguous(), &steps);
    ASSERT_TRUE(logits.ok()) << logits.status();
    step_logits.push_back(*logits);
  }
  fwtest::ExpectNearRelative(torch::stack(step_logits, 1), *all, 1e-10, "steps vs whole");
  for (size_t i = 0; i < whole.tensors.size(); ++i) {
    fwtest::ExpectNearRelative(steps.tensors[i], whole.tensors[i], 1e-10,
                               model->state_spec()[i].name);
  }
  // Not a constant function of the input: two sessions' logits differ.
  EXPECT_GT(fwtest::MaxAbsDiff((*all)[0], (*all)[1]), 1e-3);
}

// State sizes: per layer two token shifts [d] and the recurrence (rwkv7: [H, N, N]
// float32; rwkv4: α, β, p [3, d]).
TEST_P(RwkvFormsTest, StateIsTokenShiftsAndRecurrence) {
  const ModelConfig config = SmallRwkvConfig(GetParam());
  auto model = Model::InitRandom(config, 1);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t per_layer = GetParam() == Architecture::kRwkv7 ? 2 * 32 + 4 * 8 * 8 : 5 * 32;
  EXPECT_EQ(model->state_bytes_per_session(), 4 * config.n_layers * per_layer);
  ASSERT_EQ(model->state_spec().size(), 3u * config.n_layers);
  EXPECT_EQ(model->state_spec()[0].name, "blocks.0.att_shift");
  EXPECT_EQ(model->state_spec()[1].name, "blocks.0.wkv");
  if (GetParam() == Architecture::kRwkv4) {
    // p starts at -1e30 (rwkv.cpp's fresh state), α and β at 0.
    State s = model->InitialState(1);
    EXPECT_EQ(s.tensors[1][0][2][0].item<float>(), -1e30f);
    EXPECT_EQ(s.tensors[1][0][0][0].item<float>(), 0.0f);
  }
}

// The native CPU step serves both architectures (models/kernels/native_rwkv.h;
// native_rwkv_test.cc compares it with Model::Step).
TEST_P(RwkvFormsTest, NativeStepServesTheArchitecture) {
  auto model = Model::InitRandom(SmallRwkvConfig(GetParam()), 1);
  ASSERT_TRUE(model.ok()) << model.status();
  auto native = NativeStep::Create(*model);
  EXPECT_TRUE(native.ok()) << native.status();
}

// A saved RWKV model loads back with the same fingerprint and logits.
TEST_P(RwkvFormsTest, SaveAndLoadRoundTrip) {
  auto model = Model::InitRandom(SmallRwkvConfig(GetParam()), 5);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string dir = fwtest::MakeTempDir("rwkv-save");
  ASSERT_TRUE(SaveCheckpoint(*model, dir).ok());
  auto loaded = LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->fingerprint, Fingerprint(model->config(), model->ExportWeights()));
  c10::NoGradGuard no_grad;
  State a = model->InitialState(1), b = loaded->model.InitialState(1);
  const torch::Tensor tokens = fwtest::RandomTokens(1, 5, 256, 9);
  EXPECT_EQ(fwtest::MaxAbsDiff(*model->Forward(tokens, &a), *loaded->model.Forward(tokens, &b)), 0);
}

INSTANTIATE_TEST_SUITE_P(Rwkv, RwkvFormsTest,
                         ::testing::Values(Architecture::kRwkv7, Architecture::kRwkv4),
                         [](const ::testing::TestParamInfo<Architecture>& info) {
                           return std::string(ArchitectureName(info.param));
                         });

// The strict loader on a converted tiny model's weights: each defect is refused with
// an error that names the tensor.
TEST(RwkvLoadTest, DefectiveWeightsAreRefusedNamingTheTensor) {
  auto model = Model::InitRandom(SmallRwkvConfig(Architecture::kRwkv7), 2);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig config = model->config();
  auto expect_error = [&](std::map<std::string, torch::Tensor> weights, const std::string& name) {
    auto created = Model::Create(config, std::move(weights));
    ASSERT_FALSE(created.ok());
    EXPECT_NE(created.status().message().find(name), std::string::npos) << created.status();
  };
  auto missing = model->ExportWeights();
  missing.erase("blocks.1.att.v1");
  expect_error(missing, "blocks.1.att.v1");
  auto unknown = model->ExportWeights();
  unknown["blocks.0.att.v1"] = torch::zeros({3, 32});  // block 0 has no value residual
  expect_error(unknown, "blocks.0.att.v1");
  auto shaped = model->ExportWeights();
  shaped["blocks.2.att.r_k"] = torch::zeros({32});
  expect_error(shaped, "blocks.2.att.r_k");
}

}  // namespace
}  // namespace fwmodel

namespace fwmodel {
namespace {

// A random rwkv7 model written in the Hugging Face/fla layout: fla's config.json and
// fla's tensor names, x_* as [1, 1, C] as fla keeps them; `shards` > 1 splits the
// tensors over that many files with model.safetensors.index.json.
class HuggingFaceLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig c = SmallRwkvConfig(Architecture::kRwkv7);
    c.bos_token_id = 0;  // as config_ says, so that the fingerprints agree
    auto model = Model::InitRandom(c, 11);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Model>(std::move(*model));
    config_ = {{"model_type", "rwkv7"},
               {"hidden_size", 32},
               {"num_hidden_layers", 3},
               {"head_dim", 8},
               {"intermediate_size", 48},
               {"decay_low_rank_dim", 5},
               {"a_low_rank_dim", 6},
               {"v_low_rank_dim", 3},
               {"gate_low_rank_dim", 7},
               {"vocab_size", 256},
               {"norm_eps", 1e-5},
               {"tie_word_embeddings", false},
               {"attn", nullptr},
               {"hidden_act", "sqrelu"},
               {"architectures", {"RWKV7ForCausalLM"}},
               {"torch_dtype", "float32"},
               {"bos_token_id", 0},
               {"eos_token_id", 0}};
    for (auto& [name, t] : model_->ExportWeights()) {
      torch::Tensor v =
          name.find(".x_") != std::string::npos && t.dim() == 1 ? t.view({1, 1, -1}) : t;
      tensors_[FlaTensorName(name)] = v;
    }
  }

  std::string Write(int shards = 1) {
    const std::string dir = fwtest::MakeTempDir("rwkv-hf");
    std::ofstream(dir + "/config.json") << config_.dump(2);
    fwtest::WriteHuggingFaceSafetensors(dir, tensors_, shards);
    return dir;
  }

  void ExpectRefused(const std::string& dir, const std::string& needle) {
    auto loaded = LoadCheckpoint(dir);
    ASSERT_FALSE(loaded.ok()) << "accepted; expected an error naming " << needle;
    EXPECT_NE(loaded.status().message().find(needle), std::string::npos) << loaded.status();
    EXPECT_EQ(loaded.status().message().find(dir), std::string::npos) << "leaks the path";
  }

  std::unique_ptr<Model> model_;
  nlohmann::json config_;
  std::map<std::string, torch::Tensor> tensors_;
};

TEST_F(HuggingFaceLayoutTest, SingleAndShardedLoadAsTheSameModel) {
  c10::NoGradGuard no_grad;
  const torch::Tensor tokens = fwtest::RandomTokens(1, 6, 256, 4);
  State reference_state = model_->InitialState(1);
  const torch::Tensor reference = *model_->Forward(tokens, &reference_state);
  for (int shards : {1, 3}) {
    auto loaded = LoadCheckpoint(Write(shards));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->model.config().architecture, Architecture::kRwkv7);
    EXPECT_EQ(loaded->model.config().n_heads, 4);
    EXPECT_EQ(loaded->fingerprint, Fingerprint(model_->config(), model_->ExportWeights()));
    State state = loaded->model.InitialState(1);
    EXPECT_EQ(fwtest::MaxAbsDiff(*loaded->model.Forward(tokens, &state), reference), 0)
        << shards << " shards";
  }
}

TEST_F(HuggingFaceLayoutTest, TiedHeadLoadsWithoutLmHead) {
  config_["tie_word_embeddings"] = true;
  tensors_.erase("lm_head.weight");
  auto loaded = LoadCheckpoint(Write());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->model.config().tie_embeddings);
}

TEST_F(HuggingFaceLayoutTest, UnknownTensorIsRefusedByName) {
  tensors_["model.layers.1.attn.x_x"] = torch::zeros({6, 32});
  ExpectRefused(Write(), "unknown tensor 'model.layers.1.attn.x_x'");
}

TEST_F(HuggingFaceLayoutTest, MissingTensorIsRefusedByName) {
  tensors_.erase("model.layers.2.attn.v_lora.lora.0.weight");
  ExpectRefused(Write(), "missing tensor 'model.layers.2.attn.v_lora.lora.0.weight'");
}

TEST_F(HuggingFaceLayoutTest, WrongShapeIsRefusedByName) {
  tensors_["model.layers.0.attn.r_k"] = torch::zeros({32});
  ExpectRefused(Write(), "tensor 'model.layers.0.attn.r_k' has shape [32], expected [4, 8]");
}

TEST_F(HuggingFaceLayoutTest, UnknownConfigKeyIsRefusedByName) {
  config_["decay_low_rank_dimm"] = 5;
  ExpectRefused(Write(), "key 'decay_low_rank_dimm' is unknown");
}

TEST_F(HuggingFaceLayoutTest, HybridAttentionLayersAreRefused) {
  config_["attn"] = {{"layers", {1}}, {"num_heads", 4}};
  ExpectRefused(Write(), "key 'attn' sets hybrid attention layers");
}

TEST_F(HuggingFaceLayoutTest, OtherModelTypeIsRefused) {
  config_["model_type"] = "rwkv6";
  ExpectRefused(Write(), "key 'model_type' has unsupported value \"rwkv6\"");
}

TEST_F(HuggingFaceLayoutTest, ShardTensorNotInTheIndexIsRefused) {
  const std::string dir = Write(2);
  nlohmann::json index = nlohmann::json::parse(ReadAll(dir + "/model.safetensors.index.json"));
  index["weight_map"].erase("model.norm.bias");
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  ExpectRefused(dir, "tensor 'model.norm.bias' is not listed for this shard");
}

}  // namespace
}  // namespace fwmodel

namespace fwmodel {
namespace {

// fla's config of a world-vocabulary model (the 0.1B G1 shape) maps to rwkv7 with the
// rwkv_world tokenizer, end of text as BOS and the G1 chat template; its state is the
// issue's 2.4 MB a session (13 MB at the 1.5B shape).
TEST(HuggingFaceConfigTest, WorldVocabularyModelGetsTheWorldTokenizerAndG1Template) {
  auto c = ParseHuggingFaceRwkv7Config(R"({"model_type": "rwkv7", "hidden_size": 768,
      "num_hidden_layers": 12, "head_dim": 64, "hidden_ratio": 4.0, "decay_low_rank_dim": 64,
      "a_low_rank_dim": 64, "v_low_rank_dim": 32, "gate_low_rank_dim": 128,
      "vocab_size": 65536, "tie_word_embeddings": false, "attn": null, "fuse_norm": false,
      "bos_token_id": 0, "eos_token_id": 0, "transformers_version": "4.48.0"})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tokenizer, "rwkv_world");
  EXPECT_EQ(c->n_heads, 12);
  EXPECT_EQ(c->d_ff, 3072);
  EXPECT_EQ(c->bos_token_id, 0);
  EXPECT_EQ(c->chat_message_template, "{Role}: {content}\n\n");
  EXPECT_EQ(c->chat_generation_prompt, "Assistant:");
  auto state_bytes = [](const ModelConfig& config) {
    int64_t floats = 0;
    for (int i = 0; i < config.n_layers; ++i) {
      for (const StateTensorSpec& s : MakeRwkvBlock(config, i)->StateSpec()) {
        int64_t n = 1;
        for (int64_t dim : s.shape) n *= dim;
        floats += n;
      }
    }
    return 4 * floats;
  };
  EXPECT_EQ(state_bytes(*c), 2433024);  // 12 · (2 · 768 + 12 · 64 · 64) · 4
  ModelConfig large = *c;
  large.d_model = 2048;
  large.n_layers = 24;
  large.n_heads = 32;
  EXPECT_EQ(state_bytes(large), 12976128);  // 24 · (2 · 2048 + 32 · 64 · 64) · 4
}

}  // namespace
}  // namespace fwmodel
