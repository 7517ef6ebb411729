#!/usr/bin/env python3
"""Documented promises about server flags, fwctl's key and TLS options, and memory
pressure with a failing session store, checked on the real fwserve and fwctl binaries
(issue 28: every promise in the docs has a test that can fail). Each test names the
passage it checks.

Memory pressure (docs/sessions.md "Failure modes"):
  test_memory_pressure_keeps_unsaved_sessions   "memory is needed while idle sessions
        are unsaved -> RESOURCE_EXHAUSTED naming --max-state-memory-bytes, saying how many
        idle sessions must stay in memory because the store failed; no session is
        deleted to make room": a dir: store made to fail (RLIMIT_FSIZE on the server), a
        budget of 3 session states, 3 resident sessions left unsaved by Generates whose
        write failed: Create, Fork and a Generate needing a slot are refused that way, and
        every acknowledged session is still there with its tokens; the store back, the
        housekeeping retry saves them, a Create works, and after a restart every session
        is there with its tokens

fwctl's key and TLS paths (docs/client.md "fwctl reference", docs/security.md):
  test_fwctl_key_sources         --api-key-file (first line), $FWSERVE_API_KEY, --token:
        each sends the key (the caller's tenant sees its own sessions only); a wrong or
        missing key exits 1 with UNAUTHENTICATED; precedence: --api-key-file and --token
        over $FWSERVE_API_KEY, --api-key-file over --token; health needs no key
  test_fwctl_unreadable_key_file_exits_1   "Exit codes: 1 ... or a local file could not
        be read": an --api-key-file that cannot be read exits 1 like an unreadable
        --tls-ca (an empty first line is refused)
  test_fwctl_plaintext_key_refused_off_loopback   "refuse to send a key in plaintext to
        a non-loopback target unless told to (fwctl --insecure)": exit 1 and nothing
        reaches the server; with --insecure, or to 127.0.0.1/localhost, or over TLS, the
        call works; without a key nothing is refused locally
  test_fwctl_tls_and_mutual_tls  --tls-ca, --tls, --tls-cert/--tls-key against a TLS
        server (--tls-cert-file/--tls-key-file) and a mutual-TLS one
        (--tls-client-ca-file) with an x509-cn: key line: the certificate's tenant; "a
        call that sends a bearer key is judged by the key alone"
  test_readme_keyed_quickstart   the README's and docs/security.md's "start with keys"
        blocks run as written (binary paths and ports substituted), with --api-key-file
        and with FWSERVE_API_KEY; without the key the same server refuses

Flags (docs/serving.md "Flags", docs/security.md, docs/sessions.md, docs/metrics.md):
  test_tls_flags                 --tls-cert-file/--tls-key-file/--tls-client-ca-file with a
        Python client: plaintext and a wrong CA fail, the right CA works; mutual TLS
        needs a client certificate the CA signed; a mutual-TLS server on 0.0.0.0 without
        keys logs no open-listen warning; bad combinations are refused at start-up
  test_session_key_file_seals_exports   "Sealed export blobs": a blob signed with K
        (FWSHMAC1 + HMAC-SHA-256) imports on another server with K (trailing whitespace
        of the key file ignored) and continues identically; a server with another key,
        a server without the flag, and any changed byte get INVALID_ARGUMENT; a keyed
        server refuses unsigned blobs; the HTTP export is signed too; a short key is
        refused at start-up
  test_session_dir_alias         --session-dir DIR = --session-store dir:DIR (files
        DIR/<id>.fwstate, 0600 in a 0700 directory; a server with --session-store dir:DIR
        finds the sessions); both flags at once are refused
  test_session_store_threads     the store runs exactly N "fwserve-store" threads; 0 and
        a non-integer are refused at start-up naming the flag
  test_prefill_threads           --prefill-threads N: the prefill thread's team is N
        threads ("fwserve-prefill") after a 300-byte CreateSession; 1 is the prefill
        thread alone; the default is the physical cores of the affinity mask; -1 and a non-integer
        are refused at start-up naming the flag
  test_batch_wait                "a decode step may wait up to --batch-wait for streams
        waiting for a write": with --batch-wait 1h a stream stalls behind another whose
        client does not read, and goes on once that one ends; negative and malformed
        values are refused at start-up naming the flag
  test_max_streams_per_connection   with --max-streams-per-connection 2, a third call on
        a connection holding two open streams waits (another connection is answered)
        until one ends; 0 is refused at start-up
  test_grpc_memory_quota_bytes   with an 8 MB quota a 16 MiB request is refused
        (RESOURCE_EXHAUSTED) and small ones work; the default server, and one with 0
        (no bound), read the same 16 MiB request (INVALID_ARGUMENT about the blob)
  test_log_level                 debug shows the probe lines that info hides; warning
        hides INFO lines and keeps WARNING ones; error hides both and keeps ERROR lines; a
        bad value is refused at start-up naming the flag
  test_message_size_cap          "The largest request message is 64 MiB for every
        method": a message of exactly 64 MiB is read (INVALID_ARGUMENT about the blob),
        one byte more is RESOURCE_EXHAUSTED

Each test can be made to fail on purpose with --break NAME (a deliberately wrong setup;
see BREAKS below), to show that its assertions can fail.

Usage: promises_flags_test.py --fwserve PATH --fwctl PATH --model DIR --proto-dir DIR
       [--keep] [--break NAME] [TEST ...]
Run it with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf); needs openssl.
"""
import argparse
import hashlib
import hmac
import os
import re
import resource
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from fwserve_process import (GenerateReader, add_server_arguments, http_port,  # noqa: E402
                            kill_process_group, listening_port, rpc_error, wait_for)
from fwserve_stubs import ensure_grpc, load_stubs  # noqa: E402
from replica_processes import _child_setup, free_port, wait_port  # noqa: E402
from unittest_run import check, report_and_exit  # noqa: E402

ARGS = None
grpc = None
pb = None
pb_grpc = None
LOGS = {}  # test id -> log paths, for the failure report
WORK_DIRS = []
CERTS = None  # {name: path}, made once per run by make_certs()

# The deliberate breaks (--break NAME): each turns one test red.
BREAKS = {
    "memory-store": "test_memory_pressure_keeps_unsaved_sessions: --session-store memory "
                    "(eviction deletes idle sessions; no store to fail)",
    "store-works": "test_memory_pressure_keeps_unsaved_sessions: no RLIMIT_FSIZE (every "
                   "session is saved, so one can leave memory)",
    "server-other-key": "test_fwctl_key_sources: the server's file holds another key for "
                        "acme",
    "loopback-target": "test_fwctl_plaintext_key_refused_off_loopback: the 'non-loopback' "
                       "target is 127.0.0.1",
    "fwctl-wrong-ca": "test_fwctl_tls_and_mutual_tls: fwctl verifies the server with "
                      "another CA",
    "quickstart-no-keys": "test_readme_keyed_quickstart: the server line without "
                          "--api-keys-file",
    "plaintext-server": "test_tls_flags: the 'TLS' server runs without --tls-cert-file/"
                        "--tls-key-file",
    "session-key-differs": "test_session_key_file_seals_exports: the importing server has "
                           "another --session-key-file",
    "memory-not-dir": "test_session_dir_alias: --session-store memory instead of "
                      "--session-dir",
    "store-threads-default": "test_session_store_threads: --session-store-threads left "
                             "at its default (2)",
    "batch-wait-default": "test_batch_wait: --batch-wait left at its default (300us)",
    "prefill-threads-default": "test_prefill_threads: --prefill-threads left at its default "
                               "(the CPU count) where the test gives 3",
    "streams-default": "test_max_streams_per_connection: --max-streams-per-connection "
                       "left at its default (256)",
    "quota-default": "test_grpc_memory_quota_bytes: --grpc-memory-quota-bytes left at its "
                     "default (2 GiB)",
    "log-level-info": "test_log_level: every server at --log-level info",
    "cap-32mib": "test_message_size_cap: the test expects a 32 MiB cap",
}

