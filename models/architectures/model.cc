#include "models/architectures/model.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/architectures/block.h"
#include "models/architectures/delta_net.h"
#include "models/architectures/gemv_launch.h"
#include "models/architectures/mixer.h"
#include "models/architectures/rwkv_block.h"
#include "models/gpu/depthwise_conv.h"
#include "models/gpu/depthwise_conv_host.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/gpu/row_copy.h"
#endif

namespace fwmodel {

// Whether the contract's blocks and the head run their kernel path (KernelPathApplies) on
// CPU float32 tensors too, with the kernels' CPU mirrors: for tests only (slow).
// Thread-safe; read at each call. Declared here (and in the tests that use it), not in a
// header: no production caller.
void SetModelHostKernelsForTesting(bool on);

namespace {

using torch::indexing::Slice;

std::atomic<bool> model_host_kernels_for_testing{false};

// Whether x's products and elementwise work may run as the fused kernels (models/gpu):
// float32 x on a CUDA device where the kernels were built, or on the CPU where a test
// asked for the mirrors; every tensor in `with` (weights, state, residual; undefined ones
// skipped) on x's device, float32 or bf16 (ModelOptions::bf16_matrices), and no autograd
// graph to record (the kernels have no backward).
bool KernelPathApplies(const torch::Tensor& x, std::initializer_list<const torch::Tensor*> with) {
  if (!(x.is_cuda() && GemvCudaKernelsBuilt()) &&
      !(x.is_cpu() && model_host_kernels_for_testing.load())) {
    return false;
  }
  return KernelInputsOk(x.device(), {&x}) && KernelInputsOk(x.device(), with, /*bf16_ok=*/true);
}

// Rows of x [..., width]: the grouped GEMV takes at most kernels::kGemvMaxRows.
bool GemvRows(const torch::Tensor& x) {
  const int64_t width = x.size(-1);
  const int64_t rows = width > 0 ? x.numel() / width : 0;
  return rows >= 1 && rows <= kernels::kGemvMaxRows;
}

std::string LayerName(int i, const std::string& suffix) {
  return absl::StrCat("blocks.", i, ".", suffix);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Causal depthwise convolution over time. x: [B, T, d]; history: [B, K-1, d], the
// previous K-1 inputs (zeros before the session's first token). Returns y [B, T, d]
// and replaces history with the last K-1 inputs.
torch::Tensor CausalDepthwiseConv(const torch::Tensor& x, const torch::Tensor& weight,
                                  const torch::Tensor& bias, torch::Tensor* history) {
  const int64_t kernel = weight.size(1);
  const int64_t steps = x.size(1);
  torch::Tensor padded = torch::cat({*history, x}, 1);  // [B, K-1+T, d]
  torch::Tensor y = bias;
  for (int64_t j = 0; j < kernel; ++j) {
    y = y + weight.select(1, j) * padded.narrow(1, j, steps);
  }
  *history = padded.narrow(1, steps, kernel - 1);
  return y;
}

}  // namespace

struct Model::LayerWeights {
  torch::Tensor norm1_w, norm1_b, norm2_w, norm2_b;
  torch::Tensor proj[3];  // q|r, k, v
  torch::Tensor conv_w[3], conv_b[3];
  torch::Tensor o_w, o_b;
  std::unique_ptr<Mixer> mixer;  // bound to this layer's weights; null for whole blocks
  std::unique_ptr<Block> block;  // the whole block, bound (config.has_whole_blocks() only)
  torch::Tensor up_w, up_b, down_w, down_b;
  bool pkm = false;  // product-key memory instead of up/down
  torch::Tensor query_w, bn_w, bn_b, bn_mean, bn_var, keys, values;
  // PkmCandidatePairs(pkm_topk) as int64 [pairs, 2] on the model's device, made once:
  // a per-call host-to-device copy would break CUDA Graph capture (models/kernels/graphed_step.h).
  torch::Tensor pkm_pairs;
};

// ---------------------------------------------------------------------------
// State

#if defined(FWSERVE_CUDA_KERNELS)
namespace {

// Floats per row of `t` (the product of its sizes after the first).
int64_t RowFloats(const torch::Tensor& t) {
  int64_t floats = 1;
  for (int64_t i = 1; i < t.dim(); ++i) floats *= t.size(i);
  return floats;
}

// Whether the row-copy kernels (models/gpu/row_copy.h) may copy rows `rows` of `pool`
// (State::Gather; State::Scatter checks its source too): `rows` a contiguous 1-D int64
// CUDA tensor, every pool tensor a contiguous float32 tensor on its device with the
// same first dimension and at least one float per row, and no autograd graph to record
// (the kernels have no backward).
bool RowCopyApplies(const std::vector<torch::Tensor>& pool, const torch::Tensor& rows) {
  if (pool.empty() || !rows.defined() || !rows.is_cuda() || rows.scalar_type() != torch::kInt64 ||
      rows.dim() != 1 || !rows.is_contiguous()) {
    return false;
  }
  const bool grad = c10::GradMode::is_enabled();
  for (const torch::Tensor& t : pool) {
    if (!t.defined() || t.device() != rows.device() || t.scalar_type() != torch::kFloat32 ||
        t.dim() < 1 || !t.is_contiguous() || t.size(0) != pool[0].size(0) || RowFloats(t) < 1 ||
        (grad && t.requires_grad())) {
      return false;
    }
  }
  return true;
}

// Whether `source` may be scattered into `pool` at `rows` by the kernels (RowCopyApplies
// holding): as many tensors, each contiguous float32 on rows' device, [rows.numel(),
// the pool tensor's row shape], sharing no storage with its pool tensor, and without
// autograd to record.
bool RowScatterApplies(const std::vector<torch::Tensor>& pool, const torch::Tensor& rows,
                       const std::vector<torch::Tensor>& source) {
  if (source.size() != pool.size()) return false;
  const bool grad = c10::GradMode::is_enabled();
  for (size_t i = 0; i < pool.size(); ++i) {
    const torch::Tensor& s = source[i];
    if (!s.defined() || s.device() != rows.device() || s.scalar_type() != torch::kFloat32 ||
        !s.is_contiguous() || s.dim() != pool[i].dim() || s.size(0) != rows.size(0) ||
        s.sizes().slice(1) != pool[i].sizes().slice(1) ||
        s.storage().is_alias_of(pool[i].storage()) || (grad && s.requires_grad())) {
      return false;
    }
  }
  return true;
}

// Rows `rows` of every tensor of `pool` into `batch` (gather: into new tensors
// [rows.numel(), row shape], torch::empty on the pool's device, appended to *batch) or
// from `batch` into `pool` (scatter), by one launch per kRowCopyMaxTensors tensors on the
// current stream of rows' device. No host synchronisation: it runs inside CUDA Graph
// capture (the gather's outputs then come from the graph's memory pool).
void CopyRows(const std::vector<torch::Tensor>& pool, const torch::Tensor& rows, bool gather,
              std::vector<torch::Tensor>* batch) {
  const c10::cuda::CUDAGuard device(rows.device());
  const int64_t n = rows.size(0);
  const size_t count = pool.size();
  std::vector<float*> pool_data(count), batch_data(count);
  std::vector<int64_t> row_floats(count);
  for (size_t i = 0; i < count; ++i) {
    if (gather) {
      std::vector<int64_t> shape = pool[i].sizes().vec();
      shape[0] = n;
      batch->push_back(torch::empty(shape, pool[i].options()));
    }
    pool_data[i] = pool[i].data_ptr<float>();
    batch_data[i] = (*batch)[i].data_ptr<float>();
    row_floats[i] = RowFloats(pool[i]);
  }
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int error = kernels::LaunchRowCopyGroups(
      static_cast<int64_t>(count), n, pool[0].size(0), rows.data_ptr<int64_t>(), pool_data.data(),
      batch_data.data(), row_floats.data(), [&](const kernels::RowCopyArgs& args) {
        return gather ? kernels::LaunchRowGather(args, stream)
                      : kernels::LaunchRowScatter(args, stream);
      });
  TORCH_CHECK(error == 0, gather ? "State::Gather" : "State::Scatter",
              ": the row-copy kernel failed: ", kernels::RowCopyErrorString(error));
}

}  // namespace
#endif

// On CUDA (FWSERVE_CUDA_KERNELS, RowCopyApplies): one launch for up to 64 tensors
// (models/gpu/row_copy.h) instead of an index_select each. Rows outside the pool then
// give zero rows (index_select fails a device assertion); the callers check them.
State State::Gather(const torch::Tensor& rows) const {
  State out;
#if defined(FWSERVE_CUDA_KERNELS)
  if (RowCopyApplies(tensors, rows)) {
    out.tensors.reserve(tensors.size());
    CopyRows(tensors, rows, /*gather=*/true, &out.tensors);
    return out;
  }
#endif
  out.tensors.reserve(tensors.size());
  for (const torch::Tensor& t : tensors) out.tensors.push_back(t.index_select(0, rows));
  return out;
}

// On CUDA as Gather: one launch for up to 64 tensors instead of an index_copy_ each.
void State::Scatter(const torch::Tensor& rows, const State& source) {
#if defined(FWSERVE_CUDA_KERNELS)
  if (RowCopyApplies(tensors, rows) && RowScatterApplies(tensors, rows, source.tensors)) {
    std::vector<torch::Tensor> batch = source.tensors;
    CopyRows(tensors, rows, /*gather=*/false, &batch);
    return;
  }
#endif
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].index_copy_(0, rows, source.tensors[i]);
}

State State::Clone() const {
  State out;
  for (const torch::Tensor& t : tensors) out.tensors.push_back(t.clone());
  return out;
}

State State::Detach() const {
  State out;
  for (const torch::Tensor& t : tensors) out.tensors.push_back(t.detach());
  return out;
}

// ---------------------------------------------------------------------------
// Shapes

std::unique_ptr<Block> MakeWholeBlock(const ModelConfig& config, int layer) {
  if (config.is_rwkv()) return MakeRwkvBlock(config, layer);
  if (config.is_delta_net()) return MakeDeltaNetBlock(config, layer);
  return nullptr;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeightShapes(
    const ModelConfig& c) {
  const int64_t d = c.d_model, f = c.d_ff, V = c.vocab_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  if (c.has_whole_blocks()) {
    // RWKV: BlinkDL's names around the blocks; DeltaNet: fla's without "model.".
    const bool rwkv = c.is_rwkv();
    shapes.push_back({rwkv ? "emb.weight" : "embeddings.weight", {V, d}});
    for (int i = 0; i < c.n_layers; ++i) {
      for (const auto& [name, shape] : MakeWholeBlock(c, i)->WeightShapes()) {
        shapes.push_back({LayerName(i, name), shape});
      }
    }
    if (rwkv) {
      shapes.push_back({"ln_out.weight", {d}});
      shapes.push_back({"ln_out.bias", {d}});
    } else {
      shapes.push_back({"norm.weight", {d}});
    }
    if (!c.tie_embeddings) shapes.push_back({rwkv ? "head.weight" : "lm_head.weight", {V, d}});
    std::sort(shapes.begin(), shapes.end());
    return shapes;
  }
  const std::unique_ptr<Mixer> mixer = MakeMixer(c);
  shapes.push_back({"embed.weight", {V, d}});
  for (int i = 0; i < c.n_layers; ++i) {
    for (const char* norm : {"norm1", "norm2"}) {
      shapes.push_back({LayerName(i, absl::StrCat(norm, ".weight")), {d}});
      shapes.push_back({LayerName(i, absl::StrCat(norm, ".bias")), {d}});
    }
    for (const char* p : mixer->ProjectionNames()) {
      shapes.push_back({LayerName(i, absl::StrCat("mixer.", p, ".weight")), {d, d}});
      if (c.has_dconv()) {
        shapes.push_back(
            {LayerName(i, absl::StrCat("mixer.", p, "_conv.weight")), {d, c.dconv_kernel}});
        shapes.push_back({LayerName(i, absl::StrCat("mixer.", p, "_conv.bias")), {d}});
      }
    }
    shapes.push_back({LayerName(i, "mixer.o.weight"), {d, d}});
    shapes.push_back({LayerName(i, "mixer.o.bias"), {d}});
    for (const auto& [name, shape] : mixer->ExtraWeightShapes()) {
      shapes.push_back({LayerName(i, name), shape});
    }
    if (c.is_pkm_layer(i)) {
      const int64_t Hm = c.pkm_heads, nk = c.pkm_num_keys, dk = c.pkm_dim_key;
      shapes.push_back({LayerName(i, "ffn.query.weight"), {Hm * dk, d}});
      for (const char* p : {"weight", "bias", "running_mean", "running_var"}) {
        shapes.push_back({LayerName(i, absl::StrCat("ffn.query_norm.", p)), {Hm * dk}});
      }
      shapes.push_back({LayerName(i, "ffn.keys"), {Hm, nk, 2, dk / 2}});
      shapes.push_back({LayerName(i, "ffn.values.weight"), {nk * nk, d}});
    } else {
      const int64_t up = c.ffn == FfnKind::kGeglu ? 2 * f : f;
      shapes.push_back({LayerName(i, "ffn.up.weight"), {up, d}});
      shapes.push_back({LayerName(i, "ffn.up.bias"), {up}});
      shapes.push_back({LayerName(i, "ffn.down.weight"), {d, f}});
      shapes.push_back({LayerName(i, "ffn.down.bias"), {d}});
    }
  }
  shapes.push_back({"norm_f.weight", {d}});
  shapes.push_back({"norm_f.bias", {d}});
  if (!c.tie_embeddings) shapes.push_back({"head.weight", {V, d}});
  std::sort(shapes.begin(), shapes.end());
  return shapes;
}

bool IsBufferName(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".running_mean") || ends_with(".running_var");
}

int64_t FlopsPerToken(const ModelConfig& c) {
  const int64_t d = c.d_model, f = c.d_ff, V = c.vocab_size;
  if (c.has_whole_blocks()) {
    int64_t macs = V * d;  // head
    for (int i = 0; i < c.n_layers; ++i) macs += MakeWholeBlock(c, i)->MacsPerToken();
    return 2 * macs;
  }
  const int64_t mixer_macs = MakeMixer(c)->MacsPerToken();  // q|r, k, v, o and its own
  int64_t macs = 0;
  for (int i = 0; i < c.n_layers; ++i) {
    macs += mixer_macs;
    if (c.is_pkm_layer(i)) {
      const int64_t Hm = c.pkm_heads, nk = c.pkm_num_keys, dk = c.pkm_dim_key, k = c.pkm_topk;
      macs += Hm * dk * d;     // query
      macs += Hm * nk * dk;    // two halves of n_k scores of d_k/2 each
      macs += Hm * k * d;      // weighted sum of the value rows read
      macs += Hm * k * k / 2;  // k² candidate sums: 1 FLOP each, so half a multiply-add
    } else {
      macs += (c.ffn == FfnKind::kGeglu ? 3 : 2) * d * f;
    }
  }
  macs += V * d;  // head
  return 2 * macs;
}

// ---------------------------------------------------------------------------
// Construction

bool Bf16MatrixName(const std::string& name) {
  if (name == "head.weight") return true;
  if (name.rfind("blocks.", 0) != 0) return false;
  const size_t dot = name.find('.', 7);
  if (dot == std::string::npos) return false;
  const std::string suffix = name.substr(dot + 1);
  static const char* const kMatrices[] = {"att.receptance.weight",
                                          "att.key.weight",
                                          "att.value.weight",
                                          "att.output.weight",
                                          "att.w1",
                                          "att.w2",
                                          "att.a1",
                                          "att.a2",
                                          "att.v1",
                                          "att.v2",
                                          "att.g1",
                                          "att.g2",
                                          "ffn.key.weight",
                                          "ffn.value.weight"};
  for (const char* matrix : kMatrices) {
    if (suffix == matrix) return true;
  }
  return false;
}

absl::StatusOr<Model> Model::Create(const ModelConfig& config,
                                    std::map<std::string, torch::Tensor> weights,
                                    const ModelOptions& options) {
  absl::Status valid = config.Validate();
  if (!valid.ok()) return valid;
  if (options.dtype != torch::kFloat32 && options.dtype != torch::kFloat64) {
    return absl::InvalidArgumentError("compute dtype must be float32 or float64");
  }
  if (options.device.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "device cuda requested, but this LibTorch build has no usable CUDA device");
  }
  const auto expected = ExpectedWeightShapes(config);
  for (const auto& [name, shape] : expected) {
    auto it = weights.find(name);
    if (it == weights.end()) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor '", name, "'"));
    }
    if (it->second.sizes().vec() != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ",
                                                     ShapeString(it->second.sizes().vec()),
                                                     ", expected ", ShapeString(shape)));
    }
  }
  if (weights.size() != expected.size()) {
    for (const auto& [name, tensor] : weights) {
      bool known = std::any_of(expected.begin(), expected.end(),
                               [&](const auto& e) { return e.first == name; });
      if (!known) return absl::InvalidArgumentError(absl::StrCat("unexpected tensor '", name, "'"));
    }
  }
  if (options.bf16_matrices &&
      (config.architecture != Architecture::kRwkv7 || options.dtype != torch::kFloat32)) {
    return absl::InvalidArgumentError(
        "bf16_matrices: only RWKV-7 with float32 compute keeps its matrices in bf16");
  }
  Model model;
  model.config_ = config;
  model.options_ = options;
  try {
    // "cuda" names the current CUDA device without its index, while every tensor made
    // there reports "cuda:N": resolve it once, so that comparing a tensor's device with
    // options().device (CheckState, the graphed step) means the same device.
    if (!options.device.has_index() && !options.device.is_cpu()) {
      model.options_.device =
          torch::empty({0}, torch::TensorOptions().device(options.device)).device();
    }
    for (auto& [name, tensor] : weights) {
      const torch::ScalarType dtype =
          options.bf16_matrices && Bf16MatrixName(name) ? torch::kBFloat16 : options.dtype;
      model.weights_[name] =
          tensor.detach().to(options.device, dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError("could not move weights to the compute device");
  }
  absl::Status bound = model.BindWeights();
  if (!bound.ok()) return bound;
  return model;
}

absl::Status Model::BindWeights() {
  const ModelConfig& c = config_;
  layers_.clear();
  state_spec_.clear();
  mixer_state_index_.clear();
  conv_state_index_.clear();
  const int64_t d = c.d_model;
  for (int i = 0; i < c.n_layers; ++i) {
    auto w = std::make_shared<LayerWeights>();
    auto get = [&](const std::string& suffix) { return weights_.at(LayerName(i, suffix)); };
    if (c.has_whole_blocks()) {
      w->block = MakeWholeBlock(c, i);
      w->block->Bind(get);
      mixer_state_index_.push_back(static_cast<int>(state_spec_.size()));
      conv_state_index_.push_back(-1);
      for (const StateTensorSpec& s : w->block->StateSpec()) {
        state_spec_.push_back({LayerName(i, s.name), s.shape});
      }
      layers_.push_back(std::move(w));
      continue;
    }
    w->mixer = MakeMixer(c, options_);
    const auto names = w->mixer->ProjectionNames();
    w->norm1_w = get("norm1.weight");
    w->norm1_b = get("norm1.bias");
    w->norm2_w = get("norm2.weight");
    w->norm2_b = get("norm2.bias");
    for (int p = 0; p < 3; ++p) {
      w->proj[p] = get(absl::StrCat("mixer.", names[p], ".weight"));
      if (c.has_dconv()) {
        w->conv_w[p] = get(absl::StrCat("mixer.", names[p], "_conv.weight"));
        w->conv_b[p] = get(absl::StrCat("mixer.", names[p], "_conv.bias"));
      }
    }
    w->o_w = get("mixer.o.weight");
    w->o_b = get("mixer.o.bias");
    w->mixer->Bind(get);
    if (c.is_pkm_layer(i)) {
      w->pkm = true;
      w->query_w = get("ffn.query.weight");
      w->bn_w = get("ffn.query_norm.weight");
      w->bn_b = get("ffn.query_norm.bias");
      w->bn_mean = get("ffn.query_norm.running_mean");
      w->bn_var = get("ffn.query_norm.running_var");
      w->keys = get("ffn.keys");
      w->values = get("ffn.values.weight");
      const std::vector<int64_t>& pairs = PkmCandidatePairs(c.pkm_topk);
      w->pkm_pairs = torch::tensor(pairs, torch::kInt64)
                         .view({static_cast<int64_t>(pairs.size() / 2), 2})
                         .to(options_.device);
    } else {
      w->up_w = get("ffn.up.weight");
      w->up_b = get("ffn.up.bias");
      w->down_w = get("ffn.down.weight");
      w->down_b = get("ffn.down.bias");
    }
    mixer_state_index_.push_back(static_cast<int>(state_spec_.size()));
    for (const StateTensorSpec& s : w->mixer->StateSpec()) {
      state_spec_.push_back({LayerName(i, s.name), s.shape});
    }
    layers_.push_back(std::move(w));
    if (c.has_dconv()) {
      conv_state_index_.push_back(static_cast<int>(state_spec_.size()));
      state_spec_.push_back({LayerName(i, "conv"), {3, c.dconv_kernel - 1, d}});
    } else {
      conv_state_index_.push_back(-1);
    }
  }
  return absl::OkStatus();
}

namespace {
// A fresh weight of a model with whole blocks: the block's own initialisation inside
// blocks, the final norm's weights 1 and biases 0, embedding and head N(0, 1/d).
torch::Tensor InitWholeBlockWeight(const ModelConfig& config, const std::string& name,
                                   const std::vector<int64_t>& shape, at::Generator& generator) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  if (name.rfind("blocks.", 0) == 0) {
    const size_t dot = name.find('.', 7);
    const int layer = std::stoi(name.substr(7, dot - 7));
    return MakeWholeBlock(config, layer)->InitWeight(name.substr(dot + 1), shape, generator);
  }
  if (name == "ln_out.weight" || name == "norm.weight") return torch::ones(shape, f32);
  if (name == "ln_out.bias") return torch::zeros(shape, f32);
  return torch::randn(shape, generator, f32) / std::sqrt(static_cast<double>(config.d_model));
}
}  // namespace

