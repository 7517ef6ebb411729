// fwmodel: inspect, create, score and sample contract-v1 checkpoints.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cli_util.h"
#include "common/load_time_env.h"
#include "models/architectures/model.h"
#include "models/base/blas_check.h"
#include "models/base/file_util.h"
#include "models/checkpoints/checkpoint.h"
#include "models/kernels/scoring.h"
#include "models/sampling/sampler.h"
#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, config, "", "init: path of the config.json to initialise from");
ABSL_FLAG(uint64_t, seed, 0, "init: initialisation seed; generate: sampling seed");
ABSL_FLAG(std::string, text_file, "",
          "score: file whose bytes are scored; tokenize: file to encode");
ABSL_FLAG(bool, vocabulary, false,
          "tokenize: print every token's bytes (id, then the bytes in hex) instead of encoding");
ABSL_FLAG(int64_t, window, 0,
          "score: also print the mean loss of every WINDOW consecutive tokens (how loss "
          "changes with context length); 0 = off");
ABSL_FLAG(bool, json, false, "info, score, tokenize: print JSON instead of text");
ABSL_FLAG(std::string, prompt, "", "generate: prompt text (empty = start from bos_token_id)");
ABSL_FLAG(int32_t, max_tokens, 200, "generate: number of tokens to generate");
ABSL_FLAG(float, temperature, 0.8f, "generate: sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "generate: keep the k most likely tokens; 0 = all");
ABSL_FLAG(float, top_p, 1.0f, "generate: nucleus sampling mass in (0, 1]; 1 = off");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda (cuda needs a CUDA LibTorch build)");
ABSL_FLAG(std::string, storage_dtype, "F32",
          "init: dtype stored in model.safetensors (F32, F16, BF16)");

namespace {

constexpr char kUsage[] = R"(fwmodel: inspect, create, score and sample fwserve checkpoints.

  fwmodel info DIR [--json]
      Config, parameter count, product-key memory size and share of parameters (PKM
      models), FLOPs per token, state bytes per session and fingerprint.
  fwmodel init DIR --config FILE --seed N [--storage-dtype F32|F16|BF16]
      Writes a randomly initialised checkpoint.
  fwmodel score DIR --text-file F [--json | --window N]
      Per-token log-probs (contract scoring: fresh state, n-1 values; or with --window the
      mean loss of each N-token window), mean nats/byte and
      bits/byte. --json prints {"logprobs":[...],"mean_nll":x}.
  fwmodel tokenize DIR --text-file F [--json] | --vocabulary
      The token ids of a file's bytes under the model's tokenizer (bytes, or the world
      vocabulary in DIR), one line; --json prints {"tokenizer":..,"ids":[...]}.
      --vocabulary prints each id that stands for bytes, then those bytes in hex.
  fwmodel generate DIR --prompt S --max-tokens N [--temperature T --top-k K --top-p P --seed N]
      Streams generated text to stdout: sequence-form prefill, then recurrent steps.)";

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "fwmodel: %s\n", std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

absl::StatusOr<fwmodel::ModelOptions> OptionsFromFlags() {
  fwmodel::ModelOptions options;
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cuda") {
    options.device = torch::Device(torch::kCUDA);
  } else if (device != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("--device must be cpu or cuda, got ", device));
  }
  return options;
}

absl::StatusOr<fwmodel::LoadedModel> Load(const std::string& dir) {
  auto options = OptionsFromFlags();
  if (!options.ok()) return options.status();
  auto loaded = fwmodel::LoadCheckpoint(dir, *options);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(), absl::StrCat(dir, ": ", loaded.status().message()));
  }
  return loaded;
}

