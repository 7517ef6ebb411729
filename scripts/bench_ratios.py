#!/usr/bin/env python3
"""Issue 24's ratios from one invocation, in interleaved rounds (docs/benchmarks.md).

Per round, back to back on the same machine:
  1. the sgemm roof: `model_bench` BM_SgemmPeak/2048 (OpenBLAS, its default threads);
  2. per architecture (the shipped aft and fast_weight checkpoints' shapes):
     a. the library's batch-64 step, both GEMM backends: BM_NativeStep/<arch>/64
        (libxsmm, the default) and BM_NativeStepOpenBlas/<arch>/64;
     b. the PyTorch eager loop at batch 64 (bench/pytorch_baseline.py, 2 threads);
     c. fwserve serving 64 streams through gRPC (fwbench, 128-token requests), a fresh
        server for each variant: default flags, then --native-gemm openblas.
Then, per architecture, each ratio's value in every round and its median and range:
  target 1  server / library step                     (default flags: >= 0.6)
  target 2  server / PyTorch batch 64                 (>= 1.5)
  target 3  library step's FLOP rate / sgemm roof      (>= 0.5 aft, 0.4 fast_weight)
            library step / PyTorch batch 64            (>= 2)
  and libxsmm over OpenBLAS for the step and the server (this change's A/B).

Nothing else may run meanwhile (a build, a test suite): the host swings up to 2x
within minutes, so only ratios within a round mean anything.

Usage: scripts/bench_ratios.py [--rounds 3] [--duration 8s] [--archs aft,fast_weight]
           [--build-dir build] [--out DIR]
Needs python3-torch (scripts/install-deps.sh --bench) and a build with bench targets.
Writes OUT/ratios.json and prints Markdown tables.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

ARCH_INDEX = {"linear_attention": 0, "fast_weight": 1, "aft": 2}  # model_bench's MakeModel
VARIANTS = [("libxsmm", [], "BM_NativeStep"),
            ("openblas", ["--native-gemm", "openblas"], "BM_NativeStepOpenBlas")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(message):
    print(message, file=sys.stderr, flush=True)


def model_bench(build, pattern, min_time):
    out = subprocess.run(
        [os.path.join(build, "bench", "model_bench"), "--benchmark_filter=" + pattern,
         "--benchmark_min_time=%g" % min_time, "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    return {b["name"]: b for b in json.loads(out)["benchmarks"]}


def flop_per_token(model_dir):
    """2 x the weights the step's GEMMs read per token (projections, FFN, head)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    d, ff, layers, vocab = c["d_model"], c["d_ff"], c["n_layers"], c["vocab_size"]
    per_layer = 3 * d * d + d * d + 2 * d * ff
    if c["architecture"] == "fast_weight":
        per_layer += c["n_heads"] * d  # the delta rule's beta projection
    return 2 * (layers * per_layer + vocab * d)


