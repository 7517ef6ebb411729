// How a native kernel reads its model's weights at Create: contiguous float32 tensors by
// name, and raw pointers into them that stay valid while the tensors are kept.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/architectures/model.h"

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

}  // namespace fwmodel
