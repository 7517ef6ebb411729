#!/usr/bin/env python3
"""Sessions with MB-sized state (issue 38 item 5): latency of create, fork, export and
import over gRPC (fwctl) and HTTP, and the dir: store's write throughput, on an RWKV-7
model of the 0.1B G1 shape with random weights (docs/models.md: 2,433,024 state bytes a
session). Standard library only.

Usage: scripts/bench_mb_sessions.py [--build build] [--shape 0.1b|13mb] [--model-dir DIR]
                                    [--storage-dtype F32|BF16] [--rounds 5] [--store dir|redis]
  --shape: 0.1b (2.4 MB of state a session) or 13mb (a 1.5B model's state size: 200
  layers of width 256); --model-dir: an existing checkpoint; default: written once with
  `fwmodel init` into /tmp/fwserve-rwkv7-SHAPE (…-SHAPE-bf16 with --storage-dtype BF16:
  the same random model stored in bf16).
Prints one table row per operation: median and range of its latency over the rounds.
"""
import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    # The 0.1B G1 shape: 2,433,024 state bytes a session.
    "0.1b": {"format_version": 1, "architecture": "rwkv7", "vocab_size": 65536,
             "tokenizer": "rwkv_world", "bos_token_id": 0, "d_model": 768, "n_layers": 12,
             "n_heads": 12, "d_ff": 3072, "decay_low_rank_dim": 64, "a_low_rank_dim": 64,
             "v_low_rank_dim": 32, "gate_low_rank_dim": 128},
    # A 1.5B model's state size (about 13 MB a session) at a fraction of its weights:
    # 200 layers of width 256 (state grows with layers x width, weights with layers x
    # width squared), 0.2B parameters.
    "13mb": {"format_version": 1, "architecture": "rwkv7", "vocab_size": 65536,
             "tokenizer": "rwkv_world", "bos_token_id": 0, "d_model": 256, "n_layers": 200,
             "n_heads": 4, "d_ff": 1024, "decay_low_rank_dim": 32, "a_low_rank_dim": 32,
             "v_low_rank_dim": 16, "gate_low_rank_dim": 64},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(build, path, shape, storage_dtype="F32"):
    """Writes the shape's random checkpoint into `path` once (fwmodel init, seed 1), its
    tensors stored as storage_dtype (F32, F16 or BF16: the same model rounded)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    config = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(config, "w") as f:
        json.dump(SHAPES[shape], f)
    subprocess.run([os.path.join(build, "tools", "fwmodel"), "init", path, "--config", config,
                    "--seed", "1", "--storage-dtype", storage_dtype], check=True)
    shutil.copy(os.path.join(REPO, "tests", "data", "rwkv", "rwkv_vocab_v20230424.txt"), path)
    return path


def timed(fn):
    start = time.monotonic()
    out = fn()
    return time.monotonic() - start, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.1b")
    ap.add_argument("--storage-dtype", choices=("F32", "F16", "BF16"), default="F32",
                    help="the written checkpoint's tensors (BF16: as real RWKV checkpoints "
                    "ship; the native kernel then keeps 16-bit weights)")
    ap.add_argument("--model-dir", default=None,
                    help="default: /tmp/fwserve-rwkv7-SHAPE, written once by fwmodel init")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--store", choices=["dir", "redis"], default="dir",
                    help="dir: a dir: store in a temporary folder; redis: a redis-server "
                         "started on a free loopback port (no persistence)")
    args = ap.parse_args()
    default_dir = "/tmp/fwserve-rwkv7-" + args.shape + (
        "" if args.storage_dtype == "F32" else "-" + args.storage_dtype.lower())
    model_dir = make_model(args.build, args.model_dir or default_dir, args.shape,
                           args.storage_dtype)
    store = tempfile.mkdtemp(prefix="fwserve-mb-store-")
    key = os.path.join(store, "..", os.path.basename(store) + ".key")
    with open(key, "w") as f:
        f.write(base64.b64encode(os.urandom(48)).decode() + "\n")
    grpc_port, http_port = free_port(), free_port()
    redis = None
    session_store = "dir:" + store
    if args.store == "redis":
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind",
                                  "127.0.0.1", "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL)
        session_store = "redis://127.0.0.1:%d" % redis_port
        time.sleep(0.5)
    server = subprocess.Popen(
        [os.path.join(args.build, "server", "fwserve"), "--model", model_dir,
         "--listen", "127.0.0.1:%d" % grpc_port, "--http-listen", "127.0.0.1:%d" % http_port,
         "--metrics-listen", "", "--session-store", session_store, "--session-key-file", key,
         "--http-max-body-bytes", str(64 << 20), "--log-level", "warning"])
    fwctl = [os.path.join(args.build, "client", "fwctl"), "--target",
             "127.0.0.1:%d" % grpc_port, "--retries", "0"]
    http = "http://127.0.0.1:%d" % http_port

    def ctl(*argv):
        r = subprocess.run(fwctl + list(argv), capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError("fwctl %s: %s" % (" ".join(argv), r.stderr.strip()))
        return r.stdout.strip()

    def http_call(method, path, body=None):
        req = urllib.request.Request(http + path, data=body, method=method)
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.read()

    try:
        for _ in range(600):
            if server.poll() is not None:
                raise RuntimeError("fwserve exited with %s" % server.returncode)
            if subprocess.run(fwctl + ["health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        model = os.path.basename(model_dir.rstrip("/"))
        times = {}
        sizes = {}

        def add(name, seconds):
            times.setdefault(name, []).append(seconds)

        blob_path = os.path.join(store, "..", "blob.bin")
        for _ in range(args.rounds):
            t, sid = timed(lambda: ctl("session", "create", "--model", model, "--prefix",
                                       "The quick brown fox"))
            add("create, 19-byte prefix (gRPC, %s write-through)" % args.store, t)
            t, fork = timed(lambda: ctl("session", "fork", sid))
            add("fork (gRPC)", t)
            t, _ = timed(lambda: ctl("session", "export", sid, blob_path))
            add("export (gRPC)", t)
            sizes["blob bytes"] = os.path.getsize(blob_path)
            t, imported = timed(lambda: ctl("session", "import", "--model", model, blob_path))
            add("import (gRPC)", t)
            t, blob = timed(lambda: http_call("GET", "/fwserve/v1/sessions/%s/export" % sid))
            add("export (HTTP)", t)
            t, reply = timed(lambda: http_call("POST", "/fwserve/v1/sessions/import?model=" + model,
                                               blob))
            add("import (HTTP)", t)
            http_id = json.loads(reply)["id"]
            ctl("session", "rm", sid, fork, imported, http_id)
        state = sizes["blob bytes"]
        print("RWKV-7, shape %s (random weights), %d rounds, %s store; blob %d bytes" % (
            args.shape, args.rounds, args.store, state))
        print("| operation | median ms | range ms | MB/s (blob / median) |")
        print("|---|---|---|---|")
        for name, values in times.items():
            med = statistics.median(values)
            print("| %s | %.1f | %.1f-%.1f | %.0f |" % (name, med * 1e3, min(values) * 1e3,
                                                      max(values) * 1e3, state / med / 1e6))
    finally:
        server.terminate()
        server.wait(timeout=60)
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=60)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
