#include "models/checkpoints/hf_checkpoint.h"

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/base/file_util.h"
#include "models/checkpoints/safetensors.h"
#include "nlohmann/json.hpp"

namespace fwmodel {
namespace {

using nlohmann::json;

absl::Status KeyError(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: key '", key, "' ", what));
}

// fla's RWKV7Config keys (and PretrainedConfig's that its files carry). Those in
// kIgnoredKeys do not change what the model computes at inference.
const std::set<std::string>& UsedKeys() {
  static const auto* keys =
      new std::set<std::string>{"model_type",     "hidden_size",         "num_hidden_layers",
                                "head_dim",       "num_heads",           "intermediate_size",
                                "hidden_ratio",   "decay_low_rank_dim",  "gate_low_rank_dim",
                                "a_low_rank_dim", "v_low_rank_dim",      "vocab_size",
                                "norm_eps",       "tie_word_embeddings", "bos_token_id",
                                "eos_token_id",   "pad_token_id",        "attn",
                                "hidden_act",     "norm_first",          "norm_bias",
                                "value_dim"};
  return *keys;
}
const std::set<std::string>& IgnoredKeys() {
  static const auto* keys = new std::set<std::string>{"architectures",
                                                      "attn_mode",
                                                      "fuse_norm",
                                                      "fuse_cross_entropy",
                                                      "fuse_linear_cross_entropy",
                                                      "use_l2warp",
                                                      "initializer_range",
                                                      "max_position_embeddings",
                                                      "torch_dtype",
                                                      "transformers_version",
                                                      "use_cache",
                                                      "auto_map",
                                                      "_name_or_path"};
  return *keys;
}

absl::StatusOr<int> Int(const json& j, const std::string& key, bool required, int fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return KeyError(key, "is required but missing");
    return fallback;
  }
  if (!it->is_number_integer()) return KeyError(key, "must be an integer, got " + it->dump());
  const int64_t v = it->get<int64_t>();
  if (v < 0 || v > INT32_MAX) return KeyError(key, absl::StrCat("is out of range: ", v));
  return static_cast<int>(v);
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

bool IsHuggingFaceConfig(const std::string& config_json) {
  json j = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("model_type");
}

absl::StatusOr<ModelConfig> ParseHuggingFaceRwkv7Config(const std::string& config_json) {
  json j = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  for (const auto& item : j.items()) {
    if (UsedKeys().count(item.key()) == 0 && IgnoredKeys().count(item.key()) == 0) {
      return KeyError(item.key().substr(0, 64), "is unknown (not a key of fla's RWKV7Config)");
    }
  }
  const json& type = j["model_type"];
  if (!type.is_string() || (type != "rwkv7" && type != "rwkv7_fla")) {
    return KeyError("model_type", "has unsupported value " + type.dump().substr(0, 64) +
                                      " (expected \"rwkv7\", \"delta_net\" or "
                                      "\"gated_deltanet\")");
  }
  if (j.contains("attn") && !j["attn"].is_null()) {
    return KeyError("attn", "sets hybrid attention layers, which are not supported");
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "sqrelu") {
    return KeyError("hidden_act", "must be \"sqrelu\" (the channel mix), got " +
                                      j["hidden_act"].dump().substr(0, 64));
  }
  for (const char* key : {"norm_first", "norm_bias"}) {
    if (j.contains(key) && j[key] != true) return KeyError(key, "must be true");
  }
  ModelConfig c;
  c.architecture = Architecture::kRwkv7;
  absl::StatusOr<int> v;
  if (!(v = Int(j, "hidden_size", true, 0)).ok()) return v.status();
  c.d_model = *v;
  if (!(v = Int(j, "num_hidden_layers", true, 0)).ok()) return v.status();
  c.n_layers = *v;
  if (!(v = Int(j, "vocab_size", true, 0)).ok()) return v.status();
  c.vocab_size = *v;
  // head_dim wins over num_heads, as in fla's RWKV7Attention.
  const bool has_head_dim = j.contains("head_dim") && !j["head_dim"].is_null();
  if (has_head_dim || !j.contains("num_heads") || j["num_heads"].is_null()) {
    if (!(v = Int(j, "head_dim", false, 64)).ok()) return v.status();
    if (*v < 1 || c.d_model % *v != 0) {
      return KeyError("head_dim",
                      absl::StrCat("must divide hidden_size=", c.d_model, ", got ", *v));
    }
    c.n_heads = c.d_model / *v;
  } else {
    if (!(v = Int(j, "num_heads", true, 0)).ok()) return v.status();
    c.n_heads = *v;
  }
  if (j.contains("intermediate_size") && !j["intermediate_size"].is_null()) {
    if (!(v = Int(j, "intermediate_size", true, 0)).ok()) return v.status();
    c.d_ff = *v;
  } else {
    const json ratio = j.value("hidden_ratio", json(4));
    if (!ratio.is_number()) return KeyError("hidden_ratio", "must be a number");
    c.d_ff = static_cast<int>(ratio.get<double>() * c.d_model);
  }
  const std::pair<const char*, int*> ranks[] = {{"decay_low_rank_dim", &c.decay_low_rank_dim},
                                                {"gate_low_rank_dim", &c.gate_low_rank_dim},
                                                {"a_low_rank_dim", &c.a_low_rank_dim},
                                                {"v_low_rank_dim", &c.v_low_rank_dim}};
  for (const auto& [key, out] : ranks) {
    if (!(v = Int(j, key, true, 0)).ok()) return v.status();
    *out = *v;
  }
  if (j.contains("value_dim") && !j["value_dim"].is_null()) {
    const json& vd = j["value_dim"];
    bool same = vd.is_number_integer() ? vd.get<int64_t>() == c.d_model : vd.is_array();
    if (vd.is_array()) {
      for (const json& x : vd) same &= x.is_number_integer() && x.get<int64_t>() == c.d_model;
    }
    if (!same)
      return KeyError("value_dim", "must equal hidden_size (other value widths are not supported)");
  }
  if (j.contains("norm_eps")) {
    if (!j["norm_eps"].is_number()) return KeyError("norm_eps", "must be a number");
    c.norm_eps = j["norm_eps"].get<double>();
  }
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean()) {
      return KeyError("tie_word_embeddings", "must be true or false");
    }
    c.tie_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  for (const char* key : {"eos_token_id", "pad_token_id"}) {
    if (!(v = Int(j, key, false, 0)).ok()) return v.status();
  }
  c.tokenizer = c.vocab_size >= 65530 ? "rwkv_world" : "bytes";
  if (c.tokenizer == "rwkv_world") {  // the G1 chat models' template (docs/models.md)
    c.chat_message_template = kG1ChatMessage;
    c.chat_generation_prompt = kG1GenerationPrompt;
    c.chat_stop = {kG1Stop};
  }
  if (!(v = Int(j, "bos_token_id", false, c.tokenizer == "rwkv_world" ? 0 : 10)).ok()) {
    return v.status();
  }
  c.bos_token_id = *v;
  absl::Status valid = c.Validate();
  if (!valid.ok()) return valid;
  return c;
}

std::string FlaTensorName(const std::string& name) {
  static const std::map<std::string, std::string> kTop = {{"emb.weight", "model.embeddings.weight"},
                                                          {"ln_out.weight", "model.norm.weight"},
                                                          {"ln_out.bias", "model.norm.bias"},
                                                          {"head.weight", "lm_head.weight"}};
  auto top = kTop.find(name);
  if (top != kTop.end()) return top->second;
  // blocks.{i}.<part>
  const size_t dot = name.find('.', 7);
  const std::string layer = name.substr(7, dot - 7);
  std::string part = name.substr(dot + 1);
  static const std::map<std::string, std::string> kParts = {
      {"ln0", "pre_norm"},
      {"ln1", "attn_norm"},
      {"ln2", "ffn_norm"},
      {"att.receptance.weight", "attn.r_proj.weight"},
      {"att.key.weight", "attn.k_proj.weight"},
      {"att.value.weight", "attn.v_proj.weight"},
      {"att.output.weight", "attn.o_proj.weight"},
      {"att.ln_x", "attn.g_norm"},
  };
  for (const auto& [ours, theirs] : kParts) {
    if (part == ours || part.rfind(ours + ".", 0) == 0) {
      part = theirs + part.substr(ours.size());
      return absl::StrCat("model.layers.", layer, ".", part);
    }
  }
  // The LoRAs: att.{w,a,v,g}{0,1,2} -> attn.{p}_lora.lora.{2.bias, 0.weight, 2.weight}.
  if (part.size() == 6 && part.rfind("att.", 0) == 0 &&
      std::string("wavg").find(part[4]) != std::string::npos &&
      (part[5] == '0' || part[5] == '1' || part[5] == '2')) {
    const char* suffix = part[5] == '0' ? "2.bias" : part[5] == '1' ? "0.weight" : "2.weight";
    return absl::StrCat("model.layers.", layer, ".attn.", std::string(1, part[4]), "_lora.lora.",
                        suffix);
  }
  if (part.rfind("att.", 0) == 0) part = "attn." + part.substr(4);
  return absl::StrCat("model.layers.", layer, ".", part);
}

namespace {

// The model whose weights are fla's tensors `file_tensors`, strictly: every tensor of
// `config` (ExpectedWeightShapes) is found under its fla name (`fla_name_of`, ours ->
// fla's), `adapt` puts fla's layout of one into our shape where they differ, and an
// unknown, missing or wrong-shaped tensor is an error naming fla's tensor (`unknown_why`
// says why a name is unknown).
absl::StatusOr<LoadedModel> ModelFromFlaTensors(
    const ModelConfig& config, std::map<std::string, torch::Tensor> file_tensors,
    const std::function<std::string(const std::string&)>& fla_name_of,
    const std::function<void(torch::Tensor*, const std::vector<int64_t>&)>& adapt,
    const std::string& unknown_why, const ModelOptions& options) {
  std::map<std::string, std::pair<std::string, std::vector<int64_t>>> expected;  // fla -> ours
  for (const auto& [name, shape] : ExpectedWeightShapes(config)) {
    expected[fla_name_of(name)] = {name, shape};
  }
  std::map<std::string, torch::Tensor> weights;
  for (auto& [fla_name, tensor] : file_tensors) {
    auto it = expected.find(fla_name);
    if (it == expected.end()) {
      if (fla_name == "lm_head.weight" && config.tie_embeddings) {
        return absl::InvalidArgumentError(
            "model.safetensors: tensor 'lm_head.weight' is present but tie_word_embeddings is "
            "true");
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "model.safetensors: unknown tensor '", fla_name.substr(0, 200), "' (", unknown_why, ")"));
    }
    const auto& [ours, shape] = it->second;
    adapt(&tensor, shape);
    if (tensor.sizes().vec() != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.safetensors: tensor '", fla_name, "' has shape ",
                       ShapeString(tensor.sizes().vec()), ", expected ", ShapeString(shape)));
    }
    weights[ours] = tensor;
  }
  for (const auto& [fla_name, entry] : expected) {
    if (weights.count(entry.first) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.safetensors: missing tensor '", fla_name, "'"));
    }
  }
  auto model = Model::Create(config, weights, options);
  if (!model.ok()) return model.status();
  std::string fingerprint = Fingerprint(config, weights);
  return LoadedModel{std::move(*model), std::move(fingerprint)};
}

