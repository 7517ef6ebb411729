#include "models/architectures/gemv_launch.h"

#include "models/gpu/gemv_host.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fwmodel {

torch::Tensor GemvLaunch::Add(const torch::Tensor& x, const torch::Tensor& w,
                              kernels::GemvInput input, const torch::Tensor* bias,
                              kernels::GemvEpilogue epilogue, const torch::Tensor* residual) {
  TORCH_CHECK(args_.count < kernels::kGemvMaxProducts, "a grouped GEMV launch is full");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t in = wc.size(1), out = wc.size(0);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && xc.size(-1) == in, "a grouped GEMV's x has ",
              xc.size(-1), " channels for a weight of ", in);
  const int64_t rows = xc.numel() / in;
  TORCH_CHECK(args_.count == 0 || args_.M == rows, "a grouped GEMV launch mixes ", args_.M, " and ",
              rows, " rows");
  const kernels::GemvWeight weight = wc.scalar_type() == torch::kBFloat16
                                         ? kernels::GemvWeight::kBFloat16
                                         : kernels::GemvWeight::kFloat32;
  TORCH_CHECK(args_.count == 0 || args_.weight == weight,
              "a grouped GEMV launch mixes float32 and bf16 weights");
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = out;
  torch::Tensor y = torch::empty(shape, xc.options());
  args_.weight = weight;
  kernels::GemvProduct& p = args_.products[args_.count++];
  p.w = wc.data_ptr();
  p.x = xc.data_ptr<float>();
  p.in = in;
  p.out = out;
  p.x_stride = in;
  p.y = y.data_ptr<float>();
  p.y_stride = out;
  p.input = input;
  p.epilogue = epilogue;
  keep_.push_back(xc);
  keep_.push_back(wc);
  if (bias != nullptr) {
    const torch::Tensor bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == out && bc.scalar_type() == torch::kFloat32,
                "a grouped GEMV's bias has ", bc.numel(), " entries for ", out, " outputs");
    p.bias = bc.data_ptr<float>();
    keep_.push_back(bc);
  }
  if (residual != nullptr) {
    const torch::Tensor rc = residual->contiguous();
    TORCH_CHECK(rc.numel() == rows * out && rc.scalar_type() == torch::kFloat32,
                "a grouped GEMV's residual of ", rc.numel(), " elements for ", rows, " rows of ",
                out);
    p.residual = rc.data_ptr<float>();
    p.residual_stride = out;
    keep_.push_back(rc);
  }
  args_.M = static_cast<int>(rows);
  return y;
}

void GemvLaunch::Run(const torch::Tensor& like, const char* what) const {
  if (like.is_cuda()) {
#if defined(FWSERVE_CUDA_KERNELS)
    const c10::cuda::CUDAGuard device(like.device());
    const int error = kernels::LaunchGroupedGemv(args_, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == 0, what,
                ": the grouped GEMV kernel failed: ", kernels::GemvErrorString(error));
    return;
#else
    TORCH_CHECK(false, what, ": no CUDA kernels in this build");
#endif
  }
  TORCH_CHECK(kernels::RunGroupedGemvOnHost(args_), what,
              ": the grouped GEMV's arguments were refused");
}

torch::Tensor GemvLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor* bias,
                         kernels::GemvEpilogue epilogue, const torch::Tensor* residual,
                         const char* what) {
  GemvLaunch launch;
  torch::Tensor y = launch.Add(x, w, kernels::GemvInput::kNone, bias, epilogue, residual);
  launch.Run(x, what);
  return y;
}

bool GemvCudaKernelsBuilt() {
#if defined(FWSERVE_CUDA_KERNELS)
  return true;
#else
  return false;
#endif
}

}  // namespace fwmodel
