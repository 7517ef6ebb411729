// A block's token mixer, one implementation per architecture of the contract
// (../shared/spec/models.md, "Mixer ..."): linear_attention.cc, fast_weight.cc, aft.cc.
// Each file holds its architecture's weights and state layout, its sequence form, its
// recurrent step and its native float32 row update side by side; Model (model.cc) and
// NativeStep (native_step.cc) only call this interface. Adding a mixer means one new
// file and one line in MakeMixer (mixer.cc).
//
// What is common to every mixer stays with the model: the input projections q|r, k, v
// (names from ProjectionNames()), the optional causal depthwise conv on them, and the
// output projection o. A mixer maps the projected inputs to y (before o).
//
// Thread-safety: a bound Mixer and a NativeMixer are immutable; their methods may run
// concurrently on distinct states.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "models/architectures/state.h"
#include "models/base/config.h"

namespace fwmodel {

// The native (float32 CPU) side of one layer's mixer, used by NativeStep.
class NativeMixer {
 public:
  // The tokens of a batch of sessions, as NativeStep lays them out.
  struct Tokens {
    // [N, proj_width] projected inputs, N = sessions · steps, session-major: q|r, k, v
    // at columns 0, d, 2d (after the dconv), ExtraProjection() rows from 3d.
    const float* proj = nullptr;
    int64_t proj_width = 0;
    float* y = nullptr;                  // [N, d] mixer outputs, written
    const int64_t* rows = nullptr;       // the pool row of each session
    int64_t steps = 1;                   // tokens per session, absorbed in order
    float* const* state = nullptr;       // base of each of the mixer's state tensors in the pool
    const int64_t* state_row = nullptr;  // row stride (floats) of each
  };

  virtual ~NativeMixer() = default;
  // Rows of the fused input projection beyond q|r, k, v, [n, d] row-major (empty:
  // none). Their outputs reach Absorb after the three projections.
  virtual std::vector<float> ExtraProjection() const { return {}; }
  // Floats of per-thread scratch that Absorb needs.
  virtual int64_t ScratchFloats() const { return 0; }
  // Sessions [begin, end) of `tokens` absorb their tokens in order: state rows updated
  // in place, y written. Called once per layer per task of the step, never per token.
  virtual void Absorb(const Tokens& tokens, int64_t begin, int64_t end, float* scratch) const = 0;
};

// One layer's mixer. Created for a config (the contract-level queries work at once);
// Bind attaches a layer's weights for Forward, Step and MakeNative.
class Mixer {
 public:
  // A weight of this layer by name relative to "blocks.{i}." (e.g. "mixer.beta.weight").
  using WeightGetter = std::function<torch::Tensor(const std::string& suffix)>;

  virtual ~Mixer() = default;

  // ---- The contract (config only)
  // Names of the three input projections ("mixer.<name>.weight"): q|r, k, v.
  virtual std::array<const char*, 3> ProjectionNames() const { return {"q", "k", "v"}; }
  // The mixer's weights besides the projections, their convs and o: names relative to
  // "blocks.{i}.", shapes.
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> ExtraWeightShapes() const {
    return {};
  }
  // Multiply-adds per token of the mixer's matrix products: q|r, k, v, o and its own.
  virtual int64_t MacsPerToken() const;
  // Per-session state tensors, names relative to "blocks.{i}.".
  virtual std::vector<StateTensorSpec> StateSpec() const = 0;

  // ---- One layer
  // Takes this layer's weights (on the model's device, in its dtype).
  virtual void Bind(const WeightGetter& get) { (void)get; }
  // Sets fresh-session values in the mixer's state tensors (allocated as zeros).
  virtual void InitState(torch::Tensor* state) const { (void)state; }
  // Sequence form: a [B, T, d] the mixer's input (after norm1), proj[3] its projected
  // inputs [B, T, d] (after the dconv); state points at its StateSpec().size() tensors,
  // advanced past the T tokens (replaced, not written in place). Returns y [B, T, d].
  virtual torch::Tensor Forward(const torch::Tensor& a, const torch::Tensor proj[3],
                                torch::Tensor* state) const = 0;
  // Recurrent form, one token: a and proj[i] [B, d]. Returns y [B, d].
  virtual torch::Tensor Step(const torch::Tensor& a, const torch::Tensor proj[3],
                             torch::Tensor* state) const = 0;
  // The native side of this bound layer (float32 CPU weights; checked by NativeStep).
  virtual std::unique_ptr<NativeMixer> MakeNative() const = 0;

 protected:
  Mixer(const ModelConfig& config, const ModelOptions& options)
      : config_(config), options_(options) {}
  const ModelConfig config_;
  const ModelOptions options_;
};

// The sequence form's per-head outputs of consecutive chunks ([B, H, n_i, dh], in
// order) as one [B, T, d] tensor (heads merged). Used by the chunked attention mixers.
torch::Tensor MergeChunkHeads(const std::vector<torch::Tensor>& outputs, int64_t batch,
                              int64_t tokens, int64_t d_model);

// The one place that picks a mixer: by config.architecture. Null for the RWKV and
// DeltaNet architectures, whose blocks are whole (MakeWholeBlock, block.h).
std::unique_ptr<Mixer> MakeMixer(const ModelConfig& config, const ModelOptions& options = {});

// Whether a fused kernel may read these tensors (undefined ones are skipped): each on
// `device`, float32 (or, with `bf16_ok`, bfloat16: ModelOptions::bf16_matrices), and,
// while grad mode is on, none requiring grad (the kernels have no backward). Which
// devices run a kernel is the caller's test. Defined in mixer.cc.
bool KernelInputsOk(const torch::Device& device,
                    std::initializer_list<const torch::Tensor*> tensors, bool bf16_ok = false);

// The aft recurrence (aft's time mix, and RWKV-4's: the same formulas with w =
// exp(time_decay)) over the T tokens of r_raw, k, v ([B, T, d], or [B, d] for one token)
// as one launch of the fused kernel (models/gpu/aft.h) on their CUDA device (on the
// current stream, no host synchronisation), or by the kernel's CPU mirror for CPU tensors:
// returns sigmoid(r_raw) ⊙ wkv, shaped like r_raw, and replaces *state ([B, 3, d]: α, β,
// p) with a new tensor. float32 tensors, no autograd; throws c10::Error (naming `what`)
// on a mismatch or a failed launch. Defined in aft.cc.
torch::Tensor AftRecurrenceKernel(const torch::Tensor& r_raw, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& time_decay,
                                  const torch::Tensor& time_first, torch::Tensor* state,
                                  const char* what);

}  // namespace fwmodel
