// Versioned, checksummed encoding of one session's recurrent state, tied to the model
// by its fingerprint. Used for session export/import and for spilling idle sessions.
//
// The bytes are a safetensors file: one float32 tensor per state tensor (per-session
// shape, no batch dimension) and __metadata__ {format: "fwserve-state", version: "2",
// fingerprint, tokens, sha256} plus caller labels (keys starting "x-", e.g. the session
// id). The sha256 covers every other metadata field (key and value, NUL-terminated, in
// key order) and then the data section, so no trusted field can change unnoticed. When tokens > 0
// it also holds "next_logits" [vocab]: the output of the step that absorbed the last token, which
// the next token is drawn from. Readable by any safetensors tool.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "models/architectures/model.h"
#include "models/checkpoints/state_format.h"

namespace fwmodel {

struct DecodedState {
  State state;         // batch 1, in the model's compute dtype and device
  int64_t tokens = 0;  // tokens the state has absorbed
  // float32 CPU [vocab]; defined iff tokens > 0.
  torch::Tensor next_logits;
  // The caller's "x-..." labels, as encoded.
  std::map<std::string, std::string> labels;
};

// Encodes row `row` of `state`. `tokens` is recorded as-is; `next_logits` ([vocab], any
// dtype/device) is required when tokens > 0 and ignored otherwise. Label keys must start
// with "x-".
absl::StatusOr<std::string> EncodeStateRow(const Model& model, const std::string& fingerprint,
                                           const State& state, int64_t row, int64_t tokens,
                                           const torch::Tensor& next_logits = {},
                                           const std::map<std::string, std::string>& labels = {});

// Decodes and verifies: format and version, the model fingerprint, the checksum, and
// every tensor's name and shape against model.state_spec(). Errors are
// InvalidArgument (malformed) or FailedPrecondition (a different model's state).
absl::StatusOr<DecodedState> DecodeStateRow(const Model& model, const std::string& fingerprint,
                                            std::string bytes);

}  // namespace fwmodel
