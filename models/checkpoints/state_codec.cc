#include "models/checkpoints/state_codec.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/checkpoints/checkpoint.h"
#include "models/checkpoints/safetensors.h"
#include "models/checkpoints/state_format.h"

namespace fwmodel {
namespace {

constexpr char kNextLogits[] = "next_logits";

TensorBlob Float32Blob(const std::string& name, const torch::Tensor& tensor) {
  torch::Tensor t = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  return TensorBlob{name, DType::kF32, t.sizes().vec(),
                    std::string(reinterpret_cast<const char*>(t.data_ptr<float>()),
                                static_cast<size_t>(t.numel()) * 4)};
}

}  // namespace

absl::StatusOr<std::string> EncodeStateRow(const Model& model, const std::string& fingerprint,
                                           const State& state, int64_t row, int64_t tokens,
                                           const torch::Tensor& next_logits,
                                           const std::map<std::string, std::string>& labels) {
  if (state.tensors.size() != model.state_spec().size()) {
    return absl::InvalidArgumentError("state does not belong to this model");
  }
  if (row < 0 || row >= state.batch_size()) {
    return absl::InvalidArgumentError(absl::StrCat("state row ", row, " is out of range"));
  }
  if (tokens < 0) return absl::InvalidArgumentError("tokens must be >= 0");
  std::vector<TensorBlob> blobs;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    blobs.push_back(Float32Blob(model.state_spec()[i].name, state.tensors[i][row]));
  }
  if (tokens > 0) {
    if (!next_logits.defined() || next_logits.dim() != 1 ||
        next_logits.size(0) != model.config().vocab_size) {
      return absl::InvalidArgumentError("next_logits must be [vocab] when tokens > 0");
    }
    blobs.push_back(Float32Blob(kNextLogits, next_logits));
  }
  std::map<std::string, std::string> metadata = labels;
  for (const auto& [key, value] : labels) {
    if (key.rfind("x-", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("label '", key, "' must start with x-"));
    }
  }
  // The checksum covers the data section, which the writer lays out in name order.
  std::sort(blobs.begin(), blobs.end(),
            [](const TensorBlob& a, const TensorBlob& b) { return a.name < b.name; });
  std::string data;
  for (const TensorBlob& b : blobs) data += b.bytes;
  metadata["format"] = kStateFormat;
  metadata["version"] = kStateVersion;
  metadata["fingerprint"] = fingerprint;
  metadata["tokens"] = absl::StrCat(tokens);
  metadata[kStateChecksumKey] = StateChecksum(metadata, data);
  return SerializeSafetensors(std::move(blobs), metadata);
}

absl::StatusOr<DecodedState> DecodeStateRow(const Model& model, const std::string& fingerprint,
                                            std::string bytes) {
  auto file = SafetensorsFile::Parse(std::move(bytes));
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("state: ", file.status().message()));
  }
  const auto& meta = file->metadata();
  auto field = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    return it == meta.end() ? "" : it->second;
  };
  if (absl::Status format = CheckStateFormat(meta); !format.ok()) return format;
  if (StateChecksum(meta, StateDataSection(*file)) != field(kStateChecksumKey)) {
    return absl::InvalidArgumentError("state: checksum mismatch (corrupted or altered)");
  }
  if (field("fingerprint") != fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("state: belongs to model ", field("fingerprint").substr(0, 16),
                     "..., not this model ", fingerprint.substr(0, 16), "..."));
  }
  DecodedState decoded;
  if (!absl::SimpleAtoi(field("tokens"), &decoded.tokens) || decoded.tokens < 0) {
    return absl::InvalidArgumentError("state: bad 'tokens' metadata");
  }
  const auto& spec = model.state_spec();
  const size_t expected_tensors = spec.size() + (decoded.tokens > 0 ? 1 : 0);
  if (file->tensors().size() != expected_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("state: has ", file->tensors().size(),
                                                   " tensors, expected ", expected_tensors));
  }
  auto options = torch::TensorOptions().dtype(model.options().dtype).device(model.options().device);
  for (const StateTensorSpec& s : spec) {
    auto it = file->tensors().find(s.name);
    if (it == file->tensors().end()) {
      return absl::InvalidArgumentError(absl::StrCat("state: missing tensor '", s.name, "'"));
    }
    if (it->second.dtype != DType::kF32 || it->second.shape != s.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("state: tensor '", s.name, "' has the wrong dtype or shape"));
    }
    torch::Tensor t = torch::empty(s.shape, torch::kFloat32);
    std::memcpy(t.data_ptr<float>(), it->second.data, it->second.nbytes);
    decoded.state.tensors.push_back(t.to(options).unsqueeze(0));
  }
  if (decoded.tokens > 0) {
    auto it = file->tensors().find(kNextLogits);
    const std::vector<int64_t> logits_shape = {model.config().vocab_size};
    if (it == file->tensors().end() || it->second.dtype != DType::kF32 ||
        it->second.shape != logits_shape) {
      return absl::InvalidArgumentError("state: missing or malformed 'next_logits'");
    }
    decoded.next_logits = torch::empty(logits_shape, torch::kFloat32);
    std::memcpy(decoded.next_logits.data_ptr<float>(), it->second.data, it->second.nbytes);
  }
  for (const auto& [key, value] : meta) {
    if (key.rfind("x-", 0) == 0) decoded.labels[key] = value;
  }
  return decoded;
}

}  // namespace fwmodel