absl::StatusOr<Model> Model::InitRandom(const ModelConfig& config, uint64_t seed,
                                        const ModelOptions& options) {
  absl::Status valid = config.Validate();
  if (!valid.ok()) return valid;
  c10::NoGradGuard no_grad;
  auto generator = at::detail::createCPUGenerator(seed);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const double residual_std = 0.02 / std::sqrt(2.0 * config.n_layers);
  std::map<std::string, torch::Tensor> weights;
  for (const auto& [name, shape] : ExpectedWeightShapes(config)) {
    if (config.has_whole_blocks()) {
      weights[name] = InitWholeBlockWeight(config, name, shape, generator);
      continue;
    }
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    torch::Tensor t;
    if (ends_with("norm1.weight") || ends_with("norm2.weight") || name == "norm_f.weight" ||
        ends_with("query_norm.weight") || ends_with("running_var")) {
      t = torch::ones(shape, f32);
    } else if (ends_with("running_mean")) {
      t = torch::zeros(shape, f32);
    } else if (ends_with("ffn.keys")) {
      // Half-key scores of a normalised query start with unit variance.
      t = torch::randn(shape, generator, f32) / std::sqrt(static_cast<double>(shape[3]));
    } else if (ends_with("ffn.values.weight")) {
      // Lample et al.: values ~ N(0, 1/d).
      t = torch::randn(shape, generator, f32) / std::sqrt(static_cast<double>(shape[1]));
    } else if (ends_with("_conv.weight")) {
      // Identity (pass-through of the current input) plus a little noise.
      t = torch::randn(shape, generator, f32) * 0.02;
      t.select(1, shape[1] - 1).add_(1.0);
    } else if (ends_with("time_decay")) {
      // log of the per-step decay rate, spread from slow (0.05) to fast (2.7).
      t = torch::linspace(-3.0, 1.0, shape[0], f32);
    } else if (ends_with("time_first")) {
      t = torch::zeros(shape, f32);
    } else if (ends_with(".bias")) {
      t = torch::zeros(shape, f32);
    } else if (ends_with("mixer.o.weight") || ends_with("ffn.down.weight")) {
      t = torch::randn(shape, generator, f32) * residual_std;
    } else {
      t = torch::randn(shape, generator, f32) * 0.02;
    }
    weights[name] = t;
  }
  return Create(config, std::move(weights), options);
}