// The tensors of a Hugging Face directory as float32 by their names in the files:
// model.safetensors, or the shards model.safetensors.index.json lists (each tensor in the
// shard the index names). Errors name the file and the tensor, never the directory.
absl::StatusOr<std::map<std::string, torch::Tensor>> ReadHuggingFaceTensors(
    const std::string& dir) {
  std::vector<std::string> shards;
  std::map<std::string, std::string> shard_of;  // tensor -> shard, when indexed
  auto single = ReadFile(dir + "/model.safetensors");
  if (!single.ok()) {
    auto index_text = ReadFile(dir + "/model.safetensors.index.json");
    if (!index_text.ok()) {
      return absl::NotFoundError(
          "neither model.safetensors nor model.safetensors.index.json in the model directory");
    }
    json index = json::parse(*index_text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          "model.safetensors.index.json: not an object with a \"weight_map\" object");
    }
    std::set<std::string> files;
    for (const auto& item : index["weight_map"].items()) {
      if (!item.value().is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.safetensors.index.json: the shard of '", item.key(), "' is not a string"));
      }
      const std::string shard = item.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard[0] == '.' ||
          !EndsWith(shard, ".safetensors")) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.safetensors.index.json: shard name '", shard.substr(0, 128),
                         "' is not a .safetensors file in the directory"));
      }
      shard_of[item.key()] = shard;
      files.insert(shard);
    }
    shards.assign(files.begin(), files.end());
  }
  std::map<std::string, torch::Tensor> file_tensors;  // fla name -> float32
  auto take = [&](const std::string& file_name, std::string bytes) -> absl::Status {
    auto file = SafetensorsFile::Parse(std::move(bytes));
    if (!file.ok())
      return absl::InvalidArgumentError(absl::StrCat(file_name, ": ", file.status().message()));
    for (const auto& [name, view] : file->tensors()) {
      if (!shard_of.empty()) {
        auto it = shard_of.find(name);
        if (it == shard_of.end() || it->second != file_name) {
          return absl::InvalidArgumentError(absl::StrCat(
              file_name, ": tensor '", name, "' is not listed for this shard in the index"));
        }
      }
      if (file_tensors.count(name) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(file_name, ": tensor '", name, "' appears twice"));
      }
      std::vector<float> values = view.ToFloat32();
      torch::Tensor t = torch::empty(view.shape, torch::kFloat32);
      if (!values.empty())
        std::memcpy(t.data_ptr<float>(), values.data(), values.size() * sizeof(float));
      if (!torch::isfinite(t).all().item<bool>()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file_name, ": tensor '", name, "' contains NaN or Inf"));
      }
      file_tensors[name] = t;
    }
    return absl::OkStatus();
  };
  if (single.ok()) {
    absl::Status s = take("model.safetensors", std::move(*single));
    if (!s.ok()) return s;
  } else {
    for (const std::string& shard : shards) {
      auto bytes = ReadFile(dir + "/" + shard);
      if (!bytes.ok()) {
        return absl::NotFoundError(
            absl::StrCat("cannot read shard ", shard, " of model.safetensors.index.json"));
      }
      absl::Status s = take(shard, std::move(*bytes));
      if (!s.ok()) return s;
    }
    for (const auto& [name, shard] : shard_of) {
      if (file_tensors.count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("model.safetensors.index.json: tensor '",
                                                       name, "' is not in its shard ", shard));
      }
    }
  }
  return file_tensors;
}

