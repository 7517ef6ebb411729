#include "models/mixers/mixer.h"

namespace fwmodel {

// Defined in linear_attention.cc, fast_weight.cc, aft.cc.
std::unique_ptr<Mixer> MakeLinearAttentionMixer(const ModelConfig& config,
                                                const ModelOptions& options);
std::unique_ptr<Mixer> MakeFastWeightMixer(const ModelConfig& config, const ModelOptions& options);
std::unique_ptr<Mixer> MakeAftMixer(const ModelConfig& config, const ModelOptions& options);

int64_t Mixer::MacsPerToken() const {
  const int64_t d = config_.d_model;
  return 4 * d * d;  // q|r, k, v, o
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
  }
  return nullptr;  // not reached: Validate() accepts only the three
}

}  // namespace fwmodel
