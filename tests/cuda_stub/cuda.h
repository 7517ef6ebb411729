// A stand-in for the CUDA runtime header (tests/cuda_stub/README.md).
#pragma once
#include "cuda_stub_common.h"
