// Grouped GEMV launches (models/gpu/gemv.h) over LibTorch tensors: the decode step's small
// products (at most kernels::kGemvMaxRows rows) gathered into one launch of the kernel on a
// CUDA device, or run by its CPU mirror (models/gpu/gemv_host.h) on CPU tensors, where a
// test stands the mirror in for the launch. Used by model.cc (the contract's blocks and the
// head) and rwkv7.cc.
//
// Thread-safety: a GemvLaunch is a value owned by one thread.
#pragma once

#include <vector>

#include <torch/types.h>

#include "models/gpu/gemv.h"

namespace fwmodel {

// One launch being assembled: up to kernels::kGemvMaxProducts products over the same M
// rows, all with weights of one type (float32 or bf16).
class GemvLaunch {
 public:
  // Adds y = epilogue(input(x)·wᵀ (+ bias)) over x [..., in] (its M rows: every dimension
  // but the last) and returns y, a new [..., out] float32 tensor on x's device, written
  // when Run returns (CUDA: when the stream reaches the launch). w: [out, in], float32 or
  // bf16 (as every product of the launch); bias: [out] or null; residual: [..., out],
  // kResidual only, or null. Throws c10::Error on a mismatch (the model boundary turns
  // it into a Status). The tensors are kept until the launch is destroyed.
  torch::Tensor Add(const torch::Tensor& x, const torch::Tensor& w, kernels::GemvInput input,
                    const torch::Tensor* bias, kernels::GemvEpilogue epilogue,
                    const torch::Tensor* residual);
  // Runs the products on `like`'s device: LaunchGroupedGemv on its current CUDA stream (no
  // host synchronisation, so inside CUDA Graph capture too; CUDA only where the kernels
  // were built), or the CPU mirror for CPU tensors. `what` names the caller in errors.
  void Run(const torch::Tensor& like, const char* what) const;

  int count() const { return args_.count; }

 private:
  kernels::GroupedGemvArgs args_;
  std::vector<torch::Tensor> keep_;  // alive until the launch's enqueueing is done
};

// epilogue(x·wᵀ (+ bias)) by one launch of one product.
torch::Tensor GemvLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor* bias,
                         kernels::GemvEpilogue epilogue, const torch::Tensor* residual,
                         const char* what);

// Whether this build launches the CUDA kernels (FWSERVE_CUDA_KERNELS).
bool GemvCudaKernelsBuilt();

}  // namespace fwmodel
