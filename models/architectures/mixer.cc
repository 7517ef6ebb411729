#include "models/architectures/mixer.h"

#include "models/architectures/rwkv_block.h"

namespace fwmodel {

// Defined in linear_attention.cc, fast_weight.cc, aft.cc.
std::unique_ptr<Mixer> MakeLinearAttentionMixer(const ModelConfig& config,
                                                const ModelOptions& options);
std::unique_ptr<Mixer> MakeFastWeightMixer(const ModelConfig& config, const ModelOptions& options);
std::unique_ptr<Mixer> MakeAftMixer(const ModelConfig& config, const ModelOptions& options);
// rwkv7.cc, rwkv4.cc.
std::unique_ptr<RwkvBlock> MakeRwkv7Block(const ModelConfig& config, int layer);
std::unique_ptr<RwkvBlock> MakeRwkv4Block(const ModelConfig& config, int layer);

int64_t Mixer::MacsPerToken() const {
  const int64_t d = config_.d_model;
  return 4 * d * d;  // q|r, k, v, o
}

bool KernelInputsOk(const torch::Device& device,
                    std::initializer_list<const torch::Tensor*> tensors, bool bf16_ok) {
  const bool grad = c10::GradMode::is_enabled();
  for (const torch::Tensor* t : tensors) {
    if (!t->defined()) continue;
    const bool dtype_ok =
        t->scalar_type() == torch::kFloat32 || (bf16_ok && t->scalar_type() == torch::kBFloat16);
    if (t->device() != device || !dtype_ok || (grad && t->requires_grad())) return false;
  }
  return true;
}

torch::Tensor MergeChunkHeads(const std::vector<torch::Tensor>& outputs, int64_t batch,
                              int64_t tokens, int64_t d_model) {
  torch::Tensor heads = outputs.size() == 1 ? outputs[0] : torch::cat(outputs, 2);
  return heads.transpose(1, 2).reshape({batch, tokens, d_model});
}

std::unique_ptr<Mixer> MakeMixer(const ModelConfig& config, const ModelOptions& options) {
  switch (config.architecture) {
    case Architecture::kLinearAttention:
      return MakeLinearAttentionMixer(config, options);
    case Architecture::kFastWeight:
      return MakeFastWeightMixer(config, options);
    case Architecture::kAft:
      return MakeAftMixer(config, options);
    case Architecture::kRwkv7:
    case Architecture::kRwkv4:
    case Architecture::kDeltaNet:
    case Architecture::kGatedDeltaNet:
      return nullptr;  // whole blocks: MakeWholeBlock (block.h)
  }
  return nullptr;
}

std::unique_ptr<RwkvBlock> MakeRwkvBlock(const ModelConfig& config, int layer) {
  if (config.architecture == Architecture::kRwkv7) return MakeRwkv7Block(config, layer);
  if (config.architecture == Architecture::kRwkv4) return MakeRwkv4Block(config, layer);
  return nullptr;
}

}  // namespace fwmodel
