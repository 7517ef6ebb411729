#!/usr/bin/env python3
"""Runs the contract_shapes() block of docs/model-format.md: writes a random
checkpoint for several configs with a stdlib safetensors writer and checks that
`fwmodel info` accepts it. Usage: doc_snippet_test.py FWMODEL_BINARY REPO_ROOT"""
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import tempfile

fwmodel, root = sys.argv[1], sys.argv[2]
doc = open(os.path.join(root, "docs", "model-format.md"), encoding="utf-8").read()
blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
snippet = next(b for b in blocks if "def contract_shapes" in b and "import torch" not in b)
namespace = {}
exec(snippet, namespace)
contract_shapes = namespace["contract_shapes"]


def write_safetensors(path, tensors):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name in sorted(tensors):
        shape = tensors[name]
        count = 1
        for dim in shape:
            count *= dim
        values = struct.pack(f"<{count}f", *(random.gauss(0, 0.05) for _ in range(count)))
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(values)]}
        data += values
    text = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + data)


configs = [
    {"architecture": "fast_weight", "d_model": 16, "n_layers": 2, "n_heads": 4, "dconv_kernel": 4, "dpfp_nu": 2},
    {"architecture": "aft", "d_model": 8, "n_layers": 1, "n_heads": 1, "ffn": "geglu", "tie_embeddings": True},
    {"architecture": "linear_attention", "d_model": 8, "n_layers": 2, "n_heads": 2, "d_ff": 12, "ffn": "relu"},
]
random.seed(0)
for cfg in configs:
    with tempfile.TemporaryDirectory() as out:
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump({"format_version": 1, **cfg}, fh)
        write_safetensors(os.path.join(out, "model.safetensors"), contract_shapes(cfg))
        result = subprocess.run([fwmodel, "info", out, "--json"], capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"fwmodel rejected the documented layout for {cfg}: {result.stderr}")
        info = json.loads(result.stdout)
        expected = sum(math.prod(s) for s in contract_shapes(cfg).values())
        if info["parameters"] != expected:
            sys.exit(f"parameter count {info['parameters']} != {expected} for {cfg}")
        print(f"ok: {cfg['architecture']} ({expected} parameters)")