const Mixer& Model::mixer(int layer) const { return *layers_[layer]->mixer; }

int64_t Model::parameter_count() const {
  if (matrices_released_) return released_parameter_count_;
  int64_t n = 0;
  for (const auto& [name, t] : weights_) {
    if (!IsBufferName(name)) n += t.numel();
  }
  return n;
}

int64_t Model::memory_parameter_count() const {
  int64_t n = 0;
  for (const auto& w : layers_) {
    if (w->pkm) n += w->values.numel();
  }
  return n;
}

int64_t Model::memory_slots() const {
  int64_t n = 0;
  for (const auto& w : layers_) {
    if (w->pkm) n += w->values.size(0);
  }
  return n;
}

int64_t Model::state_bytes_per_session() const {
  const int64_t element = options_.dtype == torch::kFloat64 ? 8 : 4;
  int64_t n = 0;
  for (const StateTensorSpec& s : state_spec_) {
    int64_t numel = 1;
    for (int64_t dim : s.shape) numel *= dim;
    n += numel;
  }
  return n * element;
}

State Model::InitialState(int64_t batch) const {
  auto opts = torch::TensorOptions().dtype(options_.dtype).device(options_.device);
  State state;
  for (const StateTensorSpec& spec : state_spec_) {
    std::vector<int64_t> shape = {batch};
    shape.insert(shape.end(), spec.shape.begin(), spec.shape.end());
    state.tensors.push_back(torch::zeros(shape, opts));
  }
  for (int i = 0; i < config_.n_layers; ++i) {
    torch::Tensor* first = &state.tensors[mixer_state_index_[i]];
    if (layers_[i]->block != nullptr) {
      layers_[i]->block->InitState(first);
    } else {
      layers_[i]->mixer->InitState(first);
    }
  }
  return state;
}

