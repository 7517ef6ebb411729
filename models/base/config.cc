#include "models/base/config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace fwmodel {
namespace {

using nlohmann::json;

absl::Status KeyError(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: key '", key, "' ", what));
}

// Reads an integer key if present. JSON floats with an integral value are not
// accepted: "d_model": 64.0 is a typo worth reporting.
absl::Status ReadInt(const json& j, const std::string& key, bool required, int* out) {
  auto it = j.find(key);
  if (it == j.end()) {
    return required ? KeyError(key, "is required but missing") : absl::OkStatus();
  }
  if (!it->is_number_integer()) {
    return KeyError(key, absl::StrCat("must be an integer, got ", it->dump()));
  }
  const int64_t value = it->get<int64_t>();
  if (value < INT32_MIN || value > INT32_MAX) {
    return KeyError(key, absl::StrCat("is out of range: ", value));
  }
  *out = static_cast<int>(value);
  return absl::OkStatus();
}

absl::Status ReadDouble(const json& j, const std::string& key, double* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_number()) return KeyError(key, absl::StrCat("must be a number, got ", it->dump()));
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status ReadString(const json& j, const std::string& key, bool required, std::string* out) {
  auto it = j.find(key);
  if (it == j.end()) {
    return required ? KeyError(key, "is required but missing") : absl::OkStatus();
  }
  if (!it->is_string()) return KeyError(key, absl::StrCat("must be a string, got ", it->dump()));
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status ReadBool(const json& j, const std::string& key, bool* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_boolean())
    return KeyError(key, absl::StrCat("must be true or false, got ", it->dump()));
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadIntList(const json& j, const std::string& key, std::vector<int>* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_array()) {
    return KeyError(key, absl::StrCat("must be a list of integers, got ", it->dump()));
  }
  out->clear();
  for (const json& item : *it) {
    if (!item.is_number_integer()) {
      return KeyError(key, absl::StrCat("must be a list of integers, got ", it->dump()));
    }
    const int64_t value = item.get<int64_t>();
    if (value < INT32_MIN || value > INT32_MAX) {
      return KeyError(key, absl::StrCat("has an entry out of range: ", value));
    }
    out->push_back(static_cast<int>(value));
  }
  return absl::OkStatus();
}

const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{"format_version",
                                                      "architecture",
                                                      "vocab_size",
                                                      "tokenizer",
                                                      "bos_token_id",
                                                      "eos_token_id",
                                                      "d_model",
                                                      "n_layers",
                                                      "n_heads",
                                                      "d_ff",
                                                      "ffn",
                                                      "dconv_kernel",
                                                      "dpfp_nu",
                                                      "norm_eps",
                                                      "attn_eps",
                                                      "tie_embeddings",
                                                      "pkm_layers",
                                                      "pkm_heads",
                                                      "pkm_num_keys",
                                                      "pkm_topk",
                                                      "pkm_dim_key",
                                                      "pkm_bn_eps",
                                                      "chat_template",
                                                      "decay_low_rank_dim",
                                                      "a_low_rank_dim",
                                                      "v_low_rank_dim",
                                                      "gate_low_rank_dim",
                                                      "num_v_heads",
                                                      "head_k_dim",
                                                      "head_v_dim",
                                                      "use_short_conv",
                                                      "conv_size",
                                                      "use_gate",
                                                      "allow_neg_eigval",
                                                      "use_beta",
                                                      "qk_activation",
                                                      "qk_norm"};
  return *keys;
}

