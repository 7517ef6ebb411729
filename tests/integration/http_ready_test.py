#!/usr/bin/env python3
"""GET /ready on the real fwserve binary with a dir: session store holding many
sessions: the probe says ready only once the store is indexed, so that a load balancer
never routes a request for a stored session to a replica that would not know it yet.
Every /ready answer before that is 503 with status "starting"; the first 200 comes when
the session list already holds every stored session. /health answers 200 throughout.

Usage: http_ready_test.py FWSERVE_BINARY MODEL_DIR
"""
import http.client
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402

SESSIONS = 1200


def start(fwserve, model, work, name, store):
    log_path = os.path.join(work, name + ".log")
    started = start_server(fwserve, model, log_path,
                           extra=["--http-listen", "127.0.0.1:0", "--session-store",
                                  "dir:" + store, "--max-sessions", str(SESSIONS * 2)])
    return started.process, http.client.HTTPConnection("127.0.0.1", started.http_port,
                                                       timeout=30)


def call(conn, method, path, body=None):
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


def listed(conn):
    total, token = 0, ""
    while True:
        status, page = call(conn, "GET", "/fwserve/v1/sessions?page_size=1000" +
                            (f"&page_token={token}" if token else ""))
        assert status == 200, page
        total += len(page["data"])
        token = page["next_page_token"]
        if not token:
            return total


def main():
    fwserve, model = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="fwserve-http-ready-")
    store = os.path.join(work, "sessions")
    try:
        process, conn = start(fwserve, model, work, "seed", store)
        try:
            for _ in range(SESSIONS):
                status, body = call(conn, "POST", "/fwserve/v1/sessions", {})
                assert status == 200, body
        finally:
            conn.close()
            stop_server(process)

        process, conn = start(fwserve, model, work, "restart", store)
        answers = []
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                status, body = call(conn, "GET", "/ready")
                answers.append(status)
                if status == 200:
                    break
                assert status == 503 and body["status"] == "starting", (status, body)
                health, _ = call(conn, "GET", "/health")
                assert health == 200
            assert answers[-1] == 200, f"never ready: {answers[-5:]}"
            # Ready means indexed: every stored session is known at once.
            count = listed(conn)
            assert count == SESSIONS, f"ready with {count} of {SESSIONS} sessions indexed"
        finally:
            conn.close()
            stop_server(process)
        print(f"PASS: /ready answered 503 {len(answers) - 1} times while {SESSIONS} sessions "
              f"were indexed, then 200 with all {count} listed")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