void Model::SetRequiresGrad(bool requires_grad) {
  for (auto& [name, t] : weights_) {
    if (!IsBufferName(name)) t.requires_grad_(requires_grad);
  }
}

void Model::ReleaseMatrices() {
  if (!config_.has_whole_blocks() || matrices_released_) return;
  released_parameter_count_ = parameter_count();
  for (auto& [name, tensor] : weights_) {
    if (tensor.dim() == 2) tensor = torch::Tensor();
  }
  matrices_released_ = true;
  // The blocks' handles go too; the state layout is rebuilt the same.
  (void)BindWeights();
}

std::map<std::string, torch::Tensor> Model::ExportWeights() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : weights_) {
    if (!t.defined()) continue;  // released (ReleaseMatrices)
    out[name] = t.detach().to(torch::kCPU, torch::kFloat32).contiguous().clone();
  }
  return out;
}

// ---------------------------------------------------------------------------
// Shared pieces

torch::Tensor Model::EmbedTokens(const torch::Tensor& tokens) const {
  if (config_.is_delta_net()) return torch::embedding(weights_.at("embeddings.weight"), tokens);
  if (config_.is_rwkv()) {
    return torch::layer_norm(torch::embedding(weights_.at("emb.weight"), tokens), {config_.d_model},
                             weights_.at("blocks.0.ln0.weight"), weights_.at("blocks.0.ln0.bias"),
                             config_.norm_eps);
  }
  return torch::embedding(weights_.at("embed.weight"), tokens);
}

