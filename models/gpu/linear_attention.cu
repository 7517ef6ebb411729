// The fused `linear_attention` recurrence (linear_attention.h): one block per (session,
// head), LinearAttentionThreads(N) threads, thread j < N owning value channel j: column j
// of the head's state S [N, N] (N floats) stays in its registers across the loop over the
// T tokens, and z_j, the normaliser's channel j, in one more. The state's loads and
// stores are coalesced as they are (thread j reads S[i][j], consecutive j consecutive
// floats).
//
// Per token, thread j computes key channel j's φ(q_j), φ(k_j) and z_j + φ(k_j) into
// shared memory; after one barrier every thread advances its column and reads the vectors
// back for num_j and the normaliser den (each thread its own dot over the N channels of
// shared memory, so no reduction). The vectors alternate between two sets by token: a
// token's writes of one set come after the next token's barrier, which every thread
// reaches only after its last read of the set. The arithmetic is linear_attention_rule.h's;
// linear_attention_host.h runs this grid, phase by phase, on the CPU. Torch-free:
// compiled by nvcc alone.
#include <cuda_runtime.h>

#include <cstdint>

#include "models/gpu/linear_attention.h"
#include "models/gpu/linear_attention_rule.h"

namespace fwmodel::kernels {
namespace {

// kN: the head width, known at compile time (the column's loops unroll and the column
// stays in registers); 0: args.N at run time (the column in local memory).
// blockDim.x == LinearAttentionThreads(N).
template <int kN>
__global__ void __launch_bounds__(kLinearAttentionMaxN)
    LinearAttentionKernel(const LinearAttentionArgs args) {
  constexpr int kCap = kN > 0 ? kN : static_cast<int>(kLinearAttentionMaxN);
  const int n = kN > 0 ? kN : static_cast<int>(args.N);  // ≤ kCap
  const int j = static_cast<int>(threadIdx.x);
  const bool active = j < n;
  const int64_t item = blockIdx.x;  // b·H + head
  const int64_t b = item / args.H, head = item % args.H;
  const int64_t d = args.H * n;
  const int64_t state_row = args.rows != nullptr ? args.rows[b] : b;
  const int64_t S_at = (state_row * args.H + head) * n * n;
  const int64_t z_at = (state_row * args.H + head) * n;

  __shared__ float s_fq[2][kCap], s_fk[2][kCap], s_z[2][kCap];

  float column[kCap];
  float z = 0.0f;
  if (active) {
    const float* in = args.S_in + S_at + j;
#pragma unroll
    for (int i = 0; i < (kN > 0 ? kN : n); ++i) column[i] = in[static_cast<int64_t>(i) * n];
    z = args.z_in[z_at + j];
  }

  for (int64_t t = 0; t < args.T; ++t) {
    const int set = static_cast<int>(t & 1);
    const int64_t o = (b * args.T + t) * d + head * n + j;
    float v = 0.0f;
    if (active) {
      const float fq = LinearAttentionFeature(args.q[o]);
      const float fk = LinearAttentionFeature(args.k[o]);
      z += fk;
      s_fq[set][j] = fq;
      s_fk[set][j] = fk;
      s_z[set][j] = z;
      v = args.v[o];
    }
    __syncthreads();  // the token's vectors are written
    if (active) {
      const float num = LinearAttentionColumn(kN > 0 ? kN : n, column, s_fq[set], s_fk[set], v);
      const float den = LinearAttentionDen(kN > 0 ? kN : n, s_fq[set], s_z[set], args.eps);
      args.y[o] = num / den;
    }
  }

  if (active) {
    float* out = args.S_out + S_at + j;
#pragma unroll
    for (int i = 0; i < (kN > 0 ? kN : n); ++i) out[static_cast<int64_t>(i) * n] = column[i];
    args.z_out[z_at + j] = z;
  }
}

template <int kN>
cudaError_t LaunchLinearAttentionWidth(const LinearAttentionArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.B * args.H));
  const dim3 block(static_cast<unsigned>(LinearAttentionThreads(args.N)));
  LinearAttentionKernel<kN><<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int LaunchLinearAttention(const LinearAttentionArgs& args, void* cuda_stream) {
  if (!LinearAttentionArgsValid(args)) return cudaErrorInvalidValue;
  if (args.B == 0 || args.H == 0) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (args.N) {
    case 8:
      return LaunchLinearAttentionWidth<8>(args, stream);
    case 16:
      return LaunchLinearAttentionWidth<16>(args, stream);
    case 32:
      return LaunchLinearAttentionWidth<32>(args, stream);
    case 64:
      return LaunchLinearAttentionWidth<64>(args, stream);
    case 128:
      return LaunchLinearAttentionWidth<128>(args, stream);
    default:
      return LaunchLinearAttentionWidth<0>(args, stream);
  }
}

const char* LinearAttentionErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fwmodel::kernels
