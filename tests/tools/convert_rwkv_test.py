#!/usr/bin/env python3
"""tools/convert_rwkv.py (BlinkDL .pth -> model directory) against
tools/convert_rwkv_cpp.py, whose output tests/unit/rwkv_test.cc holds to rwkv.cpp's
logits: rwkv.cpp's tiny v7 and v4 models are written back as BlinkDL .pth files (the
layout BlinkDL's trainer saves: [1, 1, C] vectors, RWKV-7's low-rank matrices as
[in, rank] and [rank, out], block 0's unused att.v0/v1/v2, one tensor a strided view),
converted, and must give the same config and the same tensors, bit for bit. Also: a
pickle that names any other global is refused without running it, and an unknown
tensor is refused by name. No PyTorch: the .pth is written with Python's pickle.

Usage: convert_rwkv_test.py REPO_ROOT"""
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import types
import zipfile

root = sys.argv[1]
sys.path.insert(0, os.path.join(root, "tools"))
import convert_rwkv  # noqa: E402
import convert_rwkv_cpp  # noqa: E402

# Stand-ins for the globals torch.save writes, so that pickle names them as torch does.
torch_module = types.ModuleType("torch")
utils_module = types.ModuleType("torch._utils")


def _rebuild_tensor_v2(*args):
    raise AssertionError("never called when writing")


_rebuild_tensor_v2.__module__ = "torch._utils"
utils_module._rebuild_tensor_v2 = _rebuild_tensor_v2
STORAGE_CLASSES = {}
for dtype, name in (("F32", "FloatStorage"), ("F16", "HalfStorage"), ("BF16", "BFloat16Storage")):
    cls = type(name, (), {"__module__": "torch"})
    setattr(torch_module, name, cls)
    STORAGE_CLASSES[dtype] = cls
sys.modules["torch"], sys.modules["torch._utils"] = torch_module, utils_module


class FakeStorage:
    def __init__(self, key, dtype, data):
        self.key, self.dtype, self.data = key, dtype, data


class FakeTensor:
    def __init__(self, storage, shape, stride):
        self.storage, self.shape, self.stride = storage, shape, stride

    def __reduce__(self):
        import collections
        return (_rebuild_tensor_v2, (self.storage, 0, tuple(self.shape), tuple(self.stride),
                                     False, collections.OrderedDict()))


class Writer(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            size = 4 if obj.dtype == "F32" else 2
            return ("storage", STORAGE_CLASSES[obj.dtype], obj.key, "cpu", len(obj.data) // size)
        return None


def contiguous_stride(shape):
    stride, step = [], 1
    for dim in reversed(shape):
        stride.insert(0, step)
        step *= dim
    return stride


def write_pth(path, state, transposed_view=None, extra_pickle=None):
    """state: name -> convert_rwkv.Tensor. `transposed_view`: a 2-D tensor stored as its
    transpose's storage with swapped strides (a non-contiguous view)."""
    import collections
    storages, obj = [], collections.OrderedDict()
    for i, (name, t) in enumerate(state.items()):
        if name == transposed_view:
            data = convert_rwkv.transpose(t).data
            storage = FakeStorage(str(i), t.dtype, data)
            obj[name] = FakeTensor(storage, t.shape, [1, t.shape[0]])
        else:
            storage = FakeStorage(str(i), t.dtype, t.data)
            obj[name] = FakeTensor(storage, t.shape, contiguous_stride(t.shape))
        storages.append(storage)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        pickled = extra_pickle
        if pickled is None:
            import io
            buffer = io.BytesIO()
            Writer(buffer, protocol=2).dump(obj)
            pickled = buffer.getvalue()
        archive.writestr("model/data.pkl", pickled)
        archive.writestr("model/version", "3\n")
        for storage in storages:
            archive.writestr(f"model/data/{storage.key}", storage.data)


def blinkdl_state(bin_path):
    """rwkv.cpp's .bin -> the state dict BlinkDL's trainer would have saved."""
    header, raw = convert_rwkv_cpp.read_bin(bin_path)
    ours = convert_rwkv_cpp.convert(raw)
    state = {}
    v7 = "blocks.0.att.k_k" in ours
    for name, (dtype, shape, data) in ours.items():
        t = convert_rwkv.Tensor(dtype, shape, data)
        leaf = name.split(".")[-1]
        if len(shape) == 1 and (leaf.startswith("x_") or leaf in ("w0", "a0", "v0", "k_k", "k_a")
                                or leaf.startswith("time_mix")):
            t = convert_rwkv.Tensor(dtype, [1, 1, shape[0]], data)
        if v7 and leaf in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"):
            t = convert_rwkv.transpose(t)
        state[name] = t
    if v7:
        for leaf in ("v0", "v1", "v2"):  # present, unused, in BlinkDL's block 0
            state[f"blocks.0.att.{leaf}"] = state[f"blocks.1.att.{leaf}"]
    return state


def read_dir(path):
    config = json.load(open(os.path.join(path, "config.json")))
    data = open(os.path.join(path, "model.safetensors"), "rb").read()
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    tensors = {name: (h["dtype"], h["shape"], data[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]])
               for name, h in header.items()}
    return config, tensors


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True)