// The optional "chat_template": {"message": "...{content}...", "generation_prompt": "..."}.
absl::Status ReadChatTemplate(const json& j, ModelConfig* c) {
  auto it = j.find("chat_template");
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_object()) {
    return KeyError("chat_template",
                    "must be an object {\"message\": ..., \"generation_prompt\": ...}");
  }
  for (const auto& item : it->items()) {
    if (item.key() == "stop") {
      const json& stop = item.value();
      if (!stop.is_array() || stop.empty() || stop.size() > 4) {
        return KeyError("chat_template", "'stop' must be an array of 1 to 4 strings");
      }
      for (const json& marker : stop) {
        if (!marker.is_string() || marker.get_ref<const std::string&>().empty() ||
            marker.get_ref<const std::string&>().size() > 64) {
          return KeyError("chat_template", "each 'stop' marker must be a string of 1 to 64 bytes");
        }
        c->chat_stop.push_back(marker.get<std::string>());
      }
      continue;
    }
    if (item.key() != "message" && item.key() != "generation_prompt") {
      return KeyError("chat_template",
                      absl::StrCat("has unknown key '", item.key().substr(0, 64),
                                   "' (expected message, generation_prompt, stop)"));
    }
    if (!item.value().is_string()) {
      return KeyError("chat_template", absl::StrCat("'", item.key(), "' must be a string"));
    }
    if (item.value().get_ref<const std::string&>().size() > 1024) {
      return KeyError("chat_template",
                      absl::StrCat("'", item.key(), "' is longer than 1024 bytes"));
    }
  }
  if (!it->contains("message") || !it->contains("generation_prompt")) {
    return KeyError("chat_template", "needs both 'message' and 'generation_prompt'");
  }
  c->chat_message_template = (*it)["message"].get<std::string>();
  c->chat_generation_prompt = (*it)["generation_prompt"].get<std::string>();
  if (c->chat_message_template.find("{content}") == std::string::npos) {
    return KeyError("chat_template", "'message' must contain {content}");
  }
  return absl::OkStatus();
}

}  // namespace

const char* ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLinearAttention:
      return "linear_attention";
    case Architecture::kFastWeight:
      return "fast_weight";
    case Architecture::kAft:
      return "aft";
    case Architecture::kRwkv7:
      return "rwkv7";
    case Architecture::kRwkv4:
      return "rwkv4";
    case Architecture::kDeltaNet:
      return "delta_net";
    case Architecture::kGatedDeltaNet:
      return "gated_deltanet";
  }
  return "?";
}

const char* FfnKindName(FfnKind ffn) {
  switch (ffn) {
    case FfnKind::kRelu:
      return "relu";
    case FfnKind::kSquaredRelu:
      return "squared_relu";
    case FfnKind::kGeglu:
      return "geglu";
    case FfnKind::kSwiglu:
      return "swiglu";
  }
  return "?";
}

absl::StatusOr<Architecture> ParseArchitecture(const std::string& name) {
  if (name == "linear_attention") return Architecture::kLinearAttention;
  if (name == "fast_weight") return Architecture::kFastWeight;
  if (name == "aft") return Architecture::kAft;
  if (name == "rwkv7") return Architecture::kRwkv7;
  if (name == "rwkv4") return Architecture::kRwkv4;
  if (name == "delta_net") return Architecture::kDeltaNet;
  if (name == "gated_deltanet") return Architecture::kGatedDeltaNet;
  return KeyError("architecture", absl::StrCat("has unknown value \"", name,
                                               "\" (expected linear_attention, fast_weight, aft, "
                                               "rwkv7, rwkv4, delta_net or gated_deltanet)"));
}

absl::StatusOr<FfnKind> ParseFfnKind(const std::string& name) {
  if (name == "relu") return FfnKind::kRelu;
  if (name == "squared_relu") return FfnKind::kSquaredRelu;
  if (name == "geglu") return FfnKind::kGeglu;
  if (name == "swiglu") return FfnKind::kSwiglu;
  return KeyError("ffn", absl::StrCat("has unknown value \"", name,
                                      "\" (expected relu, squared_relu, geglu or swiglu)"));
}

