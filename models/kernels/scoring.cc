#include "models/kernels/scoring.h"

#include <algorithm>

#include "models/kernels/native_step.h"

namespace fwmodel {

absl::StatusOr<std::vector<double>> ScoreTokens(const Model& model,
                                                const std::vector<int64_t>& tokens,
                                                ScoringContext* context, int64_t chunk,
                                                NativeStep* native) {
  c10::NoGradGuard no_grad;
  std::vector<double> logprobs;
  if (tokens.empty()) return logprobs;
  ScoringContext fresh;
  if (context == nullptr) context = &fresh;
  if (context->state.tensors.empty()) context->state = model.InitialState(1);
  const int64_t n = static_cast<int64_t>(tokens.size());
  logprobs.reserve(static_cast<size_t>(n));
  torch::Tensor all = torch::tensor(tokens, torch::kInt64);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    torch::Tensor piece = all.narrow(0, start, len);
    absl::StatusOr<torch::Tensor> logits;
    if (native != nullptr) {
      // The kernel reads its pool in place: contiguous rows (a state from Forward may be
      // a view).
      for (torch::Tensor& t : context->state.tensors) t = t.contiguous();
      // [1, len, vocab] as Forward gives, from the kernel's row 0: the context's state.
      try {
        logits = torch::empty({1, len, model.config().vocab_size}, torch::kFloat32);
      } catch (const c10::Error&) {
        return absl::ResourceExhaustedError("score: no memory for a chunk's logits");
      }
      const absl::Status absorbed = native->AbsorbEveryPosition(
          absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(len)),
          len, {0}, &context->state, logits->data_ptr<float>());
      if (!absorbed.ok()) return absorbed;
    } else {
      logits = model.Forward(piece.unsqueeze(0), &context->state);
    }
    if (!logits.ok()) return logits.status();
    // Row i of `predictors` predicts token i of the piece.
    torch::Tensor logp = torch::log_softmax(logits->squeeze(0).to(torch::kFloat64), -1).cpu();
    torch::Tensor predictors = logp.narrow(0, 0, len - 1);
    torch::Tensor targets = piece.narrow(0, 1, len - 1);
    if (context->next_logits.defined()) {
      torch::Tensor first = torch::log_softmax(context->next_logits.to(torch::kFloat64).cpu(), -1);
      predictors = torch::cat({first.unsqueeze(0), predictors}, 0);
      targets = piece;
    }
    torch::Tensor picked = predictors.gather(1, targets.unsqueeze(1)).squeeze(1).contiguous();
    const double* values = picked.data_ptr<double>();
    logprobs.insert(logprobs.end(), values, values + picked.numel());
    // A copy: a view would keep the whole chunk's logits alive.
    context->next_logits = logits->squeeze(0)[len - 1].detach().clone();
  }
  return logprobs;
}

}  // namespace fwmodel
