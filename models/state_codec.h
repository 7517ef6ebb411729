// Versioned, checksummed encoding of one session's recurrent state, tied to the model
// by its fingerprint. Used for session export/import and for spilling idle sessions.
//
// The bytes are a safetensors file: one float32 tensor per state tensor (per-session
// shape, no batch dimension) and __metadata__ {format: "fwserve-state", version: "1",
// fingerprint, tokens, sha256 (of the data section)}. Readable by any safetensors tool.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "models/model.h"

namespace fwmodel {

struct DecodedState {
  State state;         // batch 1, in the model's compute dtype and device
  int64_t tokens = 0;  // tokens the state has absorbed
};

// Encodes row `row` of `state`. `tokens` is recorded as-is.
absl::StatusOr<std::string> EncodeStateRow(const Model& model, const std::string& fingerprint,
                                           const State& state, int64_t row, int64_t tokens);

// Decodes and verifies: format and version, the model fingerprint, the checksum, and
// every tensor's name and shape against model.state_spec(). Errors are
// InvalidArgument (malformed) or FailedPrecondition (a different model's state).
absl::StatusOr<DecodedState> DecodeStateRow(const Model& model, const std::string& fingerprint,
                                            std::string bytes);

}  // namespace fwmodel
