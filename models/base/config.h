// Model configuration: the `config.json` of a checkpoint (contract version 1).
// Parsing is strict: unknown keys, missing required keys and bad values are errors
// that name the key. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fwmodel {

// The contract's three architectures, and imported ones whose whole block (not just the
// mixer) differs from the contract's (docs/models.md): RWKV-7 "Goose" (x070), RWKV-4,
// and fla's DeltaNet and Gated DeltaNet.
enum class Architecture {
  kLinearAttention,
  kFastWeight,
  kAft,
  kRwkv7,
  kRwkv4,
  kDeltaNet,
  kGatedDeltaNet
};
// kSwiglu (down(silu(gate x) ⊙ up x), fla's GatedMLP) is only for the DeltaNet
// architectures, whose MLP it is.
enum class FfnKind { kRelu, kSquaredRelu, kGeglu, kSwiglu };

// Contract spellings ("linear_attention", "squared_relu", ...).
const char* ArchitectureName(Architecture arch);
const char* FfnKindName(FfnKind ffn);
absl::StatusOr<Architecture> ParseArchitecture(const std::string& name);
absl::StatusOr<FfnKind> ParseFfnKind(const std::string& name);

// Every field of contract version 1. Defaults are the contract's defaults, except
// for the required fields, which have no meaningful default and are zero here.
struct ModelConfig {
  int format_version = 1;
  Architecture architecture = Architecture::kLinearAttention;
  int vocab_size = 256;
  // "bytes" (token id = byte value), "rwkv_world" (models/tokenizers/world_tokenizer.h, its
  // vocabulary file in the model directory; id 0 is end of text), or "sentencepiece" (a
  // SentencePiece model, `tokenizer.model` in the model directory, read by
  // libsentencepiece).
  std::string tokenizer = "bytes";
  int bos_token_id = 10;
  // The id that ends a generation, or -1: none (bytes), the vocabulary's own (rwkv_world:
  // 0). Required meaning for sentencepiece (its EOS). Written to config.json only when
  // set, so older configs and their fingerprints are unchanged.
  int eos_token_id = -1;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int d_ff = 0;  // 0 in a parsed config never happens: defaults to 4 * d_model.
  FfnKind ffn = FfnKind::kSquaredRelu;
  int dconv_kernel = 0;  // 0 or 1: no convolution.
  int dpfp_nu = 1;
  double norm_eps = 1e-5;
  double attn_eps = 1e-6;
  bool tie_embeddings = false;
  // Product-key memory FFN (contract section "Product-key memory FFN"): the blocks
  // listed in pkm_layers replace up/down by a memory of pkm_num_keys² value slots.
  std::vector<int> pkm_layers;  // block indices, distinct, each in [0, n_layers)
  int pkm_heads = 4;            // H_m
  int pkm_num_keys = 128;       // n_k
  int pkm_topk = 32;            // k <= n_k
  int pkm_dim_key = 128;        // d_k, even
  double pkm_bn_eps = 1e-5;
  // RWKV-7 only (architecture rwkv7): the ranks of the LoRA maps that make the decay w,
  // the in-context learning rate a, the value residual's mix v and the output gate g (fla's
  // names). Required for rwkv7, absent otherwise. n_heads is its number of heads (d_head
  // = d_model / n_heads, 64 for the released models); d_ff the channel mix's width.
  int decay_low_rank_dim = 0;
  int a_low_rank_dim = 0;
  int v_low_rank_dim = 0;
  int gate_low_rank_dim = 0;
  // DeltaNet and Gated DeltaNet only (architectures delta_net, gated_deltanet; fla's names,
  // docs/models.md). n_heads is the number of q/k heads H; d_ff the MLP's width. Written to
  // the canonical JSON only for these architectures. The widths default (0 here) as
  // v_heads(), k_head_dim() and v_head_dim() say; the canonical JSON holds the resolved
  // values.
  int num_v_heads = 0;         // HV, value heads: a multiple of H (gated_deltanet), H (delta_net)
  int head_k_dim = 0;          // K, width of a q/k head
  int head_v_dim = 0;          // V, width of a value head
  bool use_short_conv = true;  // depthwise causal convolutions on q, k and v
  int conv_size = 4;           // their width W (the state keeps W - 1 inputs), in [2, 64]
  // The output gate silu(g_proj x). Parsing defaults it as fla does: off for delta_net, on
  // for gated_deltanet.
  bool use_gate = false;
  bool allow_neg_eigval = false;  // β ∈ (0, 2) instead of (0, 1)
  // delta_net only (gated_deltanet has fla's fixed choices: β on, silu, l2).
  bool use_beta = true;                // β = sigmoid(b_proj x); off: β = 1
  std::string qk_activation = "silu";  // silu, relu, elu (elu + 1) or identity
  std::string qk_norm = "l2";          // l2 or sum

