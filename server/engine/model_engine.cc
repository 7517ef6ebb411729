#include "server/engine/model_engine.h"
#include <ATen/Context.h>

#include <torch/cuda.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "models/base/config.h"
#include "models/checkpoints/checkpoint.h"
#include "server/engine/engine.h"
#include "server/engine/runner.h"
#include "server/engine/session_keeper.h"

namespace fwserve {

void BindSessionClaim(SessionDirectory& directory, SessionClaim& claim, WorkItem& item) {
  SessionKeeper::BindClaim(directory, claim, item);
}

absl::Status CheckDeviceName(const std::string& device) {
  if (device == "cpu" || device == "cuda" || device.rfind("cuda:", 0) == 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be cpu, cuda or cuda:N, got '", device, "'"));
}

absl::StatusOr<std::unique_ptr<ModelEngine>> LoadModelEngine(
    const ModelEngineSpec& spec, const EngineOptions& options, EngineContext context,
    const std::function<ModelMetrics*(const ModelDescription&)>& metrics_for) {
  if (absl::Status device = CheckDeviceName(spec.device); !device.ok()) return device;
  LimitIntraOpThreads(options.intra_op_threads);  // loading runs on this thread
  fwmodel::ModelOptions model_options;
  if (spec.device != "cpu") {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(
          "--device=cuda, but this LibTorch build has no usable CUDA device");
    }
    try {
      model_options.device = torch::Device(spec.device);
    } catch (const c10::Error&) {
      return absl::InvalidArgumentError(absl::StrCat("--device: bad value '", spec.device, "'"));
    }
  }
  if (spec.gpu_matrices == "bf16") {
    if (spec.device == "cpu") {
      return absl::InvalidArgumentError(
          "--gpu-matrices=bf16 needs --device=cuda (the CPU kernels read float32 matrices)");
    }
    model_options.bf16_matrices = true;
  } else if (spec.gpu_matrices != "float32") {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu-matrices must be float32 or bf16, got '", spec.gpu_matrices, "'"));
  }
  if (spec.gpu_tf32) {
    if (spec.device == "cpu") {
      return absl::InvalidArgumentError("--gpu-tf32 needs --device=cuda");
    }
    at::globalContext().setAllowTF32CuBLAS(true);
  }
  auto loaded = fwmodel::LoadCheckpoint(spec.dir, model_options);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("--model ", spec.dir, ": ", loaded.status().message()));
  }
  auto tokenizer = fwmodel::TextTokenizer::ForModel(loaded->model.config(), spec.dir);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat("--model ", spec.dir, ": ", tokenizer.status().message()));
  }
  const fwmodel::ModelConfig& config = loaded->model.config();
  ModelDescription description;
  description.name = spec.name;
  description.architecture = fwmodel::ArchitectureName(config.architecture);
  description.config_json = fwmodel::ModelConfigToJson(config);
  description.parameters = loaded->model.parameter_count();
  description.state_bytes_per_session = loaded->model.state_bytes_per_session();
  description.vocab_size = config.vocab_size;
  description.fingerprint = loaded->fingerprint;
  description.memory_slots = loaded->model.memory_slots();
  context.metrics = metrics_for(description);
  context.tokenizer = std::move(*tokenizer);
  return std::make_unique<Engine>(spec.name, std::move(*loaded), options, std::move(context));
}

}  // namespace fwserve
