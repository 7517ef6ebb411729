// The model library's one interface: a contract-v1 network over named weights, with
// the sequence form (training, scoring, prefill) and the batched recurrent step
// (decode). See ../shared/spec/models.md; docs/model-format.md.
//
// Thread-safety: a Model is immutable after construction (weights are never written
// by these methods, except ForwardUnchecked(..., training = true), the trainer's,
// which updates PKM batch-norm statistics), so concurrent Forward/Step calls on
// distinct States are safe.
// A State is a plain value owned by its caller.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "models/architectures/state.h"
#include "models/base/config.h"

namespace fwmodel {

class Mixer;  // models/architectures/mixer.h

// Expected tensor names and shapes of a checkpoint for `config`, sorted by name.
std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeightShapes(
    const ModelConfig& config);

// True for weights that are statistics rather than trainable parameters (the PKM
// batch norms' running_mean and running_var).
bool IsBufferName(const std::string& name);

// Floating-point operations per token of the recurrent step (decode), counted as 2
// per multiply-add of every matrix product (embedding lookup free; norms,
// activations, softmax, top-k selection and the mixers' elementwise recurrences
// not counted). A PKM block counts its query projection (H_m·d_k·d), both half-key
// score products (H_m·n_k·d_k), the k² candidate sums per head as one FLOP each,
// and the weighted sum of the k·H_m value rows it reads (k·H_m·d); never the n_k²
// slots it does not read.
int64_t FlopsPerToken(const ModelConfig& config);

class Model {
 public:
  // Takes float32 CPU weights named per the contract; checks names and shapes exactly
  // (missing, unexpected and wrong-shaped tensors are errors that name the tensor).
  static absl::StatusOr<Model> Create(const ModelConfig& config,
                                      std::map<std::string, torch::Tensor> weights,
                                      const ModelOptions& options = {});
  // Random initialisation suitable for training from scratch. Deterministic in seed.
  static absl::StatusOr<Model> InitRandom(const ModelConfig& config, uint64_t seed,
                                          const ModelOptions& options = {});

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // Weights by contract name (on options().device, in options().dtype).
  const std::map<std::string, torch::Tensor>& weights() const { return weights_; }
  // Trainable parameters: every weight except the batch norms' running statistics
  // (buffers in PyTorch terms).
  int64_t parameter_count() const;
  // Parameters in product-key memories: the value tables (n_k² · d per PKM block).
  int64_t memory_parameter_count() const;
  // Value slots of all product-key memories (n_k² per PKM block); 0 without PKM.
  int64_t memory_slots() const;

  // Layer `layer`'s mixer (its architecture's forms), bound to its weights. Only for the
  // contract's architectures (config().has_whole_blocks() false): RWKV and DeltaNet blocks
  // are whole.
  const Mixer& mixer(int layer) const;

  const std::vector<StateTensorSpec>& state_spec() const { return state_spec_; }
  // Bytes of one session's state in the compute dtype.
  int64_t state_bytes_per_session() const;
  // The state of `batch` fresh sessions (no tokens absorbed).
  State InitialState(int64_t batch) const;

  // Sequence form. tokens: int64 [B, T] with T >= 1; `state` (batch B) is advanced
  // past all T tokens. Returns logits [B, T, vocab]. Differentiable in the weights and
  // in the incoming state. Validates shapes and token ids; never throws.
  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& tokens, State* state) const;
  // Prefill: the sequence form that returns only the logits after the last token, [B,
  // vocab] (equal to Forward's [:, T - 1]); the head runs on B rows instead of B·T (on a
  // GPU prefill job of 16,384 tokens at a 65,536 vocabulary, Forward's logits alone are
  // 4 GiB). Validates as Forward; never throws.
  absl::StatusOr<torch::Tensor> Prefill(const torch::Tensor& tokens, State* state) const;
  // Batched recurrent step. tokens: int64 [B]; row b of `state` absorbs tokens[b].
  // Returns logits [B, vocab]. Validates; never throws.
  absl::StatusOr<torch::Tensor> Step(const torch::Tensor& tokens, State* state) const;

  // Unchecked versions for hot loops inside the model library (trainer); they
  // throw c10::Error on bad input. `training` (trainer only): the PKM query batch
  // norms normalise with the batch's statistics (over all B·T tokens) and update
  // their running statistics in place with momentum 0.1, as PyTorch's BatchNorm1d in
  // training mode. This writes weights; it must not run concurrently with anything
  // else on the model. Without PKM blocks it changes nothing.
  torch::Tensor ForwardUnchecked(const torch::Tensor& tokens, State* state,
                                 bool training = false) const;
  torch::Tensor StepUnchecked(const torch::Tensor& tokens, State* state) const;