failures = 0


def check(condition, what):
    global failures
    print(("ok   " if condition else "FAIL ") + what)
    failures += 0 if condition else 1


with tempfile.TemporaryDirectory() as tmp:
    data_dir = os.path.join(root, "tests", "data", "rwkv")
    for model in ("7v0-834K-FP32", "7v0-834K-FP16", "4v0-660K-FP32", "4v0-660K-FP16"):
        bin_path = os.path.join(data_dir, f"tiny-rwkv-{model}.bin")
        pth = os.path.join(tmp, f"{model}.pth")
        write_pth(pth, blinkdl_state(bin_path), transposed_view="head.weight")
        from_pth, from_bin = os.path.join(tmp, model + "-pth"), os.path.join(tmp, model + "-bin")
        result = run(os.path.join(root, "tools", "convert_rwkv.py"), pth, from_pth)
        check(result.returncode == 0, f"{model}: convert_rwkv.py runs ({result.stderr.strip()})")
        run(os.path.join(root, "tools", "convert_rwkv_cpp.py"), bin_path, from_bin)
        if result.returncode != 0:
            continue
        config_pth, tensors_pth = read_dir(from_pth)
        config_bin, tensors_bin = read_dir(from_bin)
        check(config_pth == config_bin, f"{model}: same config ({config_pth} vs {config_bin})")
        check(sorted(tensors_pth) == sorted(tensors_bin), f"{model}: same tensor names")
        differing = [n for n in tensors_bin if tensors_pth.get(n) != tensors_bin[n]]
        check(not differing, f"{model}: same dtypes, shapes and bytes (differ: {differing[:3]})")

    # An unknown tensor is refused by name.
    state = blinkdl_state(os.path.join(data_dir, "tiny-rwkv-7v0-834K-FP32.bin"))
    state["blocks.3.att.x_x"] = state["blocks.3.att.x_r"]
    pth = os.path.join(tmp, "unknown.pth")
    write_pth(pth, state)
    result = run(os.path.join(root, "tools", "convert_rwkv.py"), pth, os.path.join(tmp, "unknown"))
    check(result.returncode != 0 and "unknown tensor 'blocks.3.att.x_x'" in result.stderr,
          f"unknown tensor refused by name ({result.stderr.strip()})")

    # A pickle that names another global is refused before anything runs.
    marker = os.path.join(tmp, "ran")
    evil = (b"\x80\x02cos\nsystem\nq\x00X" + struct.pack("<I", len("touch " + marker))
            + ("touch " + marker).encode() + b"q\x01\x85q\x02Rq\x03.")
    pth = os.path.join(tmp, "evil.pth")
    write_pth(pth, {}, extra_pickle=evil)
    result = run(os.path.join(root, "tools", "convert_rwkv.py"), pth, os.path.join(tmp, "evil"))
    check(result.returncode != 0 and "os.system" in result.stderr and not os.path.exists(marker),
          f"foreign global refused without running ({result.stderr.strip()})")

sys.exit(1 if failures else 0)
