#!/usr/bin/env python3
"""Issue 24's ratios from one invocation, in interleaved rounds (docs/benchmarks.md).

Per round, back to back on the same machine:
  1. the sgemm roof: `model_bench` BM_SgemmPeak/2048 (OpenBLAS on --threads threads);
  2. per architecture (the shipped aft and fast_weight checkpoints' shapes):
     a. the library's batch-64 step on --threads threads (OMP_NUM_THREADS), both GEMM
        backends: BM_NativeStep/<arch>/64 (libxsmm, the default) and
        BM_NativeStepOpenBlas/<arch>/64; and BM_NativeStep on 1 thread, the server
        engine's count on a machine where LibTorch's default is 1;
     b. the PyTorch eager loop at batch 64 (bench/pytorch_baseline.py, 2 threads);
     c. fwserve serving 64 streams through gRPC (fwbench, 128-token requests), a fresh
        server for each variant: default flags, then --native-gemm openblas.
  3. with --extended (the rest of issue 24's targets), per architecture: one server with
     room for 1024 streams (--max-active-streams 1024 --max-queued-requests 4096) and
     fwbench at 1, 16, 64, 256 and 1024 streams; PyTorch batch 1 and 16 sessions one
     after another; the server's 64 KB prefill (bench/prefill_bench.sh).
Then, per architecture, each ratio's value in every round and its median and range:
  target 1  server / library step                     (default flags: >= 0.6)
            (and over the 1-thread step, for reference)
  target 2  server / PyTorch batch 64                 (>= 1.5)
  target 3  library step's FLOP rate / sgemm roof      (>= 0.5 aft, 0.4 fast_weight)
            library step / PyTorch batch 64            (>= 2)
  and libxsmm over OpenBLAS for the step and the server (this change's A/B);
  with --extended also
  target 4  64 KB prefill tokens/s (>= 50k aft, 35k fast_weight), and over 1-stream
            decode tokens/s (>= 8)
  target 5  256 and 1024 streams' tokens/s over 64 streams' (>= 0.9)
  target 6  1-stream ITL p50 over PyTorch batch 1's time per token (<= 0.25);
            16 streams over PyTorch's 16 sessions one after another (>= 10)

Nothing else may run meanwhile (a build, a test suite): the host swings up to 2x
within minutes, so only ratios within a round mean anything.

Usage: scripts/bench_ratios.py [--rounds 3] [--duration 8s] [--archs aft,fast_weight]
           [--extended] [--build-dir build] [--out DIR]
Needs python3-torch (scripts/install-deps.sh --bench) and a build with bench targets.
Writes OUT/ratios.json and prints Markdown tables.
"""
import argparse
import contextlib
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


def model_bench(build, pattern, min_time, threads=None):
    """{benchmark name: its JSON record}, run with `threads` intra-op threads (None: the
    environment's, else LibTorch's default)."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [os.path.join(build, "bench", "model_bench"), "--benchmark_filter=" + pattern,
         "--benchmark_min_time=%g" % min_time, "--benchmark_format=json"],
        check=True, capture_output=True, text=True, env=env).stdout
    # UseRealTime benchmarks are named "<name>/real_time".
    return {b["name"].replace("/real_time", ""): b for b in json.loads(out)["benchmarks"]}


def flop_per_token(model_dir):
    """2 x the weights the step's GEMMs read per token (projections, FFN, head)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    d, ff, layers, vocab = c["d_model"], c["d_ff"], c["n_layers"], c["vocab_size"]
    per_layer = 3 * d * d + d * d + 2 * d * ff
    if c["architecture"] == "fast_weight":
        per_layer += c["n_heads"] * d  # the delta rule's beta projection
    return 2 * (layers * per_layer + vocab * d)


def pytorch_modes(python, model_dir, threads, modes):
    """{mode: pytorch_baseline.py's JSON line} for a comma list of modes."""
    out = subprocess.run(
        [python, os.path.join(REPO, "bench", "pytorch_baseline.py"), model_dir,
         "--modes", modes, "--tokens", "128", "--threads", str(threads)],
        check=True, capture_output=True, text=True).stdout
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["mode"]] = result
    if sorted(results) != sorted(modes.split(",")):
        raise RuntimeError("pytorch_baseline.py printed %s for %s" % (sorted(results), modes))
    return results