  // Switches weights to trainable leaves (requires_grad) for the trainer; the running
  // statistics of batch norms never require grad.
  void SetRequiresGrad(bool requires_grad);
  // Weights as float32 CPU tensors, detached, in name order (for saving).
  std::map<std::string, torch::Tensor> ExportWeights() const;

  // RWKV and DeltaNet only (a no-op otherwise): drops this model's reference to every
  // matrix (2-D weight), for a server whose native kernels, built from this model, serve
  // decode, prefill and Score; a tensor a kernel keeps (the embedding) lives on through it.
  // Afterwards Forward and Step fail with FailedPrecondition, ExportWeights leaves the
  // matrices out, and config(), state_spec(), InitialState() and parameter_count() work
  // as before. Not thread-safe: before any other use of the model begins.
  void ReleaseMatrices();
  bool matrices_released() const { return matrices_released_; }

  Model(Model&&) = default;
  Model& operator=(Model&&) = default;

 private:
  struct LayerWeights;
  Model() = default;
  absl::Status BindWeights();

  torch::Tensor EmbedTokens(const torch::Tensor& tokens) const;
  // The sequence form up to the last block's output h [B, T, d] (the head's input).
  torch::Tensor ForwardHidden(const torch::Tensor& tokens, State* state, bool training) const;
  torch::Tensor Head(const torch::Tensor& h) const;
  // The block's FFN (dense or product-key memory) of x [..., d], per token.
  torch::Tensor Ffn(const LayerWeights& w, const torch::Tensor& x, bool training = false) const;
  // h + Ffn(w, x): the up and down products as grouped GEMV launches (relu² and the
  // residual fused) where the kernel path applies (model.cc's KernelPathApplies, at most
  // 16 rows, not PKM, not training), else LibTorch.
  torch::Tensor FfnResidual(const LayerWeights& w, const torch::Tensor& x, const torch::Tensor& h,
                            bool training) const;
  // config().ffn's activation of the up product u (geglu halves it).
  torch::Tensor Activate(torch::Tensor u) const;
  torch::Tensor PkmFfn(const LayerWeights& w, const torch::Tensor& x, bool training) const;
  // The mixer's input projections (q|r, k, v) of a [B, T, d], each through the causal
  // depthwise conv when configured (advancing the conv state).
  void ProjectInputs(int layer, const torch::Tensor& a, State* state, torch::Tensor proj[3]) const;
  // h + O(mixer(a)) of layer `layer`: the sequence form (a [B, T, d]) or the step (a
  // [B, d]), advancing the mixer's and the conv's state; the output product and the
  // residual as one GEMV launch where the kernel path applies.
  torch::Tensor MixerResidual(int layer, const torch::Tensor& a, const torch::Tensor& h,
                              State* state, bool step) const;
  // The three projections through the causal depthwise convolution as one launch of the
  // fused kernel (models/gpu/depthwise_conv.h; its CPU mirror on CPU tensors), in place
  // in proj (made contiguous); *conv_state replaced by the advanced state.
  void FusedDepthwiseConv(int layer, torch::Tensor proj[3], torch::Tensor* conv_state) const;
  absl::Status CheckState(const State& state, int64_t batch) const;
  // Forward's and Prefill's checks: matrices not released, tokens int64 [B, T] in the
  // vocabulary, `state` of batch B.
  absl::Status CheckSequenceInput(const torch::Tensor& tokens, const State& state) const;

  ModelConfig config_;
  ModelOptions options_;
  std::map<std::string, torch::Tensor> weights_;
  bool matrices_released_ = false;
  int64_t released_parameter_count_ = 0;  // parameter_count() once released
  std::vector<std::shared_ptr<LayerWeights>> layers_;
  std::vector<StateTensorSpec> state_spec_;
  // Index in State::tensors of each layer's first mixer tensor and of its conv state
  // (-1 when dconv is off).
  std::vector<int> mixer_state_index_;
  std::vector<int> conv_state_index_;
};

// The product-key memory's second top-k needs only the candidates (m, n) with
// (m+1)(n+1) <= k (the others are dominated by k better ones with lower candidate
// indices): those pairs, flattened m0, n0, m1, n1, ... in order of m*k + n. Cached per
// thread; the reference stays valid until the thread asks for another k.
const std::vector<int64_t>& PkmCandidatePairs(int64_t k);

}  // namespace fwmodel
