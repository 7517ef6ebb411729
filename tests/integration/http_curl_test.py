#!/usr/bin/env python3
"""`curl -N` against the real fwserve binary with --http-listen: a streamed
/v1/chat/completions arrives as server-sent events (a role chunk, content chunks, a
finish chunk, the usage chunk, `data: [DONE]`), /health and /ready answer, and SIGTERM
still drains and exits 0 with the HTTP port open.

Usage: http_curl_test.py FWSERVE_BINARY MODEL_DIR
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curl(*args):
    return subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True,
                          text=True, check=True).stdout


def main():
    fwserve, model = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="fwserve-http-curl-")
    log_path = os.path.join(work, "fwserve.log")
    for attempt in range(3):  # the free port may be taken meanwhile: retry
        port = free_port()
        try:
            process, _ = start_server(fwserve, model, log_path,
                                      extra=("--http-listen", f"127.0.0.1:{port}", "--threads",
                                             "1"))
            break
        except RuntimeError:
            if attempt == 2:
                raise
    base = f"http://127.0.0.1:{port}"
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            assert re.search(r"HTTP API \(OpenAI-compatible\) on", f.read()), "no HTTP log line"
        assert json.loads(curl(f"{base}/health"))["status"] == "ok"
        assert json.loads(curl(f"{base}/ready"))["status"] == "ready"
        request = {"model": "aft-shakespeare", "stream": True, "max_tokens": 16,
                   "temperature": 0, "stream_options": {"include_usage": True},
                   "messages": [{"role": "user", "content": "Good morrow"}]}
        raw = curl("-N", "-H", "Content-Type: application/json", "-d", json.dumps(request),
                   f"{base}/v1/chat/completions")
        events = [block for block in raw.split("\n\n") if block]
        assert all(e.startswith("data: ") for e in events), raw
        payloads = [e[len("data: "):] for e in events]
        assert payloads[-1] == "[DONE]", raw
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", chunks[0]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
        deltas = sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
        assert deltas >= 2, f"only {deltas} content deltas: {raw}"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-2]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
        unary = json.loads(curl("-H", "Content-Type: application/json", "-d",
                                json.dumps({**request, "stream": False,
                                            "stream_options": None}),
                                f"{base}/v1/chat/completions"))
        assert unary["choices"][0]["message"]["content"] == text, (unary, text)
        print(f"PASS: {deltas} deltas streamed through curl -N: {text!r}")
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