namespace {

// x·headᵀ: on CUDA float32 tensors (a float32 or bf16 head) without autograd, for at most
// kGemvMaxRows rows (a decode step of few streams), by the grouped GEMV kernel (models/gpu/gemv.h:
// the head read once with 16-byte loads, one launch), else torch::linear. The head is the step's
// largest matrix (65,536 × 768 for RWKV-7 0.1B), read whole for every row.
torch::Tensor HeadLinear(const torch::Tensor& x, const torch::Tensor& head) {
  if (GemvRows(x) && head.dim() == 2 && x.size(-1) == head.size(1) &&
      KernelPathApplies(x, {&head})) {
    return GemvLinear(x, head, nullptr, kernels::GemvEpilogue::kNone, nullptr, "the head");
  }
  // A bf16 head (ModelOptions::bf16_matrices) is widened exactly for the product.
  if (head.scalar_type() != x.scalar_type()) return torch::linear(x, head.to(x.scalar_type()));
  return torch::linear(x, head);
}

}  // namespace

torch::Tensor Model::Head(const torch::Tensor& h) const {
  const int64_t d = config_.d_model;
  if (config_.is_delta_net()) {
    return HeadLinear(
        RmsNorm(h, weights_.at("norm.weight"), config_.norm_eps),
        weights_.at(config_.tie_embeddings ? std::string("embeddings.weight") : "lm_head.weight"));
  }
  if (config_.is_rwkv()) {
    torch::Tensor x = torch::layer_norm(h, {d}, weights_.at("ln_out.weight"),
                                        weights_.at("ln_out.bias"), config_.norm_eps);
    return HeadLinear(
        x, weights_.at(config_.tie_embeddings ? std::string("emb.weight") : "head.weight"));
  }
  torch::Tensor x = torch::layer_norm(h, {d}, weights_.at("norm_f.weight"),
                                      weights_.at("norm_f.bias"), config_.norm_eps);
  const torch::Tensor& head =
      config_.tie_embeddings ? weights_.at("embed.weight") : weights_.at("head.weight");
  return HeadLinear(x, head);
}

torch::Tensor Model::Ffn(const LayerWeights& w, const torch::Tensor& x, bool training) const {
  if (w.pkm) return PkmFfn(w, x, training);
  return torch::linear(Activate(torch::linear(x, w.up_w, w.up_b)), w.down_w, w.down_b);
}

torch::Tensor Model::FfnResidual(const LayerWeights& w, const torch::Tensor& x,
                                 const torch::Tensor& h, bool training) const {
  if (!w.pkm && !training && GemvRows(x) && config_.ffn != FfnKind::kSwiglu &&
      KernelPathApplies(x, {&w.up_w, &w.up_b, &w.down_w, &w.down_b, &h})) {
    const char* what = "the FFN";
    torch::Tensor u =
        config_.ffn == FfnKind::kSquaredRelu
            ? GemvLinear(x, w.up_w, &w.up_b, kernels::GemvEpilogue::kSquaredRelu, nullptr, what)
            : Activate(GemvLinear(x, w.up_w, &w.up_b, kernels::GemvEpilogue::kNone, nullptr, what));
    return GemvLinear(u, w.down_w, &w.down_b, kernels::GemvEpilogue::kResidual, &h, what);
  }
  return h + Ffn(w, x, training);
}

torch::Tensor Model::Activate(torch::Tensor u) const {
  switch (config_.ffn) {
    case FfnKind::kRelu:
      u = torch::relu(u);
      break;
    case FfnKind::kSquaredRelu:
      u = torch::relu(u).square();
      break;
    case FfnKind::kGeglu: {
      const int64_t f = config_.d_ff;
      u = u.narrow(-1, 0, f) * torch::gelu(u.narrow(-1, f, f));
      break;
    }
    case FfnKind::kSwiglu:  // the DeltaNet blocks' own MLP; Validate refuses it here
      break;
  }
  return u;
}

