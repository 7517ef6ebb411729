#!/usr/bin/env python3
"""Converts BlinkDL's native RWKV checkpoint (.pth, RWKV-7 x070 or RWKV-4) into a model
directory that fwserve serves: config.json and model.safetensors (docs/models.md).

Usage: convert_rwkv.py IN.pth OUT_DIR [--vocab rwkv_vocab_v20230424.txt]

Sizes are inferred from the tensors' shapes, as fla's converter does. Tensors keep
their dtype (F32, F16 or BF16). BlinkDL's [1, 1, C] vectors are squeezed to [C] and
RWKV-7's low-rank matrices (att.w1/w2, a1/a2, v1/v2, g1/g2) are transposed into linear
weights [out, in]; block 0's unused att.v0/v1/v2 are dropped. A tensor that is not part
of the architecture (a variant such as rwkv7a/7b, or RWKV-5/6) is refused by name.

The .pth is read without PyTorch: it is a zip archive whose data.pkl is unpickled with
only the few globals a state dict needs (tensor rebuild, OrderedDict, storage types);
any other global is refused, so a checkpoint cannot run code. A 65,536-token model uses
the world tokenizer: pass --vocab to copy its rwkv_vocab_v20230424.txt into OUT_DIR.
"""
import collections
import json
import os
import pickle
import re
import shutil
import struct
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_rwkv_cpp import write_safetensors  # noqa: E402

STORAGE_DTYPES = {"FloatStorage": ("F32", 4), "HalfStorage": ("F16", 2),
                  "BFloat16Storage": ("BF16", 2)}


def fail(message):
    sys.exit(f"convert_rwkv: {message}")


class Tensor:
    """A tensor as raw little-endian bytes: dtype (safetensors name), shape, data."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, list(shape), data

    @property
    def size(self):
        return {"F32": 4, "F16": 2, "BF16": 2}[self.dtype]


class _Storage:
    def __init__(self, dtype, size, data):
        self.dtype, self.size, self.data = dtype, size, data


class _StorageType:
    def __init__(self, name):
        self.name = name


def _rebuild_tensor(storage, offset, shape, stride, *_):
    count = 1
    for dim in shape:
        count *= dim
    size = storage.size
    contiguous, expected = True, 1
    for dim, step in zip(reversed(shape), reversed(stride)):
        if dim != 1 and step != expected:
            contiguous = False
        expected *= dim
    if contiguous:
        data = storage.data[offset * size:(offset + count) * size]
    else:  # gather element by element (rare in saved state dicts)
        out = bytearray()
        index = [0] * len(shape)
        for _ in range(count):
            at = offset + sum(i * s for i, s in zip(index, stride))
            out += storage.data[at * size:(at + 1) * size]
            for d in reversed(range(len(shape))):
                index[d] += 1
                if index[d] < shape[d]:
                    break
                index[d] = 0
        data = bytes(out)
    if len(data) != count * size:
        fail("a tensor runs past the end of its storage")
    return Tensor(storage.dtype, shape, data)


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, archive, prefix):
        super().__init__(fh)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        fail(f"the checkpoint's pickle refers to {module}.{name}, which a state dict of "
             "tensors does not need (refused)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            fail(f"unsupported storage reference {pid!r:.80}")
        dtype, size = STORAGE_DTYPES[pid[1].name]
        data = self.archive.read(f"{self.prefix}data/{pid[2]}")
        return _Storage(dtype, size, data)


def read_pth(path):
    """name -> Tensor of a torch.save'd state dict (zip format, PyTorch >= 1.6)."""
    if not zipfile.is_zipfile(path):
        fail("not a zip-format .pth (saved by PyTorch >= 1.6)")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pickles) != 1:
            fail("the archive has no single data.pkl")
        prefix = pickles[0][: -len("data.pkl")]
        with archive.open(pickles[0]) as fh:
            state = _Unpickler(fh, archive, prefix).load()
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        fail("the checkpoint is not a state dict of tensors")
    return dict(state)


def transpose(t):
    rows, cols = t.shape
    view = memoryview(t.data).cast("I" if t.size == 4 else "H")
    out = [view[r * cols + c] for c in range(cols) for r in range(rows)]
    return Tensor(t.dtype, [cols, rows], struct.pack(f"<{len(out)}{'I' if t.size == 4 else 'H'}", *out))