absl::Status ModelConfig::Validate() const {
  if (format_version != 1) {
    return KeyError("format_version", absl::StrCat("must be 1, got ", format_version));
  }
  if (vocab_size < 1 || vocab_size > (1 << 24)) {
    return KeyError("vocab_size", absl::StrCat("must be in [1, 16777216], got ", vocab_size));
  }
  if (tokenizer != "bytes" && tokenizer != "rwkv_world" && tokenizer != "sentencepiece") {
    return KeyError("tokenizer", absl::StrCat("has unknown value \"", tokenizer,
                                              "\" (expected bytes, rwkv_world or sentencepiece)"));
  }
  if (tokenizer == "rwkv_world" && vocab_size < 65530) {
    return KeyError("vocab_size", absl::StrCat("must be at least 65530 for the rwkv_world "
                                               "tokenizer, got ",
                                               vocab_size));
  }
  if (vocab_size < 256) {
    return KeyError("vocab_size",
                    absl::StrCat("must be at least 256 for the bytes tokenizer, got ", vocab_size));
  }
  if (bos_token_id < 0 || bos_token_id >= vocab_size) {
    return KeyError("bos_token_id", absl::StrCat("must be in [0, vocab_size), got ", bos_token_id));
  }
  if (eos_token_id < -1 || eos_token_id >= vocab_size) {
    return KeyError("eos_token_id",
                    absl::StrCat("must be -1 (none) or in [0, vocab_size), got ", eos_token_id));
  }
  if (tokenizer == "sentencepiece" && eos_token_id < 0) {
    return KeyError("eos_token_id", "is required with the sentencepiece tokenizer");
  }
  if (d_model < 1) return KeyError("d_model", absl::StrCat("must be positive, got ", d_model));
  if (n_layers < 1) return KeyError("n_layers", absl::StrCat("must be positive, got ", n_layers));
  if (n_heads < 1) return KeyError("n_heads", absl::StrCat("must be positive, got ", n_heads));
  // The DeltaNet architectures size their heads with head_k_dim and head_v_dim instead.
  if (!is_delta_net() && d_model % n_heads != 0) {
    return KeyError("n_heads", absl::StrCat("must divide d_model=", d_model, ", got ", n_heads));
  }
  if (d_ff < 1) return KeyError("d_ff", absl::StrCat("must be positive, got ", d_ff));
  if (dconv_kernel < 0 || dconv_kernel > 64) {
    return KeyError("dconv_kernel", absl::StrCat("must be in [0, 64], got ", dconv_kernel));
  }
  if (dpfp_nu < 1 || dpfp_nu > 16) {
    return KeyError("dpfp_nu", absl::StrCat("must be in [1, 16], got ", dpfp_nu));
  }
  if (!(norm_eps > 0) || !std::isfinite(norm_eps)) {
    return KeyError("norm_eps", absl::StrCat("must be a positive finite number, got ", norm_eps));
  }
  if (!(attn_eps > 0) || !std::isfinite(attn_eps)) {
    return KeyError("attn_eps", absl::StrCat("must be a positive finite number, got ", attn_eps));
  }
  std::set<int> seen_pkm_layers;
  for (int layer : pkm_layers) {
    if (layer < 0 || layer >= n_layers) {
      return KeyError("pkm_layers",
                      absl::StrCat("entries must be in [0, n_layers=", n_layers, "), got ", layer));
    }
    if (!seen_pkm_layers.insert(layer).second) {
      return KeyError("pkm_layers", absl::StrCat("lists block ", layer, " twice"));
    }
  }
  if (pkm_heads < 1 || pkm_heads > 1024) {
    return KeyError("pkm_heads", absl::StrCat("must be in [1, 1024], got ", pkm_heads));
  }
  if (pkm_num_keys < 1 || pkm_num_keys > 4096) {
    return KeyError("pkm_num_keys", absl::StrCat("must be in [1, 4096], got ", pkm_num_keys));
  }
  if (pkm_topk < 1 || pkm_topk > pkm_num_keys) {
    return KeyError("pkm_topk", absl::StrCat("must be in [1, pkm_num_keys=", pkm_num_keys,
                                             "], got ", pkm_topk));
  }
  if (pkm_dim_key < 2 || pkm_dim_key > 65536 || pkm_dim_key % 2 != 0) {
    return KeyError("pkm_dim_key",
                    absl::StrCat("must be even and in [2, 65536], got ", pkm_dim_key));
  }
  if (!(pkm_bn_eps > 0) || !std::isfinite(pkm_bn_eps)) {
    return KeyError("pkm_bn_eps",
                    absl::StrCat("must be a positive finite number, got ", pkm_bn_eps));
  }
  const std::pair<const char*, int> ranks[] = {{"decay_low_rank_dim", decay_low_rank_dim},
                                               {"a_low_rank_dim", a_low_rank_dim},
                                               {"v_low_rank_dim", v_low_rank_dim},
                                               {"gate_low_rank_dim", gate_low_rank_dim}};
  for (const auto& [key, rank] : ranks) {
    if (architecture == Architecture::kRwkv7 && (rank < 1 || rank > 65536)) {
      return KeyError(key, absl::StrCat("must be in [1, 65536] for rwkv7, got ", rank));
    }
    if (architecture != Architecture::kRwkv7 && rank != 0) {
      return KeyError(key, "is only for architecture rwkv7");
    }
  }
  if (is_rwkv()) {
    // The RWKV blocks have their own token shift and channel mix: none of the contract's
    // block options apply.
    if (has_dconv()) return KeyError("dconv_kernel", "is not supported by the RWKV architectures");
    if (ffn != FfnKind::kSquaredRelu) {
      return KeyError("ffn", "must be squared_relu (the channel mix) for the RWKV architectures");
    }
    if (has_pkm()) return KeyError("pkm_layers", "is not supported by the RWKV architectures");
    if (dpfp_nu != 1) return KeyError("dpfp_nu", "is only for architecture fast_weight");
  }
  return ValidateDeltaNet();
}