namespace {
// Indices of the k largest entries along the last dimension, largest first, ties
// broken toward the lower index (the contract's top-k). torch::topk is fast but
// orders ties arbitrarily, so rows where its k+1 largest values hold a tie (rare
// with real-valued scores) are redone with a stable descending sort.
torch::Tensor TopKIndices(const torch::Tensor& scores, int64_t k) {
  c10::NoGradGuard no_grad;
  torch::Tensor values = scores.detach();
  const int64_t n = values.size(-1);
  auto stable = [&](const torch::Tensor& v) {
    return std::get<1>(torch::sort(v, /*stable=*/true, /*dim=*/-1, /*descending=*/true))
        .narrow(-1, 0, k);
  };
  if (!values.device().is_cpu() || k == n) return stable(values);
  auto [top, index] = torch::topk(values, k + 1, /*dim=*/-1, /*largest=*/true, /*sorted=*/true);
  torch::Tensor result = index.narrow(-1, 0, k).contiguous();
  torch::Tensor tied = (top.narrow(-1, 0, k) == top.narrow(-1, 1, k)).any(-1).reshape({-1});
  torch::Tensor tied_rows = tied.nonzero().reshape({-1});
  if (tied_rows.numel() > 0) {
    torch::Tensor flat = result.view({-1, k});
    flat.index_copy_(0, tied_rows, stable(values.reshape({-1, n}).index_select(0, tied_rows)));
  }
  return result;
}

}  // namespace

const std::vector<int64_t>& PkmCandidatePairs(int64_t k) {
  thread_local int64_t cached_k = -1;
  thread_local std::vector<int64_t> pairs;
  if (cached_k != k) {
    pairs.clear();
    for (int64_t m = 0; m < k; ++m) {
      for (int64_t n = 0; (m + 1) * (n + 1) <= k; ++n) {
        pairs.push_back(m);
        pairs.push_back(n);
      }
    }
    cached_k = k;
  }
  return pairs;
}

namespace {

template <typename T>
void BestCandidateRows(const T* a, const T* b, const int64_t* pairs, int64_t num_pairs, int64_t k,
                       int64_t begin, int64_t end, int64_t* out_m, int64_t* out_n) {
  std::vector<int64_t> order(static_cast<size_t>(num_pairs));
  std::vector<T> score(static_cast<size_t>(num_pairs));
  for (int64_t r = begin; r < end; ++r) {
    const T* ar = a + r * k;
    const T* br = b + r * k;
    for (int64_t p = 0; p < num_pairs; ++p) {
      const T v = ar[pairs[2 * p]] + br[pairs[2 * p + 1]];
      // NaN ranks lowest, so that the order below stays a strict weak order.
      score[static_cast<size_t>(p)] = std::isnan(v) ? -std::numeric_limits<T>::infinity() : v;
    }
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t x, int64_t y) {
      const T sx = score[static_cast<size_t>(x)], sy = score[static_cast<size_t>(y)];
      return sx > sy || (sx == sy && x < y);
    });
    for (int64_t m = 0; m < k; ++m) {
      const int64_t p = order[static_cast<size_t>(m)];
      out_m[r * k + m] = pairs[2 * p];
      out_n[r * k + m] = pairs[2 * p + 1];
    }
  }
}

// The contract's second top-k over the candidates a_m + b_n (m, n in 0..k-1, in
// order of m*k + n) of rows a, b [..., k] sorted descending. a and b sorted means
// candidate (m, n) is dominated by the (m+1)(n+1) - 1 candidates (m', n') with
// m' <= m, n' <= n: each scores at least as much (float addition is monotone) and
// has a lower candidate index. So it is never among the top k when (m+1)(n+1) > k,
// ties included, and only the ~k·ln k others are scored. Returns (m, n) of the k
// best, best first, each [..., k]. `pair_tensor`: PkmCandidatePairs(k) as [pairs, 2] on
// a's device.
std::pair<torch::Tensor, torch::Tensor> BestCandidates(const torch::Tensor& a,
                                                       const torch::Tensor& b, int64_t k,
                                                       const torch::Tensor& pair_tensor) {
  c10::NoGradGuard no_grad;
  const std::vector<int64_t>& pairs = PkmCandidatePairs(k);
  const int64_t num_pairs = static_cast<int64_t>(pairs.size() / 2);
  if (!a.device().is_cpu()) {
    torch::Tensor m_of = pair_tensor.select(1, 0), n_of = pair_tensor.select(1, 1);
    torch::Tensor candidates =
        a.detach().index_select(-1, m_of) + b.detach().index_select(-1, n_of);
    torch::Tensor best = TopKIndices(candidates, k);
    return {m_of.index({best}), n_of.index({best})};
  }
  torch::Tensor ac = a.detach().contiguous(), bc = b.detach().contiguous();
  const int64_t rows = ac.numel() / k;
  torch::Tensor out_m = torch::empty(ac.sizes(), ac.options().dtype(torch::kInt64));
  torch::Tensor out_n = torch::empty(ac.sizes(), ac.options().dtype(torch::kInt64));
  AT_DISPATCH_FLOATING_TYPES(ac.scalar_type(), "BestCandidates", [&] {
    const scalar_t* ad = ac.data_ptr<scalar_t>();
    const scalar_t* bd = bc.data_ptr<scalar_t>();
    int64_t* md = out_m.data_ptr<int64_t>();
    int64_t* nd = out_n.data_ptr<int64_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      BestCandidateRows<scalar_t>(ad, bd, pairs.data(), num_pairs, k, begin, end, md, nd);
    });
  });
  return {out_m, out_n};
}
}  // namespace

