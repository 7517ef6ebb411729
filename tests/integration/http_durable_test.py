#!/usr/bin/env python3
"""`previous_response_id` continues exactly across a restart (dir: store) and across
replicas (redis://), on the HTTP API of the real fwserve binary (docs/http.md,
POST /v1/responses; docs/sessions.md for what the stores promise).

A response id is `resp_` + its session id; a request with previous_response_id forks
that session and generates on the fork (one admission: the fork is stored once, when the
request is done; docs/sessions.md "Fork and generate"), so the same continuation request
sent twice on
an unchanged response must give the same text and usage, whichever process answers.
Continuations use greedy sampling (temperature 0) and seeded sampling (temperature
0.8, a fixed `seed`: the engine seeds each request's generator with it); each is first
checked to repeat on the same process, so that a difference after the restart or on the
other replica is the store's.

Tests (unittest; select one by name, e.g. HttpDurableTest.test_dir_restart):
  test_dir_restart     SIGTERM and a new server on the same dir: responses continue
                       exactly (text, usage, cached_tokens), session metadata unchanged;
                       store: false leaves no session behind
  test_dir_kill9       kill -9 with a continuation streaming: every completed response
                       continues exactly after the restart; the interrupted request left
                       its source complete and no new session (a crash leaves either the
                       old session or the new one, complete)
  test_redis_replicas  two replicas on one Redis: A creates, B continues, A continues the
                       same way, A continues B's response (cached_tokens = its session's
                       tokens); store: false forks are gone on both replicas; a delete on
                       one replica is seen by the other

Usage: http_durable_test.py --fwserve PATH --model DIR --proto-dir DIR [--keep] [TEST ...]
Run it with Debian's /usr/bin/python3 (stdlib only); test_redis_replicas needs
redis-server (scripts/install-deps.sh).
"""
import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from fwserve_process import add_server_arguments, http_port_of  # noqa: E402
from replica_processes import Processes  # noqa: E402
from unittest_run import report_and_exit  # noqa: E402

ARGS = None
HTTP_TIMEOUT_S = 60.0
# How long a request naming a stored session may get 503 ("still indexing its session
# store") after a start.
INDEXING_RETRY_S = 20.0
PROCESSES = {}  # test id -> Processes, for the failure report
WORK_DIRS = []

FIRST = {"input": "Good morrow, sweet prince. What news from Verona?",
         "max_output_tokens": 32, "temperature": 0}
# The continuations each test sends more than once: greedy and seeded sampling.
CONTINUATIONS = [
    {"input": "And then?", "max_output_tokens": 32, "temperature": 0},
    {"input": [{"role": "user", "content": "Speak on, good Romeo."}],
     "max_output_tokens": 40, "temperature": 0.8, "seed": 1234},
]


class Http:
    """A replica's HTTP API (urllib); answers are (status, parsed JSON body)."""

    def __init__(self, port, name):
        self.base = "http://127.0.0.1:%d" % port
        self.name = name

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                return error.code, json.loads(raw or b"null")
            except ValueError:
                return error.code, raw.decode(errors="replace")

    def call_indexed(self, method, path, body=None):
        """call(), retrying 503 while a freshly started server indexes its store."""
        deadline = time.time() + INDEXING_RETRY_S
        while True:
            status, answer = self.call(method, path, body)
            if status != 503 or time.time() > deadline:
                return status, answer
            time.sleep(0.1)

    def wait_ready(self, timeout_s=30):
        deadline = time.time() + timeout_s
        while True:
            try:
                status, _ = self.call("GET", "/ready")
                if status == 200:
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError("%s: /ready never answered 200" % self.name)
            time.sleep(0.05)


def session_id(response_id):
    if not response_id.startswith("resp_"):
        raise AssertionError("response id %r does not start with resp_" % response_id)
    return response_id[len("resp_"):]


def text_of(response):
    return "".join(part["text"] for item in response["output"] for part in item["content"])


def outcome(response):
    """What must repeat exactly: the text, the status and the usage."""
    return {"text": text_of(response), "status": response["status"],
            "usage": response["usage"]}


