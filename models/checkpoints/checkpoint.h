// Checkpoint directories (config.json + model.safetensors), in both directions, and
// the model fingerprint.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "models/architectures/model.h"
#include "models/base/config.h"
#include "models/checkpoints/safetensors.h"
#include "models/checkpoints/state_format.h"

namespace fwmodel {

struct LoadedModel {
  Model model;
  // Hex SHA-256 of the canonical config and the float32 weights; see Fingerprint().
  std::string fingerprint;
};

// Loads and strictly validates a checkpoint directory. Error messages name the file
// ("config.json", "model.safetensors") and the bad key or tensor, never `dir`, so they
// are safe to show to remote clients.
absl::StatusOr<LoadedModel> LoadCheckpoint(const std::string& dir,
                                           const ModelOptions& options = {});

// Parses the two files from memory (used by LoadCheckpoint and fuzz tests).
absl::StatusOr<LoadedModel> LoadCheckpointFromBytes(const std::string& config_json,
                                                    std::string safetensors_bytes,
                                                    const ModelOptions& options = {});

// Writes config.json and model.safetensors into `dir` (created if needed), each
// atomically. Weights are stored in `storage` (F32 round-trips bit-exactly).
absl::Status SaveCheckpoint(const Model& model, const std::string& dir,
                            DType storage = DType::kF32);

// Stable identity of a model: SHA-256 over the canonical config JSON and every
// tensor's name, shape and float32 bytes in name order. Independent of the storage
// dtype of the file only insofar as the float32 values are equal.
std::string Fingerprint(const ModelConfig& config,
                        const std::map<std::string, torch::Tensor>& float32_weights);

}  // namespace fwmodel