int Info(const std::string& dir) {
  auto loaded = Load(dir);
  if (!loaded.ok()) return Fail(loaded.status());
  const fwmodel::Model& model = loaded->model;
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j = {
        {"config", nlohmann::json::parse(fwmodel::ModelConfigToJson(model.config()))},
        {"parameters", model.parameter_count()},
        {"memory_slots", model.memory_slots()},
        {"memory_parameters", model.memory_parameter_count()},
        {"flops_per_token", fwmodel::FlopsPerToken(model.config())},
        {"state_bytes_per_session", model.state_bytes_per_session()},
        {"fingerprint", loaded->fingerprint}};
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "config:\n" << fwmodel::ModelConfigToJson(model.config());
  std::cout << "parameters: " << model.parameter_count() << "\n";
  if (model.config().has_pkm()) {
    const int64_t memory = model.memory_parameter_count();
    std::cout << absl::StrFormat(
        "product-key memory: %d slots in %d blocks, %d value parameters (%.1f%% of "
        "parameters), %d slots read per token per block\n",
        model.memory_slots(), model.config().pkm_layers.size(), memory,
        100.0 * static_cast<double>(memory) / static_cast<double>(model.parameter_count()),
        static_cast<int64_t>(model.config().pkm_heads) * model.config().pkm_topk);
  }
  std::cout << "FLOPs per token (decode step, matrix products): "
            << fwmodel::FlopsPerToken(model.config()) << "\n";
  std::cout << "state bytes per session: " << model.state_bytes_per_session() << "\n";
  std::cout << "state tensors:";
  for (const auto& spec : model.state_spec()) {
    std::cout << " " << spec.name << "[";
    for (size_t i = 0; i < spec.shape.size(); ++i) std::cout << (i ? "," : "") << spec.shape[i];
    std::cout << "]";
  }
  std::cout << "\nfingerprint: " << loaded->fingerprint << "\n";
  return 0;
}

int Init(const std::string& dir) {
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (config_path.empty()) return Fail(absl::InvalidArgumentError("init needs --config FILE"));
  auto text = fwmodel::ReadFile(config_path);
  if (!text.ok()) return Fail(text.status());
  auto config = fwmodel::ParseModelConfig(*text);
  if (!config.ok()) return Fail(config.status());
  auto model = fwmodel::Model::InitRandom(*config, absl::GetFlag(FLAGS_seed));
  if (!model.ok()) return Fail(model.status());
  const std::string dtype_name = absl::GetFlag(FLAGS_storage_dtype);
  fwmodel::DType storage;
  if (dtype_name == "F32") {
    storage = fwmodel::DType::kF32;
  } else if (dtype_name == "F16") {
    storage = fwmodel::DType::kF16;
  } else if (dtype_name == "BF16") {
    storage = fwmodel::DType::kBF16;
  } else {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--storage-dtype must be F32, F16 or BF16, got ", dtype_name)));
  }
  absl::Status saved = fwmodel::SaveCheckpoint(*model, dir, storage);
  if (!saved.ok()) return Fail(saved);
  std::cout << "wrote " << dir << " (" << model->parameter_count() << " parameters)\n";
  return 0;
}

int Score(const std::string& dir) {
  const std::string path = absl::GetFlag(FLAGS_text_file);
  if (path.empty()) return Fail(absl::InvalidArgumentError("score needs --text-file F"));
  auto text = fwmodel::ReadFile(path);
  if (!text.ok()) return Fail(text.status());
  if (text->size() < 2) {
    return Fail(absl::InvalidArgumentError("--text-file must hold at least 2 bytes to score"));
  }
  auto loaded = Load(dir);
  if (!loaded.ok()) return Fail(loaded.status());
  auto tokenizer = fwmodel::TextTokenizer::ForModel(loaded->model.config(), dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  const std::vector<int64_t> ids = tokenizer->Encode(*text);
  if (ids.size() < 2) {
    return Fail(absl::InvalidArgumentError("--text-file must hold at least 2 tokens to score"));
  }
  auto logprobs = fwmodel::ScoreTokens(loaded->model, ids);
  if (!logprobs.ok()) return Fail(logprobs.status());
  double sum = 0;
  for (double lp : *logprobs) sum -= lp;
  const double mean = sum / static_cast<double>(logprobs->size());
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j = {{"logprobs", *logprobs}, {"mean_nll", mean}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  const int64_t window = absl::GetFlag(FLAGS_window);
  if (window > 0) {
    std::cout << "window_start\twindow_tokens\tmean_nats_per_byte\n";
    for (size_t start = 0; start < logprobs->size(); start += static_cast<size_t>(window)) {
      const size_t end = std::min(logprobs->size(), start + static_cast<size_t>(window));
      double window_sum = 0;
      for (size_t i = start; i < end; ++i) window_sum -= (*logprobs)[i];
      std::cout << absl::StrFormat("%zu\t%zu\t%.4f\n", start + 1, end - start,
                                   window_sum / static_cast<double>(end - start));
    }
  } else {
    std::cout << "position\ttoken\tlogprob\n";  // token: the byte value for `bytes`
    for (size_t i = 0; i < logprobs->size(); ++i) {
      std::cout << absl::StrFormat("%zu\t%d\t%.6f\n", i + 1, ids[i + 1], (*logprobs)[i]);
    }
  }
  const char* unit = tokenizer->end_of_text() < 0 ? "byte" : "token";
  std::cout << absl::StrFormat("tokens scored: %zu\nmean: %.6f nats/%s, %.6f bits/%s\n",
                               logprobs->size(), mean, unit, mean / std::log(2.0), unit);
  return 0;
}

int Tokenize(const std::string& dir) {
  auto loaded = Load(dir);
  if (!loaded.ok()) return Fail(loaded.status());
  auto tokenizer = fwmodel::TextTokenizer::ForModel(loaded->model.config(), dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  if (absl::GetFlag(FLAGS_vocabulary)) {
    for (int64_t id = 0; id < loaded->model.config().vocab_size; ++id) {
      const std::string bytes = tokenizer->TokenBytes(id);
      if (!bytes.empty()) std::cout << id << "\t" << absl::BytesToHexString(bytes) << "\n";
    }
    return 0;
  }
  const std::string path = absl::GetFlag(FLAGS_text_file);
  if (path.empty())
    return Fail(absl::InvalidArgumentError("tokenize needs --text-file F or --vocabulary"));
  auto text = fwmodel::ReadFile(path);
  if (!text.ok()) return Fail(text.status());
  const std::vector<int64_t> ids = tokenizer->Encode(*text);
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"tokenizer", tokenizer->name()}, {"ids", ids}}.dump() << "\n";
  } else {
    std::cout << absl::StrJoin(ids, " ") << "\n";
  }
  return 0;
}

