// Small random models for tests. Every weight (including conv taps, biases, decays)
// is random, so no part of the network is trivially the identity.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/architectures/model.h"
#include "models/base/config.h"
#include "models/checkpoints/safetensors.h"
#include "models/kernels/scoring.h"

namespace fwtest {

fwmodel::ModelConfig TinyConfig(fwmodel::Architecture arch, fwmodel::FfnKind ffn, int dconv_kernel,
                                int nu = 1, bool tie = false);

// `config` with a product-key memory as the FFN of block `layer`: 2 heads, n_k = 5,
// k = 3, d_k = 6.
fwmodel::ModelConfig WithPkm(fwmodel::ModelConfig config, int layer = 1);

// Model with all weights drawn i.i.d. normal with standard deviation `scale`
// (LayerNorm weights around 1; batch-norm running variances in [0.5, ~2]).
// Deterministic in seed; the same weights on every `device`.
fwmodel::Model RandomModel(const fwmodel::ModelConfig& config, uint64_t seed,
                           torch::ScalarType dtype = torch::kFloat64, double scale = 0.5,
                           torch::Device device = torch::kCPU);

// One configuration of the form-equivalence tests (and of the native step's): every
// architecture x ffn x dconv (0, 3), nu in {1, 3} for fast_weight, plus a PKM block
// (geglu, nu 2) per architecture and dconv. Tied embeddings when dconv is 0.
struct ConfigCase {
  fwmodel::Architecture arch;
  fwmodel::FfnKind ffn;
  int dconv;
  int nu;
  bool pkm = false;  // block 1's FFN is a product-key memory
  int d_model = 16;  // TinyConfig's; others give head widths that are not a multiple of 8
  int n_heads = 2;   // TinyConfig's; the head count of every architecture

  // An RWKV case (RwkvConfigCases) ignores ffn, dconv, nu and pkm: RWKV-7 has its LoRA
  // ranks off the vector width, RWKV-4 one head; the head is tied when d_model < 64.
  fwmodel::ModelConfig Config() const;
  // For test names: e.g. "aft_geglu_dconv3_nu2_pkm".
  std::string Name() const;
};
std::vector<ConfigCase> AllConfigCases();
// RWKV-7 with heads of 8 and with one head of 64 (the real models' width), and RWKV-4.
std::vector<ConfigCase> RwkvConfigCases();
// DeltaNet and Gated DeltaNet (issue 49): q/k heads of 8, with and without short
// convolutions, nu value heads per q/k head; the head tied without convolutions.
std::vector<ConfigCase> DeltaNetConfigCases();
// A parameterised test's name for its ConfigCase (its Name()).
std::string ConfigCaseName(const testing::TestParamInfo<ConfigCase>& info);

// Random token ids in [0, vocab) as int64 [batch, steps].
torch::Tensor RandomTokens(int64_t batch, int64_t steps, int64_t vocab, uint64_t seed);

// max |a - b| as a double.
double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b);

// Expects a and b of the same shape, a finite, and max |a - b| <= tolerance · (1 + max |b|).
// `what` names the comparison in the failure message.
void ExpectNearRelative(const torch::Tensor& a, const torch::Tensor& b, double tolerance,
                        const std::string& what);

// The native step (NativeStep::Create(model)) against Model::Step, row by row in place:
// six sessions in a pool of eight rows; each of `steps` steps a different subset of them,
// in a different order, absorbs a random token, and each session is mirrored by a
// batch-1 LibTorch state. Logits and states equal the mirror's within `tolerance`
// (ExpectNearRelative); rows 4 and 7 are never written.
void ExpectNativeStepEqualsModelStepRowByRow(const fwmodel::Model& model, int steps,
                                             double tolerance);

// Prefill: two sessions (pool rows 3 and 1 of 5) absorb nine tokens each in one
// NativeStep::Absorb call; the reference steps them one token at a time with Model::Step.
// Then one more decode Step. Logits and states within `tolerance`.
void ExpectAbsorbEqualsSteppingTokenByToken(const fwmodel::Model& model, double tolerance);

// Scoring on the native kernel (ScoreTokens given a NativeStep) equals the sequence form:
// 23 tokens from a fresh context in chunks of 7 (a ragged last chunk), then 6 more tokens
// continuing both contexts; every log-probability within `tolerance` (absolute), the
// contexts' states and next-token logits within it (relative).
void ExpectNativeScoreEqualsSequenceForm(const fwmodel::Model& model, double tolerance);

// Splitting a native call over threads changes no result: NativeStep with 3 threads
// against 1 on clones of one pool (a warm-up step first, so states are not initial), for
// a decode step of `sessions` rows (shuffled in [0, sessions)) and a prefill of
// prompt_rows.size() sessions x `prompt_tokens` tokens, in a pool of `capacity` rows.
// Logits and every state within `tolerance` (ExpectNearRelative); messages start with
// `label`.
void ExpectThreeThreadsEqualOne(const fwmodel::Model& model, int64_t sessions, int64_t capacity,
                                const std::vector<int64_t>& prompt_rows, int64_t prompt_tokens,
                                double tolerance, const std::string& label);

// Writes `tensors` (float32, by their names in the files) into `dir` as a Hugging Face
// directory does: model.safetensors, or with shards > 1 the files
// model-0000{s}-of-0000{shards}.safetensors (tensor i in shard i % shards, in name order)
// and model.safetensors.index.json. `dtype` is kF32 or kBF16 (rounded to nearest even).
void WriteHuggingFaceSafetensors(const std::string& dir,
                                 const std::map<std::string, torch::Tensor>& tensors,
                                 int shards = 1, fwmodel::DType dtype = fwmodel::DType::kF32);

}  // namespace fwtest
