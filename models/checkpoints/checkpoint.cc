#include "models/checkpoints/checkpoint.h"

#include <cstring>

#include <openssl/evp.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "models/base/file_util.h"
#include "models/checkpoints/hf_checkpoint.h"

namespace fwmodel {
namespace {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(const void* data, size_t n) { EVP_DigestUpdate(ctx_, data, n); }
  void Update(const std::string& s) { Update(s.data(), s.size()); }
  std::string HexDigest() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, digest, &len);
    return absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(digest), static_cast<size_t>(len)));
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

std::string Fingerprint(const ModelConfig& config,
                        const std::map<std::string, torch::Tensor>& float32_weights) {
  Sha256 sha;
  sha.Update(std::string("fwserve-model-fingerprint-v1\n"));
  // Serving metadata (the chat template) does not change what the weights compute.
  ModelConfig architecture_only = config;
  architecture_only.chat_message_template.clear();
  architecture_only.chat_generation_prompt.clear();
  sha.Update(ModelConfigToJson(architecture_only));
  for (const auto& [name, tensor] : float32_weights) {
    torch::Tensor t = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    sha.Update(name.c_str(), name.size() + 1);
    for (int64_t dim : t.sizes()) sha.Update(&dim, sizeof(dim));
    sha.Update(t.data_ptr<float>(), static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return sha.HexDigest();
}

absl::StatusOr<LoadedModel> LoadCheckpointFromBytes(const std::string& config_json,
                                                    std::string safetensors_bytes,
                                                    const ModelOptions& options) {
  auto config = ParseModelConfig(config_json);
  if (!config.ok()) return config.status();
  auto file = SafetensorsFile::Parse(std::move(safetensors_bytes));
  if (!file.ok()) return file.status();
  std::map<std::string, torch::Tensor> weights;
  for (const auto& [name, view] : file->tensors()) {
    std::vector<float> values = view.ToFloat32();
    torch::Tensor t = torch::empty(view.shape, torch::kFloat32);
    if (!values.empty())
      std::memcpy(t.data_ptr<float>(), values.data(), values.size() * sizeof(float));
    weights[name] = t;
  }
  for (const auto& [name, tensor] : weights) {
    if (!torch::isfinite(tensor).all().item<bool>()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.safetensors: tensor '", name, "' contains NaN or Inf"));
    }
  }
  auto model = Model::Create(*config, weights, options);
  if (!model.ok()) {
    if (model.status().code() != absl::StatusCode::kInvalidArgument) return model.status();
    return absl::InvalidArgumentError(
        absl::StrCat("model.safetensors: ", model.status().message()));
  }
  std::string fingerprint = Fingerprint(*config, weights);
  return LoadedModel{std::move(*model), std::move(fingerprint)};
}

absl::StatusOr<LoadedModel> LoadCheckpoint(const std::string& dir, const ModelOptions& options) {
  auto config_json = ReadFile(dir + "/config.json");
  if (!config_json.ok()) {
    return absl::Status(config_json.status().code(), "cannot read config.json in the checkpoint");
  }
  if (IsHuggingFaceConfig(*config_json))
    return LoadHuggingFaceCheckpoint(dir, *config_json, options);
  auto weights = ReadFile(dir + "/model.safetensors");
  if (!weights.ok()) {
    return absl::Status(weights.status().code(), "cannot read model.safetensors in the checkpoint");
  }
  return LoadCheckpointFromBytes(*config_json, std::move(*weights), options);
}

absl::Status SaveCheckpoint(const Model& model, const std::string& dir, DType storage) {
  absl::Status s = MakeDirectories(dir);
  if (!s.ok()) return s;
  std::vector<TensorBlob> blobs;
  for (const auto& [name, tensor] : model.ExportWeights()) {
    TensorBlob blob;
    blob.name = name;
    blob.dtype = storage;
    blob.shape = tensor.sizes().vec();
    const float* values = tensor.data_ptr<float>();
    const int64_t n = tensor.numel();
    if (storage == DType::kF32) {
      blob.bytes.assign(reinterpret_cast<const char*>(values), static_cast<size_t>(n) * 4);
    } else {
      blob.bytes.resize(static_cast<size_t>(n) * 2);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t half =
            storage == DType::kF16 ? FloatToHalf(values[i]) : FloatToBFloat16(values[i]);
        std::memcpy(&blob.bytes[static_cast<size_t>(2 * i)], &half, 2);
      }
    }
    blobs.push_back(std::move(blob));
  }
  auto bytes = SerializeSafetensors(std::move(blobs), {{"format", "pt"}});
  if (!bytes.ok()) return bytes.status();
  if (!(s = WriteFileAtomic(dir + "/model.safetensors", *bytes)).ok()) return s;
  return WriteFileAtomic(dir + "/config.json", ModelConfigToJson(model.config()));
}

}  // namespace fwmodel
