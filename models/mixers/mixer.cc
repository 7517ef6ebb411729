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