absl::StatusOr<LoadedModel> LoadHuggingFaceRwkv7(const std::string& dir,
                                                 const std::string& config_json,
                                                 const ModelOptions& options) {
  auto config = ParseHuggingFaceRwkv7Config(config_json);
  if (!config.ok()) return config.status();
  auto read = ReadHuggingFaceTensors(dir);
  if (!read.ok()) return read.status();
  std::map<std::string, torch::Tensor>& file_tensors = *read;
  return ModelFromFlaTensors(
      *config, std::move(file_tensors), FlaTensorName,
      [](torch::Tensor* tensor, const std::vector<int64_t>& shape) {
        // fla keeps the token-shift mixes as [1, 1, C].
        if (tensor->dim() == 3 && tensor->size(0) == 1 && tensor->size(1) == 1 &&
            shape.size() == 1) {
          *tensor = tensor->reshape({-1});
        }
      },
      "not part of RWKV-7 x070 as implemented; variants such as rwkv7a/7b or hybrid attention "
      "layers are not supported",
      options);
}

}  // namespace

// ---------------------------------------------------------------------------
// DeltaNet and Gated DeltaNet (fla's DeltaNetConfig, GatedDeltaNetConfig)

namespace {

// Keys of both configs (PretrainedConfig's that fla's files carry included), then each
// architecture's own. FlaDeltaNetIgnoredKeys do not change what the model computes at
// inference (use_output_norm: fla's layers always apply o_norm, whatever it says).
const std::set<std::string>& FlaDeltaNetCommonKeys() {
  static const auto* keys = new std::set<std::string>{"model_type",
                                                      "hidden_size",
                                                      "num_hidden_layers",
                                                      "num_heads",
                                                      "expand_v",
                                                      "use_gate",
                                                      "use_short_conv",
                                                      "allow_neg_eigval",
                                                      "conv_size",
                                                      "hidden_ratio",
                                                      "intermediate_size",
                                                      "hidden_act",
                                                      "norm_eps",
                                                      "norm_first",
                                                      "attn",
                                                      "attnres_block_size",
                                                      "bos_token_id",
                                                      "eos_token_id",
                                                      "pad_token_id",
                                                      "tie_word_embeddings",
                                                      "vocab_size"};
  return *keys;
}
const std::set<std::string>& FlaDeltaNetOwnKeys(bool gated) {
  static const auto* delta =
      new std::set<std::string>{"expand_k", "use_beta", "qk_norm", "qk_activation"};
  static const auto* gated_keys = new std::set<std::string>{"head_dim", "num_v_heads"};
  return gated ? *gated_keys : *delta;
}
const std::set<std::string>& FlaDeltaNetIgnoredKeys() {
  static const auto* keys = new std::set<std::string>{"fuse_swiglu", "use_output_norm"};
  return *keys;
}

// An optional JSON value: its default when absent or null.
absl::StatusOr<double> FlaNumber(const json& j, const std::string& key, double fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) return KeyError(key, "must be a number, got " + it->dump().substr(0, 64));
  return it->get<double>();
}
absl::StatusOr<bool> FlaBool(const json& j, const std::string& key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return KeyError(key, "must be true or false, got " + it->dump().substr(0, 64));
  }
  return it->get<bool>();
}
absl::StatusOr<std::string> FlaString(const json& j, const std::string& key,
                                      const std::string& fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string()) return KeyError(key, "must be a string, got " + it->dump().substr(0, 64));
  return it->get<std::string>();
}