V7_NAMES = re.compile(
    r"^(emb\.weight|ln_out\.(weight|bias)|head\.weight|blocks\.0\.ln0\.(weight|bias)|"
    r"blocks\.\d+\.(ln[12]\.(weight|bias)|att\.x_[rwkvag]|att\.[wav][012]|att\.g[12]|"
    r"att\.k_k|att\.k_a|att\.r_k|att\.(receptance|key|value|output)\.weight|"
    r"att\.ln_x\.(weight|bias)|ffn\.x_k|ffn\.(key|value)\.weight))$")
V4_NAMES = re.compile(
    r"^(emb\.weight|ln_out\.(weight|bias)|head\.weight|blocks\.0\.ln0\.(weight|bias)|"
    r"blocks\.\d+\.(ln[12]\.(weight|bias)|att\.time_(decay|first|mix_[kvr])|"
    r"att\.(key|value|receptance|output)\.weight|ffn\.time_mix_[kr]|"
    r"ffn\.(key|value|receptance)\.weight))$")


def convert(state):
    """BlinkDL names and layouts -> ours; returns (tensors, config)."""
    if "blocks.0.att.k_k" in state:
        arch, names = "rwkv7", V7_NAMES
    elif "blocks.0.att.time_mix_k" in state:
        arch, names = "rwkv4", V4_NAMES
    else:
        fail("neither RWKV-7 (att.k_k) nor RWKV-4 (att.time_mix_k): versions 5 and 6 are not supported")
    out = {}
    for name, t in state.items():
        if arch == "rwkv7" and name in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"):
            continue  # present in some checkpoints, never used
        if not names.match(name):
            fail(f"unknown tensor '{name}' for {arch} (a variant that is not supported?)")
        if len(t.shape) == 3 and t.shape[:2] == [1, 1]:
            t = Tensor(t.dtype, [t.shape[2]], t.data)
        if arch == "rwkv7" and re.search(r"\.att\.[wavg][12]$", name):
            t = transpose(t)
        out[name] = t
    layers = 0
    while f"blocks.{layers}.ln1.weight" in out:
        layers += 1
    vocab, width = out["emb.weight"].shape
    config = {"format_version": 1, "architecture": arch, "vocab_size": vocab,
              "tokenizer": "bytes" if vocab < 65530 else "rwkv_world",
              "d_model": width, "n_layers": layers,
              "d_ff": out["blocks.0.ffn.key.weight"].shape[0],
              "tie_embeddings": "head.weight" not in out}
    if arch == "rwkv7":
        config.update(n_heads=out["blocks.0.att.r_k"].shape[0],
                      decay_low_rank_dim=out["blocks.0.att.w1"].shape[0],
                      a_low_rank_dim=out["blocks.0.att.a1"].shape[0],
                      gate_low_rank_dim=out["blocks.0.att.g1"].shape[0],
                      v_low_rank_dim=out["blocks.1.att.v1"].shape[0] if layers > 1 else 1)
    else:
        config["n_heads"] = 1
    if vocab >= 65530:
        config["bos_token_id"] = 0
        if arch == "rwkv7":  # RWKV's G1 chat template (docs/models.md)
            config["chat_template"] = {"message": "{Role}: {content}\n\n",
                                       "generation_prompt": "Assistant:",
                                       "stop": ["\n\n"]}
    return out, dict(sorted(config.items()))


def main():
    args = sys.argv[1:]
    vocab = None
    if "--vocab" in args:
        i = args.index("--vocab")
        if i + 1 >= len(args):
            sys.exit(__doc__)
        vocab = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    source, out_dir = args
    tensors, config = convert(read_pth(source))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"),
                      {n: (t.dtype, t.shape, t.data) for n, t in tensors.items()}, "BlinkDL .pth")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    if vocab is not None:
        shutil.copyfile(vocab, os.path.join(out_dir, "rwkv_vocab_v20230424.txt"))
    elif config["tokenizer"] == "rwkv_world":
        print("note: copy rwkv_vocab_v20230424.txt into the directory (or pass --vocab)")
    print(f"{config['architecture']}: {config['n_layers']} layers, d_model {config['d_model']}, "
          f"vocabulary {config['vocab_size']}, {len(tensors)} tensors -> {out_dir}")


if __name__ == "__main__":
    main()
