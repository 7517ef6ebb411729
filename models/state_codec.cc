#include "models/state_codec.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/checkpoint.h"
#include "models/safetensors.h"

namespace fwmodel {
namespace {

constexpr char kFormat[] = "fwserve-state";
constexpr char kVersion[] = "1";

}  // namespace

absl::StatusOr<std::string> EncodeStateRow(const Model& model, const std::string& fingerprint,
                                           const State& state, int64_t row, int64_t tokens) {
  if (state.tensors.size() != model.state_spec().size()) {
    return absl::InvalidArgumentError("state does not belong to this model");
  }
  if (row < 0 || row >= state.batch_size()) {
    return absl::InvalidArgumentError(absl::StrCat("state row ", row, " is out of range"));
  }
  std::vector<TensorBlob> blobs;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    torch::Tensor t = state.tensors[i][row].detach().to(torch::kCPU, torch::kFloat32).contiguous();
    TensorBlob blob{model.state_spec()[i].name, DType::kF32, t.sizes().vec(),
                    std::string(reinterpret_cast<const char*>(t.data_ptr<float>()),
                                static_cast<size_t>(t.numel()) * 4)};
    blobs.push_back(std::move(blob));
  }
  // The checksum covers the data section, which the writer lays out in name order.
  std::sort(blobs.begin(), blobs.end(),
            [](const TensorBlob& a, const TensorBlob& b) { return a.name < b.name; });
  std::string data;
  for (const TensorBlob& b : blobs) data += b.bytes;
  return SerializeSafetensors(std::move(blobs), {{"format", kFormat},
                                                 {"version", kVersion},
                                                 {"fingerprint", fingerprint},
                                                 {"tokens", absl::StrCat(tokens)},
                                                 {"sha256", Sha256Hex(data)}});
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
  if (field("format") != kFormat) return absl::InvalidArgumentError("state: not an fwserve state");
  if (field("version") != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("state: unsupported version '", field("version"), "' (expected 1)"));
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
  if (file->tensors().size() != spec.size()) {
    return absl::InvalidArgumentError(absl::StrCat("state: has ", file->tensors().size(),
                                                   " tensors, this model has ", spec.size()));
  }
  std::string data;
  for (const auto& [name, view] : file->tensors()) {
    data.append(reinterpret_cast<const char*>(view.data), view.nbytes);
  }
  if (Sha256Hex(data) != field("sha256")) {
    return absl::InvalidArgumentError("state: checksum mismatch (corrupted data)");
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
  return decoded;
}

}  // namespace fwmodel
