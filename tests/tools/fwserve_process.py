"""Starting and stopping a real fwserve process for the Python tests.

start_server runs it on a free loopback port (--listen 127.0.0.1:0) with metrics off
and waits for the "fwserve listening on ... (port N)" log line; stop_server sends
SIGTERM (graceful drain) and waits.
"""
import re
import signal
import subprocess
import time


def start_server(fwserve, model, log_path, extra=()):
    """Returns (process, "127.0.0.1:PORT"). The server's stderr goes to log_path."""
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [fwserve, "--listen", "127.0.0.1:0", "--metrics-listen", "", "--model", model,
         "--max-tokens", "100000", *extra],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        with open(log_path, "rb") as f:
            match = re.search(rb"fwserve listening on \S+ \(port (\d+)\)", f.read())
        if match:
            return process, "127.0.0.1:%d" % int(match.group(1))
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    with open(log_path, "rb") as f:
        raise RuntimeError("fwserve did not start:\n" + f.read().decode(errors="replace"))


def stop_server(process):
    """SIGTERM, then the graceful drain: fwserve must exit with status 0 within 30 s.
    Raises AssertionError otherwise (after killing it), also when it had already died."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError("fwserve did not exit within 30 s of SIGTERM (killed)")
    if code != 0:
        raise AssertionError(f"fwserve exited with status {code} after SIGTERM, not 0")


def add_server_arguments(parser):
    """The arguments every process test takes (process_tests.cmake passes them)."""
    parser.add_argument("--fwserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--protoc", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directories")