  // Serving metadata, not architecture (an fwserve extension of the contract; see
  // docs/http.md "Chat template"): how the HTTP API renders chat messages into a prompt.
  // `chat_message_template` contains "{content}" and may contain "{role}"; empty = the
  // server's default template. Not part of the model's fingerprint.
  std::string chat_message_template;
  std::string chat_generation_prompt;  // only meaningful with a message template
  // The template's end-of-turn markers ("stop" in chat_template): a chat or response
  // that gives no `stop` of its own ends its reply at the first one (RWKV's G1:
  // "\n\n"). At most 4, each 1 to 64 bytes.
  std::vector<std::string> chat_stop;
  bool has_chat_template() const { return !chat_message_template.empty(); }

  int d_head() const { return n_heads > 0 ? d_model / n_heads : 0; }
  bool has_dconv() const { return dconv_kernel >= 2; }
  // Width of the DPFP feature map (fast_weight only).
  int d_phi() const { return 2 * dpfp_nu * d_head(); }
  bool has_pkm() const { return !pkm_layers.empty(); }
  bool is_pkm_layer(int layer) const;
  // RWKV blocks (docs/models.md) instead of the contract's norm/mixer/norm/FFN blocks.
  bool is_rwkv() const {
    return architecture == Architecture::kRwkv7 || architecture == Architecture::kRwkv4;
  }
  // DeltaNet or Gated DeltaNet blocks (models/architectures/delta_net.h).
  bool is_delta_net() const {
    return architecture == Architecture::kDeltaNet || architecture == Architecture::kGatedDeltaNet;
  }
  // Whole blocks (models/architectures/block.h) instead of the contract's
  // norm/mixer/norm/FFN blocks: the RWKV and DeltaNet architectures.
  bool has_whole_blocks() const { return is_rwkv() || is_delta_net(); }
  // The DeltaNet widths with their defaults applied: HV (n_heads), K (d_model / n_heads)
  // and V (K).
  int v_heads() const { return num_v_heads > 0 ? num_v_heads : n_heads; }
  int k_head_dim() const {
    return head_k_dim > 0 ? head_k_dim : (n_heads > 0 ? d_model / n_heads : 0);
  }
  int v_head_dim() const { return head_v_dim > 0 ? head_v_dim : k_head_dim(); }

  // Checks every value range and cross-field rule; the error names the key.
  absl::Status Validate() const;

 private:
  // Validate()'s rules for the DeltaNet keys (and their absence elsewhere).
  absl::Status ValidateDeltaNet() const;
};

// Parses config.json text. Applies the contract's defaults, then Validate().
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text);

// Canonical JSON with every key written out (sorted keys, two-space indent). Parsing
// the result gives back an equal config; the fingerprint hashes this text. The pkm_*
// keys are written only when pkm_layers is non-empty, so that configs without a
// memory (and their fingerprints) are the same as before the keys existed.
std::string ModelConfigToJson(const ModelConfig& config);

bool operator==(const ModelConfig& a, const ModelConfig& b);

}  // namespace fwmodel