// Product-key memory, per token: both forms run this on [..., d].
torch::Tensor Model::PkmFfn(const LayerWeights& w, const torch::Tensor& x, bool training) const {
  const ModelConfig& c = config_;
  const int64_t d = c.d_model, Hm = c.pkm_heads, nk = c.pkm_num_keys, k = c.pkm_topk,
                half = c.pkm_dim_key / 2;
  std::vector<int64_t> out_shape = x.sizes().vec();
  torch::Tensor flat = x.reshape({-1, d});
  const int64_t N = flat.size(0);
  torch::Tensor q = torch::linear(flat, w.query_w);  // [N, Hm*dk]
  if (training) {
    // Batch statistics over the N tokens; updates running_mean/var in place
    // (momentum 0.1, unbiased variance), like BatchNorm1d.train().
    q = torch::batch_norm(q, w.bn_w, w.bn_b, w.bn_mean, w.bn_var, /*training=*/true,
                          /*momentum=*/0.1, c.pkm_bn_eps, /*cudnn_enabled=*/false);
  } else {
    q = (q - w.bn_mean) / torch::sqrt(w.bn_var + c.pkm_bn_eps) * w.bn_w + w.bn_b;
  }
  // Head h, half p: channels h*dk + p*half .. + half - 1.
  torch::Tensor qh = q.view({N, Hm, 2, half}).permute({1, 2, 0, 3});  // [Hm, 2, N, half]
  torch::Tensor keys = w.keys.permute({0, 2, 3, 1});                  // [Hm, 2, half, nk]
  torch::Tensor scores = torch::matmul(qh, keys);                     // [Hm, 2, N, nk]
  torch::Tensor sub_index = TopKIndices(scores, k);                   // [Hm, 2, N, k]
  torch::Tensor sub_score = scores.gather(-1, sub_index);
  torch::Tensor a = sub_score.select(1, 0), b = sub_score.select(1, 1);  // [Hm, N, k]
  torch::Tensor i = sub_index.select(1, 0), j = sub_index.select(1, 1);
  // Candidate m*k + n: score a_m + b_n, slot i_m * n_k + j_n; the k best.
  auto [best_m, best_n] = BestCandidates(a, b, k, w.pkm_pairs);  // [Hm, N, k] each
  torch::Tensor weights = torch::softmax(a.gather(-1, best_m) + b.gather(-1, best_n), -1);
  torch::Tensor slots = i.gather(-1, best_m) * nk + j.gather(-1, best_n);
  // One bag per token over all heads' k slots: Σ_h Σ_m w_hm · values[slot_hm].
  torch::Tensor bag_slots = slots.permute({1, 0, 2}).reshape({N, Hm * k});
  torch::Tensor bag_weights = weights.permute({1, 0, 2}).reshape({N, Hm * k});
  // F.embedding_bag(mode=sum, per_sample_weights) on 2-D input, as LibTorch's functional
  // lowers it: fixed-length bags at offsets 0, Hm·k, 2·Hm·k, ...
  torch::Tensor offsets =
      torch::arange(0, bag_slots.numel(), bag_slots.size(1),
                    torch::TensorOptions().dtype(torch::kLong).device(bag_slots.device()));
  torch::Tensor out = std::get<0>(torch::embedding_bag(
      w.values, bag_slots.reshape(-1), offsets, /*scale_grad_by_freq=*/false, /*mode=*/0,
      /*sparse=*/false, bag_weights.reshape(-1), /*include_last_offset=*/false,
      /*padding_idx=*/c10::nullopt));
  return out.view(out_shape);
}

// ---------------------------------------------------------------------------
// Sequence form

void Model::ProjectInputs(int layer, const torch::Tensor& a, State* state,
                          torch::Tensor proj[3]) const {
  const LayerWeights& w = *layers_[layer];
  if (GemvRows(a) && KernelPathApplies(a, {&w.proj[0], &w.proj[1], &w.proj[2]})) {
    GemvLaunch launch;
    for (int p = 0; p < 3; ++p) {
      proj[p] = launch.Add(a, w.proj[p], kernels::GemvInput::kNone, nullptr,
                           kernels::GemvEpilogue::kNone, nullptr);
    }
    launch.Run(a, "the mixer's input projections");
  } else {
    for (int p = 0; p < 3; ++p) proj[p] = torch::linear(a, w.proj[p]);
  }
  if (!config_.has_dconv()) return;
  torch::Tensor& conv_state = state->tensors[conv_state_index_[layer]];  // [B, 3, K-1, d]
  if (config_.dconv_kernel <= kernels::kDepthwiseConvMaxTaps &&
      KernelPathApplies(a, {&proj[0], &proj[1], &proj[2], &w.conv_w[0], &w.conv_w[1], &w.conv_w[2],
                            &w.conv_b[0], &w.conv_b[1], &w.conv_b[2], &conv_state})) {
    FusedDepthwiseConv(layer, proj, &conv_state);
    return;
  }
  std::vector<torch::Tensor> histories;
  for (int p = 0; p < 3; ++p) {
    torch::Tensor history = conv_state.select(1, p);
    proj[p] = CausalDepthwiseConv(proj[p], w.conv_w[p], w.conv_b[p], &history);
    histories.push_back(history);
  }
  conv_state = torch::stack(histories, 1);
}

void Model::FusedDepthwiseConv(int layer, torch::Tensor proj[3], torch::Tensor* conv_state) const {
  const LayerWeights& w = *layers_[layer];
  const int64_t d = config_.d_model;
  const torch::Tensor state_in = conv_state->contiguous();
  torch::Tensor state_out = torch::empty_like(state_in, torch::MemoryFormat::Contiguous);
  kernels::DepthwiseConvArgs args;
  args.B = proj[0].size(0);
  args.T = proj[0].numel() / std::max<int64_t>(args.B * d, 1);
  args.d = d;
  args.K = static_cast<int>(config_.dconv_kernel);
  torch::Tensor keep[9];
  for (int p = 0; p < 3; ++p) {
    TORCH_CHECK(proj[p].size(-1) == d && proj[p].numel() == args.B * args.T * d,
                "the mixer's projection ", p, " of shape ", proj[p].sizes(), " for d = ", d);
    proj[p] = proj[p].contiguous();  // the output in place: a fresh product
    keep[3 * p] = w.conv_w[p].contiguous();
    keep[3 * p + 1] = w.conv_b[p].contiguous();
    args.x[p] = proj[p].data_ptr<float>();
    args.y[p] = proj[p].data_ptr<float>();
    args.weight[p] = keep[3 * p].data_ptr<float>();
    args.bias[p] = keep[3 * p + 1].data_ptr<float>();
  }
  args.state_in = state_in.data_ptr<float>();
  args.state_out = state_out.data_ptr<float>();
  if (state_in.is_cuda()) {
#if defined(FWSERVE_CUDA_KERNELS)
    const c10::cuda::CUDAGuard device(state_in.device());
    const int error =
        kernels::LaunchDepthwiseConv(args, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, "block ", layer, ": the depthwise convolution kernel failed: ",
                kernels::DepthwiseConvErrorString(error));
#else
    TORCH_CHECK(false, "block ", layer, ": no CUDA kernels in this build");
#endif
  } else {
    TORCH_CHECK(kernels::RunDepthwiseConvOnHost(args), "block ", layer,
                ": the depthwise convolution's arguments were refused");
  }
  *conv_state = state_out;
}

