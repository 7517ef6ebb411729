#include "server/engine/stepper.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "server/base/log.h"

namespace fwserve {

Stepper::Stepper(const fwmodel::Model& model, const std::string& decode_kernel,
                 const std::string& name)
    : model_(model), vocab_(model.config().vocab_size) {
  if (decode_kernel != "native" || !model_.options().device.is_cpu() ||
      model_.options().dtype != torch::kFloat32) {
    return;
  }
  auto native = fwmodel::NativeStep::Create(model_);
  auto native_prefill = fwmodel::NativeStep::Create(model_);
  if (native.ok() && native_prefill.ok()) {
    native_step_ = std::move(*native);
    native_prefill_ = std::move(*native_prefill);
  } else {
    Log(LogLevel::kWarning, absl::StrCat("model ", name, ": native decode step unavailable (",
                                         native.status().message(), "); using LibTorch"));
  }
}

absl::Status Stepper::Step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                           StatePool& pool) {
  if (native_step_ != nullptr) {
    // In place: the pool's rows absorb their tokens; no copies of the state.
    step_logits_.resize(rows.size() * static_cast<size_t>(vocab_));
    absl::Status stepped =
        native_step_->Step(tokens, rows, pool.mutable_state(), step_logits_.data());
    if (stepped.ok()) pool.SetLogits(rows, step_logits_.data());
    return stepped;
  }
  const torch::Device device = model_.options().device;
  torch::Tensor row_index = torch::tensor(rows, torch::kInt64).to(device);
  fwmodel::State state = pool.Gather(row_index);
  auto logits = model_.Step(torch::tensor(tokens, torch::kInt64).to(device), &state);
  if (!logits.ok()) return logits.status();
  pool.Scatter(row_index, state);
  pool.SetLogits(row_index, *logits);
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> Stepper::Prefill(const torch::Tensor& tokens, fwmodel::State* state) {
  const int64_t batch = tokens.size(0);
  const int64_t length = tokens.size(1);
  if (native_prefill_ != nullptr) {
    // The rows are the job's own copy ([B, ...], contiguous): rows 0..B-1.
    torch::Tensor contiguous = tokens.contiguous();
    std::vector<int64_t> rows(static_cast<size_t>(batch));
    std::iota(rows.begin(), rows.end(), int64_t{0});
    torch::Tensor logits = torch::empty({batch, vocab_}, torch::kFloat32);
    absl::Status absorbed = native_prefill_->Absorb(
        absl::MakeConstSpan(contiguous.data_ptr<int64_t>(), static_cast<size_t>(batch * length)),
        length, rows, state, logits.data_ptr<float>());
    if (!absorbed.ok()) return absorbed;
    return logits;
  }
  auto logits = model_.Forward(tokens, state);
  if (!logits.ok()) return logits.status();
  return logits->select(1, length - 1).to(torch::kCPU, torch::kFloat32).contiguous();
}

}  // namespace fwserve
