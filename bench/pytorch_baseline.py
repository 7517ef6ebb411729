#!/usr/bin/env python3
"""Hand-batched PyTorch eager baseline for fwserve's decode speed (issue 13).

What a user who writes a few dozen lines of Python gets without the server: load a
checkpoint (docs: /work/shared/spec/models.md, "Model and checkpoint contract,
version 1"), run the contract's RECURRENT form in plain eager PyTorch (float32,
torch.inference_mode, torch.set_num_threads(N)) over a batch of B streams with
preallocated state, and decode greedily (argmax, fed back as the next token).
RWKV-7 checkpoints (architecture rwkv7, as `fwmodel init` or tools/convert_rwkv.py
write them) run RWKV-7's recurrent step the same way (Rwkv7LM); their prompts are the
same byte values taken as token ids. DeltaNet and Gated DeltaNet checkpoints
(architectures delta_net and gated_deltanet, fla's blocks with the names of
models/architectures/delta_net.h, as `fwmodel init` writes them) run the delta rule's
recurrent step the same way (DeltaNetLM): short causal depthwise convolutions on q, k
and v over a ring buffer of the last conv_size inputs, per-head l2-normalised q and k,
then per value head S <- decay * S (gated only), u = beta (v - S^T k), S += k u^T in
place, o = S^T q, a per-head RMSNorm, the optional silu gate and the SwiGLU MLP (the math
of models/architectures/delta_net.h's header comment).

Modes (each prints one JSON line: model, mode, batch, tokens_per_second,
ms_per_step, threads, plus tokens and streams):
  batchB         B streams stepped together in one batched step per token.
  sequentialN    N sessions served one after another at batch 1; tokens/s is all
                 generated tokens over the summed generation time.
Every stream first absorbs a 64-byte prompt by stepping (--prompt-bytes), and a few
warm-up steps run before; neither is timed. The timed part is --tokens generated tokens per
stream, each one an argmax of the current logits followed by the step absorbing it
(a session holds its next-token logits, as in the contract).

--check TEXTFILE scores the first --check-bytes bytes of TEXTFILE with this
recurrent form (fresh state, the first token has no prediction: n - 1 values) and
prints the mean NLL in nats/token; with --fwmodel PATH it also runs
`PATH score DIR --text-file ... --json` on the same bytes and fails (exit 1) when
the two differ by more than --check-tol.

--matmul-dtype bf16 (RWKV-7 only) keeps every weight matrix in bfloat16 and runs the
matrix products in bfloat16 (activations cast to it, results back to float32): what a
user gets by `.to(torch.bfloat16)` on the weights, to compare with fwserve's 16-bit
weights (which compute in float32). The elementwise work stays float32.

--device cuda (or cuda:N) runs the same eager code on a GPU (PyTorch 2.x: the weights
are moved there and torch.set_default_device puts every tensor made afterwards there;
each timed part ends with torch.cuda.synchronize()). The default is cpu.

Usage:
  python3 bench/pytorch_baseline.py models/pretrained/aft-shakespeare \
      --modes batch1,sequential16,batch64 --tokens 128 --threads 2
  python3 bench/pytorch_baseline.py models/pretrained/aft-shakespeare \
      --device cuda --modes batch1,batch64,batch1024 --tokens 128
  python3 bench/pytorch_baseline.py models/pretrained/aft-shakespeare \
      --check /work/shared/data/tinyshakespeare.txt --fwmodel build/tools/fwmodel
  python3 bench/pytorch_baseline.py /tmp/dn340 --modes batch1,batch64 --tokens 8 \
      --prompt-bytes 4 --threads 2     # a DeltaNet checkpoint (fwmodel init)
"""
import argparse
import functools
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# Checkpoint: config.json and a strict safetensors reader.

CONFIG_DEFAULTS = {
    "format_version": None, "architecture": None, "vocab_size": 256,
    "tokenizer": "bytes", "bos_token_id": 10, "d_model": None, "n_layers": None,
    "n_heads": None, "d_ff": None, "ffn": "squared_relu", "dconv_kernel": 0,
    "dpfp_nu": 1, "norm_eps": 1e-5, "attn_eps": 1e-6, "tie_embeddings": False,
    "pkm_layers": [], "pkm_heads": 4, "pkm_num_keys": 128, "pkm_topk": 32,
    "pkm_dim_key": 128, "pkm_bn_eps": 1e-5,
    # rwkv7 only (docs/models.md): the LoRA ranks of the decay, in-context learning
    # rate, value residual and gate.
    "decay_low_rank_dim": 0, "a_low_rank_dim": 0, "v_low_rank_dim": 0, "gate_low_rank_dim": 0,
}
# delta_net and gated_deltanet only (models/base/config.h): fla's defaults. 0 widths mean
# num_v_heads = n_heads, head_k_dim = d_model / n_heads, head_v_dim = head_k_dim; ffn is
# swiglu and use_gate defaults to true for gated_deltanet only (resolved in load_config).
DELTA_NET_DEFAULTS = {
    "num_v_heads": 0, "head_k_dim": 0, "head_v_dim": 0, "use_short_conv": True,
    "conv_size": 4, "use_gate": None, "allow_neg_eigval": False, "use_beta": True,
    "qk_activation": "silu", "qk_norm": "l2",
}
CONFIG_DEFAULTS.update(DELTA_NET_DEFAULTS)
REQUIRED = ("format_version", "architecture", "d_model", "n_layers", "n_heads")
DELTA_NETS = ("delta_net", "gated_deltanet")
ARCHITECTURES = ("linear_attention", "fast_weight", "aft", "rwkv7") + DELTA_NETS


