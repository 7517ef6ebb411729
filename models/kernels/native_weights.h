// How a native kernel reads its model's weights at Create: contiguous float32 tensors by
// name, and raw pointers into them that stay valid while the tensors are kept.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"
#include "models/kernels/packed_linear.h"

namespace fwmodel {

class NativeWeightReader {
 public:
  // `model` and `kept` are not owned and outlive the reader; `kept` holds the tensors
  // the pointers from Kept read, for the kernel's lifetime.
  NativeWeightReader(const Model& model, std::vector<torch::Tensor>* kept)
      : model_(model), kept_(kept) {}

  // The weight `name`, contiguous. Throws std::out_of_range for an unknown name (the
  // kernels' Create catches it).
  torch::Tensor Tensor(const std::string& name) const {
    return model_.weights().at(name).detach().contiguous();
  }
  // Tensor(name)'s data, the tensor kept.
  float* Kept(const std::string& name) {
    torch::Tensor t = Tensor(name);
    kept_->push_back(t);
    return t.data_ptr<float>();
  }
  // Keeps `t` for the kernel's lifetime (a copy it made).
  void Keep(const torch::Tensor& t) { kept_->push_back(t); }

  // The index in State::tensors of block `layer`'s state tensor `suffix` (e.g.
  // "att_shift"), or -1 when the model has none.
  int StateIndex(int layer, const char* suffix) const {
    const std::string name = absl::StrCat("blocks.", layer, ".", suffix);
    const auto& spec = model_.state_spec();
    for (size_t i = 0; i < spec.size(); ++i) {
      if (spec[i].name == name) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  const Model& model_;
  std::vector<torch::Tensor>* kept_;
};

// How many of a kernel's projections keep each WeightFormat.
struct WeightFormatCounts {
  int64_t count[3] = {0, 0, 0};  // indexed by WeightFormat's value
  void Add(WeightFormat format) { ++count[static_cast<int>(format)]; }
  // The formats kept, in the order bf16, f16, f32, joined by '+': "bf16", "bf16+f16",
  // "f32"...
  std::string Names() const {
    std::string names;
    for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kF16, WeightFormat::kF32}) {
      if (count[static_cast<int>(f)] == 0) continue;
      absl::StrAppend(&names, names.empty() ? "" : "+", WeightFormatName(f));
    }
    return names;
  }
  // 16 when no projection keeps float32, else 32.
  int Bits() const { return count[static_cast<int>(WeightFormat::kF32)] == 0 ? 16 : 32; }
};

// An embedding table [vocab, d] as a kernel reads it: the model's float32 tensor, or, when
// every value is exact in 16 bits and narrowing is asked for, a 16-bit copy of its own (so
// that the model may release its float32 one: Model::ReleaseMatrices).
struct NativeEmbedding {
  const float* f32 = nullptr;
  const uint16_t* narrow = nullptr;
  WeightFormat format = WeightFormat::kF32;

  // Reads the weight `name` through `read` (whose kept tensors hold what this points to).
  // Throws as NativeWeightReader does.
  static NativeEmbedding Read(NativeWeightReader& read, const std::string& name, bool narrow) {
    NativeEmbedding e;
    const torch::Tensor t = read.Tensor(name);
    e.format =
        narrow ? PackedLinear::ExactFormat(t.data_ptr<float>(), t.numel()) : WeightFormat::kF32;
    if (e.format == WeightFormat::kF32) {
      e.f32 = read.Kept(name);
    } else {
      const torch::Tensor t16 =
          t.to(e.format == WeightFormat::kBf16 ? torch::kBFloat16 : torch::kHalf);
      read.Keep(t16);
      e.narrow = reinterpret_cast<const uint16_t*>(t16.data_ptr());
    }
    return e;
  }
  // out[0, d) := row `token`, widened exactly.
  void Row(int64_t token, int64_t d, float* out) const {
    if (narrow != nullptr) {
      WidenValues(format, narrow + token * d, d, out);
    } else {
      std::memcpy(out, f32 + token * d, sizeof(float) * static_cast<size_t>(d));
    }
  }
};

}  // namespace fwmodel
