"""One fwserve with its HTTP API on a free loopback port, for the bench/ scripts that
drive it over HTTP (structured_cost.py, choices_cost.py).

    with HttpFwserve(fwserve, model_dir, threads=2, metrics=True, flags=[...]) as server:
        server.base      # "http://127.0.0.1:PORT"
        server.model     # the served model's name (the first of /v1/models)
        server.metrics   # "http://127.0.0.1:PORT" of /metrics, or None

Waits up to `start_seconds` (120) for /v1/models; then raises SystemExit naming the log's
tail. The server's output goes to a temporary log file; it is stopped on exit.
"""
import json
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpFwserve:
    def __init__(self, fwserve, model_dir, threads=2, metrics=False, flags=(), start_seconds=120):
        port = free_port()
        metrics_port = free_port() if metrics else None
        self.base = f"http://127.0.0.1:{port}"
        self.metrics = f"http://127.0.0.1:{metrics_port}" if metrics else None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fwserve-", suffix=".log")
        self.proc = subprocess.Popen(
            [fwserve, "--model", model_dir, "--listen", "127.0.0.1:0", "--metrics-listen",
             f"127.0.0.1:{metrics_port}" if metrics else "", "--http-listen",
             f"127.0.0.1:{port}", "--threads", str(threads)] + list(flags),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_seconds
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models") as r:
                    self.model = json.load(r)["data"][0]["id"]
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    self.log.seek(0)
                    raise SystemExit("fwserve did not start: " + self.log.read()[-1500:])
                time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self.log.close()