def session_tokens(response):
    """The tokens of a response's session after it (as reported in its usage: the input
    counts the cached tokens, so the total is the whole session)."""
    return response["usage"]["total_tokens"]


class HttpDurableTest(unittest.TestCase):

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="fwserve-http-durable-")
        WORK_DIRS.append(self.work)
        self.procs = Processes(self.work)
        PROCESSES[self.id()] = self.procs

    def tearDown(self):
        self.procs.cleanup()

    # Helpers.

    def start(self, extra):
        proc = self.procs.fwserve(ARGS.fwserve, ARGS.model,
                                  ["--http-listen", "127.0.0.1:0", *extra])
        api = Http(http_port_of(proc), proc.name)
        api.wait_ready()
        return proc, api

    def restarted(self, proc):
        proc.restart()
        api = Http(http_port_of(proc), proc.name)
        api.wait_ready()
        return api

    def respond(self, api, body, indexed=False):
        """POST /v1/responses; asserts 200 and a completed or incomplete response."""
        status, response = (api.call_indexed if indexed else api.call)(
            "POST", "/v1/responses", body)
        self.assertEqual(status, 200, "%s: POST /v1/responses %s -> %s"
                         % (api.name, json.dumps(body), response))
        self.assertIn(response["status"], ("completed", "incomplete"), response)
        session_id(response["id"])
        return response

    def first(self, api):
        r1 = self.respond(api, FIRST)
        self.assertEqual(r1["usage"]["input_tokens_details"]["cached_tokens"], 0, r1)
        self.assertGreater(r1["usage"]["output_tokens"], 0, r1)
        self.assertTrue(text_of(r1), r1)
        return r1

    def continue_(self, api, previous, request, indexed=False, **fields):
        body = dict(request, previous_response_id=previous["id"], **fields)
        response = self.respond(api, body, indexed)
        self.assertNotEqual(response["id"], previous["id"], "a continuation forks")
        self.assertEqual(response["previous_response_id"], previous["id"], response)
        self.assertEqual(response["usage"]["input_tokens_details"]["cached_tokens"],
                         session_tokens(previous),
                         "cached_tokens of a continuation of %s (%s)"
                         % (previous["id"], json.dumps(body)))
        return response

    def session(self, api, response, indexed=False):
        """GET /fwserve/v1/sessions/<id of response>: the session object."""
        status, session = (api.call_indexed if indexed else api.call)(
            "GET", "/fwserve/v1/sessions/" + session_id(response["id"]))
        self.assertEqual(status, 200, "%s: session of %s: %s" % (api.name, response["id"],
                                                                  session))
        return session

    @staticmethod
    def stable(session):
        """The fields of a session object that no read may change."""
        return {k: session[k] for k in ("id", "model", "tokens", "state_bytes",
                                        "created_unix_ms")}

    def assert_gone(self, api, response_id):
        for path in ("/v1/responses/" + response_id,
                     "/fwserve/v1/sessions/" + session_id(response_id)):
            status, answer = api.call_indexed("GET", path)
            self.assertEqual(status, 404, "%s: GET %s after store: false: %s"
                             % (api.name, path, answer))

    def references(self, api, r1):
        """Each continuation of r1, sent twice on the same server (they must agree)."""
        refs = []
        for request in CONTINUATIONS:
            ref = self.continue_(api, r1, request)
            again = self.continue_(api, r1, request)
            self.assertEqual(outcome(again), outcome(ref),
                             "the same continuation twice on one server: %s" % request)
            self.assertNotEqual(again["id"], ref["id"])
            refs.append(ref)
        self.assertNotEqual(text_of(refs[0]), text_of(refs[1]),
                            "the two continuations should differ (test design)")
        return refs

    # Tests.

    def test_dir_restart(self):
        store = os.path.join(self.work, "sessions")
        proc, api = self.start(["--session-store", "dir:" + store])
        r1 = self.first(api)
        before = self.session(api, r1)
        self.assertEqual(before["tokens"], session_tokens(r1), before)
        refs = self.references(api, r1)
        fork_sessions = [self.stable(self.session(api, ref)) for ref in refs]
        for ref, fork in zip(refs, fork_sessions):
            self.assertEqual(fork["tokens"], session_tokens(ref), fork)
        # Continuing did not change R1.
        self.assertEqual(self.stable(self.session(api, r1)), self.stable(before))

        self.assertEqual(proc.terminate(), 0, "exit status after SIGTERM")
        api = self.restarted(proc)

        after = self.session(api, r1, indexed=True)
        self.assertEqual(self.stable(after), self.stable(before), "R1's session restarted")
        for ref, fork in zip(refs, fork_sessions):
            self.assertEqual(self.stable(self.session(api, ref, indexed=True)), fork,
                             "the session of continuation %s restarted" % ref["id"])
        for request, ref in zip(CONTINUATIONS, refs):
            again = self.continue_(api, r1, request, indexed=True)
            self.assertEqual(outcome(again), outcome(ref),
                             "continuing %s after the restart: %s" % (r1["id"], request))
        # store: false: the same answer, and its fork is gone before the answer came.
        gone = self.continue_(api, r1, CONTINUATIONS[1], store=False)
        self.assertEqual(outcome(gone), outcome(refs[1]), "store: false continuation")
        self.assertFalse(gone["store"], gone)
        self.assert_gone(api, gone["id"])
        self.assertEqual(self.stable(self.session(api, r1)), self.stable(before))
        self.assertEqual(proc.terminate(), 0, "exit status after SIGTERM")
        print("\ndir restart: R1 %d tokens %r; continued the same after the restart: %s"
              % (before["tokens"], text_of(r1), "; ".join(repr(text_of(r)) for r in refs)))

    def test_dir_kill9(self):
        store = os.path.join(self.work, "sessions")
        proc, api = self.start(["--session-store", "dir:" + store])
        r1 = self.first(api)
        before = self.stable(self.session(api, r1))
        c1 = self.continue_(api, r1, CONTINUATIONS[0])
        c1_session = self.stable(self.session(api, c1))
        refs = [self.continue_(api, c1, request) for request in CONTINUATIONS]

        # A continuation of R1 streaming (long; the test reads its first delta and stops
        # reading, so it cannot finish), then kill -9.
        body = dict(CONTINUATIONS[1], previous_response_id=r1["id"], stream=True,
                    max_output_tokens=50000)
        request = urllib.request.Request(api.base + "/v1/responses",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        stream = urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)
        cut_id, deltas = None, 0
        event = None
        while deltas < 3:
            line = stream.readline()
            self.assertTrue(line, "the stream ended early")
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                self.assertNotIn(event, ("error", "response.completed", "response.incomplete"),
                                 data)
                if event == "response.created":
                    cut_id = data["response"]["id"]
                elif event == "response.output_text.delta":
                    deltas += 1
        self.assertIsNotNone(cut_id, "no response.created event")
        proc.signal(signal.SIGKILL)
        proc.process.wait()
        stream.close()
        self.assertEqual(proc.process.returncode, -signal.SIGKILL)

        api = self.restarted(proc)
        self.assertEqual(self.stable(self.session(api, r1, indexed=True)), before,
                         "R1's session after kill -9")
        self.assertEqual(self.stable(self.session(api, c1, indexed=True)), c1_session,
                         "C1's session after kill -9")
        # The interrupted request's fork is stored only once the request is done: the
        # crash left R1 complete (above) and no new session.
        status, cut = api.call_indexed("GET", "/fwserve/v1/sessions/" + session_id(cut_id))
        self.assertEqual(status, 404, "the interrupted request's fork: %s" % cut)
        again = self.continue_(api, c1, CONTINUATIONS[0], indexed=True)
        self.assertEqual(outcome(again), outcome(refs[0]), "continuing C1 after kill -9")
        again = self.continue_(api, c1, CONTINUATIONS[1], indexed=True)
        self.assertEqual(outcome(again), outcome(refs[1]), "continuing C1 after kill -9")
        again = self.continue_(api, r1, CONTINUATIONS[0])
        self.assertEqual(outcome(again), outcome(c1), "continuing R1 after kill -9")
        self.assertEqual(proc.terminate(), 0, "exit status after SIGTERM")
        print("\ndir kill -9: R1 %d tokens, C1 %d tokens, the request cut after %d deltas "
              "left no fork" % (before["tokens"], c1_session["tokens"], deltas))

    def test_redis_replicas(self):
        if shutil.which("redis-server", path=os.environ.get("PATH", "") + ":/usr/bin") is None:
            self.fail("redis-server is missing (scripts/install-deps.sh)")
        redis = self.procs.redis(persist=False)
        _, a = self.start(["--session-store", redis.url()])
        _, b = self.start(["--session-store", redis.url()])
        a.name, b.name = "replica A", "replica B"

        r1 = self.first(a)
        on_a = self.stable(self.session(a, r1))
        self.assertEqual(self.stable(self.session(b, r1)), on_a, "R1's session seen from B")
        # B continues A's response; A continues it the same way: the same answers.
        continued_on_b = [self.continue_(b, r1, request) for request in CONTINUATIONS]
        for request, cb in zip(CONTINUATIONS, continued_on_b):
            ca = self.continue_(a, r1, request)
            self.assertEqual(outcome(ca), outcome(cb),
                             "continuing %s on A and on B: %s" % (r1["id"], request))
        for request, cb in zip(CONTINUATIONS, continued_on_b):
            cb2 = self.continue_(b, r1, request)
            self.assertEqual(outcome(cb2), outcome(cb), "B again: %s" % request)
        self.assertEqual(self.stable(self.session(a, r1)), on_a, "R1 unchanged")

        # Hop back: A continues B's response (cached_tokens = its session's tokens, which
        # continue_ checks), B continues it the same way.
        cb = continued_on_b[1]
        cb_session = self.stable(self.session(a, cb))
        self.assertEqual(cb_session["tokens"], session_tokens(cb), cb_session)
        self.assertEqual(self.stable(self.session(b, cb)), cb_session)
        hop_cached = []
        for request in CONTINUATIONS:
            da = self.continue_(a, cb, request)
            hop_cached.append(da["usage"]["input_tokens_details"]["cached_tokens"])
            self.assertEqual(da["usage"]["input_tokens_details"]["cached_tokens"],
                             cb_session["tokens"])
            db = self.continue_(b, cb, request)
            self.assertEqual(outcome(da), outcome(db), "continuing B's %s on A and on B: %s"
                             % (cb["id"], request))
            # And once more on A, after B served it.
            self.assertEqual(outcome(self.continue_(a, cb, request)), outcome(da))

        # store: false on either replica: the same answer, its fork gone on both.
        for api in (a, b):
            gone = self.continue_(api, r1, CONTINUATIONS[1], store=False)
            self.assertEqual(outcome(gone), outcome(continued_on_b[1]),
                             "store: false continuation on %s" % api.name)
            for other in (a, b):
                self.assert_gone(other, gone["id"])
        self.assertEqual(self.stable(self.session(b, r1)), on_a, "R1 unchanged")

        # A deletes B's response (resident on B): B no longer knows it either.
        status, deleted = a.call("DELETE", "/v1/responses/" + cb["id"])
        self.assertEqual((status, deleted.get("deleted")), (200, True), deleted)
        for api in (a, b):
            status, answer = api.call("GET", "/v1/responses/" + cb["id"])
            self.assertEqual(status, 404, "%s: GET a deleted response: %s" % (api.name, answer))
        status, answer = b.call("POST", "/v1/responses",
                                dict(CONTINUATIONS[0], previous_response_id=cb["id"]))
        self.assertEqual(status, 404, "B continuing a response deleted on A: %s" % answer)
        print("\nredis replicas: R1 %d tokens on A; B's continuation %d tokens %r, the same "
              "on A; hop back to A: cached_tokens %s"
              % (on_a["tokens"], cb_session["tokens"], text_of(cb), hop_cached))


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    ARGS, rest = parser.parse_known_args()
    program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)

    def show_failure(test_id):
        procs = PROCESSES.get(test_id)
        if procs is not None:
            sys.stderr.write("=== %s: process logs (in %s)\n%s\n"
                             % (test_id, procs.work, procs.tails(skip=())))

    report_and_exit("http_durable_test", program.result, WORK_DIRS, ARGS.keep, show_failure)


if __name__ == "__main__":
    main()
