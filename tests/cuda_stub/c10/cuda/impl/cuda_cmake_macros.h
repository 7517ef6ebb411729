// Empty: LibTorch's CUDA build generates this file (tests/cuda_stub/README.md).
#pragma once
