#!/usr/bin/env python3
"""A real Prometheus server (Debian's package) scrapes a real fwserve on loopback; the
test then asks Prometheus's HTTP API for fwserve series and expects them ingested.

Usage: prometheus_ingest_test.py FWSERVE_BINARY MODEL_DIR
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from unittest_run import check  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"FAIL: timed out after {timeout}s waiting for {what}")


def main():
    fwserve, model_dir = sys.argv[1], sys.argv[2]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("FAIL: prometheus not installed (scripts/install-deps.sh installs it)")
    work = tempfile.mkdtemp(prefix="fwserve-prom-")
    metrics_port, grpc_port, prom_port = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [fwserve, "--listen", f"127.0.0.1:{grpc_port}", "--model", model_dir,
         "--metrics-listen", f"127.0.0.1:{metrics_port}", "--log-level", "warning"],
        stderr=subprocess.PIPE)
    config = os.path.join(work, "prometheus.yml")
    with open(config, "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: fwserve
    static_configs:
      - targets: ['127.0.0.1:{metrics_port}']
""")
    prom = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work}/data",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).status == 200, 30,
            "fwserve /metrics")

        def query(expr):
            url = (f"http://127.0.0.1:{prom_port}/api/v1/query?" +
                   urllib.parse.urlencode({"query": expr}))
            body = json.load(urllib.request.urlopen(url, timeout=2))
            return body["data"]["result"] if body.get("status") == "success" else None

        result = wait_for(lambda: query('fwserve_model_info{job="fwserve"}'), 60,
                          "Prometheus to ingest fwserve_model_info")
        labels = result[0]["metric"]
        check(labels.get("model") == os.path.basename(model_dir.rstrip("/")), labels)
        up = wait_for(lambda: query('up{job="fwserve"} == 1'), 30, "up == 1")
        print(f"PASS: Prometheus ingested fwserve_model_info {labels} and up={up[0]['value'][1]}")
    finally:
        prom.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGTERM)
        prom.wait(timeout=30)
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