torch::Tensor Model::MixerResidual(int layer, const torch::Tensor& a, const torch::Tensor& h,
                                   State* state, bool step) const {
  const LayerWeights& w = *layers_[layer];
  torch::Tensor proj[3];
  torch::Tensor y;
  torch::Tensor* mixer_state = &state->tensors[mixer_state_index_[layer]];
  if (step) {
    ProjectInputs(layer, a.unsqueeze(1), state, proj);
    for (torch::Tensor& x : proj) x = x.squeeze(1);  // [B, d]
    y = w.mixer->Step(a, proj, mixer_state);         // [B, d]
  } else {
    ProjectInputs(layer, a, state, proj);
    y = w.mixer->Forward(a, proj, mixer_state);
  }
  if (GemvRows(y) && h.numel() == y.numel() / y.size(-1) * w.o_w.size(0) &&
      KernelPathApplies(y, {&w.o_w, &w.o_b, &h})) {
    return GemvLinear(y, w.o_w, &w.o_b, kernels::GemvEpilogue::kResidual, &h,
                      "the mixer's output projection")
        .view(h.sizes());
  }
  return h + torch::linear(y, w.o_w, w.o_b);
}

torch::Tensor Model::ForwardHidden(const torch::Tensor& tokens, State* state,
                                   bool training) const {
  const int64_t d = config_.d_model;
  torch::Tensor h = EmbedTokens(tokens);  // [B, T, d]
  if (config_.has_whole_blocks()) {
    torch::Tensor v_first;
    for (int i = 0; i < config_.n_layers; ++i) {
      h = layers_[i]->block->Forward(h, &state->tensors[mixer_state_index_[i]], &v_first);
    }
    return h;
  }
  for (int i = 0; i < config_.n_layers; ++i) {
    const LayerWeights& w = *layers_[i];
    torch::Tensor a = torch::layer_norm(h, {d}, w.norm1_w, w.norm1_b, config_.norm_eps);
    h = MixerResidual(i, a, h, state, /*step=*/false);
    h = FfnResidual(w, torch::layer_norm(h, {d}, w.norm2_w, w.norm2_b, config_.norm_eps), h,
                    training);
  }
  return h;
}

torch::Tensor Model::ForwardUnchecked(const torch::Tensor& tokens, State* state,
                                      bool training) const {
  return Head(ForwardHidden(tokens, state, training));
}

// ---------------------------------------------------------------------------
// Recurrent form: the contract's formulas one token at a time.

torch::Tensor Model::StepUnchecked(const torch::Tensor& tokens, State* state) const {
  const int64_t d = config_.d_model;
  torch::Tensor h = EmbedTokens(tokens);  // [B, d]
  if (config_.has_whole_blocks()) {
    torch::Tensor v_first;
    for (int i = 0; i < config_.n_layers; ++i) {
      h = layers_[i]->block->Step(h, &state->tensors[mixer_state_index_[i]], &v_first);
    }
    return Head(h);
  }
  for (int i = 0; i < config_.n_layers; ++i) {
    const LayerWeights& w = *layers_[i];
    torch::Tensor a = torch::layer_norm(h, {d}, w.norm1_w, w.norm1_b, config_.norm_eps);
    h = MixerResidual(i, a, h, state, /*step=*/true);
    h = FfnResidual(w, torch::layer_norm(h, {d}, w.norm2_w, w.norm2_b, config_.norm_eps), h,
                    /*training=*/false);
  }
  return Head(h);
}

// ---------------------------------------------------------------------------
// Checked entry points

absl::Status Model::CheckState(const State& state, int64_t batch) const {
  if (state.tensors.size() != state_spec_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("state has ", state.tensors.size(),
                                                   " tensors, expected ", state_spec_.size()));
  }
  for (size_t i = 0; i < state_spec_.size(); ++i) {
    std::vector<int64_t> shape = {batch};
    shape.insert(shape.end(), state_spec_[i].shape.begin(), state_spec_[i].shape.end());
    const torch::Tensor& t = state.tensors[i];
    if (!t.defined() || t.sizes().vec() != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("state tensor '", state_spec_[i].name, "' has shape ",
                       t.defined() ? ShapeString(t.sizes().vec()) : "undefined", ", expected ",
                       ShapeString(shape)));
    }
    if (t.scalar_type() != options_.dtype || t.device() != options_.device) {
      return absl::InvalidArgumentError(
          absl::StrCat("state tensor '", state_spec_[i].name, "' has the wrong dtype or device"));
    }
  }
  return absl::OkStatus();
}

namespace {
absl::Status CheckTokens(const torch::Tensor& tokens, int64_t dims, int64_t vocab) {
  if (!tokens.defined() || tokens.dim() != dims || tokens.scalar_type() != torch::kInt64) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens must be an int64 tensor of rank ", dims));
  }
  if (tokens.numel() == 0) return absl::InvalidArgumentError("tokens must not be empty");
  const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
  if (lo < 0 || hi >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", lo < 0 ? lo : hi, " is outside [0, ", vocab, ")"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status Model::CheckSequenceInput(const torch::Tensor& tokens, const State& state) const {
  if (matrices_released_) {
    return absl::FailedPreconditionError(
        "the model's matrices were released to its native kernel (ReleaseMatrices)");
  }
  absl::Status s = CheckTokens(tokens, 2, config_.vocab_size);
  if (!s.ok()) return s;
  return CheckState(state, tokens.size(0));
}

absl::StatusOr<torch::Tensor> Model::Forward(const torch::Tensor& tokens, State* state) const {
  if (absl::Status s = CheckSequenceInput(tokens, *state); !s.ok()) return s;
  try {
    return ForwardUnchecked(tokens.to(options_.device), state);
  } catch (const c10::Error& e) {
    return absl::InternalError("model sequence form failed");
  }
}

absl::StatusOr<torch::Tensor> Model::Prefill(const torch::Tensor& tokens, State* state) const {
  if (absl::Status s = CheckSequenceInput(tokens, *state); !s.ok()) return s;
  try {
    torch::Tensor h = ForwardHidden(tokens.to(options_.device), state, /*training=*/false);
    return Head(h.select(1, h.size(1) - 1));
  } catch (const c10::Error& e) {
    return absl::InternalError("model sequence form failed");
  }
}

absl::StatusOr<torch::Tensor> Model::Step(const torch::Tensor& tokens, State* state) const {
  if (matrices_released_) {
    return absl::FailedPreconditionError(
        "the model's matrices were released to its native kernel (ReleaseMatrices)");
  }
  absl::Status s = CheckTokens(tokens, 1, config_.vocab_size);
  if (!s.ok()) return s;
  if (!(s = CheckState(*state, tokens.size(0))).ok()) return s;
  try {
    return StepUnchecked(tokens.to(options_.device), state);
  } catch (const c10::Error& e) {
    return absl::InternalError("model recurrent step failed");
  }
}

void SetModelHostKernelsForTesting(bool on) { model_host_kernels_for_testing.store(on); }

}  // namespace fwmodel