def prefill(build, model_dir):
    """Tokens/s of one 64 KB CreateSession prefix (bench/prefill_bench.sh)."""
    env = dict(os.environ, MODEL=model_dir, KERNELS="native", BUILD_DIR=build)
    out = subprocess.run([os.path.join(REPO, "bench", "prefill_bench.sh"), "65536", "1"],
                         check=True, capture_output=True, text=True, env=env).stdout
    for line in out.splitlines():
        if "tokens_per_second=" in line:
            return float(line.rsplit("tokens_per_second=", 1)[1].split()[0])
    raise RuntimeError("prefill_bench.sh printed no result")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_fwserve(binary, model_dir, flags, log_path):
    """A fresh fwserve on a free loopback port (metrics off, log level warning), its log in
    `log_path`; yields (process, port) once it listens, and stops it (SIGTERM) after."""
    port = free_port()
    # The log goes to a file: a pipe nobody drains could fill up (1024 cancelled streams
    # log 1024 warnings).
    log_file = open(log_path, "w")
    server = subprocess.Popen(
        [binary, "--model", model_dir, "--listen", "127.0.0.1:%d" % port, "--metrics-listen", "",
         "--log-level", "warning"] + list(flags),
        stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True)
    log_file.close()
    try:
        deadline = time.time() + 60
        while True:
            if server.poll() is not None:
                with open(log_path) as log:
                    raise RuntimeError("fwserve exited: " + log.read()[-2000:])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("fwserve did not listen within 60 s")
                time.sleep(0.1)
        yield server, port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def serve_and_measure(build, model_dir, flags, duration, warmup, out_json, concurrency="64",
                      binary=None):
    """fwbench's levels (one per concurrency) against a fresh fwserve (`binary`, default
    the build's)."""
    log_path = out_json[:-len(".json")] + "-fwserve.log"
    with running_fwserve(binary or os.path.join(build, "server", "fwserve"), model_dir, flags,
                         log_path) as (server, port):
        subprocess.run(
            [os.path.join(build, "bench", "fwbench"), "--target", "127.0.0.1:%d" % port,
             "--concurrency", concurrency, "--duration", duration, "--warmup", warmup,
             "--max_tokens", "128", "--server_pid", str(server.pid), "--json", out_json],
            check=True, stdout=subprocess.DEVNULL)
        with open(out_json) as f:
            return {level["concurrency"]: level for level in json.load(f)["levels"]}


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
    ap.add_argument("--threads", type=int, default=2,
                    help="threads of PyTorch, the library step and the sgemm roof")
    ap.add_argument("--extended", action="store_true",
                    help="also targets 4-6: 1/16/256/1024 streams, PyTorch batch 1 and "
                    "sequential 16, the 64 KB prefill")
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
        peak = model_bench(args.build_dir, "^BM_SgemmPeak/2048(/real_time)?$", args.min_time,
                           args.threads)
        record = {"sgemm_flops": peak["BM_SgemmPeak/2048"]["flops"], "archs": {}}
        for arch in archs:
            model_dir = os.path.join(REPO, "models", "pretrained", arch + "-shakespeare")
            index = ARCH_INDEX[arch]
            log("round %d: %s: library step, PyTorch, servers" % (r + 1, arch))
            steps = model_bench(args.build_dir,
                                "^BM_NativeStep(OpenBlas)?/%d/64(/real_time)?$" % index,
                                args.min_time, args.threads)
            one_thread = model_bench(args.build_dir, "^BM_NativeStep/%d/64(/real_time)?$" % index,
                                     args.min_time, 1)
            modes = "batch64,batch1,sequential16" if args.extended else "batch64"
            torch_results = pytorch_modes(args.python, model_dir, args.threads, modes)
            a = {"flop_per_token": flop_per_token(model_dir),
                 "pytorch": torch_results["batch64"]["tokens_per_second"],
                 "step_libxsmm_1_thread": one_thread["BM_NativeStep/%d/64" % index][
                     "items_per_second"]}
            for name, flags, benchmark in VARIANTS:
                a["step_" + name] = steps["%s/%d/64" % (benchmark, index)]["items_per_second"]
                a["server_" + name] = serve_and_measure(
                    args.build_dir, model_dir, flags, args.duration, args.warmup,
                    os.path.join(args.out, "fwbench-%d-%s-%s.json" % (r, arch, name)))[
                        64]["output_tokens_per_s"]
            if args.extended:
                levels = serve_and_measure(
                    args.build_dir, model_dir,
                    ["--max-active-streams", "1024", "--max-queued-requests", "4096"],
                    args.duration, args.warmup,
                    os.path.join(args.out, "fwbench-%d-%s-scale.json" % (r, arch)),
                    concurrency="1,16,64,256,1024")
                a["scale"] = {str(c): levels[c]["output_tokens_per_s"] for c in levels}
                a["itl_p50_1_ms"] = levels[1]["itl_ms"]["p50"]
                a["pytorch_batch1_ms"] = torch_results["batch1"]["ms_per_step"]
                a["pytorch_sequential16"] = torch_results["sequential16"]["tokens_per_second"]
                a["prefill"] = prefill(args.build_dir, model_dir)
            record["archs"][arch] = a
            log("  " + json.dumps(a))
        rounds.append(record)
    with open(os.path.join(args.out, "ratios.json"), "w") as f:
        json.dump(rounds, f, indent=1)

    rows = [
        ("target 1: server / library step (default flags)",
         lambda a, p: a["server_libxsmm"] / a["step_libxsmm"]),
        ("server / library step on 1 thread",
         lambda a, p: a["server_libxsmm"] / a["step_libxsmm_1_thread"]),
        ("library step, %d threads / 1" % args.threads,
         lambda a, p: a["step_libxsmm"] / a["step_libxsmm_1_thread"]),
        ("target 2: server / PyTorch batch 64", lambda a, p: a["server_libxsmm"] / a["pytorch"]),
        ("target 3: step FLOP rate / sgemm roof",
         lambda a, p: a["step_libxsmm"] * a["flop_per_token"] / p),
        ("target 3: step / PyTorch batch 64", lambda a, p: a["step_libxsmm"] / a["pytorch"]),
        ("step, libxsmm / openblas", lambda a, p: a["step_libxsmm"] / a["step_openblas"]),
        ("server, libxsmm / openblas", lambda a, p: a["server_libxsmm"] / a["server_openblas"]),
        ("server / library step, both openblas",
         lambda a, p: a["server_openblas"] / a["step_openblas"]),
    ]
    if args.extended:
        rows += [
            ("target 4: 64 KB prefill, thousand tokens/s", lambda a, p: a["prefill"] / 1000),
            ("target 4: prefill / 1-stream decode", lambda a, p: a["prefill"] / a["scale"]["1"]),
            ("target 5: 256 streams / 64", lambda a, p: a["scale"]["256"] / a["scale"]["64"]),
            ("target 5: 1024 streams / 64", lambda a, p: a["scale"]["1024"] / a["scale"]["64"]),
            ("target 6: 1-stream ITL p50 / PyTorch batch-1 step",
             lambda a, p: a["itl_p50_1_ms"] / a["pytorch_batch1_ms"]),
            ("target 6: 16 streams / PyTorch 16 sequential",
             lambda a, p: a["scale"]["16"] / a["pytorch_sequential16"]),
        ]
    print("| %d rounds: median (range) | %s |" % (len(rounds), " | ".join(archs)))
    print("|---|%s" % ("---|" * len(archs)))
    for label, ratio in rows:
        cells = [summary([ratio(rd["archs"][arch], rd["sgemm_flops"]) for rd in rounds])
                 for arch in archs]
        print("| %s | %s |" % (label, " | ".join(cells)))
    print()
    print("| round | sgemm roof GFLOP/s | arch | step libxsmm / openblas tok/s | "
          "step, 1 thread | PyTorch b64 tok/s | server libxsmm / openblas tok/s |")
    print("|---|---|---|---|---|---|---|")
    for i, rd in enumerate(rounds):
        for arch in archs:
            a = rd["archs"][arch]
            print("| %d | %.0f | %s | %.0f / %.0f | %.0f | %.0f | %.0f / %.0f |" % (
                i + 1, rd["sgemm_flops"] / 1e9, arch, a["step_libxsmm"], a["step_openblas"],
                a["step_libxsmm_1_thread"], a["pytorch"], a["server_libxsmm"],
                a["server_openblas"]))


if __name__ == "__main__":
    main()