KEY_A = "acme-flags-key-Pq7wLz3KdV9sRt2M"
KEY_B = "beta-flags-key-Jx4nBv8CyH1gFe6Q"
KEY_C = "carl-flags-key-Wm5uTa0QoE7iNd3Z"
WRONG_KEY = "wrong-flags-key-Gk2hYr6XlS8cPb4V"
SESSION_KEY_1 = b"session-key-one-0123456789abcdefABCDEF"
SESSION_KEY_2 = b"session-key-two-0123456789abcdefABCDEF"
RPC_TIMEOUT_S = 60.0
# Deadlines below only catch hangs; no outcome depends on how fast anything is. Where a
# test checks that something does NOT happen, it watches for HOLD_S and the server
# working correctly never lets it happen, however slow the machine is.
HANG_S = 60.0
HOLD_S = 3.0
CAP = 64 << 20  # docs/security.md: the largest request message


def broken(name):
    return ARGS.break_ == name


def physical_cores_of_affinity():
    """What --prefill-threads 0 documents (server/base/cpu_count.h): the distinct cores
    (their CPU lists) among the CPUs this process may run on, capped by the tightest
    cgroup v2 cpu.max quota on its cgroup and the cgroups above it, rounded up."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = "/sys/devices/system/cpu/cpu%d/topology/" % cpu
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                with open(topology + name) as f:
                    cores.add(f.read().strip())
                break
            except OSError:
                continue
        else:
            cores = set(range(len(os.sched_getaffinity(0))))
            break
    count = len(cores)
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), "")
    except OSError:
        path = ""
    while True:
        try:
            with open("/sys/fs/cgroup%s/cpu.max" % path.rstrip("/")) as f:
                quota, period = f.read().split()
            if quota != "max":
                count = min(count, max(1, -(-int(quota) // int(period))))
        except (OSError, ValueError):
            pass
        if path in ("", "/"):
            break
        path = path[:path.rfind("/")] or "/"
    return max(1, count)


def key_line(key, tenant):
    return "sha256:%s tenant=%s\n" % (hashlib.sha256(key.encode()).hexdigest(), tenant)


def auth(key):
    return (("authorization", "Bearer " + key),) if key else ()


def greedy():
    return pb.SamplingParams(temperature=0.0)


def threads_named(pid, name):
    """How many threads of process `pid` are named `name` (/proc/PID/task/*/comm)."""
    names = []
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, task)) as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count(name)


def non_loopback_ipv4():
    """An IPv4 address of this machine outside 127.0.0.0/8, or None."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for match in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+)/", out):
        if not match.group(1).startswith("127."):
            return match.group(1)
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not info[4][0].startswith("127."):
                return info[4][0]
    except OSError:
        pass
    return None


def make_certs(directory):
    """A CA, a server certificate it signed (localhost, 127.0.0.1 and this machine's
    other address), client certificates (CN batch.internal and nobody.internal) it
    signed, and another CA with its own batch.internal client certificate."""
    ip = non_loopback_ipv4()
    config = os.path.join(directory, "openssl.cnf")
    with open(config, "w") as f:
        f.write("[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = fwtest\n"
                "[v3_ca]\nbasicConstraints = critical, CA:TRUE\n"
                "keyUsage = critical, keyCertSign, cRLSign\n"
                "subjectKeyIdentifier = hash\n"
                "[v3_server]\nbasicConstraints = CA:FALSE\n"
                "keyUsage = critical, digitalSignature, keyEncipherment\n"
                "extendedKeyUsage = serverAuth\nsubjectAltName = @alt\n"
                "[alt]\nDNS.1 = localhost\nIP.1 = 127.0.0.1\n"
                + ("IP.2 = %s\n" % ip if ip else "")
                + "[v3_client]\nbasicConstraints = CA:FALSE\n"
                "keyUsage = critical, digitalSignature, keyEncipherment\n"
                "extendedKeyUsage = clientAuth\n")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    paths = {}
    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-new", *ec, "-keyout", ca + ".key", "-out", ca + ".pem",
            "-days", "3", "-subj", "/CN=fwserve test " + ca, "-config", config,
            "-extensions", "v3_ca")
        paths[ca] = os.path.join(directory, ca + ".pem")
    for serial, (name, ca, cn, extensions) in enumerate((
            ("server", "ca", "localhost", "v3_server"),
            ("client", "ca", "batch.internal", "v3_client"),
            ("nobody", "ca", "nobody.internal", "v3_client"),
            ("other-client", "other-ca", "batch.internal", "v3_client")), 1):
        run("req", "-new", *ec, "-keyout", name + ".key", "-out", name + ".csr",
            "-subj", "/CN=" + cn, "-config", config)
        run("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
            "-set_serial", str(serial), "-out", name + ".pem",
            "-days", "3", "-extfile", config, "-extensions", extensions)
        paths[name] = os.path.join(directory, name + ".pem")
        paths[name + "-key"] = os.path.join(directory, name + ".key")
    paths["ip"] = ip
    return paths


def read(path):
    with open(path, "rb") as f:
        return f.read()


def child_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("FWSERVE_API_KEY", "FWSERVE_TARGET")}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Server:
    """One fwserve process. Its stderr comes through a pipe into log_path (so that a
    file-size limit on the server does not silence its log). port=0: a free port, found
    from the "listening" line; else a fixed port, waited for by connecting (the line is
    hidden at --log-level warning and error)."""

    def __init__(self, log_path, extra=(), host="127.0.0.1", port=0):
        self.log_path = log_path
        argv = [ARGS.fwserve, "--listen", "%s:%d" % (host, port), "--metrics-listen", "",
                "--model", ARGS.model, "--max-tokens", "100000", "--threads", "1", *extra]
        self.data = b""
        self.lock = threading.Lock()
        self.log = open(log_path, "ab")
        self.log.write(("=== %s\n" % " ".join(argv)).encode())
        self.log.flush()
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        env=child_env(), start_new_session=True,
                                        preexec_fn=_child_setup)
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        if port == 0:
            deadline = time.time() + HANG_S
            while time.time() < deadline and self.process.poll() is None:
                port = listening_port(self.text())
                if port is not None:
                    self.port = port
                    break
                time.sleep(0.05)
            else:
                self.kill()
                raise RuntimeError("fwserve did not start:\n" + self.text()[-3000:])
        else:
            self.port = port
            if not wait_port(port, HANG_S, lambda: self.process.poll() is None):
                self.kill()
                raise RuntimeError("fwserve did not listen:\n" + self.text()[-3000:])

    def _pump(self):
        while True:
            chunk = os.read(self.process.stderr.fileno(), 65536)
            if not chunk:
                return
            with self.lock:
                self.data += chunk
                self.log.write(chunk)
                self.log.flush()

    def text(self):
        with self.lock:
            return self.data.decode(errors="replace")

    @property
    def pid(self):
        return self.process.pid

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def http_port(self):
        port = http_port(self.text())
        check(port is not None, "no HTTP API log line:\n" + self.text()[-2000:])
        return port

    def stop(self):
        """SIGTERM and the drain; returns the exit status ("timeout" if killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                self.kill()
                return "timeout"
        self.pump.join(10)
        return self.process.returncode

    def kill(self):
        kill_process_group(self.process)
        self.pump.join(10)
        self.close()

    def close(self):
        with self.lock:
            if not self.log.closed:
                self.log.close()
        if not self.pump.is_alive():
            self.process.stderr.close()


class ProcessGroup:
    """A bash process group, ended with the test (like a call: .cancel())."""

    def __init__(self, process):
        self.process = process

    def cancel(self):
        kill_process_group(self.process)


class PromisesFlagsTest(unittest.TestCase):
    maxDiff = None

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="fwserve-promises-flags-")
        WORK_DIRS.append(self.work)
        self.servers = []
        self.channels = []
        self.calls = []  # calls to cancel before the servers stop
        self.count = 0

    def tearDown(self):
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()
        for server in self.servers:
            if server.process.poll() is None:
                code = server.stop()
                if code != 0:
                    print("note: %s exited with %s after SIGTERM" % (server.log_path, code))
            server.kill()

    # Helpers.

    def path(self, name):
        return os.path.join(self.work, name)

    def write(self, name, text, mode=None):
        path = self.path(name)
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        if mode is not None:
            os.chmod(path, mode)
        return path

    def start(self, extra=(), **kwargs):
        self.count += 1
        log = self.path("%02d-fwserve.log" % self.count)
        LOGS.setdefault(self.id(), []).append(log)
        server = Server(log, extra, **kwargs)
        self.servers.append(server)
        return server

    def start_fails(self, extra):
        """fwserve with `extra` must refuse to start: returns (exit status, stderr)."""
        argv = [ARGS.fwserve, "--listen", "127.0.0.1:0", "--metrics-listen", "",
                "--model", ARGS.model, *extra]
        try:
            result = subprocess.run(argv, capture_output=True, timeout=HANG_S,
                                    env=child_env())
        except subprocess.TimeoutExpired:
            raise AssertionError("fwserve %s started (it ran past %.0f s)"
                                 % (" ".join(extra), HANG_S))
        self.assertNotEqual(result.returncode, 0, "fwserve %s started" % " ".join(extra))
        return result.returncode, result.stderr.decode(errors="replace")

    def assert_refused_at_start(self, extra, *needles):
        code, err = self.start_fails(extra)
        for needle in needles:
            self.assertIn(needle, err, "fwserve %s: exit %s, stderr: %s"
                          % (" ".join(extra), code, err[-500:]))

    def channel(self, target, credentials=None, options=()):
        """A channel with its own connection (no subchannel shared with another channel)."""
        options = [("grpc.use_local_subchannel_pool", 1), *options]
        if credentials is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            channel = grpc.secure_channel(target, credentials, options=options)
        self.channels.append(channel)
        return channel

    def stub(self, target, credentials=None, options=()):
        return pb_grpc.FwserveStub(self.channel(target, credentials, options))

    def stream(self, stub, key=None, **fields):
        stream = GenerateReader(stub.Generate(pb.GenerateRequest(**fields), metadata=auth(key),
                                              timeout=600))
        self.calls.append(stream.call)
        return stream

    def fwctl(self, *args, target=None, env=None, stdin=None):
        """Runs fwctl; returns (exit status, stdout text, stderr text)."""
        environ = child_env()
        environ.update(env or {})
        argv = [ARGS.fwctl] + (["--target", target] if target else []) + list(args)
        result = subprocess.run(argv, capture_output=True, timeout=HANG_S, env=environ,
                                input=stdin)
        return (result.returncode, result.stdout.decode(errors="replace"),
                result.stderr.decode(errors="replace"))

    def fwctl_ok(self, *args, **kwargs):
        code, out, err = self.fwctl(*args, **kwargs)
        self.assertEqual(code, 0, "fwctl %s -> %d: %s" % (" ".join(args), code, err))
        return out

    def fwctl_fails(self, code_name, *args, **kwargs):
        code, out, err = self.fwctl(*args, **kwargs)
        self.assertEqual(code, 1, "fwctl %s -> %d (expected 1, %s): %s%s"
                         % (" ".join(args), code, code_name, out, err))
        self.assertIn(code_name, err, "fwctl %s" % " ".join(args))
        return err

    def list_ids(self, stub, key=None):
        response = stub.ListSessions(pb.ListSessionsRequest(page_size=1000),
                                     metadata=auth(key), timeout=RPC_TIMEOUT_S)
        return {s.session_id: s for s in response.sessions}

    # ---------------------------------------------------------------- item 4: memory
    def test_memory_pressure_keeps_unsaved_sessions(self):
        # The state size of one session, from the model (docs: GetSession state_bytes).
        probe = self.start()
        state_bytes = self.stub(probe.target).DescribeModel(
            pb.DescribeModelRequest(), timeout=RPC_TIMEOUT_S).state_bytes_per_session
        self.assertEqual(probe.stop(), 0)
        self.assertGreater(state_bytes, 1000)
        capacity = 3
        store = self.path("store")
        store_flags = (["--session-store", "memory"] if broken("memory-store")
                       else ["--session-store", "dir:" + store])
        budget = capacity * state_bytes + state_bytes // 2
        server = self.start(store_flags + ["--max-state-memory-bytes", str(budget)])
        stub = self.stub(server.target)

        # capacity + 2 sessions while the store works: two of them leave memory (they
        # are in the store), the last `capacity` stay resident.
        tokens = {}
        order = []
        for i in range(capacity + 2):
            prefix = ("SESSION %d:\n" % i).encode()
            info = stub.CreateSession(pb.CreateSessionRequest(prefix=prefix),
                                      timeout=RPC_TIMEOUT_S)
            self.assertEqual(info.state_bytes, state_bytes)
            tokens[info.session_id] = len(prefix)
            order.append(info.session_id)
        listed = self.list_ids(stub)
        self.assertEqual(set(listed), set(order), "sessions beyond the memory budget")
        resident = [sid for sid in order if listed[sid].resident]
        if not broken("memory-store"):
            self.assertEqual(resident, order[2:], "the least recently used left memory")

        # The store fails from here on: EFBIG for any file over 1000 bytes (a session
        # file holds its state, state_bytes).
        original = resource.prlimit(server.pid, resource.RLIMIT_FSIZE)
        if not broken("store-works"):
            resource.prlimit(server.pid, resource.RLIMIT_FSIZE, (1000, original[1]))
        try:
            # A Generate on each resident session: its tokens are streamed, the write
            # fails, the session keeps them in memory, unsaved.
            for sid in resident:
                prompt = b" Speak."
                streamed = []
                try:
                    for message in stub.Generate(pb.GenerateRequest(
                            session_id=sid, prompt=prompt, max_tokens=5, sampling=greedy()),
                            timeout=RPC_TIMEOUT_S):
                        streamed.extend(message.token_ids)
                    error = None
                except grpc.RpcError as e:
                    error = e
                if not (broken("memory-store") or broken("store-works")):
                    self.assertIsNotNone(error, "the Generate's store write did not fail")
                    self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE,
                                     error.details())
                    self.assertIn("session store failed", error.details())
                self.assertEqual(len(streamed), 5)
                tokens[sid] += len(prompt) + 5

            # Memory is needed: a new session, a fork, and a Generate on a session that
            # is only in the store (it needs a slot to come back). The count is of idle
            # sessions: a fork's source is held by the fork.
            refusals = {}
            for what, idle, call in (
                    ("CreateSession", capacity, lambda: stub.CreateSession(
                        pb.CreateSessionRequest(prefix=b"NEWCOMER:\n"),
                        timeout=RPC_TIMEOUT_S)),
                    ("ForkSession", capacity - 1, lambda: stub.ForkSession(
                        pb.ForkSessionRequest(session_id=resident[0]),
                        timeout=RPC_TIMEOUT_S)),
                    ("Generate", capacity, lambda: list(stub.Generate(pb.GenerateRequest(
                        session_id=order[0], prompt=b"x", max_tokens=1, sampling=greedy()),
                        timeout=RPC_TIMEOUT_S)))):
                error = rpc_error(call)
                refusals[what] = error
                self.assertEqual(error.code(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "%s: %s %s" % (what, error.code(), error.details()))
                self.assertIn("--max-state-memory-bytes=%d" % budget, error.details(), what)
                match = re.search(r"(\d+) idle sessions must stay in memory because the "
                                  r"session store failed", error.details())
                self.assertIsNotNone(match, "%s: %s" % (what, error.details()))
                self.assertEqual(int(match.group(1)), idle, error.details())
            print("\nrefused with: %s" % refusals["CreateSession"].details())

            # No session was deleted to make room: every acknowledged one is there with
            # its tokens, the unsaved ones still in memory.
            listed = self.list_ids(stub)
            self.assertEqual(set(listed), set(order), "sessions after the refusals")
            for sid in order:
                info = stub.GetSession(pb.GetSessionRequest(session_id=sid),
                                       timeout=RPC_TIMEOUT_S)
                self.assertEqual(info.tokens, tokens[sid], sid)
                self.assertFalse(info.busy)
            for sid in resident:
                self.assertTrue(listed[sid].resident, "an unsaved session left memory")
        finally:
            if server.process.poll() is None:
                resource.prlimit(server.pid, resource.RLIMIT_FSIZE, original)

        # The store works again: the housekeeping retry (every second) saves the
        # sessions, after which one of them can leave memory for a new session.
        def created():
            try:
                return stub.CreateSession(pb.CreateSessionRequest(prefix=b"LATE:\n"),
                                          timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as error:
                self.assertEqual(error.code(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 error.details())
                return None
        late = wait_for(created, "a CreateSession to work after the store recovered")
        tokens[late.session_id] = len(b"LATE:\n")
        self.assertEqual(set(self.list_ids(stub)), set(tokens))
        self.assertEqual(server.stop(), 0)

        # And they are all in the store, with the tokens of their failed-write Generates.
        again = self.start(["--session-store", "dir:" + store])
        stub = self.stub(again.target)
        wait_for(lambda: re.search(r"found \d+ sessions", again.text()), "the index")
        for sid, count in tokens.items():
            info = stub.GetSession(pb.GetSessionRequest(session_id=sid),
                                   timeout=RPC_TIMEOUT_S)
            self.assertEqual(info.tokens, count, "%s after the restart" % sid)

    # ------------------------------------------------------------ item 7: fwctl keys
    def keyed_server(self, extra=(), **kwargs):
        acme = KEY_C if broken("server-other-key") else KEY_A
        keys = self.write("api-keys", key_line(acme, "acme") + key_line(KEY_B, "beta")
                          + "x509-cn:batch.internal tenant=batch\n")
        return self.start(["--api-keys-file", keys, *extra], **kwargs)

    def test_fwctl_key_sources(self):
        server = self.keyed_server()
        target = server.target
        key_file = self.write("acme.key", KEY_A + "\nsecond line is not the key\n", 0o600)
        beta_file = self.write("beta.key", KEY_B + "\n", 0o600)
        wrong_file = self.write("wrong.key", WRONG_KEY + "\n", 0o600)

        # Health needs no key (docs/security.md: probes stay open).
        self.assertEqual(self.fwctl_ok("health", target=target), "SERVING\n")
        # No key, and each source with a wrong key: exit 1, UNAUTHENTICATED.
        for args, env in ((("session", "list"), None),
                          (("--token", WRONG_KEY, "session", "list"), None),
                          (("--api-key-file", wrong_file, "session", "list"), None),
                          (("session", "list"), {"FWSERVE_API_KEY": WRONG_KEY}),
                          (("generate", "--max-tokens", "2", "x"), None)):
            self.fwctl_fails("UNAUTHENTICATED", *args, target=target, env=env)

        # Each source with acme's key acts as acme.
        created = {}
        for source, args, env in (
                ("--api-key-file", ("--api-key-file", key_file), None),
                ("FWSERVE_API_KEY", (), {"FWSERVE_API_KEY": KEY_A}),
                ("--token", ("--token", KEY_A), None)):
            out = self.fwctl_ok(*args, "session", "create", "--prefix", source,
                                target=target, env=env)
            created[source] = out.strip()
            self.assertRegex(created[source], r"^[0-9a-f]{32}$")
            out = self.fwctl_ok(*args, "generate", "--session", created[source],
                                "--max-tokens", "3", "--seed", "1", target=target, env=env)
        # acme sees its three sessions, beta none of them.
        acme = self.list_ids(self.stub(target), KEY_A)
        self.assertEqual(set(acme), set(created.values()))
        for source, sid in created.items():
            self.assertEqual(acme[sid].tokens, len(source) + 3, source)
        listing = self.fwctl_ok("--api-key-file", beta_file, "session", "list",
                                target=target)
        for sid in created.values():
            self.assertNotIn(sid, listing)
        listing = self.fwctl_ok("--api-key-file", key_file, "session", "list", target=target)
        for sid in created.values():
            self.assertIn(sid, listing)

        # Precedence. Documented (docs/client.md, fwctl --help): $FWSERVE_API_KEY is
        # the default when --api-key-file is not given. Not in the docs, from
        # client/fwctl/options.{h,cc}: --token also overrides the variable, and
        # --api-key-file wins over --token.
        sid = created["--token"]
        for args, env, wins in (
                (("--api-key-file", key_file), {"FWSERVE_API_KEY": WRONG_KEY}, "acme"),
                (("--token", KEY_A), {"FWSERVE_API_KEY": KEY_B}, "acme"),
                (("--token", KEY_B), {"FWSERVE_API_KEY": KEY_A}, "beta"),
                (("--api-key-file", key_file, "--token", KEY_B), None, "acme"),
                (("--token", WRONG_KEY, "--api-key-file", key_file), None, "acme"),
                (("--api-key-file", beta_file, "--token", KEY_A), None, "beta")):
            code, out, err = self.fwctl(*args, "session", "get", sid, target=target, env=env)
            if wins == "acme":
                self.assertEqual(code, 0, "%s %s: %s" % (args, env, err))
            else:  # beta's view: acme's session does not exist
                self.assertEqual(code, 1, "%s %s: %s" % (args, env, out))
                self.assertIn("NOT_FOUND", err)

    def test_fwctl_unreadable_key_file_exits_1(self):
        # docs/client.md "Exit codes" (and fwctl --help): 1 = "the server answered an
        # error ... or a local file could not be read or written"; 2 = usage error. An
        # unreadable --tls-ca is exit 1 (tests/client/fwctl_test.py); so must an
        # unreadable --api-key-file be. Nothing is sent (no server is needed).
        missing = self.path("missing.key")
        code, _, err = self.fwctl("--tls-ca", missing, "session", "list",
                                  target="127.0.0.1:1")
        self.assertEqual(code, 1, "--tls-ca: " + err)
        code, _, err = self.fwctl("--api-key-file", missing, "session", "list",
                                  target="127.0.0.1:1")
        self.assertIn("cannot read", err)
        self.assertEqual(code, 1, "--api-key-file: exit %d: %s" % (code, err))
        empty = self.write("empty.key", "\nKEY-ON-THE-SECOND-LINE\n", 0o600)
        code, _, err = self.fwctl("--api-key-file", empty, "session", "list",
                                  target="127.0.0.1:1")
        self.assertNotEqual(code, 0, err)
        self.assertIn("first line is empty", err)

    def test_fwctl_plaintext_key_refused_off_loopback(self):
        ip = CERTS["ip"]
        if ip is None:
            self.skipTest("this machine has no IPv4 address outside 127.0.0.0/8")
        server = self.keyed_server(["--tls-cert-file", CERTS["server"], "--tls-key-file",
                                    CERTS["server-key"]], host="0.0.0.0")
        plain = self.keyed_server(host="0.0.0.0")
        self.assertNotEqual(server.port, plain.port)
        key_file = self.write("acme.key", KEY_A + "\n", 0o600)
        remote = "%s:%d" % ("127.0.0.1" if broken("loopback-target") else ip, plain.port)

        def calls():
            return plain.text().count(" request id=")

        # A key over plaintext to a non-loopback address: refused before anything is sent.
        for args, env in ((("--api-key-file", key_file), None),
                          (("--token", KEY_A), None),
                          ((), {"FWSERVE_API_KEY": KEY_A})):
            before = calls()
            code, out, err = self.fwctl(*args, "session", "list", target=remote, env=env)
            self.assertEqual(code, 1, "%s %s: exit %d %s%s" % (args, env, code, out, err))
            self.assertIn("refusing to send the API key without TLS", err)
            self.assertEqual(calls(), before, "the refused call reached the server")
        # Told to (--insecure): it goes, and the key works.
        out = self.fwctl_ok("--insecure", "--api-key-file", key_file, "session", "create",
                            target=remote)
        sid = out.strip()
        self.assertIn(sid, self.fwctl_ok("--insecure", "--api-key-file", key_file, "session",
                                         "list", target=remote))
        # Loopback targets are allowed without --insecure.
        for target in ("127.0.0.1:%d" % plain.port, "localhost:%d" % plain.port):
            self.assertIn(sid, self.fwctl_ok("--api-key-file", key_file, "session", "list",
                                             target=target))
        # No key: nothing to protect, the server answers (UNAUTHENTICATED).
        self.fwctl_fails("UNAUTHENTICATED", "session", "list", target=remote)
        # Over TLS to the non-loopback address the key goes without --insecure.
        out = self.fwctl_ok("--tls-ca", CERTS["ca"], "--api-key-file", key_file, "session",
                            "create", target="%s:%d" % (ip, server.port))
        self.assertRegex(out.strip(), r"^[0-9a-f]{32}$")

    def test_fwctl_tls_and_mutual_tls(self):
        tls = self.keyed_server(["--tls-cert-file", CERTS["server"], "--tls-key-file",
                                 CERTS["server-key"]])
        mtls = self.keyed_server(["--tls-cert-file", CERTS["server"], "--tls-key-file",
                                  CERTS["server-key"], "--tls-client-ca-file", CERTS["ca"]])
        ca = CERTS["other-ca"] if broken("fwctl-wrong-ca") else CERTS["ca"]
        key_file = self.write("acme.key", KEY_A + "\n", 0o600)

        # TLS: the right CA works; plaintext, the system roots and another CA do not.
        # First a Health call, which the client retries: on a loaded machine the very
        # first handshake with a new server can fail ("handshaker shutdown"), and a
        # session create is never retried (docs/client.md).
        self.fwctl_ok("--tls-ca", ca, "--api-key-file", key_file, "health", target=tls.target)
        sid = self.fwctl_ok("--tls-ca", ca, "--api-key-file", key_file, "session", "create",
                            "--prefix", "TLS", target=tls.target).strip()
        self.assertIn(sid, self.fwctl_ok("--tls-ca", ca, "--api-key-file", key_file,
                                         "session", "list", target=tls.target))
        self.fwctl_fails("UNAUTHENTICATED", "--tls-ca", ca, "--token", WRONG_KEY, "session",
                         "list", target=tls.target)
        for args in ((), ("--tls",), ("--tls-ca", CERTS["other-ca"])):
            self.fwctl_fails("UNAVAILABLE", "--retries", "0", *args, "--api-key-file",
                             key_file, "session", "list", target=tls.target)

        # Mutual TLS: the client certificate (CN batch.internal) is tenant batch.
        client = ("--tls-ca", ca, "--tls-cert", CERTS["client"], "--tls-key",
                  CERTS["client-key"])
        self.fwctl_ok(*client, "health", target=mtls.target)
        batch_sid = self.fwctl_ok(*client, "session", "create", "--prefix", "batch",
                                  target=mtls.target).strip()
        self.assertRegex(batch_sid, r"^[0-9a-f]{32}$")
        self.assertIn(batch_sid, self.fwctl_ok(*client, "session", "list",
                                               target=mtls.target))
        self.fwctl_ok(*client, "generate", "--session", batch_sid, "--max-tokens", "2",
                      target=mtls.target)
        # A bearer key is judged alone: acme's key with batch's certificate is acme...
        acme_sid = self.fwctl_ok(*client, "--api-key-file", key_file, "session", "create",
                                 target=mtls.target).strip()
        acme_view = self.fwctl_ok(*client, "--api-key-file", key_file, "session", "list",
                                  target=mtls.target)
        self.assertIn(acme_sid, acme_view)
        self.assertNotIn(batch_sid, acme_view)
        self.assertNotIn(acme_sid, self.fwctl_ok(*client, "session", "list",
                                                 target=mtls.target))
        # ... and a wrong key is refused although the certificate maps to a tenant.
        self.fwctl_fails("UNAUTHENTICATED", *client, "--token", WRONG_KEY, "session", "list",
                         target=mtls.target)
        # A certificate the CA signed but no line maps: no tenant.
        self.fwctl_fails("UNAUTHENTICATED", "--tls-ca", ca, "--tls-cert", CERTS["nobody"],
                         "--tls-key", CERTS["nobody-key"], "session", "list",
                         target=mtls.target)
        # No client certificate, or one another CA signed: the handshake fails.
        for args in (("--tls-ca", ca, "--api-key-file", key_file),
                     ("--tls-ca", ca, "--tls-cert", CERTS["other-client"], "--tls-key",
                      CERTS["other-client-key"])):
            self.fwctl_fails("UNAVAILABLE", "--retries", "0", *args, "session", "list",
                             target=mtls.target)

    def doc_block(self, relative, needle):
        with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
            text = f.read()
        blocks = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if needle in b]
        self.assertEqual(len(blocks), 1, "%s: the block with %r" % (relative, needle))
        return blocks[0]

    def run_quickstart(self, name, block, variant):
        """Runs a doc block in a fresh directory: build/server/fwserve and
        build/client/fwctl are the binaries under test, the server gets a free port
        (and no metrics port), and fwctl finds it through $FWSERVE_TARGET. variant
        "env": the fwctl line with FWSERVE_API_KEY=$key instead of --api-key-file my.key.
        Returns (bash process, its work directory, the server's pid, the output so far).
        The server keeps running until the caller ends it."""
        work = self.path(name)
        os.makedirs(work)
        port = free_port()
        lines = []
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line)
            if line.startswith("build/server/fwserve"):
                if broken("quickstart-no-keys"):
                    line = line.replace("--api-keys-file api-keys", "")
                line = line.replace("build/server/fwserve",
                                    '"$FWSERVE" --listen 127.0.0.1:%d --metrics-listen ""'
                                    % port, 1)
                self.assertTrue(line.rstrip().endswith("&"), line)
                line = line.rstrip()[:-1] + ">fwserve.log 2>&1 &"
                lines += [line, "echo $! > fwserve.pid",
                          'for i in $(seq 600); do "$FWCTL" --retries 0 health >/dev/null '
                          '2>&1 && break; kill -0 "$(cat fwserve.pid)"; sleep 0.1; done']
                continue
            if line.startswith("build/client/fwctl"):
                line = line.replace("build/client/fwctl", '"$FWCTL"', 1)
                if variant == "env":
                    self.assertIn("--api-key-file my.key", line)
                    line = "FWSERVE_API_KEY=$key " + line.replace("--api-key-file my.key ", "")
                line += " >fwctl.out 2>fwctl.err"
            lines.append(line)
        script = "set -e\n" + "\n".join(lines) + "\necho QUICKSTART-DONE\nwait\n"
        with open(os.path.join(work, "quickstart.sh"), "w") as f:
            f.write(script)
        env = child_env()
        env.update(FWSERVE=ARGS.fwserve, FWCTL=ARGS.fwctl,
                   FWSERVE_TARGET="127.0.0.1:%d" % port)
        bash = subprocess.Popen(["bash", "quickstart.sh"], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_child_setup)
        self.calls.append(ProcessGroup(bash))
        out = b""
        while b"QUICKSTART-DONE" not in out:
            line = bash.stdout.readline()
            if not line:
                break
            out += line
        text = out.decode(errors="replace")
        if "QUICKSTART-DONE" not in text:
            logs = ""
            for log in ("fwctl.err", "fwserve.log"):
                if os.path.exists(os.path.join(work, log)):
                    with open(os.path.join(work, log), errors="replace") as f:
                        logs += "--- %s:\n%s\n" % (log, f.read()[-2000:])
            self.fail("the %s block failed:\n%s\n%s--- script:\n%s"
                      % (name, text, logs, script))
        with open(os.path.join(work, "fwserve.pid")) as f:
            pid = int(f.read())
        return bash, work, pid, port

    def test_readme_keyed_quickstart(self):
        for doc, needle in (("README.md", "--api-keys-file api-keys &"),
                            ("docs/security.md", "--api-keys-file api-keys &")):
            block = self.doc_block(doc, needle)
            for variant in ("file", "env"):
                name = "%s-%s" % (os.path.basename(doc).split(".")[0], variant)
                bash, work, pid, port = self.run_quickstart(name, block, variant)
                try:
                    with open(os.path.join(work, "fwctl.err")) as f:
                        err = f.read()
                    with open(os.path.join(work, "fwctl.out")) as f:
                        out = f.read()
                    self.assertIn("[finish: length; prompt 6, generated 128", err, name)
                    self.assertTrue(out, "%s: no generated text" % name)
                    with open(os.path.join(work, "my.key")) as f:
                        key = f.read().strip()
                    target = "127.0.0.1:%d" % port
                    # The same server refuses a call without the key, and a wrong key.
                    self.fwctl_fails("UNAUTHENTICATED", "generate", "--max-tokens", "2",
                                     "ROMEO:", target=target)
                    self.fwctl_fails("UNAUTHENTICATED", "--token", key[::-1], "generate",
                                     "--max-tokens", "2", "ROMEO:", target=target)
                    self.fwctl_ok("--token", key, "session", "list", target=target)
                finally:
                    os.kill(pid, signal.SIGTERM)
                    try:
                        code = bash.wait(timeout=HANG_S)
                    except subprocess.TimeoutExpired:
                        os.killpg(bash.pid, signal.SIGKILL)
                        raise
                    bash.stdout.close()
                print("\n%s: %s" % (name, err.strip().splitlines()[-1]))
                self.assertEqual(code, 0, "%s: the server's exit status" % name)

    # ------------------------------------------------------------------ item 8: flags
    def test_tls_flags(self):
        tls_flags = ([] if broken("plaintext-server") else
                     ["--tls-cert-file", CERTS["server"], "--tls-key-file",
                      CERTS["server-key"]])
        server = self.start(tls_flags)
        ca = grpc.ssl_channel_credentials(root_certificates=read(CERTS["ca"]))
        other = grpc.ssl_channel_credentials(root_certificates=read(CERTS["other-ca"]))
        request = pb.ListSessionsRequest()
        self.stub(server.target, ca).ListSessions(request, timeout=RPC_TIMEOUT_S)
        for what, stub in (("plaintext", self.stub(server.target)),
                           ("another CA", self.stub(server.target, other))):
            error = rpc_error(lambda: stub.ListSessions(request, timeout=RPC_TIMEOUT_S))
            self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE, what)

        # Mutual TLS, on all interfaces and without keys: no open-listen warning.
        mtls = self.start(tls_flags + ["--tls-client-ca-file", CERTS["ca"]], host="0.0.0.0")
        self.assertNotIn("reachable from other machines", mtls.text())
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=read(CERTS["ca"]), private_key=read(CERTS["client-key"]),
            certificate_chain=read(CERTS["client"]))
        foreign_cert = grpc.ssl_channel_credentials(
            root_certificates=read(CERTS["ca"]), private_key=read(CERTS["other-client-key"]),
            certificate_chain=read(CERTS["other-client"]))
        stub = self.stub(mtls.target, with_cert)
        session = stub.CreateSession(pb.CreateSessionRequest(prefix=b"mTLS"),
                                     timeout=RPC_TIMEOUT_S)
        self.assertIn(session.session_id, self.list_ids(stub))
        for what, credentials in (("no client certificate", ca),
                                  ("a certificate of another CA", foreign_cert)):
            stub = self.stub(mtls.target, credentials)
            error = rpc_error(lambda: stub.ListSessions(request, timeout=RPC_TIMEOUT_S))
            self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE, what)

        # Start-up checks name the flags.
        self.assert_refused_at_start(["--tls-cert-file", CERTS["server"]],
                                     "--tls-cert-file and --tls-key-file go together")
        self.assert_refused_at_start(["--tls-key-file", CERTS["server-key"]],
                                     "--tls-cert-file and --tls-key-file go together")
        self.assert_refused_at_start(["--tls-client-ca-file", CERTS["ca"]],
                                     "--tls-client-ca-file needs --tls-cert-file")
        for flag in ("--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"):
            extra = {"--tls-cert-file": CERTS["server"], "--tls-key-file": CERTS["server-key"]}
            extra[flag] = self.path("missing.pem")
            self.assert_refused_at_start([x for kv in extra.items() for x in kv], flag + ":")

    def test_session_key_file_seals_exports(self):
        key1 = self.write("session-1.key", SESSION_KEY_1, 0o600)
        key1_nl = self.write("session-1-newline.key", SESSION_KEY_1 + b" \n", 0o600)
        key2 = self.write("session-2.key", SESSION_KEY_2, 0o600)
        exporter = self.start(["--session-key-file", key1, "--http-listen", "127.0.0.1:0"])
        importer = self.start(["--session-key-file",
                                key2 if broken("session-key-differs") else key1_nl])
        unkeyed = self.start([])
        other = self.start(["--session-key-file", key2])
        stubs = {s: self.stub(s.target) for s in (exporter, importer, unkeyed, other)}

        source = stubs[exporter].CreateSession(pb.CreateSessionRequest(prefix=b"HAMLET:\n"),
                                               timeout=RPC_TIMEOUT_S)
        list(stubs[exporter].Generate(pb.GenerateRequest(
            session_id=source.session_id, prompt=b"To be", max_tokens=20, sampling=greedy()),
            timeout=RPC_TIMEOUT_S))
        blob = stubs[exporter].ExportSession(pb.ExportSessionRequest(
            session_id=source.session_id), timeout=RPC_TIMEOUT_S).blob
        # FWSHMAC1 and the HMAC-SHA-256 of the blob before them, keyed with the file.
        self.assertEqual(blob[-40:-32], b"FWSHMAC1")
        self.assertEqual(blob[-32:], hmac.new(SESSION_KEY_1, blob[:-40],
                                              hashlib.sha256).digest())

        imported = stubs[importer].ImportSession(pb.ImportSessionRequest(blob=blob),
                                                 timeout=RPC_TIMEOUT_S)
        self.assertEqual(imported.tokens, 8 + 5 + 20)
        continuations = []
        for stub, sid in ((stubs[exporter], source.session_id),
                          (stubs[importer], imported.session_id)):
            tokens = []
            for message in stub.Generate(pb.GenerateRequest(
                    session_id=sid, prompt=b"\n", max_tokens=30, sampling=greedy()),
                    timeout=RPC_TIMEOUT_S):
                tokens.extend(message.token_ids)
            continuations.append(tokens)
        self.assertEqual(continuations[0], continuations[1], "the import continues alike")

        def refused(stub, data, what):
            error = rpc_error(lambda: stub.ImportSession(pb.ImportSessionRequest(blob=data),
                                                         timeout=RPC_TIMEOUT_S))
            self.assertEqual(error.code(), grpc.StatusCode.INVALID_ARGUMENT,
                             "%s: %s" % (what, error.details()))
            return error.details()

        details = refused(stubs[other], blob, "a server with another key")
        self.assertIn("signature does not match", details)
        refused(stubs[unkeyed], blob, "a server without --session-key-file")
        for position in (0, len(blob) // 2, len(blob) - 41, len(blob) - 1):
            changed = bytearray(blob)
            changed[position] ^= 0x01
            self.assertIn("signature does not match",
                          refused(stubs[importer], bytes(changed), "byte %d changed" % position))
        refused(stubs[importer], blob[:-1], "truncated")
        # An unsigned blob (a server without the flag exports one) is refused by a keyed
        # server, and imports where no key is set.
        plain = stubs[unkeyed].CreateSession(pb.CreateSessionRequest(prefix=b"ROMEO:"),
                                             timeout=RPC_TIMEOUT_S)
        unsigned = stubs[unkeyed].ExportSession(pb.ExportSessionRequest(
            session_id=plain.session_id), timeout=RPC_TIMEOUT_S).blob
        self.assertNotIn(b"FWSHMAC1", unsigned[-64:])
        refused(stubs[importer], unsigned, "an unsigned blob")
        self.assertEqual(stubs[unkeyed].ImportSession(pb.ImportSessionRequest(blob=unsigned),
                                                      timeout=RPC_TIMEOUT_S).tokens, 6)
        # The HTTP export (docs/http.md) is signed with the same key.
        http = urllib.request.urlopen(
            "http://127.0.0.1:%d/fwserve/v1/sessions/%s/export"
            % (exporter.http_port(), source.session_id), timeout=RPC_TIMEOUT_S).read()
        self.assertEqual(http[-40:-32], b"FWSHMAC1")
        self.assertEqual(stubs[importer].ImportSession(pb.ImportSessionRequest(blob=http),
                                                       timeout=RPC_TIMEOUT_S).tokens,
                         8 + 5 + 20 + 1 + 30)
        refused(stubs[other], http, "an HTTP export on a server with another key")
        # The key must be at least 32 bytes; a missing file is refused too.
        short = self.write("short.key", b"x" * 31 + b"\n", 0o600)
        self.assert_refused_at_start(["--session-key-file", short], "--session-key-file",
                                     "at least 32")
        self.assert_refused_at_start(["--session-key-file", self.path("none.key")],
                                     "--session-key-file")

    def test_session_dir_alias(self):
        store = self.path("sessions")  # created by the server
        flags = (["--session-store", "memory"] if broken("memory-not-dir")
                 else ["--session-dir", store])
        server = self.start(flags)
        stub = self.stub(server.target)
        info = stub.CreateSession(pb.CreateSessionRequest(prefix=b"KING LEAR:\n"),
                                  timeout=RPC_TIMEOUT_S)
        list(stub.Generate(pb.GenerateRequest(session_id=info.session_id, prompt=b"Speak",
                                              max_tokens=7, sampling=greedy()),
                           timeout=RPC_TIMEOUT_S))
        # docs/sessions.md: PATH/<id>.fwstate, files 0600, the directory 0700.
        path = os.path.join(store, info.session_id + ".fwstate")
        self.assertTrue(os.path.isfile(path), "no %s" % path)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(store).st_mode), 0o700)
        self.assertEqual(server.stop(), 0)
        # The same directory through --session-store dir: has the session.
        again = self.start(["--session-store", "dir:" + store])
        stub = self.stub(again.target)
        got = wait_for(lambda: self.list_ids(stub).get(info.session_id),
                       "the session to be indexed")
        self.assertEqual(got.tokens, 11 + 5 + 7)
        # A second server on the directory through the alias: the lock holds.
        self.assert_refused_at_start(["--session-dir", store], "another fwserve process")
        self.assert_refused_at_start(["--session-dir", store, "--session-store",
                                      "dir:" + self.path("x")], "--session-dir")

    def test_session_store_threads(self):
        def store_threads(server):
            return threads_named(server.pid, "fwserve-store")

        flags = [] if broken("store-threads-default") else ["--session-store-threads", "5"]
        server = self.start(flags + ["--session-store", "dir:" + self.path("store")])
        stub = self.stub(server.target)
        for i in range(4):  # the store works with them
            stub.CreateSession(pb.CreateSessionRequest(prefix=b"x" * (i + 1)),
                               timeout=RPC_TIMEOUT_S)
        self.assertEqual(len(os.listdir(self.path("store"))) - 1, 4)  # and .lock
        self.assertEqual(store_threads(server), 5)
        default = self.start(["--session-store", "dir:" + self.path("store2")])
        self.assertEqual(store_threads(default), 2, "the documented default")
        self.assert_refused_at_start(["--session-store-threads", "0"],
                                     "--session-store-threads must be > 0")
        self.assert_refused_at_start(["--session-store-threads", "two"],
                                     "session_store_threads")

    def test_prefill_threads(self):
        # The prefill thread's OpenMP workers take its name ("fwserve-prefill") and stay
        # once started. A 300-byte prefix is a 256-token chunk and a 45-token one; the
        # chunk's projections split into as many tasks as allowed (32 rows at least).
        def prefill_threads(flags):
            server = self.start(flags)
            self.stub(server.target).CreateSession(pb.CreateSessionRequest(prefix=b"x" * 300),
                                                   timeout=RPC_TIMEOUT_S)
            return threads_named(server.pid, "fwserve-prefill")

        flags = [] if broken("prefill-threads-default") else ["--prefill-threads", "3"]
        self.assertEqual(prefill_threads(flags), 3)
        self.assertEqual(prefill_threads(["--prefill-threads", "1"]), 1)
        self.assertEqual(prefill_threads([]), physical_cores_of_affinity(),
                         "the documented default: the physical cores this process may run on")
        self.assert_refused_at_start(["--prefill-threads", "-1"],
                                     "--prefill-threads must be >= 0, got -1")
        self.assert_refused_at_start(["--prefill-threads", "two"], "prefill_threads")

    def test_batch_wait(self):
        flags = [] if broken("batch-wait-default") else ["--batch-wait", "1h"]
        server = self.start(flags)
        # A stream whose client reads nothing: a 1-byte HTTP/2 window, no BDP growth, so
        # its writes stay in flight once it is --decode-lookahead tokens ahead.
        stalled = self.stub(server.target, options=[("grpc.http2.lookahead_bytes", 1),
                                                    ("grpc.http2.bdp_probe", 0)])
        blocker = stalled.Generate(pb.GenerateRequest(prompt=b"ROMEO:", max_tokens=100000),
                                   timeout=600)
        self.calls.append(blocker)
        next(blocker)  # it has started
        # Another stream, read as fast as it comes: its decode steps wait up to
        # --batch-wait for the blocked stream, so it stalls.
        reader = self.stream(self.stub(server.target), prompt=b"JULIET:", max_tokens=200,
                             sampling=greedy())
        check(reader.first.wait(HANG_S), "the second stream did not start")
        time.sleep(HOLD_S)
        seen = len(reader.tokens)
        print("\nwith the other stream blocked: %d of 200 tokens in %.0f s" % (seen, HOLD_S))
        self.assertFalse(reader.done.is_set(), "the stream did not wait for the blocked one "
                         "(%d tokens, error %s)" % (seen, reader.error))
        self.assertLess(seen, 200)
        # The blocked stream ends: the other goes on to its end.
        blocker.cancel()
        check(reader.done.wait(HANG_S), "the stream did not go on")
        self.assertIsNone(reader.error)
        self.assertEqual(len(reader.tokens), 200)
        self.assert_refused_at_start(["--batch-wait", "-1ms"],
                                     "--batch-wait must not be negative")
        self.assert_refused_at_start(["--batch-wait", "soon"], "batch_wait")

    def test_max_streams_per_connection(self):
        flags = ([] if broken("streams-default") else
                 ["--max-streams-per-connection", "2"])
        server = self.start(flags)
        # One connection whose two streams stay open (the client reads nothing of them).
        stub = self.stub(server.target, options=[("grpc.http2.lookahead_bytes", 1),
                                                 ("grpc.http2.bdp_probe", 0)])
        streams = []
        for prompt in (b"ROMEO:", b"JULIET:"):
            call = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=100000),
                                 timeout=600)
            self.calls.append(call)
            next(call)
            streams.append(call)
        # A third call on that connection waits for a free stream...
        third = stub.ListSessions.future(pb.ListSessionsRequest(), timeout=600)
        self.calls.append(third)
        # ... while another connection is answered at once.
        self.stub(server.target).ListSessions(pb.ListSessionsRequest(), timeout=RPC_TIMEOUT_S)
        time.sleep(HOLD_S)
        self.assertFalse(third.done(), "a third call on a connection with 2 open streams "
                         "was not held: %s" % (third.exception() if third.done() else ""))
        self.assertEqual(server.text().count("method=ListSessions"), 1)
        streams[0].cancel()
        third.result(timeout=HANG_S)
        self.assert_refused_at_start(["--max-streams-per-connection", "0"],
                                     "--max-streams-per-connection must be >= 1")

    def test_grpc_memory_quota_bytes(self):
        flags = ([] if broken("quota-default") else
                 ["--grpc-memory-quota-bytes", str(8 * 1000 * 1000)])
        server = self.start(flags)
        stub = self.stub(server.target)
        big = pb.ImportSessionRequest(blob=b"\x00" * (16 << 20))
        error = rpc_error(lambda: stub.ImportSession(big, timeout=RPC_TIMEOUT_S))
        print("\n16 MiB request under an 8 MB quota: %s %s" % (error.code(), error.details()))
        self.assertEqual(error.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, error.details())
        # Small requests still work, on this connection and a new one.
        small = pb.ImportSessionRequest(blob=b"\x00" * 1000)
        for s in (stub, self.stub(server.target)):
            self.assertEqual(rpc_error(lambda: s.ImportSession(small, timeout=RPC_TIMEOUT_S))
                             .code(), grpc.StatusCode.INVALID_ARGUMENT)
            info = s.CreateSession(pb.CreateSessionRequest(prefix=b"x"), timeout=RPC_TIMEOUT_S)
            self.assertEqual(info.tokens, 1)
        # Without the flag (2 GiB), and with 0 (no bound), the same request is read and
        # judged on its contents.
        for flags in ([], ["--grpc-memory-quota-bytes", "0"]):
            stub = self.stub(self.start(flags).target)
            error = rpc_error(lambda: stub.ImportSession(big, timeout=RPC_TIMEOUT_S))
            self.assertEqual(error.code(), grpc.StatusCode.INVALID_ARGUMENT,
                             "%s: %s" % (flags, error.details()))
            self.assertIn("blob", error.details())
        self.assert_refused_at_start(["--grpc-memory-quota-bytes", "2GB"],
                                     "grpc_memory_quota_bytes")

    def test_log_level(self):
        def level(name):
            return "info" if broken("log-level-info") else name

        servers = {}
        for name in ("debug", "info"):
            servers[name] = self.start(["--log-level", level(name),
                                        "--http-listen", "127.0.0.1:0"])
        for name in ("warning", "error"):
            keys = self.write("keys-" + name, key_line(KEY_A, "acme"))
            servers[name] = self.start(["--log-level", level(name), "--api-keys-file", keys],
                                       port=free_port())
        for name in ("debug", "info"):
            port = servers[name].http_port()
            self.assertEqual(urllib.request.urlopen("http://127.0.0.1:%d/health" % port,
                                                    timeout=RPC_TIMEOUT_S).status, 200)
            self.stub(servers[name].target).ListSessions(pb.ListSessionsRequest(),
                                                         timeout=RPC_TIMEOUT_S)
        for name in ("warning", "error"):
            stub = self.stub(servers[name].target)
            stub.ListSessions(pb.ListSessionsRequest(), metadata=auth(KEY_A),
                              timeout=RPC_TIMEOUT_S)
            self.assertEqual(rpc_error(lambda: stub.ListSessions(
                pb.ListSessionsRequest(), timeout=RPC_TIMEOUT_S)).code(),
                grpc.StatusCode.UNAUTHENTICATED)
            # A key file with an error and SIGHUP: logged at ERROR, the keys kept.
            self.write("keys-" + name, "this is not a key line\n")
            servers[name].process.send_signal(signal.SIGHUP)
            wait_for(lambda: "keeping the previous API keys" in servers[name].text(),
                     "the SIGHUP error line")
            stub.ListSessions(pb.ListSessionsRequest(), metadata=auth(KEY_A),
                              timeout=RPC_TIMEOUT_S)
        for server in servers.values():  # every line written and read
            self.assertEqual(server.stop(), 0)

        def lines(name, levels):
            return [line for line in servers[name].text().splitlines()
                    if re.match(r"^\S+Z (%s) " % levels, line)]

        probe = 'http request route="GET /health"'
        debug_probe = [line for line in lines("debug", "DEBUG") if probe in line]
        self.assertTrue(debug_probe, "--log-level debug: no DEBUG line for the probe")
        self.assertTrue([line for line in lines("debug", "INFO")
                         if "method=ListSessions" in line], "debug shows INFO lines too")
        self.assertFalse([line for line in servers["info"].text().splitlines()
                          if probe in line], "--log-level info: the probe is logged")
        self.assertFalse(lines("info", "DEBUG"), "--log-level info: DEBUG lines")
        self.assertTrue([line for line in lines("info", "INFO")
                         if "method=ListSessions" in line])
        self.assertFalse(lines("warning", "DEBUG|INFO"), "--log-level warning: INFO lines")
        self.assertTrue([line for line in lines("warning", "WARNING")
                         if "status=UNAUTHENTICATED" in line],
                        "--log-level warning: no WARNING line for the refused call")
        self.assertTrue([line for line in lines("warning", "ERROR")
                         if "keeping the previous API keys" in line])
        self.assertFalse(lines("error", "DEBUG|INFO|WARNING"),
                         "--log-level error: lines below ERROR")
        self.assertTrue([line for line in lines("error", "ERROR")
                         if "keeping the previous API keys" in line])
        self.assert_refused_at_start(["--log-level", "verbose"],
                                     "--log-level must be debug, info, warning or error")

    def test_message_size_cap(self):
        server = self.start([])
        stub = self.stub(server.target)
        cap = (32 << 20) if broken("cap-32mib") else CAP

        def request(size):
            """An ImportSession request of exactly `size` bytes on the wire."""
            blob_size = size - 5  # field tag + a 4-byte length varint (2^21..2^28)
            message = pb.ImportSessionRequest(blob=b"\x00" * blob_size)
            check(message.ByteSize() == size, "request size %d" % message.ByteSize())
            return message

        at = rpc_error(lambda: stub.ImportSession(request(cap), timeout=RPC_TIMEOUT_S))
        self.assertEqual(at.code(), grpc.StatusCode.INVALID_ARGUMENT,
                         "a %d-byte request: %s %s" % (cap, at.code(), at.details()))
        self.assertIn("blob", at.details())
        over = rpc_error(lambda: stub.ImportSession(request(cap + 1), timeout=RPC_TIMEOUT_S))
        print("\n%d bytes: %s; %d bytes: %s %s" % (cap, at.code(), cap + 1, over.code(),
                                                  over.details()))
        self.assertEqual(over.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, over.details())
        # The cap is per message, for every method: a Score of cap + 1 bytes too.
        error = rpc_error(lambda: stub.Score(pb.ScoreRequest(text=b"a" * (cap + 1)),
                                             timeout=RPC_TIMEOUT_S))
        self.assertEqual(error.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, error.details())
        # The server goes on.
        stub.CreateSession(pb.CreateSessionRequest(prefix=b"x"), timeout=RPC_TIMEOUT_S)


def main():
    global ARGS, grpc, pb, pb_grpc, CERTS
    ensure_grpc()
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--fwctl", required=True)
    parser.add_argument("--break", dest="break_", choices=sorted(BREAKS), default=None,
                        help="a deliberately wrong setup that must turn one test red")
    ARGS, rest = parser.parse_known_args()
    ARGS.fwserve, ARGS.fwctl = os.path.abspath(ARGS.fwserve), os.path.abspath(ARGS.fwctl)
    if ARGS.break_:
        print("promises_flags_test: deliberate break %s: %s" % (ARGS.break_,
                                                               BREAKS[ARGS.break_]))
    with tempfile.TemporaryDirectory() as tmp:
        grpc, pb, pb_grpc = load_stubs(ARGS.proto_dir, os.path.join(tmp, "stubs"), ARGS.protoc)
        os.makedirs(os.path.join(tmp, "certs"))
        CERTS = make_certs(os.path.join(tmp, "certs"))
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)

        def show_failure(test_id):
            for path in LOGS.get(test_id, []):
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        lines = [line for line in f.read().decode(errors="replace")
                                 .splitlines() if " INFO request id=" not in line]
                    sys.stderr.write("--- %s: %s (tail, without request lines)\n%s\n"
                                     % (test_id, os.path.basename(path),
                                        "\n".join(lines[-25:])))

        report_and_exit("promises_flags_test", program.result, WORK_DIRS, ARGS.keep,
                        show_failure)


if __name__ == "__main__":
    main()