def pytorch_batch64(python, model_dir, threads):
    out = subprocess.run(
        [python, os.path.join(REPO, "bench", "pytorch_baseline.py"), model_dir,
         "--modes", "batch64", "--tokens", "128", "--threads", str(threads)],
        check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line)["tokens_per_second"]
    raise RuntimeError("pytorch_baseline.py printed no result")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_measure(build, model_dir, flags, duration, warmup, out_json):
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(build, "server", "fwserve"), "--model", model_dir, "--listen",
         "127.0.0.1:%d" % port, "--metrics-listen", "", "--log-level", "warning"] + flags,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 60
        while True:
            if server.poll() is not None:
                raise RuntimeError("fwserve exited: " + server.stderr.read().decode()[-2000:])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("fwserve did not listen within 60 s")
                time.sleep(0.1)
        subprocess.run(
            [os.path.join(build, "bench", "fwbench"), "--target", "127.0.0.1:%d" % port,
             "--concurrency", "64", "--duration", duration, "--warmup", warmup,
             "--max_tokens", "128", "--server_pid", str(server.pid), "--json", out_json],
            check=True, stdout=subprocess.DEVNULL)
        with open(out_json) as f:
            return json.load(f)["levels"][0]["output_tokens_per_s"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def summary(values):
    return "**%.2f** (%.2f-%.2f)" % (statistics.median(values), min(values), max(values))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="8s", help="fwbench's measured time per server")
    ap.add_argument("--warmup", default="2s")
    ap.add_argument("--archs", default="aft,fast_weight")
    ap.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    ap.add_argument("--min-time", type=float, default=2.0, help="model_bench seconds each")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch's threads")
    ap.add_argument("--out", default="/tmp/fwserve-ratios")
    ap.add_argument("--python", default="/usr/bin/python3" if os.path.exists("/usr/bin/python3")
                    else sys.executable, help="a Python with torch (Debian's python3-torch)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1, got %d" % args.rounds)
    archs = args.archs.split(",")
    for arch in archs:
        if arch not in ARCH_INDEX:
            ap.error("--archs: unknown architecture '%s' (aft, fast_weight, linear_attention)"
                     % arch)
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        log("round %d of %d: sgemm roof" % (r + 1, args.rounds))
        peak = model_bench(args.build_dir, "^BM_SgemmPeak/2048$", args.min_time)
        record = {"sgemm_flops": peak["BM_SgemmPeak/2048"]["flops"], "archs": {}}
        for arch in archs:
            model_dir = os.path.join(REPO, "models", "pretrained", arch + "-shakespeare")
            index = ARCH_INDEX[arch]
            log("round %d: %s: library step, PyTorch, servers" % (r + 1, arch))
            steps = model_bench(args.build_dir, "^BM_NativeStep(OpenBlas)?/%d/64$" % index,
                                args.min_time)
            a = {"flop_per_token": flop_per_token(model_dir),
                 "pytorch": pytorch_batch64(args.python, model_dir, args.threads)}
            for name, flags, benchmark in VARIANTS:
                a["step_" + name] = steps["%s/%d/64" % (benchmark, index)]["items_per_second"]
                a["server_" + name] = serve_and_measure(
                    args.build_dir, model_dir, flags, args.duration, args.warmup,
                    os.path.join(args.out, "fwbench-%d-%s-%s.json" % (r, arch, name)))
            record["archs"][arch] = a
            log("  " + json.dumps(a))
        rounds.append(record)
    with open(os.path.join(args.out, "ratios.json"), "w") as f:
        json.dump(rounds, f, indent=1)

    rows = [
        ("target 1: server / library step (default flags)",
         lambda a, p: a["server_libxsmm"] / a["step_libxsmm"]),
        ("target 2: server / PyTorch batch 64", lambda a, p: a["server_libxsmm"] / a["pytorch"]),
        ("target 3: step FLOP rate / sgemm roof",
         lambda a, p: a["step_libxsmm"] * a["flop_per_token"] / p),
        ("target 3: step / PyTorch batch 64", lambda a, p: a["step_libxsmm"] / a["pytorch"]),
        ("step, libxsmm / openblas", lambda a, p: a["step_libxsmm"] / a["step_openblas"]),
        ("server, libxsmm / openblas", lambda a, p: a["server_libxsmm"] / a["server_openblas"]),
        ("server / library step, both openblas",
         lambda a, p: a["server_openblas"] / a["step_openblas"]),
    ]
    print("| %d rounds: median (range) | %s |" % (len(rounds), " | ".join(archs)))
    print("|---|%s" % ("---|" * len(archs)))
    for label, ratio in rows:
        cells = [summary([ratio(rd["archs"][arch], rd["sgemm_flops"]) for rd in rounds])
                 for arch in archs]
        print("| %s | %s |" % (label, " | ".join(cells)))
    print()
    print("| round | sgemm roof GFLOP/s | arch | step libxsmm / openblas tok/s | "
          "PyTorch b64 tok/s | server libxsmm / openblas tok/s |")
    print("|---|---|---|---|---|---|")
    for i, rd in enumerate(rounds):
        for arch in archs:
            a = rd["archs"][arch]
            print("| %d | %.0f | %s | %.0f / %.0f | %.0f | %.0f / %.0f |" % (
                i + 1, rd["sgemm_flops"] / 1e9, arch, a["step_libxsmm"], a["step_openblas"],
                a["pytorch"], a["server_libxsmm"], a["server_openblas"]))


if __name__ == "__main__":
    main()
