"""Starting and stopping a real fwserve process for the Python tests, and the small
helpers the process tests share.

start_server runs it on a free loopback port (--listen 127.0.0.1:0) with metrics off
and waits for the "fwserve listening on ... (port N)" log line; stop_server sends
SIGTERM (graceful drain) and waits. listening_port/http_port read the ports from a
server's log text; rpc_error and wait_for are the tests' assertion helpers;
GenerateReader reads a Generate stream on a thread.
"""
import os
import re
import signal
import subprocess
import threading
import time

# Deadlines in these helpers only catch hangs; no outcome depends on how fast anything is.
HANG_S = 60.0
# The log lines with the ports fwserve chose (server/fwserve.cc); the HTTP line, when
# --http-listen is given, comes before the "listening" line.
LISTENING = re.compile(r"fwserve listening on \S+ \(port (\d+)\)")
HTTP_LISTENING = re.compile(r"HTTP API \(OpenAI-compatible\) on \S+ \(port (\d+)\)")


def listening_port(text):
    """The gRPC port in a fwserve log text (str), or None before it is listening."""
    match = LISTENING.search(text)
    return int(match.group(1)) if match else None


def http_port(text):
    """The HTTP API port in a fwserve log text (str), or None (no --http-listen)."""
    match = HTTP_LISTENING.search(text)
    return int(match.group(1)) if match else None


def http_port_of(proc):
    """The HTTP port in the log of a replica_processes fwserve's latest start (its log
    is appended to across restarts, each start after a "=== " line); AssertionError
    when that start logged none."""
    port = http_port(proc.log_text().rsplit("=== ", 1)[-1])
    if port is None:
        raise AssertionError("%s: no HTTP API log line:\n%s" % (proc.name, proc.tail()))
    return port


def rpc_error(call):
    """The grpc.RpcError that call() raises; AssertionError when it succeeds."""
    import grpc  # here: the tests import grpc only after fwserve_stubs.ensure_grpc()
    try:
        result = call()
    except grpc.RpcError as error:
        return error
    raise AssertionError("expected an error, got %r" % (result,))


def kill_process_group(process):
    """SIGKILL to the process group led by `process` (started with start_new_session),
    then reaps it. A process that has already exited is only reaped."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


class GenerateReader:
    """A Generate call (its stream of GenerateResponse) read on a thread until it ends
    or is cancelled: `tokens` (the ids so far), the events `first` (tokens arrived) and
    `done`, and `error` (the grpc.RpcError it ended with, or None)."""

    def __init__(self, call):
        self.call = call
        self.tokens = []
        self.error = None
        self.first = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        import grpc  # here: the tests import grpc only after fwserve_stubs.ensure_grpc()
        try:
            for message in self.call:
                self.tokens.extend(message.token_ids)
                self.first.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.done.set()

    def started(self, timeout_s=HANG_S):
        """Waits until the first tokens arrive or the stream ends; True on tokens."""
        deadline = time.time() + timeout_s
        while not self.first.is_set() and not self.done.is_set() and time.time() < deadline:
            time.sleep(0.01)
        return self.first.is_set() and self.error is None

    def cancel(self, timeout_s=HANG_S):
        """Cancels the call; True when the reader has ended within timeout_s."""
        self.call.cancel()
        return self.done.wait(timeout_s)


def wait_for(predicate, what, timeout_s=HANG_S):
    """Polls predicate() until true and returns its value; AssertionError after
    timeout_s (a hang)."""
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError("gave up waiting (%.0f s) for %s" % (timeout_s, what))
        time.sleep(0.05)


class Started(tuple):
    """What start_server returns: the pair (process, "127.0.0.1:PORT"), so that callers
    unpack it as before, with the ports also by name (http_port: None without
    --http-listen)."""

    def __new__(cls, process, port, http_port=None):
        started = super().__new__(cls, (process, "127.0.0.1:%d" % port))
        started.port = port
        started.http_port = http_port
        return started

    @property
    def process(self):
        return self[0]

    @property
    def target(self):
        return self[1]


def start_server(fwserve, model, log_path, extra=()):
    """Returns Started: (process, "127.0.0.1:PORT"), with .http_port when the server
    logged an HTTP port. The server's stderr goes to log_path."""
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [fwserve, "--listen", "127.0.0.1:0", "--metrics-listen", "", "--model", model,
         "--max-tokens", "100000", *extra],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        with open(log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        port = listening_port(text)
        if port is not None:
            return Started(process, port, http_port(text))
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
