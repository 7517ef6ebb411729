#!/usr/bin/env python3
"""API keys on the real fwserve binary (--api-keys-file), with a Python gRPC client that
sends 'authorization: Bearer <key>' (docs/security.md):

  test_sighup_revokes_a_key    a key removed from the file and SIGHUP: refused by the
                               first call after the server logs the reload; a stream of
                               another key goes on to its end
  test_open_listen_warns       --listen on all interfaces without keys logs the warning;
                               with keys it does not
  test_log_lines_are_safe      a model name with a newline and 1 MB long does not forge or
                               bloat a log line; session ids show only 8 hex digits

Usage: api_keys_test.py --fwserve PATH --model DIR --proto-dir DIR [TEST ...]
Run it with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf).
"""
import argparse
import hashlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
import unittest

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import (add_server_arguments, start_server, stop_server,  # noqa: E402
                             wait_for)
from fwserve_stubs import ensure_grpc, load_stubs, stream_generate  # noqa: E402
from unittest_run import check, report_and_exit  # noqa: E402

ARGS = None
grpc = None
pb = None
pb_grpc = None
LOGS = {}
WORK_DIRS = []

# Deadlines only catch hangs; no outcome depends on how fast anything is.
RPC_TIMEOUT_S = 60.0
HANG_S = 60.0
# server/fwserve.cc logs one of these once it has handled a SIGHUP (after the new key
# table is in place).
SIGHUP_HANDLED = re.compile(rb"SIGHUP: (API keys re-read|keeping the previous API keys)"
                            rb"[^\n]*")

KEY_A = "acme-key-0123456789abcdef"
KEY_B = "beta-key-0123456789abcdef"


def key_line(key, tenant):
    return "sha256:%s tenant=%s\n" % (hashlib.sha256(key.encode()).hexdigest(), tenant)


def auth(key):
    return (("authorization", "Bearer " + key),)


class ApiKeysTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="fwserve-api-keys-")
        WORK_DIRS.append(self.work)
        self.keys = os.path.join(self.work, "api-keys")
        with open(self.keys, "w") as f:
            f.write(key_line(KEY_A, "acme") + key_line(KEY_B, "beta"))
        self.processes = []

    def tearDown(self):
        for process in self.processes:
            stop_server(process)

    def start(self, name, extra):
        log = os.path.join(self.work, name + ".log")
        LOGS.setdefault(self.id(), []).append(log)
        process, target = start_server(ARGS.fwserve, ARGS.model, log, extra)
        self.processes.append(process)
        channel = grpc.insecure_channel(target)
        return process, pb_grpc.FwserveStub(channel), log

    def test_sighup_revokes_a_key(self):
        process, stub, log = self.start("server", ["--api-keys-file", self.keys])
        # No key and a wrong key are refused; both keys work.
        for metadata in [(), auth("wrong")]:
            with self.assertRaises(grpc.RpcError) as refused:
                stub.ListSessions(pb.ListSessionsRequest(), metadata=metadata,
                                  timeout=RPC_TIMEOUT_S)
            check(refused.exception.code() == grpc.StatusCode.UNAUTHENTICATED,
                  "expected UNAUTHENTICATED, got %s" % refused.exception.code())
        stub.ListSessions(pb.ListSessionsRequest(), metadata=auth(KEY_A), timeout=RPC_TIMEOUT_S)
        session = stub.CreateSession(pb.CreateSessionRequest(prefix=b"ROMEO:"),
                                     metadata=auth(KEY_B), timeout=RPC_TIMEOUT_S)

        # A long stream of beta's, running across the reload.
        result = {}
        started = threading.Event()

        def stream():
            tokens = []
            try:
                for message in stub.Generate(
                        pb.GenerateRequest(session_id=session.session_id, prompt=b" ",
                                           max_tokens=3000,
                                           sampling=pb.SamplingParams(temperature=0.0)),
                        metadata=auth(KEY_B), timeout=120):
                    tokens.extend(message.token_ids)
                    started.set()
                    if message.HasField("usage"):
                        result["usage"] = message.usage
            except grpc.RpcError as error:
                result["error"] = error
            result["tokens"] = len(tokens)
            started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        check(started.wait(HANG_S), "beta's stream did not start")

        with open(self.keys, "w") as f:
            f.write(key_line(KEY_B, "beta"))  # acme's key revoked
        revoked_at = time.monotonic()
        process.send_signal(signal.SIGHUP)

        def sighup_line():
            with open(log, "rb") as f:
                return SIGHUP_HANDLED.search(f.read())

        # The event that decides: the server says it re-read the keys; the very next
        # call with the revoked key must be refused. (How long that took is printed for
        # information only; HANG_S only catches a server that never handles SIGHUP.)
        handled = wait_for(sighup_line, "the server's SIGHUP log line", HANG_S).group(0)
        reloaded_after = time.monotonic() - revoked_at
        check(handled.startswith(b"SIGHUP: API keys re-read: 1 tenants (beta)"),
              "the SIGHUP reload: %r" % handled)
        with self.assertRaises(grpc.RpcError) as refused:
            stub.ListSessions(pb.ListSessionsRequest(), metadata=auth(KEY_A),
                              timeout=RPC_TIMEOUT_S)
        check(refused.exception.code() == grpc.StatusCode.UNAUTHENTICATED,
              "the revoked key after the reload: expected UNAUTHENTICATED, got %s"
              % refused.exception.code())
        refused_after = time.monotonic() - revoked_at
        thread.join(120)
        print("\nkeys re-read %.3f s after SIGHUP, revoked key refused %.3f s after SIGHUP "
              "(information only); beta's stream: %s tokens"
              % (reloaded_after, refused_after, result.get("tokens")))
        check("error" not in result, "beta's stream failed: %s" % result.get("error"))
        check(result.get("usage") is not None and result["usage"].generated_tokens == 3000,
              "beta's stream did not run to its end: %s" % result)
        # The session stays beta's and holds the stream's tokens.
        info = stub.GetSession(pb.GetSessionRequest(session_id=session.session_id),
                               metadata=auth(KEY_B), timeout=RPC_TIMEOUT_S)
        check(info.tokens == 6 + 1 + 3000, "session has %d tokens" % info.tokens)

    def test_open_listen_warns(self):
        _, _, open_log = self.start("open", ["--listen", "0.0.0.0:0"])
        _, _, keyed_log = self.start("keyed", ["--listen", "0.0.0.0:0",
                                               "--api-keys-file", self.keys])
        with open(open_log, "rb") as f:
            check(b"reachable from other machines" in f.read(),
                  "no warning for a keyless server on 0.0.0.0")
        with open(keyed_log, "rb") as f:
            check(b"reachable from other machines" not in f.read(),
                  "a warning although --api-keys-file is set")

    def test_log_lines_are_safe(self):
        _, stub, log = self.start("server", ["--api-keys-file", self.keys])
        forged = "nomodel\n2026-01-01T00:00:00.000Z INFO forged line" + "x" * (1 << 20)
        with self.assertRaises(grpc.RpcError) as refused:
            stub.DescribeModel(pb.DescribeModelRequest(model=forged), metadata=auth(KEY_A),
                               timeout=RPC_TIMEOUT_S)
        check(refused.exception.code() == grpc.StatusCode.NOT_FOUND,
              "expected NOT_FOUND, got %s" % refused.exception.code())
        session = stub.CreateSession(pb.CreateSessionRequest(prefix=b"x"), metadata=auth(KEY_A),
                                     timeout=RPC_TIMEOUT_S)
        stub.GetSession(pb.GetSessionRequest(session_id=session.session_id),
                        metadata=auth(KEY_A), timeout=RPC_TIMEOUT_S)
        # The server writes its log asynchronously: wait (a bounded time) for the
        # GetSession line before reading the whole log.
        prefix = (session.session_id[:8] + "...").encode()
        deadline = time.time() + 10
        while True:
            with open(log, "rb") as f:
                text = f.read()
            if b"method=GetSession" in text or time.time() > deadline:
                break
            time.sleep(0.05)
        for line in text.splitlines():
            check(b"INFO forged line" not in line or b"\\x0a" in line,
                  "a forged log line: %r" % line[:200])
            check(len(line) < 8192, "a log line of %d bytes" % len(line))
        check(session.session_id.encode() not in text, "a whole session id in the log")
        check(prefix in text, "the session id's prefix is not in the log")


def main():
    global ARGS, grpc, pb, pb_grpc
    ensure_grpc()
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        grpc, pb, pb_grpc = load_stubs(ARGS.proto_dir, os.path.join(tmp, "stubs"), ARGS.protoc)
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)

        def show_failure(test_id):
            for path in LOGS.get(test_id, []):
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        tail = f.read().decode(errors="replace").splitlines()[-30:]
                    sys.stderr.write("--- %s: %s\n%s\n" % (test_id, os.path.basename(path),
                                                          "\n".join(tail)))

        report_and_exit("api_keys_test", program.result, WORK_DIRS, ARGS.keep, show_failure)


if __name__ == "__main__":
    main()