bool FlaFileExists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

}  // namespace

absl::StatusOr<ModelConfig> ParseHuggingFaceDeltaNetConfig(const std::string& config_json,
                                                           bool sentencepiece, int mlp_width) {
  json j = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  const json& type = j["model_type"];
  const bool gated = type == "gated_deltanet";
  if (!gated && type != "delta_net") {
    return KeyError("model_type", "has unsupported value " + type.dump().substr(0, 64) +
                                      " (expected \"delta_net\" or \"gated_deltanet\")");
  }
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    if (FlaDeltaNetCommonKeys().count(key) == 0 && FlaDeltaNetOwnKeys(gated).count(key) == 0 &&
        FlaDeltaNetIgnoredKeys().count(key) == 0 && IgnoredKeys().count(key) == 0) {
      return KeyError(key.substr(0, 64),
                      absl::StrCat("is unknown (not a key of fla's ",
                                   gated ? "GatedDeltaNetConfig" : "DeltaNetConfig", ")"));
    }
  }
  if (j.contains("attn") && !j["attn"].is_null()) {
    return KeyError("attn", "sets hybrid attention layers, which are not supported");
  }
  if (j.contains("attnres_block_size") && !j["attnres_block_size"].is_null()) {
    return KeyError("attnres_block_size",
                    "sets attention residuals between blocks, which are not supported");
  }
  if (j.contains("norm_first") && j["norm_first"] != false) {
    return KeyError("norm_first",
                    "must be false (fla's older layout with the norms inside the layers is not "
                    "supported)");
  }
  auto act = FlaString(j, "hidden_act", "swish");
  if (!act.ok()) return act.status();
  if (*act != "swish") {
    return KeyError("hidden_act",
                    "must be \"swish\" (the MLP is SwiGLU), got \"" + act->substr(0, 64) + "\"");
  }
  ModelConfig c;
  c.architecture = gated ? Architecture::kGatedDeltaNet : Architecture::kDeltaNet;
  c.ffn = FfnKind::kSwiglu;
  absl::StatusOr<int> v;
  if (!(v = Int(j, "hidden_size", true, 0)).ok()) return v.status();
  c.d_model = *v;
  if (!(v = Int(j, "num_hidden_layers", true, 0)).ok()) return v.status();
  c.n_layers = *v;
  if (!(v = Int(j, "vocab_size", true, 0)).ok()) return v.status();
  c.vocab_size = *v;
  if (!(v = Int(j, "num_heads", false, gated ? 6 : 16)).ok()) return v.status();
  c.n_heads = *v;
  if (c.n_heads < 1) return KeyError("num_heads", "must be positive");
  auto expand_v = FlaNumber(j, "expand_v", gated ? 2.0 : 1.0);
  if (!expand_v.ok()) return expand_v.status();
  if (gated) {
    // fla's GatedDeltaNet: head_k_dim = head_dim, head_v_dim = int(head_dim · expand_v).
    if (!(v = Int(j, "head_dim", false, 256)).ok()) return v.status();
    c.head_k_dim = *v;
    if (!(v = Int(j, "num_v_heads", false, c.n_heads)).ok()) return v.status();
    c.num_v_heads = *v;
    const double width = c.head_k_dim * *expand_v;
    c.head_v_dim = static_cast<int>(width);
    if (c.head_k_dim < 1 || c.head_v_dim < 1 || std::abs(width - c.head_v_dim) > 1e-5 * width) {
      return KeyError("expand_v", absl::StrCat("times head_dim=", c.head_k_dim,
                                               " must be a positive integer, got ", width));
    }
  } else {
    // fla's DeltaNet: key_dim = int(hidden_size · expand_k), split over num_heads.
    auto expand_k = FlaNumber(j, "expand_k", 1.0);
    if (!expand_k.ok()) return expand_k.status();
    const std::pair<const char*, double> expands[] = {{"expand_k", *expand_k},
                                                      {"expand_v", *expand_v}};
    int* widths[] = {&c.head_k_dim, &c.head_v_dim};
    for (int i = 0; i < 2; ++i) {
      const int64_t dim = static_cast<int64_t>(c.d_model * expands[i].second);
      if (dim < c.n_heads || dim % c.n_heads != 0) {
        return KeyError(expands[i].first, absl::StrCat("gives a width of ", dim, " that num_heads=",
                                                       c.n_heads, " does not divide"));
      }
      *widths[i] = static_cast<int>(dim / c.n_heads);
    }
    c.num_v_heads = c.n_heads;
    auto beta = FlaBool(j, "use_beta", true);
    if (!beta.ok()) return beta.status();
    c.use_beta = *beta;
    auto qk_norm = FlaString(j, "qk_norm", "l2");
    if (!qk_norm.ok()) return qk_norm.status();
    c.qk_norm = *qk_norm;
    auto qk_activation = FlaString(j, "qk_activation", "silu");
    if (!qk_activation.ok()) return qk_activation.status();
    c.qk_activation = *qk_activation;
  }
  struct Flag {
    const char* key;
    bool fla_default;
    bool* out;
  };
  const Flag flags[] = {{"use_gate", gated, &c.use_gate},
                        {"use_short_conv", true, &c.use_short_conv},
                        {"allow_neg_eigval", false, &c.allow_neg_eigval},
                        {"tie_word_embeddings", false, &c.tie_embeddings}};
  for (const Flag& flag : flags) {
    auto value = FlaBool(j, flag.key, flag.fla_default);
    if (!value.ok()) return value.status();
    *flag.out = *value;
  }
  if (!(v = Int(j, "conv_size", false, 4)).ok()) return v.status();
  c.conv_size = *v;
  if (j.contains("intermediate_size") && !j["intermediate_size"].is_null()) {
    if (!(v = Int(j, "intermediate_size", true, 0)).ok()) return v.status();
    c.d_ff = *v;
  } else if (mlp_width > 0) {
    c.d_ff = mlp_width;
  } else {  // fla's GatedMLP: 2/3 · hidden_ratio · hidden_size, up to a multiple of 256
    auto ratio = FlaNumber(j, "hidden_ratio", 4.0);
    if (!ratio.ok()) return ratio.status();
    const int64_t width = static_cast<int64_t>(c.d_model * *ratio * 2 / 3);
    c.d_ff = static_cast<int>(256 * ((width + 255) / 256));
  }
  auto eps = FlaNumber(j, "norm_eps", 1e-6);
  if (!eps.ok()) return eps.status();
  c.norm_eps = *eps;
  if (!(v = Int(j, "pad_token_id", false, 0)).ok()) return v.status();
  if (!(v = Int(j, "bos_token_id", false, 1)).ok()) return v.status();
  c.bos_token_id = *v;
  if (!(v = Int(j, "eos_token_id", false, 2)).ok()) return v.status();
  // A byte vocabulary has no end-of-text id of its own (a byte is text); SentencePiece's
  // is the config's.
  c.tokenizer = sentencepiece ? "sentencepiece" : "bytes";
  c.eos_token_id = sentencepiece ? *v : -1;
  absl::Status valid = c.Validate();
  if (!valid.ok()) return valid;
  return c;
}

