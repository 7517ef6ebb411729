#!/usr/bin/env python3
"""Durable sessions survive kill -9: real fwserve processes on a session store
directory (--session-store dir:DIR), killed with SIGKILL and restarted on the same
directory, driven by a Python gRPC client (stubs generated from the proto at test time).

The contract under test (docs/sessions.md):
  * write-through: once a client has the last message of a Generate (the one carrying
    usage) or the response of CreateSession / ForkSession / ImportSession, that
    session's new state is in the store (and once DeleteSession has answered, the
    session is gone from it). A kill loses only in-flight requests: after a
    restart each session holds exactly the tokens of its last completed request, or,
    when the crash fell between the server's commit and the client reading the final
    message, that plus the in-flight request's prompt tokens + max_tokens.
  * the store is indexed in the background at start; meanwhile a request naming a
    session not indexed yet may get UNAVAILABLE, which the tests retry for up to 20 s.
  * store write failures (here EFBIG from RLIMIT_FSIZE): Create/Fork/Import get
    UNAVAILABLE and leave no session; a Generate streams its tokens, then ends with
    UNAVAILABLE naming the session store, and the session keeps those tokens in
    memory; the server retries the write about every second; no session is deleted
    because of a store error; fwserve_session_store_errors_total counts failures.

Tests (unittest; select one by name, e.g. CrashTest.test_crash_loop):
  test_kill9_under_load       500 idle sessions + 16 sessions under Generate load, kill -9
  test_crash_loop             20 start / random mix of RPCs / kill -9 cycles
  test_store_write_failure    RLIMIT_FSIZE on the running server, then recovery

Usage: crash_test.py --fwserve PATH --model DIR --proto-dir DIR [TEST ...]
Debugging flags: --legacy-session-dir (the old --session-dir DIR flag), --graceful
(SIGTERM and a wait instead of SIGKILL, so that a server that saves sessions only on
shutdown passes: it checks the client side of the tests), --keep (keep the work
directories), --seed N (the crash loop's random choices; default 1, printed).
Run it with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf).
"""
import argparse
import concurrent.futures
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
import warnings

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import add_server_arguments, start_server  # noqa: E402
from fwserve_stubs import ensure_grpc, load_stubs, stream_generate  # noqa: E402
from unittest_run import report_and_exit  # noqa: E402

ARGS = None
grpc = None
pb = None
pb_grpc = None

# How long a request naming a session may keep getting UNAVAILABLE while the
# restarted server indexes its store.
LOADING_RETRY_S = 20.0
# How long to wait for the store to be indexed after a start.
INDEX_WAIT_S = 30.0
RPC_TIMEOUT_S = 60.0
# The "found N sessions" line the server logs when indexing ends (the old server's
# "restored N sessions" too, for --legacy-session-dir).
INDEXED_RE = re.compile(rb"(?:found|restored) (\d+) sessions?\b")
# Server logs of each test, for the failure report, and the work directories to remove.
LOGS = {}
WORK_DIRS = []
# The server process the tests talk to (retries stop when it has exited).
RUNNING = None


def greedy():
    return pb.SamplingParams(temperature=0.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ascii_text(rng, low, high):
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.:;!?\nABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high))).encode()


