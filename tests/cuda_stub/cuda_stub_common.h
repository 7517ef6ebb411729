// Declarations of the CUDA runtime API that LibTorch's CUDA headers use, so that code
// guarded by FWSERVE_CUDA_GRAPHS can be compiled (never linked or run) on a machine
// without CUDA: tests/cuda_stub/README.md. Only types and signatures; nothing here works.
#pragma once
#include <cstddef>
typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal,
  cudaStreamCaptureModeThreadLocal,
  cudaStreamCaptureModeRelaxed
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone,
  cudaStreamCaptureStatusActive,
  cudaStreamCaptureStatusInvalidated
};
enum cudaMemcpyKind { cudaMemcpyHostToDevice };
struct cudaDeviceProp {
  int major;
  int minor;
};
#define cudaSuccess 0
#define cudaErrorNotReady 600
#define cudaStreamNonBlocking 1
#define cudaEventDisableTiming 2
#define cudaEventDefault 0
#define cudaEventBlockingSync 1
#define cudaEventInterprocess 4
inline const char* cudaGetErrorString(cudaError_t) { return ""; }
inline cudaError_t cudaGetLastError() { return 0; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
inline cudaError_t cudaStreamQuery(cudaStream_t) { return 0; }
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return 0;
}
inline cudaError_t cudaSetDevice(int) { return 0; }
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 0;
  return 0;
}
inline cudaError_t cudaDeviceSynchronize() { return 0; }
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) {
  *s = cudaStreamCaptureStatusNone;
  return 0;
}
inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*) { return 0; }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t*, unsigned) { return 0; }
inline cudaError_t cudaEventDestroy(cudaEvent_t) { return 0; }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return 0; }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return 0; }
inline cudaError_t cudaEventQuery(cudaEvent_t) { return 0; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return 0; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0;
  return 0;
}
inline cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  return 0;
}
inline cudaError_t cudaStreamGetPriority(cudaStream_t, int* p) {
  *p = 0;
  return 0;
}
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* lo, int* hi) {
  *lo = 0;
  *hi = 0;
  return 0;
}