int Generate(const std::string& dir) {
  fwserve::SamplingParams params;
  params.temperature = absl::GetFlag(FLAGS_temperature);
  params.top_k = absl::GetFlag(FLAGS_top_k);
  params.top_p = absl::GetFlag(FLAGS_top_p);
  params.seed = absl::GetFlag(FLAGS_seed);
  absl::Status valid = params.Validate();
  if (!valid.ok()) return Fail(valid);
  const int32_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens < 0) return Fail(absl::InvalidArgumentError("--max-tokens must be >= 0"));
  auto loaded = Load(dir);
  if (!loaded.ok()) return Fail(loaded.status());
  const fwmodel::Model& model = loaded->model;
  c10::NoGradGuard no_grad;

  std::string prompt = absl::GetFlag(FLAGS_prompt);
  auto tokenizer = fwmodel::TextTokenizer::ForModel(model.config(), dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  std::vector<int64_t> ids = tokenizer->Encode(prompt);
  if (ids.empty()) ids.push_back(model.config().bos_token_id);
  std::cout << prompt << std::flush;

  fwmodel::State state = model.InitialState(1);
  auto prefill = model.Forward(torch::tensor(ids, torch::kInt64).unsqueeze(0), &state);
  if (!prefill.ok()) return Fail(prefill.status());
  torch::Tensor logits = (*prefill)[0][-1].to(torch::kCPU, torch::kFloat32).contiguous();
  std::mt19937_64 rng(params.seed);
  fwmodel::Utf8StreamDecoder decoder;
  const int64_t vocab = model.config().vocab_size;
  for (int32_t i = 0; i < max_tokens; ++i) {
    const int64_t token = fwserve::SampleToken(logits.data_ptr<float>(), vocab, params, rng);
    if (token == tokenizer->end_of_text()) break;
    std::cout << (tokenizer->end_of_text() < 0 ? decoder.Push(token)
                                               : decoder.PushBytes(tokenizer->TokenBytes(token)))
              << std::flush;
    if (i + 1 == max_tokens) break;
    auto next = model.Step(torch::tensor({token}, torch::kInt64), &state);
    if (!next.ok()) return Fail(next.status());
    logits = (*next)[0].to(torch::kCPU, torch::kFloat32).contiguous();
  }
  std::cout << decoder.Finish() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // OPENBLAS_CORETYPE when OpenBLAS misdetected the CPU: executes this binary again once.
  fwserve::ReexecWithLoadTimeEnv(argv, fwserve::LoadTimeEnvOptions());
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> args = fwserve::ParseFlagsAllowingDashes(argc, argv);
  if (args.size() != 3) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  if (auto warning = fwmodel::SlowBlasWarning()) std::fprintf(stderr, "%s\n", warning->c_str());
  if (auto note = fwserve::LoadTimeEnvNote()) std::fprintf(stderr, "%s\n", note->c_str());
  const std::string& command = args[1];
  const std::string& dir = args[2];
  if (command == "info") return Info(dir);
  if (command == "init") return Init(dir);
  if (command == "score") return Score(dir);
  if (command == "generate") return Generate(dir);
  if (command == "tokenize") return Tokenize(dir);
  std::fprintf(stderr, "fwmodel: unknown command '%s'\n\n%s\n", command.c_str(), kUsage);
  return 2;
}