class Server:
    """One fwserve process at a time on one store directory (start, kill -9, restart)."""

    def __init__(self, work, store_dir, test_id, extra=()):
        self.work = work
        self.store_dir = store_dir
        self.extra = list(extra)
        self.logs = LOGS.setdefault(test_id, [])
        self.process = None
        self.channel = None
        self.stub = None
        self.starts = 0

    def store_flags(self):
        if ARGS.legacy_session_dir:
            return ["--session-dir", self.store_dir]
        return ["--session-store", "dir:" + self.store_dir]

    def start(self):
        global RUNNING
        self.starts += 1
        log_path = os.path.join(self.work, "fwserve-%03d.log" % self.starts)
        self.logs.append(log_path)
        self.process, target = start_server(ARGS.fwserve, ARGS.model, log_path,
                                            extra=self.store_flags() + self.extra)
        RUNNING = self.process
        self.channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.FwserveStub(self.channel)
        return self.stub

    def log_text(self):
        with open(self.logs[-1], "rb") as f:
            return f.read()

    def kill(self):
        """SIGKILL (SIGTERM and a wait with --graceful)."""
        if ARGS.graceful:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.process.kill()
        self.process.wait()
        self.close_channel()

    def stop(self):
        """Graceful stop; returns the exit status."""
        self.process.send_signal(signal.SIGTERM)
        try:
            rc = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            rc = "timeout"
        self.close_channel()
        return rc

    def close_channel(self):
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def cleanup(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.close_channel()

    def list_ids(self):
        check_running()
        listed, token = {}, ""
        while True:  # every page (at most 1000 sessions each)
            response = retry_unavailable(lambda: self.stub.ListSessions(
                pb.ListSessionsRequest(page_size=1000, page_token=token),
                timeout=RPC_TIMEOUT_S))
            listed.update((s.session_id, s.tokens) for s in response.sessions)
            token = response.next_page_token
            if not token:
                return listed

    def wait_indexed(self):
        """Waits (at most INDEX_WAIT_S) until the server has logged "found N sessions"
        and ListSessions lists at least N. Returns the listing {id: tokens}; on timeout
        returns it anyway and the caller's checks report what is missing."""
        deadline = time.time() + INDEX_WAIT_S
        while True:
            listed = self.list_ids()
            match = INDEXED_RE.search(self.log_text())
            if ((match is not None and len(listed) >= int(match.group(1)))
                    or time.time() > deadline):
                return listed
            time.sleep(0.1)


class ServerDied(Exception):
    pass


def check_running():
    """Raises ServerDied when the current server process has exited."""
    if RUNNING is not None and RUNNING.poll() is not None:
        status = RUNNING.returncode
        if status < 0:
            status = "signal %s" % signal.Signals(-status).name
        raise ServerDied("fwserve exited unexpectedly (%s)" % status)


def retry_unavailable(call, limit_s=LOADING_RETRY_S):
    """Runs call(), retrying UNAVAILABLE ("still being loaded") for up to limit_s."""
    deadline = time.time() + limit_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.time() > deadline:
                raise
            check_running()
            time.sleep(0.05)


def get_session(stub, session_id):
    """SessionInfo, or None for NOT_FOUND (UNAVAILABLE retried)."""
    try:
        return retry_unavailable(lambda: stub.GetSession(
            pb.GetSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S))
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def generate(stub, **fields):
    """A whole Generate with UNAVAILABLE retried while nothing was streamed. Returns
    (token ids, last message) or raises the RpcError."""
    deadline = time.time() + LOADING_RETRY_S
    while True:
        try:
            return stream_generate(stub, pb, RPC_TIMEOUT_S, **fields)
        except grpc.RpcError as error:
            if (error.code() != grpc.StatusCode.UNAVAILABLE or error.streamed
                    or time.time() > deadline):
                raise
            check_running()
            time.sleep(0.05)


def to_bytes(token_ids):
    """The shipped models use the bytes tokenizer: token id = byte value."""
    return bytes(token_ids)


class StreamSession:
    """A session under load in test_kill9_under_load, as its client thread saw it."""

    def __init__(self, session_id, prefix, tokens):
        self.session_id = session_id
        self.history = bytearray(prefix)   # every byte of every completed request
        self.tokens = tokens               # session_tokens after the last completed one
        self.completed = 0
        self.inflight = None               # prompt of the request in flight, if any
        self.received = []                 # tokens received of the request in flight
        self.error = None                  # an RpcError before the kill
        self.mismatch = None               # a usage that did not add up


class CrashTest(unittest.TestCase):

    def setUp(self):
        # start_server keeps its log file open for the server's lifetime.
        warnings.filterwarnings("ignore", category=ResourceWarning)
        self.work = tempfile.mkdtemp(prefix="fwserve-crash-")
        WORK_DIRS.append(self.work)
        self.store_dir = os.path.join(self.work, "store")
        os.makedirs(self.store_dir)
        self.servers = []

    def tearDown(self):
        for server in self.servers:
            server.cleanup()

    def server(self, extra=()):
        server = Server(self.work, self.store_dir, self.id(), extra)
        self.servers.append(server)
        return server

    def assert_continuation_matches(self, stub, session_id, history, tokens, what):
        """Greedy 16 tokens on the session equal a throwaway Generate over its history."""
        continued, last = generate(stub, session_id=session_id, max_tokens=16,
                                   sampling=greedy())
        self.assertIsNotNone(last, "%s: no usage message" % what)
        self.assertEqual(last.usage.session_tokens, tokens + 16, what)
        control, _ = generate(stub, prompt=bytes(history), max_tokens=16, sampling=greedy())
        self.assertEqual(to_bytes(continued), to_bytes(control),
                         "%s: the restored session continues differently from a fresh "
                         "request over its %d-byte history" % (what, len(history)))

    # ---------------------------------------------------------------- kill -9 under load
    def test_kill9_under_load(self):
        idle_count, stream_count, max_tokens = 500, 16, 24
        rng = random.Random(1234)
        server = self.server()
        stub = server.start()

        def create(prefix):
            info = stub.CreateSession(pb.CreateSessionRequest(prefix=prefix),
                                      timeout=RPC_TIMEOUT_S)
            return info.session_id, prefix, info.tokens

        prefixes = [b"Idle %d:\n" % i for i in range(idle_count)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            idle = list(pool.map(create, prefixes))
        for session_id, prefix, tokens in idle:
            self.assertEqual(tokens, len(prefix))
        streams = [StreamSession(*create(b"ROMEO %d:\n" % i)) for i in range(stream_count)]
        self.assertEqual(len({s[0] for s in idle} | {s.session_id for s in streams}),
                         idle_count + stream_count)

        prompts = [b"\nJULIET:\n", b" and ", b"\nFirst Citizen:\n", b"; but ", b"\nROMEO:\n"]
        lock = threading.Lock()
        killed = threading.Event()

        def drive(index, session):
            n = 0
            while not killed.is_set():
                prompt = prompts[(index + n) % len(prompts)]
                n += 1
                with lock:
                    session.inflight = prompt
                    session.received = []
                try:
                    call = stub.Generate(pb.GenerateRequest(
                        session_id=session.session_id, prompt=prompt, max_tokens=max_tokens,
                        sampling=greedy()), timeout=RPC_TIMEOUT_S)
                    for message in call:
                        with lock:
                            session.received.extend(message.token_ids)
                            if not message.HasField("usage"):
                                continue
                            expected = session.tokens + len(prompt) + max_tokens
                            if (message.usage.session_tokens != expected
                                    or len(session.received) != max_tokens):
                                session.mismatch = (
                                    "usage %s after %d tokens streamed, expected session "
                                    "tokens %d" % (message.usage, len(session.received),
                                                   expected))
                            session.history += prompt + to_bytes(session.received)
                            session.tokens = message.usage.session_tokens
                            session.completed += 1
                            session.inflight = None
                            session.received = []
                except grpc.RpcError as error:
                    if not killed.is_set():
                        session.error = error
                    return

        threads = [threading.Thread(target=drive, args=(i, s), daemon=True)
                   for i, s in enumerate(streams)]
        load_start = time.time()
        for thread in threads:
            thread.start()
        # About 2.5 s of load, and at least one completed request on every stream.
        while time.time() < load_start + 15:
            with lock:
                everyone = all(s.completed > 0 for s in streams)
            if (everyone and time.time() > load_start + 2.5) or any(s.error for s in streams):
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.3))
        killed.set()
        server.kill()
        for thread in threads:
            thread.join(timeout=60)
        for s in streams:
            self.assertIsNone(s.error, "%s failed before the kill" % s.session_id)
            self.assertIsNone(s.mismatch, s.session_id)
            self.assertGreater(s.completed, 0, "%s completed nothing in the load phase"
                               % s.session_id)
        completed = sum(s.completed for s in streams)
        inflight = sum(1 for s in streams if s.inflight is not None)

        stub = server.start()
        listed = server.wait_indexed()
        missing = [i for i, _, _ in idle if i not in listed]
        self.assertEqual(missing[:3], [], "idle sessions lost by kill -9: %d of %d"
                         % (len(missing), idle_count))
        wrong = [(i, t, listed[i]) for i, _, t in idle if listed[i] != t]
        self.assertEqual(wrong[:3], [], "%d idle sessions with other token counts (id, "
                         "before, after)" % len(wrong))
        self.assertEqual(len(listed), idle_count + stream_count,
                         "sessions listed after the restart")

        known_history = []  # (session id, history bytes, tokens)
        caught_in_flight = 0
        for s in streams:
            info = get_session(stub, s.session_id)
            self.assertIsNotNone(info, "stream session %s lost by kill -9" % s.session_id)
            allowed = {s.tokens}
            if s.inflight is not None:
                allowed.add(s.tokens + len(s.inflight) + max_tokens)
            self.assertIn(info.tokens, allowed,
                          "stream session %s: %d tokens after the restart; its last "
                          "completed request left %d; in flight: %r"
                          % (s.session_id, info.tokens, s.tokens, s.inflight))
            if info.tokens == s.tokens:
                known_history.append((s.session_id, s.history, s.tokens))
            else:
                caught_in_flight += 1
                if len(s.received) == max_tokens:
                    known_history.append((s.session_id,
                                          s.history + s.inflight + to_bytes(s.received),
                                          info.tokens))
        for session_id, prefix, tokens in rng.sample(idle, 4):
            known_history.append((session_id, prefix, tokens))
        # A history is a control prompt only when it is valid UTF-8 (a greedy Shakespeare
        # model writes ASCII, so this should drop nothing).
        known_history = [k for k in known_history if all(b < 128 for b in k[1])]
        for session_id, history, tokens in known_history:
            self.assertEqual(len(history), tokens, session_id)
            self.assert_continuation_matches(stub, session_id, history, tokens,
                                             "session %s" % session_id)
        self.assertGreaterEqual(len(known_history), 4 + stream_count // 2,
                                "too few sessions with a known history to compare")
        print("\nkill -9 under load: %d idle + %d streaming sessions, %d requests completed "
              "before the kill, %d in flight (%d of them committed), %d continuations "
              "compared" % (idle_count, stream_count, completed, inflight, caught_in_flight,
                            len(known_history)))
        self.assertEqual(server.stop(), 0, "exit status after SIGTERM")

    # ---------------------------------------------------------------------- crash loop
    def test_crash_loop(self):
        kills, workers = 20, 3  # a count, not a time budget (ctest's timeout catches a hang)
        rng = random.Random(ARGS.seed)
        server = self.server()
        lock = threading.Lock()
        counts = {}        # session id -> token count (exact between kills)
        free = []          # ids not held by a worker
        deleted = set()    # DeleteSession answered: must stay deleted
        deleted_lately = set()  # the part of deleted since the last check
        orphans = []       # token counts a session from an unanswered create/fork may have
        inflight = {}      # id -> ("generate", tokens if it committed) | ("delete", None)
        errors = []        # RpcErrors before the kill
        totals = {"kills": 0, "checked": 0, "lost": 0, "wrong_tokens": 0, "resurrected": 0,
                  "unexplained": 0, "adopted": 0, "operations": 0}
        problems = []

        def worker(seed, stub, killed):
            wrng = random.Random(seed)
            while not killed.is_set():
                with lock:
                    many = len(counts) > 120
                    op = wrng.choices(["create", "generate", "fork", "delete"],
                                      [1 if many else 3, 4, 1.5, 3 if many else 1.5])[0]
                    if op != "create" and not free:
                        op = "create"
                    session_id = None
                    if op != "create":
                        session_id = free.pop(wrng.randrange(len(free)))
                    tokens = counts.get(session_id)
                try:
                    if op == "create":
                        prefix = ascii_text(wrng, 1, 12)
                        with lock:
                            orphans.append(len(prefix))
                        info = stub.CreateSession(pb.CreateSessionRequest(prefix=prefix),
                                                  timeout=RPC_TIMEOUT_S)
                        with lock:
                            orphans.remove(len(prefix))
                            counts[info.session_id] = info.tokens
                            free.append(info.session_id)
                            if info.tokens != len(prefix):
                                problems.append("create: %d tokens for a %d-byte prefix"
                                                % (info.tokens, len(prefix)))
                    elif op == "generate":
                        prompt = ascii_text(wrng, 1, 8)
                        max_tokens = wrng.choice([0, 1, 4, 8, 16])
                        sampling = pb.SamplingParams(temperature=0.8, seed=wrng.randrange(1000))
                        after = tokens + len(prompt) + max_tokens
                        with lock:
                            inflight[session_id] = ("generate", after)
                        for message in stub.Generate(pb.GenerateRequest(
                                session_id=session_id, prompt=prompt, max_tokens=max_tokens,
                                sampling=sampling), timeout=RPC_TIMEOUT_S):
                            if message.HasField("usage"):
                                with lock:
                                    del inflight[session_id]
                                    counts[session_id] = message.usage.session_tokens
                                    if message.usage.session_tokens != after:
                                        problems.append("generate: usage %s, expected %d"
                                                        % (message.usage, after))
                        with lock:
                            free.append(session_id)
                    elif op == "fork":
                        with lock:
                            orphans.append(tokens)
                        info = stub.ForkSession(pb.ForkSessionRequest(session_id=session_id),
                                                timeout=RPC_TIMEOUT_S)
                        with lock:
                            orphans.remove(tokens)
                            counts[info.session_id] = info.tokens
                            free.extend([session_id, info.session_id])
                            if info.tokens != tokens:
                                problems.append("fork: %d tokens of a %d-token session"
                                                % (info.tokens, tokens))
                    else:
                        with lock:
                            inflight[session_id] = ("delete", None)
                        stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id),
                                           timeout=RPC_TIMEOUT_S)
                        with lock:
                            del inflight[session_id]
                            del counts[session_id]
                            deleted.add(session_id)
                            deleted_lately.add(session_id)
                    with lock:
                        totals["operations"] += 1
                except grpc.RpcError as error:
                    if not killed.is_set():
                        with lock:
                            errors.append("%s: %s %s" % (op, error.code(), error.details()))
                    return

        def verify(stub):
            """Checks every session known so far on a freshly started server."""
            listed = server.wait_indexed()
            for session_id in sorted(counts):
                allowed = {counts[session_id]}
                kind, after = inflight.get(session_id, (None, None))
                if kind == "generate":
                    allowed.add(after)
                info = get_session(stub, session_id)
                totals["checked"] += 1
                if info is None:
                    if kind == "delete":
                        deleted.add(session_id)
                        deleted_lately.add(session_id)
                        del counts[session_id]
                    else:
                        totals["lost"] += 1
                        problems.append("lost %s (%d tokens)" % (session_id, counts[session_id]))
                        del counts[session_id]
                    continue
                if info.tokens not in allowed:
                    totals["wrong_tokens"] += 1
                    problems.append("%s holds %d tokens, expected one of %s"
                                    % (session_id, info.tokens, sorted(allowed)))
                counts[session_id] = info.tokens
                if session_id not in listed:
                    problems.append("%s answers GetSession but is not listed" % session_id)
            # Every deleted session must be unlisted; those deleted since the last check
            # must also answer NOT_FOUND.
            for session_id in sorted(deleted):
                if session_id in listed or (session_id in deleted_lately
                                            and get_session(stub, session_id) is not None):
                    totals["resurrected"] += 1
                    problems.append("deleted session %s is back" % session_id)
            deleted_lately.clear()
            for session_id in sorted(set(listed) - set(counts) - deleted):
                # A create or fork whose answer the kill swallowed may have committed.
                tokens = listed[session_id]
                if tokens in orphans:
                    orphans.remove(tokens)
                    totals["adopted"] += 1
                    counts[session_id] = tokens
                else:
                    totals["unexplained"] += 1
                    problems.append("unknown session %s with %d tokens" % (session_id, tokens))
            inflight.clear()
            orphans.clear()  # indexing is over: an unanswered create that committed is listed
            free[:] = sorted(counts)

        start = time.time()
        while totals["kills"] < kills:
            stub = server.start()
            verify(stub)
            killed = threading.Event()
            threads = [threading.Thread(target=worker, args=(rng.random(), stub, killed),
                                        daemon=True) for _ in range(workers)]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.1, 1.0))
            killed.set()
            server.kill()
            totals["kills"] += 1
            for thread in threads:
                thread.join(timeout=60)
        stub = server.start()
        verify(stub)
        self.assertEqual(server.stop(), 0, "exit status after SIGTERM")
        print("\ncrash loop: %(kills)d kills, %(operations)d operations answered, "
              "%(checked)d session checks, %(lost)d sessions lost, %(wrong_tokens)d with a "
              "wrong token count, %(resurrected)d deleted sessions back, %(adopted)d "
              "sessions from unanswered creates/forks, %(unexplained)d unexplained" % totals
              + "; %d sessions and %d deleted at the end, %.0f s"
              % (len(counts), len(deleted), time.time() - start))
        self.assertFalse(errors, "%d RPC errors before a kill: %s" % (len(errors), errors[:5]))
        self.assertFalse(problems, "%d problems, the first: %s"
                         % (len(problems), "; ".join(problems[:10])))
        self.assertEqual(totals["lost"], 0)
        self.assertGreater(totals["checked"], 100, "too few session checks to mean much")

    # ---------------------------------------------------------- store write failure
    def scrape_store_errors(self, port):
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port,
                                      timeout=10).read().decode()
        values = [float(m.group(1)) for m in re.finditer(
            r"^fwserve_session_store_errors_total(?:\{[^}]*\})?\s+(\S+)", text, re.M)]
        return values

    def test_store_write_failure(self):
        metrics_port = free_port()
        server = self.server(extra=["--metrics-listen", "127.0.0.1:%d" % metrics_port])
        stub = server.start()
        histories = {}
        for prefix, prompt in ((b"KING HENRY:\n", b"Once more unto"), (b"QUEEN:\n", b"My lord")):
            info = stub.CreateSession(pb.CreateSessionRequest(prefix=prefix),
                                      timeout=RPC_TIMEOUT_S)
            tokens, last = generate(stub, session_id=info.session_id, prompt=prompt,
                                    max_tokens=12, sampling=greedy())
            self.assertIsNotNone(last)
            histories[info.session_id] = prefix + prompt + to_bytes(tokens)
            self.assertEqual(last.usage.session_tokens, len(histories[info.session_id]))
        first, second = list(histories)
        blob = stub.ExportSession(pb.ExportSessionRequest(session_id=second),
                                  timeout=RPC_TIMEOUT_S).blob
        before = server.list_ids()
        self.assertEqual(set(before), {first, second})

        pid = server.process.pid
        original = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        # Only the soft limit: an unprivileged test can raise it back afterwards. (The
        # server's stderr log is a file too; its writes fail from here on as well.)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1000, original[1]))
        try:
            for what, call in (
                    ("CreateSession", lambda: stub.CreateSession(
                        pb.CreateSessionRequest(prefix=b"GHOST:\n"), timeout=RPC_TIMEOUT_S)),
                    ("ForkSession", lambda: stub.ForkSession(
                        pb.ForkSessionRequest(session_id=first), timeout=RPC_TIMEOUT_S)),
                    ("ImportSession", lambda: stub.ImportSession(
                        pb.ImportSessionRequest(blob=blob), timeout=RPC_TIMEOUT_S))):
                with self.assertRaises(grpc.RpcError, msg=what) as raised:
                    call()
                self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAVAILABLE,
                                 "%s: %s" % (what, raised.exception.details()))
                self.assertEqual(server.list_ids(), before,
                                 "%s that the store refused left a session" % what)

            prompt = b" Dear friends"
            streamed = []
            with self.assertRaises(grpc.RpcError) as raised:
                for message in stub.Generate(pb.GenerateRequest(
                        session_id=first, prompt=prompt, max_tokens=20, sampling=greedy()),
                        timeout=RPC_TIMEOUT_S):
                    streamed.extend(message.token_ids)
            self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAVAILABLE,
                             raised.exception.details())
            self.assertIn("session store", (raised.exception.details() or "").lower())
            self.assertEqual(len(streamed), 20, "tokens streamed before the store error")
            histories[first] += prompt + to_bytes(streamed)
            info = get_session(stub, first)
            self.assertIsNotNone(info, "the session was dropped after a store error")
            self.assertEqual(info.tokens, len(histories[first]),
                             "the session keeps the streamed tokens in memory")
            self.assertFalse(info.busy)
            listed = server.list_ids()
            self.assertEqual(set(listed), {first, second})
            self.assertEqual(listed[second], before[second])
            # A few housekeeping retries fail too; none of them deletes anything.
            time.sleep(2.5)
            self.assertEqual(set(server.list_ids()), {first, second})
            errors = self.scrape_store_errors(metrics_port)
            self.assertTrue(errors, "no fwserve_session_store_errors_total series")
            self.assertGreater(sum(errors), 0, "fwserve_session_store_errors_total")
        finally:
            if server.process.poll() is None:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, original)
        raised_at = time.time()

        # The housekeeping retry writes the session once the store works again: wait for
        # a file under the store to change (at most 10 s), give it a second, kill -9.
        deadline = raised_at + 10
        while time.time() < deadline and not any(
                os.stat(os.path.join(d, f)).st_mtime >= raised_at - 0.01
                for d, _, files in os.walk(self.store_dir) for f in files
                if os.path.exists(os.path.join(d, f))):
            time.sleep(0.1)
        time.sleep(1.0)
        self.assertIsNone(server.process.poll(), "the server died under RLIMIT_FSIZE")
        server.kill()

        stub = server.start()
        listed = server.wait_indexed()
        self.assertEqual(set(listed), {first, second}, "sessions after the restart")
        for session_id, history in histories.items():
            info = get_session(stub, session_id)
            self.assertIsNotNone(info, session_id)
            self.assertEqual(info.tokens, len(history),
                             "%s after the restart (the retry should have written it)"
                             % session_id)
        for session_id, history in histories.items():
            self.assert_continuation_matches(stub, session_id, history, len(history),
                                             "session %s" % session_id)
        self.assertEqual(server.stop(), 0, "exit status after SIGTERM")


