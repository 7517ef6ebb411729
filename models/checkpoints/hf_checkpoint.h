// Model directories in the Hugging Face layout that flash-linear-attention (fla) writes:
// RWKV-7 as the RWKV releases ship it (`fla-hub/rwkv7-*`, `RWKV/RWKV7-Goose-*-HF`),
// config.json with `model_type` rwkv7 (or fla's rwkv7_fla), and DeltaNet and Gated
// DeltaNet (`fla-hub/delta_net-*`, `fla-hub/gated_deltanet-*`), `model_type` delta_net or
// gated_deltanet; with fla's keys, and model.safetensors, or shards listed in
// model.safetensors.index.json, with fla's tensor names (BF16, F16 or F32). Loaded as
// strictly as the contract's directories (docs/models.md): an unknown or missing tensor,
// a wrong shape, an unknown config key and a variant that is not implemented (fla's
// hybrid `attn` layers, other value dims) are errors that name the tensor or key, never
// the directory.
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

// fla's delta_net or gated_deltanet config.json -> the equivalent ModelConfig. Its
// tokenizer: `sentencepiece` when the directory has tokenizer.model (bos_token_id and
// eos_token_id from config.json, fla's defaults 1 and 2), else `bytes` (no EOS;
// vocab_size at least 256). d_ff is intermediate_size; when config.json leaves it null,
// `mlp_width` (> 0, the loader's: the tensors') or else fla's GatedMLP default
// (2/3 · hidden_ratio · hidden_size rounded up to a multiple of 256).
absl::StatusOr<ModelConfig> ParseHuggingFaceDeltaNetConfig(const std::string& config_json,
                                                           bool sentencepiece, int mlp_width = 0);

// The fla name of a delta_net or gated_deltanet weight of ours: "blocks.{i}." ->
// "model.layers.{i}.", "embeddings.weight" and "norm.weight" under "model.",
// "lm_head.weight" as it is (docs/models.md).
std::string FlaDeltaNetTensorName(const std::string& name);

// Loads the directory; `config_json` is its config.json, already read. DeltaNet
// directories besides: a fused `mlp.gate_proj.weight` [2F, D] (fla's older GatedMLP: the
// gate's rows, then up's) is split; Gated DeltaNet's unused `attn.D` is dropped; a
// directory with tokenizer.json but no tokenizer.model is refused (InvalidArgument naming
// tokenizer.json).
absl::StatusOr<LoadedModel> LoadHuggingFaceCheckpoint(const std::string& dir,
                                                      const std::string& config_json,
                                                      const ModelOptions& options);

}  // namespace fwmodel
