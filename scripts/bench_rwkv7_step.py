#!/usr/bin/env python3
"""RWKV-7's decode step at the 0.1B G1 shape, in interleaved rounds (docs/benchmarks.md).

Per round, back to back:
  1. `model_bench` (OMP_NUM_THREADS=--threads): BM_SgemmPeak/2048 (the sgemm roof,
     OpenBLAS), BM_Rwkv7NativeStep/{1,64} (the native step, models/kernels/native_rwkv.h),
     BM_Rwkv7NativeStepBf16/{1,64} (the same on the model's weights rounded to bf16,
     which the kernel keeps in 16 bits) and BM_Rwkv7Step/{1,64} (LibTorch's step), on
     random weights made in the process;
  2. bench/pytorch_baseline.py batch1 and batch64 (PyTorch eager, --threads threads) on
     a checkpoint of the same shape (--model-dir; default: written once with
     `fwmodel init` by scripts/bench_mb_sessions.py's "0.1b" config), with a 1-token
     prompt, 1 warm-up step and --tokens timed steps (short: eager batch 64 takes seconds
     a step on a loaded 2-core machine): in float32, then with the weight matrices and
     their products in bf16 (--matmul-dtype bf16; --no-eager-bf16 skips it).
Both run with OMP_WAIT_POLICY=--omp-wait-policy (default PASSIVE, as fwserve runs its
workers: docs/benchmarks.md, "OpenMP wait policy"). Then each ratio's value in every round, its median and range:
  native batch-64 GEMM FLOP rate / sgemm roof       (issue 38: >= 0.5)
  native batch 64 / PyTorch eager batch 64          (>= 1.3)
  native batch 1 / PyTorch eager batch 1            (>= 2)
  native / LibTorch at batch 1 and 64               (the step this replaces)
  native bf16 weights against native f32 weights, eager f32 and eager bf16, at 1 and 64

Usage: scripts/bench_rwkv7_step.py [--rounds 3] [--threads 2] [--tokens 3]
           [--build build] [--model-dir DIR] [--omp-wait-policy PASSIVE] [--no-eager-bf16]
Needs python3-torch for the eager baseline.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_mb_sessions  # noqa: E402  (SHAPES, make_model)


def model_bench(build, threads, env):
    env = dict(env, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [os.path.join(build, "bench", "model_bench"),
         "--benchmark_filter=BM_SgemmPeak|BM_Rwkv7(Native)?Step(Bf16)?/(1|64)/",
         "--benchmark_min_time=1",
         "--benchmark_format=json"], env=env, check=True, capture_output=True, text=True)
    results = {}
    for b in json.loads(out.stdout)["benchmarks"]:
        name = b["name"].replace("/real_time", "")
        results[name] = {"ms": b["real_time"] if b["time_unit"] == "ms" else None,
                         "flops": b.get("flops")}
    return results


def pytorch(model_dir, threads, tokens, env, matmul_dtype="f32"):
    out = subprocess.run(
        ["/usr/bin/python3", os.path.join(REPO, "bench", "pytorch_baseline.py"), model_dir,
         "--modes", "batch1,batch64", "--tokens", str(tokens), "--warmup", "1",
         "--prompt-bytes", "1", "--threads", str(threads), "--matmul-dtype", matmul_dtype],
        env=env, check=True, capture_output=True, text=True)
    return {r["mode"]: r for r in map(json.loads, out.stdout.splitlines())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=3, help="timed eager steps per mode")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--model-dir", default="/tmp/fwserve-rwkv7-0.1b")
    ap.add_argument("--omp-wait-policy", default="PASSIVE")
    ap.add_argument("--no-eager-bf16", action="store_true",
                    help="skip PyTorch eager with bf16 weight matrices")
    args = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY=args.omp_wait_policy)
    bench_mb_sessions.make_model(args.build, args.model_dir, "0.1b")
    ratios = {}
    for round_index in range(args.rounds):
        m = model_bench(args.build, args.threads, env)
        p = pytorch(args.model_dir, args.threads, args.tokens, env)
        pb = None if args.no_eager_bf16 else pytorch(args.model_dir, args.threads, args.tokens,
                                                     env, "bf16")
        row = {
            "sgemm roof GFLOP/s": m["BM_SgemmPeak/2048"]["flops"] / 1e9,
            "native b1 ms": m["BM_Rwkv7NativeStep/1"]["ms"],
            "native b64 ms": m["BM_Rwkv7NativeStep/64"]["ms"],
            "libtorch b1 ms": m["BM_Rwkv7Step/1"]["ms"],
            "libtorch b64 ms": m["BM_Rwkv7Step/64"]["ms"],
            "eager b1 ms": p["batch1"]["ms_per_step"],
            "eager b64 ms": p["batch64"]["ms_per_step"],
        }
        row["native b64 / roof"] = (m["BM_Rwkv7NativeStep/64"]["flops"] /
                                    m["BM_SgemmPeak/2048"]["flops"])
        row["native b64 / eager b64"] = row["eager b64 ms"] / row["native b64 ms"]
        row["native b1 / eager b1"] = row["eager b1 ms"] / row["native b1 ms"]
        row["native b1 / libtorch b1"] = row["libtorch b1 ms"] / row["native b1 ms"]
        row["native b64 / libtorch b64"] = row["libtorch b64 ms"] / row["native b64 ms"]
        # Speed-ups of the native step on bf16 weights (kept in 16 bits).
        for b in ("1", "64"):
            ms = m[f"BM_Rwkv7NativeStepBf16/{b}"]["ms"]
            row[f"native bf16 b{b} ms"] = ms
            row[f"native bf16 b{b} / native f32 b{b}"] = row[f"native b{b} ms"] / ms
            row[f"native bf16 b{b} / eager b{b}"] = row[f"eager b{b} ms"] / ms
            if pb is not None:
                row[f"eager bf16 b{b} ms"] = pb[f"batch{b}"]["ms_per_step"]
                row[f"native bf16 b{b} / eager bf16 b{b}"] = row[f"eager bf16 b{b} ms"] / ms
        row["load average (1 min)"] = os.getloadavg()[0]
        print(json.dumps({"round": round_index + 1, **{k: round(v, 3) for k, v in row.items()}}),
              flush=True)
        for k, v in row.items():
            ratios.setdefault(k, []).append(v)
    print("| figure | rounds | median | range |")
    print("|---|---|---|---|")
    for k, values in ratios.items():
        print(f"| {k} | {', '.join(f'{v:.3g}' for v in values)} | "
              f"{statistics.median(values):.3g} | {min(values):.3g} - {max(values):.3g} |")


if __name__ == "__main__":
    main()