absl::Status ModelConfig::ValidateDeltaNet() const {
  if (!is_delta_net()) {
    if (ffn == FfnKind::kSwiglu) {
      return KeyError("ffn", "swiglu is only for architectures delta_net and gated_deltanet");
    }
    const ModelConfig defaults;
    const std::pair<const char*, bool> set[] = {
        {"num_v_heads", num_v_heads != defaults.num_v_heads},
        {"head_k_dim", head_k_dim != defaults.head_k_dim},
        {"head_v_dim", head_v_dim != defaults.head_v_dim},
        {"use_short_conv", use_short_conv != defaults.use_short_conv},
        {"conv_size", conv_size != defaults.conv_size},
        {"use_gate", use_gate != defaults.use_gate},
        {"allow_neg_eigval", allow_neg_eigval != defaults.allow_neg_eigval},
        {"use_beta", use_beta != defaults.use_beta},
        {"qk_activation", qk_activation != defaults.qk_activation},
        {"qk_norm", qk_norm != defaults.qk_norm}};
    for (const auto& [key, differs] : set) {
      if (differs) return KeyError(key, "is only for architectures delta_net and gated_deltanet");
    }
    return absl::OkStatus();
  }
  // The block is fla's: its own norms, short convolutions and MLP; none of the contract's
  // block options apply.
  if (ffn != FfnKind::kSwiglu) {
    return KeyError("ffn", "must be swiglu (fla's GatedMLP) for the DeltaNet architectures");
  }
  if (has_dconv()) {
    return KeyError("dconv_kernel",
                    "is not supported by the DeltaNet architectures (see conv_size)");
  }
  if (has_pkm()) return KeyError("pkm_layers", "is not supported by the DeltaNet architectures");
  if (dpfp_nu != 1) return KeyError("dpfp_nu", "is only for architecture fast_weight");
  const std::pair<const char*, int> widths[] = {
      {"num_v_heads", num_v_heads}, {"head_k_dim", head_k_dim}, {"head_v_dim", head_v_dim}};
  for (const auto& [key, value] : widths) {
    if (value < 0 || value > 65536) {
      return KeyError(key, absl::StrCat("must be in [1, 65536] (or absent), got ", value));
    }
  }
  if (k_head_dim() < 1) {
    return KeyError("head_k_dim", absl::StrCat("is required when n_heads=", n_heads,
                                               " exceeds d_model=", d_model));
  }
  const int hv = v_heads();
  if (architecture == Architecture::kDeltaNet && hv != n_heads) {
    return KeyError("num_v_heads",
                    absl::StrCat("must equal n_heads=", n_heads, " for delta_net, got ", hv));
  }
  if (hv < n_heads || hv % n_heads != 0) {
    return KeyError("num_v_heads",
                    absl::StrCat("must be a multiple of n_heads=", n_heads, ", got ", hv));
  }
  if (use_short_conv && (conv_size < 2 || conv_size > 64)) {
    return KeyError("conv_size", absl::StrCat("must be in [2, 64], got ", conv_size));
  }
  if (qk_activation != "silu" && qk_activation != "relu" && qk_activation != "elu" &&
      qk_activation != "identity") {
    return KeyError("qk_activation", absl::StrCat("has unknown value \"", qk_activation,
                                                  "\" (expected silu, relu, elu or identity)"));
  }
  if (qk_norm != "l2" && qk_norm != "sum") {
    return KeyError("qk_norm",
                    absl::StrCat("has unknown value \"", qk_norm, "\" (expected l2 or sum)"));
  }
  if (architecture == Architecture::kGatedDeltaNet) {
    if (!use_beta) return KeyError("use_beta", "is only for architecture delta_net");
    if (qk_activation != "silu") {
      return KeyError("qk_activation", "is only for architecture delta_net");
    }
    if (qk_norm != "l2") return KeyError("qk_norm", "is only for architecture delta_net");
  }
  return absl::OkStatus();
}