std::string FlaDeltaNetTensorName(const std::string& name) {
  if (name == "lm_head.weight") return name;
  if (name.rfind("blocks.", 0) == 0) return "model.layers." + name.substr(7);
  return "model." + name;  // embeddings.weight, norm.weight
}

namespace {

absl::StatusOr<LoadedModel> LoadFlaDeltaNet(const std::string& dir, const std::string& config_json,
                                            const ModelOptions& options) {
  // Fail fast on the config and the tokenizer, before reading the weights.
  const bool sentencepiece = FlaFileExists(dir + "/tokenizer.model");
  auto config = ParseHuggingFaceDeltaNetConfig(config_json, sentencepiece);
  if (!config.ok()) return config.status();
  if (!sentencepiece && FlaFileExists(dir + "/tokenizer.json")) {
    return absl::InvalidArgumentError(
        "tokenizer.json: Hugging Face's tokenizers are not supported; this model needs its "
        "SentencePiece tokenizer.model (the directory has tokenizer.json but no "
        "tokenizer.model)");
  }
  auto read = ReadHuggingFaceTensors(dir);
  if (!read.ok()) return read.status();
  std::map<std::string, torch::Tensor>& file_tensors = *read;
  // The MLP's width from the tensors when config.json leaves it to hidden_ratio.
  const json j = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.contains("intermediate_size") || j["intermediate_size"].is_null()) {
    const std::string down = "model.layers.0.mlp.down_proj.weight";
    auto it = file_tensors.find(down);
    if (it == file_tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.safetensors: missing tensor '", down, "'"));
    }
    if (it->second.dim() != 2 || it->second.size(0) != config->d_model) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.safetensors: tensor '", down, "' has shape ",
          ShapeString(it->second.sizes().vec()), ", expected [", config->d_model, ", F]"));
    }
    config = ParseHuggingFaceDeltaNetConfig(config_json, sentencepiece,
                                            static_cast<int>(it->second.size(1)));
    if (!config.ok()) return config.status();
  }
  const ModelConfig& c = *config;
  const int64_t f = c.d_ff;
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string layer = absl::StrCat("model.layers.", i, ".");
    // fla's older GatedMLP: one gate_proj [2F, D], the gate's rows then up's.
    const std::string gate = layer + "mlp.gate_proj.weight", up = layer + "mlp.up_proj.weight";
    auto fused = file_tensors.find(gate);
    if (file_tensors.count(up) == 0 && fused != file_tensors.end() && fused->second.dim() == 2 &&
        fused->second.size(0) == 2 * f) {
      torch::Tensor both = fused->second;
      file_tensors[up] = both.narrow(0, f, f).clone();
      file_tensors[gate] = both.narrow(0, 0, f).clone();
    }
    // Older Gated DeltaNet files carry an unused `D` per head.
    const std::string d_name = layer + "attn.D";
    auto d = file_tensors.find(d_name);
    if (c.architecture == Architecture::kGatedDeltaNet && d != file_tensors.end()) {
      if (d->second.dim() != 1 ||
          (d->second.size(0) != c.n_heads && d->second.size(0) != c.v_heads())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.safetensors: tensor '", d_name, "' has shape ",
            ShapeString(d->second.sizes().vec()), ", expected [", c.n_heads, "] (unused)"));
      }
      file_tensors.erase(d);
    }
  }
  return ModelFromFlaTensors(
      c, std::move(file_tensors), FlaDeltaNetTensorName,
      [](torch::Tensor* tensor, const std::vector<int64_t>& shape) {
        // fla's convolutions are Conv1d weights [C, 1, W].
        if (tensor->dim() == 3 && tensor->size(1) == 1 && shape.size() == 2) {
          *tensor = tensor->reshape({tensor->size(0), tensor->size(2)});
        }
      },
      absl::StrCat("not part of ", ArchitectureName(c.architecture),
                   " as implemented or as config.json sets it"),
      options);
}

}  // namespace

absl::StatusOr<LoadedModel> LoadHuggingFaceCheckpoint(const std::string& dir,
                                                      const std::string& config_json,
                                                      const ModelOptions& options) {
  json j = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && (j["model_type"] == "delta_net" || j["model_type"] == "gated_deltanet")) {
    return LoadFlaDeltaNet(dir, config_json, options);
  }
  return LoadHuggingFaceRwkv7(dir, config_json, options);
}

}  // namespace fwmodel
