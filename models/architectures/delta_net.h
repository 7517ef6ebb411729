// DeltaNet and Gated DeltaNet (architectures delta_net, gated_deltanet): the blocks of
// flash-linear-attention's `fla/models/delta_net` and `fla/models/gated_deltanet`
// (layers `fla/layers/delta_net.py`, `fla/layers/gated_deltanet.py`), whole blocks behind
// Block (block.h). Model (model.cc) adds the embedding `embeddings.weight`, the final
// RMSNorm `norm.weight` and the head `lm_head.weight` (or the tied embedding).
//
// Per block, with x = RMSNorm(h; attn_norm) (RMSNorm(x; w) = x / sqrt(mean(x²) + norm_eps)
// ⊙ w), H q/k heads of width K, HV value heads of width V, r = HV / H:
//   q = act(conv_q(x·Wqᵀ)),  k = act(conv_k(x·Wkᵀ)),  v = silu(conv_v(x·Wvᵀ))
//     conv: depthwise, causal, width W = conv_size, the current token on the last tap, no
//     bias; the identity without use_short_conv. act: silu (qk_activation silu; always for
//     gated_deltanet), relu, elu + 1 or the identity.
//   per head: q, k ← q / sqrt(Σq² + 1e-6), k / sqrt(Σk² + 1e-6)   (qk_norm l2; sum: q / Σq)
//             q ← q · K^(−1/2)
//   β = sigmoid(x·Wbᵀ) per value head (delta_net without use_beta: 1); allow_neg_eigval: 2β
//   value head j reads q/k head j / r; with S_j ∈ R^{K×V}:
//     gated_deltanet first: S_j ← exp(g_j) S_j,  g = −exp(A_log) ⊙ softplus(x·Waᵀ + dt_bias)
//     u = β_j (v_j − S_jᵀ k);  S_j ← S_j + k uᵀ;  o_j = S_jᵀ q   (read after the update)
//   o_j ← RMSNorm(o_j; o_norm) ⊙ silu(x·Wgᵀ)_j   (the gate only with use_gate)
//   h += o·Woᵀ
// then h += down(silu(gate(y)) ⊙ up(y)) with y = RMSNorm(h; mlp_norm).
//
// Weights, relative to "blocks.{i}." (fla's names there, "model.layers.{i}."), with
// HK = H·K, HVV = HV·V, D = d_model, F = d_ff:
//   attn_norm.weight [D]; attn.q_proj.weight, attn.k_proj.weight [HK, D];
//   attn.v_proj.weight [HVV, D]; attn.b_proj.weight [HV, D] (gated_deltanet, or use_beta);
//   attn.a_proj.weight [HV, D], attn.A_log [HV], attn.dt_bias [HV] (gated_deltanet);
//   attn.{q,k,v}_conv1d.weight [HK|HK|HVV, W] (use_short_conv; fla's [C, 1, W] squeezed);
//   attn.g_proj.weight [HVV, D] (use_gate); attn.o_norm.weight [V]; attn.o_proj.weight
//   [D, HVV]; mlp_norm.weight [D]; mlp.gate_proj.weight, mlp.up_proj.weight [F, D];
//   mlp.down_proj.weight [D, F].
// State, in the compute dtype: attn.recurrent_state [HV, K, V] (S_j, rows key channels),
// and with use_short_conv attn.conv_state_q, _k [W − 1, HK] and attn.conv_state_v
// [W − 1, HVV], the last W − 1 inputs of each convolution, oldest first (zeros when fresh).
//
// Thread-safety: as Block's.
#pragma once

#include <memory>

#include <torch/types.h>

#include "models/architectures/block.h"
#include "models/base/config.h"

namespace fwmodel {

// The block `layer` of a delta_net or gated_deltanet config.
std::unique_ptr<Block> MakeDeltaNetBlock(const ModelConfig& config, int layer);

// RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) ⊙ weight (fla's RMSNorm,
// without bias), in x's dtype.
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace fwmodel