bool ModelConfig::is_pkm_layer(int layer) const {
  return std::find(pkm_layers.begin(), pkm_layers.end(), layer) != pkm_layers.end();
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text) {
  json j = json::parse(json_text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: top level must be an object");
  for (const auto& item : j.items()) {
    if (KnownKeys().count(item.key()) == 0) {
      return KeyError(item.key(), "is unknown (contract version 1 has no such key)");
    }
  }
  ModelConfig c;
  absl::Status s;
  std::string arch_name, ffn_name;
  if (!(s = ReadInt(j, "format_version", true, &c.format_version)).ok()) return s;
  if (!(s = ReadString(j, "architecture", true, &arch_name)).ok()) return s;
  auto arch = ParseArchitecture(arch_name);
  if (!arch.ok()) return arch.status();
  c.architecture = *arch;
  if (!(s = ReadInt(j, "vocab_size", false, &c.vocab_size)).ok()) return s;
  if (!(s = ReadString(j, "tokenizer", false, &c.tokenizer)).ok()) return s;
  if (!(s = ReadInt(j, "bos_token_id", false, &c.bos_token_id)).ok()) return s;
  if (!(s = ReadInt(j, "eos_token_id", false, &c.eos_token_id)).ok()) return s;
  if (!(s = ReadInt(j, "d_model", true, &c.d_model)).ok()) return s;
  if (!(s = ReadInt(j, "n_layers", true, &c.n_layers)).ok()) return s;
  if (!(s = ReadInt(j, "n_heads", true, &c.n_heads)).ok()) return s;
  c.d_ff = 4 * c.d_model;
  if (!(s = ReadInt(j, "d_ff", false, &c.d_ff)).ok()) return s;
  if (c.is_delta_net()) {  // fla's defaults
    c.ffn = FfnKind::kSwiglu;
    c.use_gate = c.architecture == Architecture::kGatedDeltaNet;
  }
  if (j.contains("ffn")) {
    if (!(s = ReadString(j, "ffn", true, &ffn_name)).ok()) return s;
    auto ffn = ParseFfnKind(ffn_name);
    if (!ffn.ok()) return ffn.status();
    c.ffn = *ffn;
  }
  if (!(s = ReadInt(j, "dconv_kernel", false, &c.dconv_kernel)).ok()) return s;
  if (!(s = ReadInt(j, "dpfp_nu", false, &c.dpfp_nu)).ok()) return s;
  if (!(s = ReadDouble(j, "norm_eps", &c.norm_eps)).ok()) return s;
  if (!(s = ReadDouble(j, "attn_eps", &c.attn_eps)).ok()) return s;
  if (!(s = ReadBool(j, "tie_embeddings", &c.tie_embeddings)).ok()) return s;
  if (!(s = ReadIntList(j, "pkm_layers", &c.pkm_layers)).ok()) return s;
  if (!(s = ReadInt(j, "pkm_heads", false, &c.pkm_heads)).ok()) return s;
  if (!(s = ReadInt(j, "pkm_num_keys", false, &c.pkm_num_keys)).ok()) return s;
  if (!(s = ReadInt(j, "pkm_topk", false, &c.pkm_topk)).ok()) return s;
  if (!(s = ReadInt(j, "pkm_dim_key", false, &c.pkm_dim_key)).ok()) return s;
  if (!(s = ReadDouble(j, "pkm_bn_eps", &c.pkm_bn_eps)).ok()) return s;
  if (!(s = ReadInt(j, "decay_low_rank_dim", false, &c.decay_low_rank_dim)).ok()) return s;
  if (!(s = ReadInt(j, "a_low_rank_dim", false, &c.a_low_rank_dim)).ok()) return s;
  if (!(s = ReadInt(j, "v_low_rank_dim", false, &c.v_low_rank_dim)).ok()) return s;
  if (!(s = ReadInt(j, "gate_low_rank_dim", false, &c.gate_low_rank_dim)).ok()) return s;
  if (!(s = ReadInt(j, "num_v_heads", false, &c.num_v_heads)).ok()) return s;
  if (!(s = ReadInt(j, "head_k_dim", false, &c.head_k_dim)).ok()) return s;
  if (!(s = ReadInt(j, "head_v_dim", false, &c.head_v_dim)).ok()) return s;
  if (!(s = ReadBool(j, "use_short_conv", &c.use_short_conv)).ok()) return s;
  if (!(s = ReadInt(j, "conv_size", false, &c.conv_size)).ok()) return s;
  if (!(s = ReadBool(j, "use_gate", &c.use_gate)).ok()) return s;
  if (!(s = ReadBool(j, "allow_neg_eigval", &c.allow_neg_eigval)).ok()) return s;
  if (!(s = ReadBool(j, "use_beta", &c.use_beta)).ok()) return s;
  if (!(s = ReadString(j, "qk_activation", false, &c.qk_activation)).ok()) return s;
  if (!(s = ReadString(j, "qk_norm", false, &c.qk_norm)).ok()) return s;
  if (!(s = ReadChatTemplate(j, &c)).ok()) return s;
  if (!(s = c.Validate()).ok()) return s;
  return c;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j;  // nlohmann::json objects keep keys sorted.
  j["format_version"] = c.format_version;
  j["architecture"] = ArchitectureName(c.architecture);
  j["vocab_size"] = c.vocab_size;
  j["tokenizer"] = c.tokenizer;
  j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  j["d_model"] = c.d_model;
  j["n_layers"] = c.n_layers;
  j["n_heads"] = c.n_heads;
  j["d_ff"] = c.d_ff;
  j["ffn"] = FfnKindName(c.ffn);
  j["dconv_kernel"] = c.dconv_kernel;
  j["dpfp_nu"] = c.dpfp_nu;
  j["norm_eps"] = c.norm_eps;
  j["attn_eps"] = c.attn_eps;
  j["tie_embeddings"] = c.tie_embeddings;
  if (c.has_pkm()) {
    std::vector<int> layers = c.pkm_layers;  // canonical: ascending
    std::sort(layers.begin(), layers.end());
    j["pkm_layers"] = layers;
    j["pkm_heads"] = c.pkm_heads;
    j["pkm_num_keys"] = c.pkm_num_keys;
    j["pkm_topk"] = c.pkm_topk;
    j["pkm_dim_key"] = c.pkm_dim_key;
    j["pkm_bn_eps"] = c.pkm_bn_eps;
  }
  if (c.architecture == Architecture::kRwkv7) {  // only here: older fingerprints unchanged
    j["decay_low_rank_dim"] = c.decay_low_rank_dim;
    j["a_low_rank_dim"] = c.a_low_rank_dim;
    j["v_low_rank_dim"] = c.v_low_rank_dim;
    j["gate_low_rank_dim"] = c.gate_low_rank_dim;
  }
  if (c.is_delta_net()) {  // only here: older fingerprints unchanged
    j["num_v_heads"] = c.v_heads();
    j["head_k_dim"] = c.k_head_dim();
    j["head_v_dim"] = c.v_head_dim();
    j["use_short_conv"] = c.use_short_conv;
    j["conv_size"] = c.conv_size;
    j["use_gate"] = c.use_gate;
    j["allow_neg_eigval"] = c.allow_neg_eigval;
    if (c.architecture == Architecture::kDeltaNet) {
      j["use_beta"] = c.use_beta;
      j["qk_activation"] = c.qk_activation;
      j["qk_norm"] = c.qk_norm;
    }
  }
  if (c.has_chat_template()) {
    j["chat_template"] = {{"message", c.chat_message_template},
                          {"generation_prompt", c.chat_generation_prompt}};
    if (!c.chat_stop.empty()) j["chat_template"]["stop"] = c.chat_stop;
  }
  return j.dump(2) + "\n";
}

bool operator==(const ModelConfig& a, const ModelConfig& b) {
  return ModelConfigToJson(a) == ModelConfigToJson(b);
}

}  // namespace fwmodel
