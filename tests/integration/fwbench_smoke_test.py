#!/usr/bin/env python3
"""fwbench against the real fwserve binary, both protocols: starts fwserve with
--http-listen, runs `fwbench --protocol grpc,http` at 2 streams for 3 requests per
stream, with and without session context (the fork path), and checks its JSON: every
level generated tokens and completed requests with no errors (window, warm-up or set-up),
each level says its protocol, the prefilled sessions hold the context, and the HTTP/gRPC
ratios are there. Then one short level per protocol with the streams split over two
worker processes (`--processes 2`, `--server-pid`): the merged level has tokens,
messages of at least one token, processes == 2, the bench's CPU per token (parent and
workers) and the server's, and no errors. Keeps the load generator's HTTP mode and its
worker processes from rotting; it measures nothing.

Usage: fwbench_smoke_test.py FWSERVE_BINARY FWBENCH_BINARY MODEL_DIR
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    fwserve, fwbench, model = sys.argv[1], sys.argv[2], sys.argv[3]
    work = tempfile.mkdtemp(prefix="fwbench-smoke-")
    log_path = os.path.join(work, "fwserve.log")
    for attempt in range(3):  # the free port may be taken meanwhile: retry
        http_port = free_port()
        try:
            process, target = start_server(fwserve, model, log_path,
                                           extra=("--http-listen", f"127.0.0.1:{http_port}"))
            break
        except RuntimeError:
            if attempt == 2:
                raise
    report_path = os.path.join(work, "fwbench.json")
    try:
        run = subprocess.run(
            [fwbench, "--target", target, "--http-target", f"127.0.0.1:{http_port}",
             "--protocol", "grpc,http", "--concurrency", "2", "--context-tokens", "0,16",
             "--requests-per-stream", "3", "--warmup", "200ms", "--max-tokens", "16",
             "--json", report_path],
            capture_output=True, text=True, timeout=120)
        output = run.stdout + run.stderr
        assert run.returncode == 0, f"fwbench exited with {run.returncode}:\n{output}"
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
        assert report["flags"]["protocol"] == ["grpc", "http"], report["flags"]
        levels = report["levels"]
        seen = sorted((l["protocol"], l["context_tokens"]) for l in levels)
        assert seen == [("grpc", 0), ("grpc", 16), ("http", 0), ("http", 16)], seen
        for l in levels:
            where = f"{l['protocol']} context={l['context_tokens']}: {json.dumps(l)}\n{output}"
            assert l["output_tokens"] > 0 and l["requests_completed"] > 0, where
            assert l["errors"] == {} and l["warmup_errors"] == {}, where
            assert "setup_errors" not in l, where
            assert l["ttft_ms"]["count"] > 0 and l["request_ms"]["count"] > 0, where
            if l["context_tokens"] > 0:
                assert l["session_tokens_after_prefill"] == 16, where
        summary = report["protocol_ratios"]["summary"]
        assert len(summary) == 2 and all("output_tokens_per_s" in s for s in summary), summary
        assert "HTTP/gRPC" in run.stdout, output
        for l in levels:
            where = f"{l['protocol']} context={l['context_tokens']}: {json.dumps(l)}"
            assert l["processes"] == 1, where
            assert l["messages"] > 0 and l["tokens_per_message"] >= 1, where

        # The streams split over two worker processes, a short window per protocol.
        split_path = os.path.join(work, "fwbench-processes.json")
        run = subprocess.run(
            [fwbench, "--target", target, "--http-target", f"127.0.0.1:{http_port}",
             "--protocol", "grpc,http", "--concurrency", "4", "--processes", "2",
             "--duration", "700ms", "--warmup", "200ms", "--max-tokens", "16",
             "--server-pid", str(process.pid), "--json", split_path],
            capture_output=True, text=True, timeout=120)
        output = run.stdout + run.stderr
        assert run.returncode == 0, f"fwbench --processes 2 exited with {run.returncode}:\n{output}"
        with open(split_path, encoding="utf-8") as f:
            split = json.load(f)
        assert split["flags"]["processes"] == 2, split["flags"]
        assert [l["protocol"] for l in split["levels"]] == ["grpc", "http"], split["levels"]
        for l in split["levels"]:
            where = f"--processes 2 {l['protocol']}: {json.dumps(l)}\n{output}"
            assert l["processes"] == 2, where
            assert l["output_tokens"] > 0 and l["messages"] > 0, where
            assert l["tokens_per_message"] >= 1, where
            assert l["errors"] == {} and l["warmup_errors"] == {}, where
            assert "setup_errors" not in l, where
            assert l["ttft_ms"]["count"] > 0, where
            assert l["bench_cpu_us_per_token"] > 0, where
            # This process's, then each worker's.
            assert len(l["bench_cpu_fraction_by_process"]) == 3, where
            assert l["server_cpu_us_per_token"] >= 0, where
            assert "server_engine_thread_cpu_us_per_token" in l, where
        print("PASS: " + ", ".join(
            f"{l['protocol']} context={l['context_tokens']} {l['output_tokens']} tokens "
            f"{l['requests_completed']} requests" for l in levels) + "; --processes 2: " +
            ", ".join(f"{l['protocol']} {l['output_tokens']} tokens in {l['messages']} messages"
                      for l in split["levels"]))
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