def main():
    global ARGS, grpc, pb, pb_grpc
    ensure_grpc()
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--seed", type=int, default=1,
                        help="crash loop seed (default 1; printed; any other value to explore)")
    parser.add_argument("--legacy-session-dir", action="store_true",
                        help="debugging: the old --session-dir flag")
    parser.add_argument("--graceful", action="store_true",
                        help="debugging: SIGTERM instead of SIGKILL")
    ARGS, rest = parser.parse_known_args()
    print("crash_test: seed %d (--seed N to repeat or vary the crash loop's choices)"
          % ARGS.seed)
    with tempfile.TemporaryDirectory() as tmp:
        grpc, pb, pb_grpc = load_stubs(ARGS.proto_dir, os.path.join(tmp, "stubs"), ARGS.protoc)
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)

        def show_failure(test_id):
            for path in LOGS.get(test_id, [])[-2:]:
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        lines = [line for line in f.read().decode(errors="replace").splitlines()
                                 if " INFO request id=" not in line]
                    sys.stderr.write("--- %s: %s (tail, without request lines)\n%s\n" % (
                        test_id, os.path.basename(path), "\n".join(lines[-40:])))

        report_and_exit("crash_test", program.result, WORK_DIRS, ARGS.keep, show_failure)


if __name__ == "__main__":
    main()
