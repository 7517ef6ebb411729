// The contract's scoring convention (../shared/spec/models.md) over either form of a
// model: the sequence form in chunks, or a native kernel's prefill with every
// position's logits.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "models/architectures/model.h"

namespace fwmodel {

// What scoring continues from: a batch-1 state and the logits that predict the next
// token (undefined before the first token). Default-constructed = a fresh session.
struct ScoringContext {
  State state;
  torch::Tensor next_logits;
};

class NativeStep;  // models/kernels/native_step.h

// Natural-log probabilities of tokens by the contract's scoring convention. From a
// fresh context, returns tokens.size() - 1 values: log p(t_i | t_<i) for i >= 1. From
// a context that already holds tokens, returns one value per token. Advances
// `context` past the tokens. Runs the sequence form in chunks of `chunk` tokens, or,
// given `native` (a native kernel of `model`, used by this call alone), its prefill
// with every position's logits: equal up to float32 summation order, and for RWKV
// several times faster. The native path advances context->state in place (Forward
// replaces its tensors): a context to keep apart must be a Clone, not a copy.
absl::StatusOr<std::vector<double>> ScoreTokens(const Model& model,
                                                const std::vector<int64_t>& tokens,
                                                ScoringContext* context = nullptr,
                                                int64_t chunk = 1024, NativeStep* native = nullptr);

}  // namespace fwmodel
