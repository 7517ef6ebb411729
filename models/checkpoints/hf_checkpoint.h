// RWKV-7 model directories in the Hugging Face layout that flash-linear-attention (fla)
// writes and the RWKV releases ship (`fla-hub/rwkv7-*`, `RWKV/RWKV7-Goose-*-HF`):
// config.json with `model_type` rwkv7 (or fla's rwkv7_fla) and fla's keys, and
// model.safetensors, or shards listed in model.safetensors.index.json, with fla's tensor
// names. Loaded as strictly as the contract's directories (docs/models.md): an unknown or
// missing tensor, a wrong shape, an unknown config key and a variant that is not
// implemented (fla's hybrid `attn` layers, other value dims) are errors that name the
// tensor or key, never the directory.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "models/base/config.h"
#include "models/checkpoints/checkpoint.h"

namespace fwmodel {

// RWKV's G1 chat template (`User: ...\n\nAssistant:`), given to rwkv7 models with the
// world vocabulary: {Role} is the role with its first letter capitalised.
inline constexpr const char* kG1ChatMessage = "{Role}: {content}\n\n";
inline constexpr const char* kG1GenerationPrompt = "Assistant:";
// Where a G1 reply ends: before the blank line that starts the next turn.
inline constexpr const char* kG1Stop = "\n\n";

// Whether config.json's text is a Hugging Face config (an object with "model_type").
bool IsHuggingFaceConfig(const std::string& config_json);

// fla's config.json -> the equivalent rwkv7 ModelConfig (tokenizer rwkv_world for a
// vocabulary of at least 65,530, bytes for 256..65,529).
absl::StatusOr<ModelConfig> ParseHuggingFaceRwkv7Config(const std::string& config_json);

// The fla name of an rwkv7 weight of ours (docs/models.md's table), e.g.
// "blocks.3.att.w1" -> "model.layers.3.attn.w_lora.lora.0.weight".
std::string FlaTensorName(const std::string& name);

// Loads the directory; `config_json` is its config.json, already read.
absl::StatusOr<LoadedModel> LoadHuggingFaceCheckpoint(const std::string& dir,
                                                      const std::string& config_json,
                                                      const ModelOptions& options);

}  // namespace fwmodel
