#include "models/checkpoints/hf_checkpoint.h"

#include <cstring>
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
    return KeyError("model_type",
                    "has unsupported value " + type.dump().substr(0, 64) + " (expected \"rwkv7\")");
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

absl::StatusOr<LoadedModel> LoadHuggingFaceCheckpoint(const std::string& dir,
                                                      const std::string& config_json,
                                                      const ModelOptions& options) {
  auto config = ParseHuggingFaceRwkv7Config(config_json);
  if (!config.ok()) return config.status();
  // The files: model.safetensors, or the shards of model.safetensors.index.json.
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
  // fla names -> ours, strictly, errors in fla's names.
  std::map<std::string, std::pair<std::string, std::vector<int64_t>>> expected;  // fla -> ours
  for (const auto& [name, shape] : ExpectedWeightShapes(*config)) {
    expected[FlaTensorName(name)] = {name, shape};
  }
  std::map<std::string, torch::Tensor> weights;
  for (auto& [fla_name, tensor] : file_tensors) {
    auto it = expected.find(fla_name);
    if (it == expected.end()) {
      if (fla_name == "lm_head.weight" && config->tie_embeddings) {
        return absl::InvalidArgumentError(
            "model.safetensors: tensor 'lm_head.weight' is present but tie_word_embeddings is "
            "true");
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "model.safetensors: unknown tensor '", fla_name.substr(0, 200),
          "' (not part of RWKV-7 x070 as implemented; variants such as rwkv7a/7b or hybrid "
          "attention layers are not supported)"));
    }
    const auto& [ours, shape] = it->second;
    // fla keeps the token-shift mixes as [1, 1, C].
    if (tensor.dim() == 3 && tensor.size(0) == 1 && tensor.size(1) == 1 && shape.size() == 1) {
      tensor = tensor.reshape({-1});
    }
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
  auto model = Model::Create(*config, weights, options);
  if (!model.ok()) return model.status();
  std::string fingerprint = Fingerprint(*config, weights);
  return LoadedModel{std::move(*model), std::move(fingerprint)};
}

}  // namespace fwmodel
