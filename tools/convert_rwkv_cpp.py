#!/usr/bin/env python3
"""Converts an rwkv.cpp model file (.bin, FP32 or FP16; rwkv.cpp's docs/FILE_FORMAT.md)
of RWKV-7 (x070) or RWKV-4 into a model directory that fwserve serves: config.json and
model.safetensors (docs/models.md). Python's standard library only.

Usage: convert_rwkv_cpp.py IN.bin OUT_DIR

The tensors keep their dtype (F32 or F16) and their values, undoing what rwkv.cpp's
converter changed: RWKV-7's concatenated token-shift mixes `att.x_rwkvag` are split
back into att.x_r, x_w, x_k, x_v, x_a, x_g; [1, 1, C] vectors are squeezed to [C];
RWKV-4's `att.time_decay`, stored as -exp(time_decay), is stored as time_decay again
(float32, its log computed in float64). Quantised files (Q4/Q5/Q8) are refused. The
vocabulary must be 256 (rwkv.cpp's tiny byte-level models: fwserve's `bytes`
tokenizer) or 65536 (the world tokenizer, whose rwkv_vocab_v20230424.txt must then be
copied into OUT_DIR).
"""
import json
import math
import os
import struct
import sys

MAGIC = 0x67676D66
DTYPES = {0: ("F32", 4), 1: ("F16", 2)}


def fail(message):
    sys.exit(f"convert_rwkv_cpp: {message}")


def read_bin(path):
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < 24:
        fail("file shorter than the rwkv.cpp header")
    magic, version, n_vocab, n_embed, n_layer, _ = struct.unpack_from("<6i", data, 0)
    if magic != MAGIC:
        fail(f"not an rwkv.cpp file (magic {magic:#x})")
    if version not in (100, 101):
        fail(f"unsupported rwkv.cpp file version {version}")
    offset, tensors = 24, {}
    while offset < len(data):
        dims, key_length, dtype = struct.unpack_from("<3i", data, offset)
        offset += 12
        if dtype not in DTYPES:
            fail(f"tensor data type {dtype} is quantised or unknown (only FP32 and FP16)")
        if not 1 <= dims <= 4:
            fail(f"tensor with {dims} dimensions")
        shape = list(struct.unpack_from(f"<{dims}i", data, offset))[::-1]  # ggml order reversed
        offset += 4 * dims
        name = data[offset:offset + key_length].decode("utf-8")
        offset += key_length
        count = math.prod(shape)
        size = count * DTYPES[dtype][1]
        if offset + size > len(data):
            fail(f"tensor '{name}' runs past the end of the file")
        tensors[name] = (DTYPES[dtype][0], shape, data[offset:offset + size])
        offset += size
    return (n_vocab, n_embed, n_layer), tensors


def squeeze(shape):
    kept = [d for d in shape if d != 1]
    return kept or [1]


def convert(tensors):
    """rwkv.cpp names and layouts -> fwserve's (BlinkDL names, docs/models.md)."""
    out = {}
    for name, (dtype, shape, raw) in tensors.items():
        if name.endswith(".att.x_rwkvag"):
            if dtype != "F32" or len(squeeze(shape)) != 2 or squeeze(shape)[0] != 6:
                fail(f"tensor '{name}' has shape {shape}, expected [6, 1, C] float32")
            width = squeeze(shape)[1]
            prefix = name[: -len("x_rwkvag")]
            for i, part in enumerate("rwkvag"):
                out[prefix + "x_" + part] = ("F32", [width], raw[4 * width * i:4 * width * (i + 1)])
        elif name.endswith(".att.time_decay") and ".att.time_decay_" not in name:
            if dtype != "F32":
                fail(f"tensor '{name}' is {dtype}, expected float32")
            values = struct.unpack(f"<{len(raw) // 4}f", raw)
            if any(not v < 0 for v in values):
                fail(f"tensor '{name}' has an entry >= 0: not -exp(time_decay)")
            decay = [math.log(-v) for v in values]
            out[name] = ("F32", squeeze(shape), struct.pack(f"<{len(decay)}f", *decay))
        elif len(shape) == 3 and shape[0] == 1 and shape[1] == 1:
            out[name] = (dtype, [shape[2]], raw)
        else:
            out[name] = (dtype, shape, raw)
    return out


def config_for(header, tensors):
    n_vocab, n_embed, n_layer = header
    if n_vocab not in (256, 65536):
        fail(f"vocabulary of {n_vocab} tokens (expected 256 bytes or the 65536-token world vocabulary)")
    config = {
        "format_version": 1,
        "vocab_size": n_vocab,
        "tokenizer": "bytes" if n_vocab == 256 else "rwkv_world",
        "d_model": n_embed,
        "n_layers": n_layer,
        "d_ff": tensors["blocks.0.ffn.key.weight"][1][0],
        "tie_embeddings": False,
    }
    if "blocks.0.att.k_k" in tensors:
        heads = tensors["blocks.0.att.r_k"][1][0]
        config.update(architecture="rwkv7", n_heads=heads,
                      decay_low_rank_dim=tensors["blocks.0.att.w1"][1][0],
                      a_low_rank_dim=tensors["blocks.0.att.a1"][1][0],
                      gate_low_rank_dim=tensors["blocks.0.att.g1"][1][0],
                      v_low_rank_dim=tensors["blocks.1.att.v1"][1][0] if n_layer > 1 else 1)
    elif "blocks.0.att.time_mix_k" in tensors:
        config.update(architecture="rwkv4", n_heads=1)
    else:
        fail("neither RWKV-7 (att.k_k) nor RWKV-4 (att.time_mix_k): versions 5 and 6 are not supported")
    if n_vocab != 256:
        config["bos_token_id"] = 0
        if config["architecture"] == "rwkv7":  # RWKV's G1 chat template (docs/models.md)
            config["chat_template"] = {"message": "{Role}: {content}\n\n",
                                       "generation_prompt": "Assistant:",
                                       "stop": ["\n\n"]}
    return dict(sorted(config.items()))


def write_safetensors(path, tensors, source="rwkv.cpp"):
    """tensors: name -> (dtype, shape, raw little-endian bytes); written in name order."""
    header, offset = {"__metadata__": {"format": "pt", "source": source}}, 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            fh.write(tensors[name][2])
    os.replace(tmp, path)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, out_dir = sys.argv[1], sys.argv[2]
    header, raw_tensors = read_bin(source)
    tensors = convert(raw_tensors)
    config = config_for(header, tensors)
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    print(f"{config['architecture']}: {config['n_layers']} layers, d_model {config['d_model']}, "
          f"vocabulary {config['vocab_size']}, {len(tensors)} tensors -> {out_dir}")


if __name__ == "__main__":
    main()