def load_config(model_dir):
    """config.json with defaults applied; unknown keys and bad values are errors."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    unknown = sorted(set(raw) - set(CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"config.json: unknown keys {unknown}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"config.json: missing required keys {missing}")
    cfg = dict(CONFIG_DEFAULTS, **raw)
    if cfg["d_ff"] is None:
        cfg["d_ff"] = 4 * cfg["d_model"]
    if cfg["format_version"] != 1:
        raise ValueError(f"config.json: format_version {cfg['format_version']} is not 1")
    if cfg["architecture"] not in ARCHITECTURES:
        raise ValueError(f"config.json: unknown architecture {cfg['architecture']!r}")
    if cfg["architecture"] in DELTA_NETS:
        resolve_delta_net(cfg, raw)
    else:
        for key in DELTA_NET_DEFAULTS:
            if key in raw:
                raise ValueError(f"config.json: {key} is only for delta_net and gated_deltanet")
        if cfg["ffn"] not in ("relu", "squared_relu", "geglu"):
            raise ValueError(f"config.json: unknown ffn {cfg['ffn']!r}")
    if cfg["architecture"] == "rwkv7":
        # The benchmark's prompts are byte values: ids of either tokenizer.
        if cfg["tokenizer"] not in ("bytes", "rwkv_world") or cfg["vocab_size"] < 256:
            raise ValueError("config.json: rwkv7 needs the bytes or rwkv_world tokenizer")
    elif cfg["tokenizer"] != "bytes" or cfg["vocab_size"] < 256:
        raise ValueError("config.json: the bytes tokenizer needs vocab_size >= 256")
    if cfg["architecture"] not in DELTA_NETS and cfg["d_model"] % cfg["n_heads"] != 0:
        raise ValueError("config.json: d_model must divide by n_heads")
    if cfg["pkm_dim_key"] % 2 or cfg["pkm_topk"] > cfg["pkm_num_keys"]:
        raise ValueError("config.json: pkm_dim_key must be even, pkm_topk <= pkm_num_keys")
    bad = [i for i in cfg["pkm_layers"] if not 0 <= i < cfg["n_layers"]]
    if bad:
        raise ValueError(f"config.json: pkm_layers {bad} outside 0..n_layers-1")
    return cfg


def resolve_delta_net(cfg, raw):
    """The DeltaNet keys resolved as models/base/config.cc does (fla's defaults), checked."""
    arch, H = cfg["architecture"], cfg["n_heads"]
    cfg["ffn"] = raw.get("ffn", "swiglu")
    if cfg["ffn"] != "swiglu":
        raise ValueError("config.json: ffn must be swiglu for the DeltaNet architectures")
    if cfg["use_gate"] is None:
        cfg["use_gate"] = arch == "gated_deltanet"
    if cfg["dconv_kernel"] or cfg["pkm_layers"] or cfg["dpfp_nu"] != 1:
        raise ValueError("config.json: dconv_kernel, pkm_layers and dpfp_nu are not for "
                         "the DeltaNet architectures")
    cfg["num_v_heads"] = cfg["num_v_heads"] or H
    cfg["head_k_dim"] = cfg["head_k_dim"] or cfg["d_model"] // H
    cfg["head_v_dim"] = cfg["head_v_dim"] or cfg["head_k_dim"]
    HV = cfg["num_v_heads"]
    if cfg["head_k_dim"] < 1:
        raise ValueError("config.json: head_k_dim is required when n_heads exceeds d_model")
    if HV % H or (arch == "delta_net" and HV != H):
        raise ValueError(f"config.json: num_v_heads {HV} must be a multiple of n_heads {H} "
                         "(equal for delta_net)")
    if cfg["use_short_conv"] and not 2 <= cfg["conv_size"] <= 64:
        raise ValueError("config.json: conv_size must be in [2, 64]")
    if cfg["qk_activation"] not in ("silu", "relu", "elu", "identity"):
        raise ValueError(f"config.json: unknown qk_activation {cfg['qk_activation']!r}")
    if cfg["qk_norm"] not in ("l2", "sum"):
        raise ValueError(f"config.json: unknown qk_norm {cfg['qk_norm']!r}")
    if arch == "gated_deltanet" and (not cfg["use_beta"] or cfg["qk_activation"] != "silu"
                                     or cfg["qk_norm"] != "l2"):
        raise ValueError("config.json: use_beta, qk_activation and qk_norm are fixed "
                         "(true, silu, l2) for gated_deltanet")


def delta_net_tensors(cfg):
    """delta_net / gated_deltanet tensors (models/architectures/delta_net.h: fla's names
    without "model.", convolution weights [C, W])."""
    d, f, V = cfg["d_model"], cfg["d_ff"], cfg["vocab_size"]
    H, HV, K, Vh = cfg["n_heads"], cfg["num_v_heads"], cfg["head_k_dim"], cfg["head_v_dim"]
    gated, W = cfg["architecture"] == "gated_deltanet", cfg["conv_size"]
    shapes = {"embeddings.weight": (V, d), "norm.weight": (d,)}
    if not cfg["tie_embeddings"]:
        shapes["lm_head.weight"] = (V, d)
    for i in range(cfg["n_layers"]):
        b = f"blocks.{i}."
        shapes.update({
            b + "attn_norm.weight": (d,), b + "attn.q_proj.weight": (H * K, d),
            b + "attn.k_proj.weight": (H * K, d), b + "attn.v_proj.weight": (HV * Vh, d),
            b + "attn.o_norm.weight": (Vh,), b + "attn.o_proj.weight": (d, HV * Vh),
            b + "mlp_norm.weight": (d,), b + "mlp.gate_proj.weight": (f, d),
            b + "mlp.up_proj.weight": (f, d), b + "mlp.down_proj.weight": (d, f)})
        if gated or cfg["use_beta"]:
            shapes[b + "attn.b_proj.weight"] = (HV, d)
        if gated:
            shapes[b + "attn.a_proj.weight"] = (HV, d)
            shapes[b + "attn.A_log"] = shapes[b + "attn.dt_bias"] = (HV,)
        if cfg["use_short_conv"]:
            for p, c in (("q", H * K), ("k", H * K), ("v", HV * Vh)):
                shapes[f"{b}attn.{p}_conv1d.weight"] = (c, W)
        if cfg["use_gate"]:
            shapes[b + "attn.g_proj.weight"] = (HV * Vh, d)
    return shapes


def rwkv7_tensors(cfg):
    """rwkv7's tensors (models/architectures/rwkv7.cc: BlinkDL's names, LoRAs as [out, in])."""
    d, f, H, V = cfg["d_model"], cfg["d_ff"], cfg["n_heads"], cfg["vocab_size"]
    shapes = {"emb.weight": (V, d), "ln_out.weight": (d,), "ln_out.bias": (d,)}
    if not cfg["tie_embeddings"]:
        shapes["head.weight"] = (V, d)
    for i in range(cfg["n_layers"]):
        b = f"blocks.{i}."
        for n in ("ln1", "ln2", "att.ln_x") + (("ln0",) if i == 0 else ()):
            shapes[b + n + ".weight"] = shapes[b + n + ".bias"] = (d,)
        for p in ("receptance", "key", "value", "output"):
            shapes[f"{b}att.{p}.weight"] = (d, d)
        for n in ("att.k_k", "att.k_a", "ffn.x_k") + tuple(f"att.x_{x}" for x in "rwkvag"):
            shapes[b + n] = (d,)
        shapes[b + "att.r_k"] = (H, d // H)
        shapes[b + "ffn.key.weight"], shapes[b + "ffn.value.weight"] = (f, d), (d, f)
        for p, rank in (("w", "decay"), ("a", "a"), ("v", "v"), ("g", "gate")):
            if p == "v" and i == 0:
                continue  # block 0 has no value residual
            r = cfg[rank + "_low_rank_dim"]
            if p != "g":
                shapes[f"{b}att.{p}0"] = (d,)
            shapes[f"{b}att.{p}1"], shapes[f"{b}att.{p}2"] = (r, d), (d, r)
    return shapes


def expected_tensors(cfg):
    """Every tensor name the contract requires for this config, with its shape."""
    d, f, H, K = cfg["d_model"], cfg["d_ff"], cfg["n_heads"], cfg["dconv_kernel"]
    arch = cfg["architecture"]
    if arch == "rwkv7":
        return rwkv7_tensors(cfg)
    shapes = {"embed.weight": (cfg["vocab_size"], d), "norm_f.weight": (d,), "norm_f.bias": (d,)}
    if not cfg["tie_embeddings"]:
        shapes["head.weight"] = (cfg["vocab_size"], d)
    projections = ("r", "k", "v") if arch == "aft" else ("q", "k", "v")
    for i in range(cfg["n_layers"]):
        b = f"blocks.{i}."
        for n in ("norm1", "norm2"):
            shapes[b + n + ".weight"] = shapes[b + n + ".bias"] = (d,)
        for p in projections + ("o",):
            shapes[f"{b}mixer.{p}.weight"] = (d, d)
        shapes[b + "mixer.o.bias"] = (d,)
        if arch == "fast_weight":
            shapes[b + "mixer.beta.weight"] = (H, d)
        if arch == "aft":
            shapes[b + "mixer.time_decay"] = shapes[b + "mixer.time_first"] = (d,)
        if K >= 2:
            for p in projections:
                shapes[f"{b}mixer.{p}_conv.weight"] = (d, K)
                shapes[f"{b}mixer.{p}_conv.bias"] = (d,)
        if i in cfg["pkm_layers"]:
            hm, nk, dk = cfg["pkm_heads"], cfg["pkm_num_keys"], cfg["pkm_dim_key"]
            shapes[b + "ffn.query.weight"] = (hm * dk, d)
            for s in ("weight", "bias", "running_mean", "running_var"):
                shapes[f"{b}ffn.query_norm.{s}"] = (hm * dk,)
            shapes[b + "ffn.keys"] = (hm, nk, 2, dk // 2)
            shapes[b + "ffn.values.weight"] = (nk * nk, d)
        else:
            up = 2 * f if cfg["ffn"] == "geglu" else f
            shapes[b + "ffn.up.weight"], shapes[b + "ffn.up.bias"] = (up, d), (up,)
            shapes[b + "ffn.down.weight"], shapes[b + "ffn.down.bias"] = (d, f), (d,)
    return shapes


SAFETENSORS_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2),
                      "BF16": (torch.bfloat16, 2)}


def read_safetensors(path, expected):
    """Returns {name: float32 tensor} for exactly the names in `expected` ({name: shape}).

    Rejects, naming the tensor: missing or unexpected tensors, wrong shapes,
    unsupported dtypes, offsets outside the data or overlapping, a header that is
    not valid JSON, a file shorter than its header says.
    """
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if 8 + n > len(blob):
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(bytes(blob[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise ValueError(f"{path}: __metadata__ is not an object")
    for name in header:
        if name not in expected:
            raise ValueError(f"{path}: unexpected tensor {name}")
    data_start, data_len = 8 + n, len(blob) - 8 - n
    spans, out = [], {}
    for name, shape in expected.items():
        spec = header.get(name)
        if spec is None:
            raise ValueError(f"{path}: missing tensor {name}")
        if not isinstance(spec, dict) or spec.get("dtype") not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype "
                             f"{spec.get('dtype') if isinstance(spec, dict) else spec!r}")
        dtype, itemsize = SAFETENSORS_DTYPES[spec["dtype"]]
        got = spec.get("shape")
        if not isinstance(got, list) or tuple(got) != tuple(shape):
            raise ValueError(f"{path}: tensor {name}: shape {got}, expected {list(shape)}")
        offsets = spec.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{path}: tensor {name}: bad data_offsets {offsets!r}")
        begin, end = offsets
        count = math.prod(shape)
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{path}: tensor {name}: offsets [{begin}, {end}] outside "
                             f"the {data_len} data bytes (file shorter than it says?)")
        if end - begin != count * itemsize:
            raise ValueError(f"{path}: tensor {name}: {end - begin} bytes for "
                             f"{count} x {spec['dtype']}")
        spans.append((begin, end, name))
        if count == 0:
            out[name] = torch.zeros(shape)
        else:
            raw = torch.frombuffer(blob, dtype=dtype, count=count, offset=data_start + begin)
            out[name] = raw.reshape(shape).to(torch.float32, copy=True)
    spans.sort()
    for (_, prev_end, prev), (begin, end, name) in zip(spans, spans[1:]):
        if begin < prev_end and begin < end:
            raise ValueError(f"{path}: tensor {name} overlaps tensor {prev}")
    return out


# ---------------------------------------------------------------------------
# The recurrent form, batched.
#
# Load-time rearrangements (exact, so the numbers are the contract's):
# - one fused input projection per block: a single [d, C] matrix whose C output
#   columns are what the mixer needs, laid out so that every per-head view below is
#   a plain view (no copies, no per-head Python loops);
# - the causal depthwise conv keeps the last K projected inputs in a ring buffer
#   [K, B, C] (zeros = "before the session's first token"); the step writes the
#   projection straight into its slot and applies the kernel rotated to that slot;
# - fast_weight: the projection also emits -q and -k (negated rows, negated conv
#   bias; exact in IEEE arithmetic), so DPFP's concat(relu(z), relu(-z)) is a single
#   relu over a view; beta goes through the conv buffer with the identity kernel
#   (weight 1 at the current slot, 0 elsewhere, bias 0), again exact.


def both(weight, dtype=None):
    """A linear map's weight [out, in] in both layouts: (W for gemv, W^T for gemm), in
    `dtype` when given (the products then run in it: matmul below)."""
    if dtype is not None:
        weight = weight.to(dtype)
    return weight.contiguous(), weight.t().contiguous()


# x [B, in] times W^T. At B = 1 these use gemv: BLAS gemm with one row costs about
# three times as much per call here, and a batch-1 step is mostly such calls.
def matmul(x, w, out=None):
    if w[0].dtype != x.dtype:  # --matmul-dtype: the product in the weights' dtype
        return matmul(x.to(w[0].dtype), w).to(x.dtype)
    if x.shape[0] == 1:
        return torch.mv(w[0], x[0], out=None if out is None else out[0]).unsqueeze(0)
    return torch.mm(x, w[1], out=out)


def addmatmul(bias, x, w):
    if w[0].dtype != x.dtype:
        return bias + matmul(x, w)
    if x.shape[0] == 1:
        return torch.addmv(bias, w[0], x[0]).unsqueeze(0)
    return torch.addmm(bias, x, w[1])


def addmatmul_(acc, x, w):
    """acc += x W^T, in place."""
    if w[0].dtype != x.dtype:
        return acc.add_(matmul(x, w))
    if x.shape[0] == 1:
        acc[0].addmv_(w[0], x[0])
    else:
        acc.addmm_(x, w[1])
    return acc


class State:
    """Per-stream recurrent state for B streams, preallocated; reset() = fresh sessions."""

    def __init__(self, model, batch):
        self.batch, self.t, self.layers = batch, 0, []
        for blk in model.blocks:
            s = {}
            if model.K >= 2:
                s["conv"] = torch.zeros(model.K, batch, blk["proj"][0].shape[0])
            d, H, dh = model.d, model.H, model.dh
            if model.arch == "aft":
                s["ab"] = torch.zeros(batch, 2, d)       # alpha, beta
                s["vo"] = torch.ones(batch, 2, d)        # [v_t, 1], row 0 rewritten each step
                s["p"] = torch.full((batch, d), -1e30)
            elif model.arch == "linear_attention":
                # S augmented with z as an extra column: phi(q)^T [S | z] gives num and den.
                s["S"] = torch.zeros(batch * H, dh, dh + 1)
                s["v1"] = torch.ones(batch * H, dh + 1)  # [v_t, 1]
            else:
                s["W"] = torch.zeros(batch * H, dh, model.dphi)
            self.layers.append(s)

    def reset(self):
        self.t = 0
        for s in self.layers:
            for name, x in s.items():
                if name == "p":
                    x.fill_(-1e30)
                elif name in ("vo", "v1"):
                    x.fill_(1.0)
                else:
                    x.zero_()


class RecurrentLM:
    def __init__(self, model_dir, device="cpu"):
        self.name = os.path.basename(os.path.normpath(model_dir))
        cfg = self.cfg = load_config(model_dir)
        w = read_safetensors(os.path.join(model_dir, "model.safetensors"),
                             expected_tensors(cfg))
        if device != "cpu":
            # The checkpoint is read on the CPU; everything from here on lives on device.
            w = {name: t.to(device) for name, t in w.items()}
            torch.set_default_device(device)
        self.arch, self.d, self.H = cfg["architecture"], cfg["d_model"], cfg["n_heads"]
        self.dh, self.K, self.nu = self.d // self.H, cfg["dconv_kernel"], cfg["dpfp_nu"]
        self.dphi = 2 * self.nu * self.dh
        # 0-dim tensors: an in-place add of a Python float converts it on every call.
        self.attn_eps, self.one = torch.tensor(cfg["attn_eps"]), torch.tensor(1.0)
        self.embed = w["embed.weight"]
        self.norm_f = (w["norm_f.weight"], w["norm_f.bias"])
        head = w["embed.weight"] if cfg["tie_embeddings"] else w["head.weight"]
        self.head = both(head)
        # DPFP: x_rep[j] * x[roll_idx[j]] over the nu rolls, j in 0..2*nu*d_head-1.
        n2 = 2 * self.dh
        self.roll_idx = torch.tensor([(j - i) % n2 for i in range(1, self.nu + 1)
                                      for j in range(n2)])
        self.blocks = [self._block(w, i) for i in range(cfg["n_layers"])]

    def _block(self, w, i):
        cfg, d, H, dh, K = self.cfg, self.d, self.H, self.dh, self.K
        g = lambda n: w[f"blocks.{i}.{n}"]
        blk = {"norm1": (g("norm1.weight"), g("norm1.bias")),
               "norm2": (g("norm2.weight"), g("norm2.bias")),
               "o": both(g("mixer.o.weight")), "o_b": g("mixer.o.bias")}
        # Rows of the fused projection: (weight rows [n, d], conv weight [n, K], conv bias [n]).
        conv = lambda p: ((g(f"mixer.{p}_conv.weight"), g(f"mixer.{p}_conv.bias")) if K >= 2
                          else (None, None))
        rows = []
        if self.arch == "aft":
            for p in ("r", "k", "v"):
                rows.append((g(f"mixer.{p}.weight"),) + conv(p))
            blk["w_decay"] = g("mixer.time_decay").exp()
            blk["u"] = g("mixer.time_first")
        else:
            per_head = lambda t, h: None if t is None else t[h * dh:(h + 1) * dh]
            for h in range(H):
                # linear_attention, per head: q_h, k_h, v_h -> view [B*H, 3*d_head].
                # fast_weight, per head: q_h, -q_h, k_h, -k_h -> view [B*H, 2, 2*d_head].
                for p in ("q", "k") + (("v",) if self.arch == "linear_attention" else ()):
                    W, cw, cb = (g(f"mixer.{p}.weight"),) + conv(p)
                    rows.append((per_head(W, h), per_head(cw, h), per_head(cb, h)))
                    if self.arch == "fast_weight":
                        rows.append((-per_head(W, h), per_head(cw, h),
                                     None if cb is None else -per_head(cb, h)))
            if self.arch == "fast_weight":
                rows.append((g("mixer.v.weight"),) + conv("v"))
                ident = torch.zeros(H, K)
                if K >= 2:
                    ident[:, K - 1] = 1.0
                rows.append((g("mixer.beta.weight"), ident, torch.zeros(H)))
        blk["proj"] = both(torch.cat([r[0] for r in rows]))                # [C, d]
        if K >= 2:
            cw = torch.cat([r[1] for r in rows])                              # [C, K]
            # Ring slot s at write position pos holds x[t - ((pos - s) mod K)], which
            # the contract weighs with kernel tap j = K-1 - ((pos - s) mod K).
            blk["conv_w"] = torch.stack([
                torch.stack([cw[:, K - 1 - (pos - s) % K] for s in range(K)])
                for pos in range(K)]).unsqueeze(2).contiguous()              # [K, K, 1, C]
            blk["conv_b"] = torch.cat([r[2] for r in rows])
        if i in cfg["pkm_layers"]:
            hm, dk = cfg["pkm_heads"], cfg["pkm_dim_key"]
            blk["pkm"] = {
                "q": both(g("ffn.query.weight")),
                "bn_mean": g("ffn.query_norm.running_mean"),
                "bn_std": (g("ffn.query_norm.running_var") + cfg["pkm_bn_eps"]).sqrt(),
                "bn_w": g("ffn.query_norm.weight"), "bn_b": g("ffn.query_norm.bias"),
                # [H_m, n_k, 2, d_k/2] -> [H_m*2, d_k/2, n_k]: one bmm scores both
                # halves of all heads.
                "keys": g("ffn.keys").permute(0, 2, 3, 1).reshape(hm * 2, dk // 2, -1).contiguous(),
                "values": g("ffn.values.weight")}
        else:
            blk["up"] = both(g("ffn.up.weight"))
            blk["up_b"] = g("ffn.up.bias")
            blk["down"] = both(g("ffn.down.weight"))
            blk["down_b"] = g("ffn.down.bias")
        return blk

    # -- one step: tokens [B] -> next-token logits [B, V] ---------------------
    def step(self, st, tokens):
        d, eps = self.d, self.cfg["norm_eps"]
        h = self.embed.index_select(0, tokens)                    # [B, d], fresh tensor
        slot = st.t % self.K if self.K >= 2 else 0
        st.t += 1
        for blk, s in zip(self.blocks, st.layers):
            a = F.layer_norm(h, (d,), *blk["norm1"], eps)
            if self.K >= 2:
                buf = s["conv"]
                matmul(a, blk["proj"], out=buf[slot])
                y = (buf * blk["conv_w"][slot]).sum(0).add_(blk["conv_b"])
            else:
                y = matmul(a, blk["proj"])
            mixed = getattr(self, "_" + self.arch)(blk, s, y, a)
            addmatmul_(h, mixed, blk["o"]).add_(blk["o_b"])
            a = F.layer_norm(h, (d,), *blk["norm2"], eps)
            if "pkm" in blk:
                h.add_(self._pkm(blk["pkm"], a))
            else:
                u = addmatmul(blk["up_b"], a, blk["up"])
                if self.cfg["ffn"] == "relu":
                    u.relu_()
                elif self.cfg["ffn"] == "squared_relu":
                    u.relu_().square_()
                else:
                    f = self.cfg["d_ff"]
                    u = u[:, :f] * F.gelu(u[:, f:])
                addmatmul_(h, u, blk["down"]).add_(blk["down_b"])
        x = F.layer_norm(h, (d,), *self.norm_f, eps)
        return matmul(x, self.head)

    def _aft(self, blk, s, y, a):
        d = self.d
        r, k = torch.sigmoid(y[:, :d]), y[:, d:2 * d]
        ab, vo, p = s["ab"], s["vo"], s["p"]
        vo[:, 0].copy_(y[:, 2 * d:])
        # Output: wkv = (e1 alpha + e2 v) / (e1 beta + e2), stable in (alpha, beta, p).
        uk = k + blk["u"]
        q = torch.maximum(p, uk)
        e1, e2 = (p - q).exp_(), uk.sub_(q).exp_()
        nd = torch.addcmul(ab * e1.unsqueeze(1), vo, e2.unsqueeze(1))
        wkv = nd[:, 0] / nd[:, 1]
        # State update: decay by e^-w, add e^k (v, 1).
        pw = p - blk["w_decay"]
        q = torch.maximum(pw, k)
        e1, e2 = pw.sub_(q).exp_(), (k - q).exp_()
        ab.mul_(e1.unsqueeze(1)).addcmul_(vo, e2.unsqueeze(1))
        p.copy_(q)
        return r.mul_(wkv)

    def _linear_attention(self, blk, s, y, a):
        B, H, dh = y.shape[0], self.H, self.dh
        y = y.view(B * H, 3 * dh)
        phi = F.elu(y[:, :2 * dh]).add_(self.one)                # [phi(q) | phi(k)]
        S, v1 = s["S"], s["v1"]
        v1[:, :dh].copy_(y[:, 2 * dh:])
        # Broadcast products, not bmm: CPU bmm/baddbmm of these small matrices loops over
        # the B*H batch entries one addmm each (LibTorch 1.13), which dominates at B=64.
        S.addcmul_(phi[:, dh:].unsqueeze(2), v1.unsqueeze(1))    # S += phi(k) v^T, z += phi(k)
        nd = (S * phi[:, :dh].unsqueeze(2)).sum(1)               # [phi(q)^T S | phi(q)^T z]
        return (nd[:, :dh] / nd[:, dh:].add_(self.attn_eps)).view(B, self.d)

    def _fast_weight(self, blk, s, y, a):
        B, H, dh, d = y.shape[0], self.H, self.dh, self.d
        # concat(relu(z), relu(-z)) for z = q and z = k of each head.
        x = torch.relu(y[:, :4 * d]).view(B * H, 2, 2 * dh)
        xs = x if self.nu == 1 else x.repeat(1, 1, self.nu)
        phi = xs * x.index_select(2, self.roll_idx)               # DPFP_nu, [B*H, 2, d_phi]
        phi = phi.div_(phi.sum(2, keepdim=True).add_(self.attn_eps))
        W = s["W"]
        phq, phk = phi[:, 0], phi[:, 1]
        # Broadcast products, not bmm (see _linear_attention).
        v_bar = (W * phk.unsqueeze(1)).sum(2).view(B, H, dh)     # W_{t-1} phi(k)
        v = y[:, 4 * d:5 * d].view(B, H, dh)
        beta = torch.sigmoid(y[:, 5 * d:]).unsqueeze(2)           # [B, H, 1], pre-dconv input
        delta = (v - v_bar).mul_(beta).view(B * H, dh, 1)
        W.addcmul_(delta, phk.unsqueeze(1))                       # W += beta (v - v_bar) phi(k)^T
        return (W * phq.unsqueeze(1)).sum(2).view(B, d)           # y = W_t phi(q)

    def _pkm(self, m, a):
        cfg = self.cfg
        B, hm, nk, k = a.shape[0], cfg["pkm_heads"], cfg["pkm_num_keys"], cfg["pkm_topk"]
        q = matmul(a, m["q"]).sub_(m["bn_mean"]).div_(m["bn_std"]).mul_(m["bn_w"]).add_(m["bn_b"])
        q = q.view(B, hm * 2, -1).transpose(0, 1)                 # [H_m*2, B, d_k/2]
        scores = torch.bmm(q, m["keys"]).transpose(0, 1).reshape(B, hm, 2, nk)
        sv, si = scores.topk(k, dim=3)                            # per half: [B, H_m, 2, k]
        cand = (sv[:, :, 0, :, None] + sv[:, :, 1, None, :]).view(B, hm, k * k)
        cslot = (si[:, :, 0, :, None] * nk + si[:, :, 1, None, :]).view(B, hm, k * k)
        c, pos = cand.topk(k, dim=2)
        slot = cslot.gather(2, pos)
        w = torch.softmax(c, dim=2)
        return F.embedding_bag(slot.view(B, hm * k), m["values"], mode="sum",
                               per_sample_weights=w.view(B, hm * k))


# ---------------------------------------------------------------------------
# RWKV-7 (x070), batched: the math of models/architectures/rwkv7.cc's header comment, as
# BlinkDL's rwkv_v7_demo_rnn.py writes it but over B streams, with the state update
# as matrix-vector products (S·(−kk) and S·r) rather than demo_rnn's S·(ab) matrix
# product (N times fewer operations).


class Rwkv7State:
    """Per-stream state for B streams: per block the two token shifts and S [B, H, N, N]."""

    def __init__(self, model, batch):
        self.batch, self.layers = batch, []
        for _ in model.blocks:
            self.layers.append({"att_shift": torch.zeros(batch, model.d),
                                "ffn_shift": torch.zeros(batch, model.d),
                                "wkv": torch.zeros(batch, model.H, model.N, model.N)})

    def reset(self):
        for s in self.layers:
            for x in s.values():
                x.zero_()


class Rwkv7LM:
    DECAY_SCALE = -math.exp(-0.5)

    def __init__(self, model_dir, cfg, device="cpu", matmul_dtype=None):
        self.name = os.path.basename(os.path.normpath(model_dir))
        self.cfg = cfg
        w = read_safetensors(os.path.join(model_dir, "model.safetensors"), rwkv7_tensors(cfg))
        pair = functools.partial(both, dtype=matmul_dtype)
        if device != "cpu":
            w = {name: t.to(device) for name, t in w.items()}
            torch.set_default_device(device)
        self.d, self.H = cfg["d_model"], cfg["n_heads"]
        self.N = self.d // self.H
        self.emb = w["emb.weight"]
        self.ln0 = (w["blocks.0.ln0.weight"], w["blocks.0.ln0.bias"])
        self.ln_out = (w["ln_out.weight"], w["ln_out.bias"])
        self.head = pair(w["emb.weight"] if cfg["tie_embeddings"] else w["head.weight"])
        self.blocks = []
        for i in range(cfg["n_layers"]):
            g = lambda n: w[f"blocks.{i}.{n}"]
            blk = {"ln1": (g("ln1.weight"), g("ln1.bias")), "ln2": (g("ln2.weight"), g("ln2.bias")),
                   "ln_x": (g("att.ln_x.weight"), g("att.ln_x.bias")),
                   # The six mixes stacked: [6, 1, d] (r, w, k, v, a, g).
                   "mix": torch.stack([g(f"att.x_{x}") for x in "rwkvag"]).unsqueeze(1),
                   "k_k": g("att.k_k"), "k_a": g("att.k_a"), "r_k": g("att.r_k"),
                   "ffn_x_k": g("ffn.x_k"), "key": pair(g("ffn.key.weight")),
                   "value": pair(g("ffn.value.weight"))}
            for p in ("receptance", "key", "value", "output"):
                blk["att." + p] = pair(g(f"att.{p}.weight"))
            for p in ("w", "a", "v", "g"):
                if p == "v" and i == 0:
                    continue
                blk[p + "1"], blk[p + "2"] = pair(g(f"att.{p}1")), pair(g(f"att.{p}2"))
                if p != "g":
                    blk[p + "0"] = g(f"att.{p}0")
            self.blocks.append(blk)

    def new_state(self, batch):
        return Rwkv7State(self, batch)

    def step(self, st, tokens):
        d, H, N, eps = self.d, self.H, self.N, self.cfg["norm_eps"]
        B = tokens.shape[0]
        h = F.layer_norm(self.emb.index_select(0, tokens), (d,), *self.ln0, eps)
        v_first = None
        for i, (blk, s) in enumerate(zip(self.blocks, st.layers)):
            x = F.layer_norm(h, (d,), *blk["ln1"], eps)
            xx = torch.addcmul(x, s["att_shift"] - x, blk["mix"])     # [6, B, d]
            s["att_shift"].copy_(x)
            xr, xw, xk, xv, xa, xg = xx.unbind(0)
            r = matmul(xr, blk["att.receptance"])
            k = matmul(xk, blk["att.key"])
            v = matmul(xv, blk["att.value"])
            w = addmatmul(blk["w0"], torch.tanh(matmul(xw, blk["w1"])), blk["w2"])
            w = torch.exp(torch.sigmoid(w) * self.DECAY_SCALE)
            a = torch.sigmoid(addmatmul(blk["a0"], matmul(xa, blk["a1"]), blk["a2"]))
            g = matmul(torch.sigmoid(matmul(xg, blk["g1"])), blk["g2"])
            kk = F.normalize((k * blk["k_k"]).view(B, H, N), dim=-1, p=2.0)
            k = k * (1 + (a - 1) * blk["k_a"])
            if i == 0:
                v_first = v
            else:
                v = v + (v_first - v) * torch.sigmoid(
                    addmatmul(blk["v0"], matmul(xv, blk["v1"]), blk["v2"]))
            S = s["wkv"]                                               # [B, H, N(v), N(k)]
            sa = torch.matmul(S, kk.neg().unsqueeze(-1))               # S·(−kk), [B, H, N, 1]
            S.mul_(w.view(B, H, 1, N)).addcmul_(sa, (kk * a.view(B, H, N)).unsqueeze(-2))
            S.addcmul_(v.view(B, H, N, 1), k.view(B, H, 1, N))
            y = torch.matmul(S, r.view(B, H, N, 1)).view(B, d)
            y = F.group_norm(y, H, *blk["ln_x"], eps=N * eps)
            bonus = (r * k * blk["r_k"].view(d)).view(B, H, N).sum(-1, keepdim=True)
            y = y.add_((bonus * v.view(B, H, N)).view(B, d)).mul_(g)
            addmatmul_(h, y, blk["att.output"])
            x = F.layer_norm(h, (d,), *blk["ln2"], eps)
            xk = torch.addcmul(x, s["ffn_shift"] - x, blk["ffn_x_k"])
            s["ffn_shift"].copy_(x)
            addmatmul_(h, torch.relu(matmul(xk, blk["key"])).square_(), blk["value"])
        return matmul(F.layer_norm(h, (d,), *self.ln_out, eps), self.head)


# ---------------------------------------------------------------------------
# DeltaNet and Gated DeltaNet, batched: the math of models/architectures/delta_net.h's
# header comment (fla's fused_recurrent form) over B streams.
#
# Load-time rearrangements (exact): the block's input projections q, k, v, b, a, g are one
# fused [C, d] matrix (and the MLP's gate and up one [2F, d]); the short convolutions keep
# their inputs in a ring buffer [W, B, C_qkv] as RecurrentLM's does (the last W - 1 inputs
# plus the slot the current one is written to, zeros when fresh; no bias); value head j
# reads q/k head j / r (r = HV / H), so S is stored per q/k head as [B, H, K, r*V], S_j
# being the columns j % r of head j / r: S_jᵀk for the r value heads of a q/k head is one
# matrix-vector product, with no repeat_interleave of q and k.


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x²) + eps) ⊙ weight over the last dimension (delta_net.cc's RmsNorm)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps)) * weight


class DeltaNetState:
    """Per-stream state for B streams: per block S [B, H, K, r*V] and the conv ring buffer."""

    def __init__(self, model, batch):
        self.batch, self.t, self.layers = batch, 0, []
        for _ in model.blocks:
            s = {"S": torch.zeros(batch, model.H, model.K, model.r * model.V)}
            if model.W:
                s["conv"] = torch.zeros(model.W, batch, model.C)
            self.layers.append(s)

    def reset(self):
        self.t = 0
        for s in self.layers:
            for x in s.values():
                x.zero_()


class DeltaNetLM:
    def __init__(self, model_dir, cfg, device="cpu"):
        self.name = os.path.basename(os.path.normpath(model_dir))
        self.cfg = cfg
        w = read_safetensors(os.path.join(model_dir, "model.safetensors"), delta_net_tensors(cfg))
        if device != "cpu":
            w = {name: t.to(device) for name, t in w.items()}
            torch.set_default_device(device)
        self.gated = cfg["architecture"] == "gated_deltanet"
        self.d, self.H, self.HV = cfg["d_model"], cfg["n_heads"], cfg["num_v_heads"]
        self.K, self.V, self.r = cfg["head_k_dim"], cfg["head_v_dim"], self.HV // self.H
        self.W = cfg["conv_size"] if cfg["use_short_conv"] else 0
        self.C = 2 * self.H * self.K + self.HV * self.V           # q, k, v channels
        self.eps, self.q_scale = cfg["norm_eps"], self.K ** -0.5
        self.has_beta = self.gated or cfg["use_beta"]
        act = cfg["qk_activation"]
        self.qk_act = {"silu": F.silu, "relu": torch.relu, "elu": lambda x: F.elu(x).add_(1.0),
                       "identity": lambda x: x}[act]
        self.embed = w["embeddings.weight"]
        self.norm = w["norm.weight"]
        self.head = both(w["embeddings.weight"] if cfg["tie_embeddings"] else w["lm_head.weight"])
        self.blocks = [self._block(w, i) for i in range(cfg["n_layers"])]

    def _block(self, w, i):
        g = lambda n: w[f"blocks.{i}.{n}"]
        W = self.W
        # Fused projection rows: q, k, v (convolved), then b, a, g (not).
        names = ["q_proj", "k_proj", "v_proj"] + (["b_proj"] if self.has_beta else [])
        names += (["a_proj"] if self.gated else []) + (["g_proj"] if self.cfg["use_gate"] else [])
        blk = {"attn_norm": g("attn_norm.weight"), "o_norm": g("attn.o_norm.weight"),
               "proj": both(torch.cat([g(f"attn.{n}.weight") for n in names])),
               "o_proj": both(g("attn.o_proj.weight")), "mlp_norm": g("mlp_norm.weight"),
               "gate_up": both(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),
               "down": both(g("mlp.down_proj.weight"))}
        if self.gated:
            blk["neg_A"] = -g("attn.A_log").exp()
            blk["dt_bias"] = g("attn.dt_bias")
        if W:
            cw = torch.cat([g(f"attn.{p}_conv1d.weight") for p in "qkv"])   # [C, W]
            # Ring slot s at write position pos holds x[t - ((pos - s) mod W)]: kernel tap
            # W-1 - ((pos - s) mod W) (the current token on the last tap).
            blk["conv_w"] = torch.stack([
                torch.stack([cw[:, W - 1 - (pos - s) % W] for s in range(W)])
                for pos in range(W)]).unsqueeze(2).contiguous()              # [W, W, 1, C]
        return blk

    def new_state(self, batch):
        return DeltaNetState(self, batch)

    def step(self, st, tokens):
        H, HV, K, V, r, C, eps = self.H, self.HV, self.K, self.V, self.r, self.C, self.eps
        B, HK, F_ = tokens.shape[0], self.H * self.K, self.cfg["d_ff"]
        h = self.embed.index_select(0, tokens)                      # [B, d], fresh tensor
        slot = st.t % self.W if self.W else 0
        st.t += 1
        for blk, s in zip(self.blocks, st.layers):
            x = rms_norm(h, blk["attn_norm"], eps)
            y = matmul(x, blk["proj"])                              # [B, C + extras]
            if self.W:
                buf = s["conv"]
                buf[slot].copy_(y[:, :C])
                qkv = (buf * blk["conv_w"][slot]).sum(0)            # [B, C]
            else:
                qkv = y[:, :C]
            q = self.qk_act(qkv[:, :HK]).view(B, H, K)
            k = self.qk_act(qkv[:, HK:2 * HK]).view(B, H, K)
            v = F.silu(qkv[:, 2 * HK:]).view(B, H, 1, r * V)
            if self.cfg["qk_norm"] == "l2":
                q = q * torch.rsqrt(q.square().sum(-1, keepdim=True).add_(1e-6)).mul_(self.q_scale)
                k = k * torch.rsqrt(k.square().sum(-1, keepdim=True).add_(1e-6))
            else:
                q = q / q.sum(-1, keepdim=True).div_(self.q_scale)
                k = k / k.sum(-1, keepdim=True)
            extra = C
            S = s["S"]                                              # [B, H, K, r*V]
            if self.has_beta:
                beta = torch.sigmoid(y[:, extra:extra + HV])        # [B, HV]
                if self.cfg["allow_neg_eigval"]:
                    beta = beta.mul_(2.0)
                extra += HV
            if self.gated:
                decay = torch.exp(F.softplus(y[:, extra:extra + HV] + blk["dt_bias"])
                                  .mul_(blk["neg_A"]))              # [B, HV]
                S.view(B, H, K, r, V).mul_(decay.view(B, H, 1, r, 1))
                extra += HV
            # The delta rule: u = β (v − Sᵀk); S += k uᵀ; o = Sᵀq (after the update).
            u = v - torch.matmul(k.unsqueeze(2), S)                 # [B, H, 1, r*V]
            if self.has_beta:
                u.view(B, H, r, V).mul_(beta.view(B, H, r, 1))
            S.addcmul_(k.unsqueeze(3), u)
            o = rms_norm(torch.matmul(q.unsqueeze(2), S).view(B, HV, V), blk["o_norm"], eps)
            if self.cfg["use_gate"]:
                o.mul_(F.silu(y[:, extra:]).view(B, HV, V))
            addmatmul_(h, o.view(B, HV * V), blk["o_proj"])
            gu = matmul(rms_norm(h, blk["mlp_norm"], eps), blk["gate_up"])   # [B, 2F]
            addmatmul_(h, F.silu(gu[:, :F_]).mul_(gu[:, F_:]), blk["down"])
        return matmul(rms_norm(h, self.norm, eps), self.head)


def load_model(model_dir, device="cpu", matmul_dtype=None):
    cfg = load_config(model_dir)
    if cfg["architecture"] == "rwkv7":
        return Rwkv7LM(model_dir, cfg, device, matmul_dtype)
    if matmul_dtype is not None:
        raise ValueError("--matmul-dtype bf16 is for rwkv7 checkpoints only")
    if cfg["architecture"] in DELTA_NETS:
        return DeltaNetLM(model_dir, cfg, device)
    return RecurrentLM(model_dir, device)


def new_state(model, batch):
    return model.new_state(batch) if hasattr(model, "new_state") else State(model, batch)


# ---------------------------------------------------------------------------
# Benchmark and check.

PROMPT_TEXT = (b"ROMEO:\nBut, soft! what light through yonder window breaks?\n"
               b"It is the east, and Juliet is the sun.\nArise, fair sun, and kill "
               b"the envious moon,\nWho is already sick and pale with grief,\n")
PROMPT_BYTES = 64


def prompts(batch, offset=0, length=PROMPT_BYTES):
    """[B, length] byte prompts, stream i starting at byte offset+i of a fixed text."""
    text = PROMPT_TEXT * (2 + (offset + batch + length) // len(PROMPT_TEXT))
    return torch.tensor([list(text[o:o + length])
                         for o in range(offset, offset + batch)], dtype=torch.long)


def absorb(model, st, tokens):
    """Steps every column of tokens [B, T]; returns the last next-token logits."""
    logits = None
    for t in range(tokens.shape[1]):
        logits = model.step(st, tokens[:, t].contiguous())
    return logits


def sync():
    """Waits for the GPU's queued work (CUDA runs asynchronously); nothing on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_generate(model, st, logits, n):
    """n greedy tokens per stream (argmax, then the step absorbing it); seconds taken."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        logits = model.step(st, logits.argmax(1))
    sync()
    return time.perf_counter() - start


def run_mode(model, mode, args):
    if mode.startswith("batch"):
        batch, sessions = int(mode[len("batch"):]), 1
    elif mode.startswith("sequential"):
        batch, sessions = 1, int(mode[len("sequential"):])
    else:
        raise ValueError(f"unknown mode {mode!r} (batchB or sequentialN)")
    st = new_state(model, batch)
    warm = absorb(model, st, prompts(batch, length=args.prompt_bytes))
    timed_generate(model, st, warm, args.warmup)
    seconds = 0.0
    for i in range(sessions):
        st.reset()
        logits = absorb(model, st, prompts(batch, offset=i, length=args.prompt_bytes))
        seconds += timed_generate(model, st, logits, args.tokens)
    steps = sessions * args.tokens
    return {"model": model.name, "mode": mode, "batch": batch,
            "tokens_per_second": round(batch * steps / seconds, 1),
            "ms_per_step": round(1000 * seconds / steps, 4),
            "threads": torch.get_num_threads(), "tokens": args.tokens, "streams": batch * sessions,
            "device": args.device, "matmul_dtype": args.matmul_dtype}


def check(model, args):
    with open(args.check, "rb") as f:
        text = f.read(args.check_bytes)
    tokens = torch.tensor(list(text), dtype=torch.long)
    st, nll = new_state(model, 1), 0.0
    for t in range(len(tokens) - 1):
        logits = model.step(st, tokens[t:t + 1])
        nll -= torch.log_softmax(logits[0].double(), 0)[tokens[t + 1]].item()
    result = {"model": model.name, "check": args.check, "bytes": len(text),
              "mean_nll": nll / (len(tokens) - 1)}
    ok = True
    if args.fwmodel:
        with tempfile.NamedTemporaryFile(suffix=".txt") as tmp:
            tmp.write(text)
            tmp.flush()
            out = subprocess.run([args.fwmodel, "score", args.model_dir, "--text-file",
                                  tmp.name, "--json"], check=True, capture_output=True, text=True)
        ref = json.loads(out.stdout)["mean_nll"]
        result.update(fwmodel_mean_nll=ref, abs_diff=abs(result["mean_nll"] - ref))
        ok = result["abs_diff"] <= args.check_tol
        result["ok"] = ok
    print(json.dumps(result), flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="checkpoint directory (config.json + model.safetensors)")
    ap.add_argument("--modes", default="", help="comma list of batchB / sequentialN")
    ap.add_argument("--batch", type=int, action="append", default=[], help="add mode batchB")
    ap.add_argument("--sequential", type=int, action="append", default=[],
                    help="add mode sequentialN")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per stream")
    ap.add_argument("--warmup", type=int, default=16, help="untimed steps before each mode")
    ap.add_argument("--prompt-bytes", type=int, default=PROMPT_BYTES,
                    help="untimed prompt steps per stream before each timed part (>= 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--matmul-dtype", choices=("f32", "bf16"), default="f32",
                    help="rwkv7: weight matrices and their products in this dtype")
    ap.add_argument("--check", metavar="TEXTFILE", help="score TEXTFILE's first bytes")
    ap.add_argument("--check-bytes", type=int, default=2000)
    ap.add_argument("--fwmodel", metavar="PATH", help="compare --check with `PATH score`")
    ap.add_argument("--check-tol", type=float, default=1e-4)
    args = ap.parse_args()
    if args.prompt_bytes < 1:
        ap.error("--prompt-bytes must be >= 1")

    modes = [m for m in args.modes.split(",") if m]
    modes += [f"batch{b}" for b in args.batch] + [f"sequential{n}" for n in args.sequential]
    if not modes and not args.check:
        modes = ["batch1"]
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        model = load_model(args.model_dir, args.device,
                           torch.bfloat16 if args.matmul_dtype == "bf16" else None)
        ok = check(model, args) if args.check else True
        for mode in modes:
            print(json.dumps(run_mode(model, mode, args)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
