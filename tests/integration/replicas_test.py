#!/usr/bin/env python3
"""Several fwserve replicas on one Redis session store (--session-store redis://...),
behind HAProxy (deploy/haproxy/haproxy.cfg, the shipped file), as real processes:
redis-server, haproxy and fwserve on free loopback ports, driven by a Python gRPC
client (stubs generated from the proto at test time). Every conversation is greedy, so
each turn's tokens are compared with the same conversation on one fwserve with
--session-store memory (the reference, run first in this process).

The contract under test (docs/sessions.md):
  * any replica serves any session: a session lives in Redis with a version; a request
    holds the session's lease there (renewed while it runs); a second request on a busy
    session gets ABORTED from any replica.
  * writes are fenced: a replica that lost its lease (stalled past --session-lease-ttl)
    cannot overwrite newer state; its client gets a non-OK status (ABORTED).
  * a Generate whose final message arrived is in Redis; a replica killed mid-request
    loses only that request: the session holds the tokens before it, or (when the kill
    fell between the commit and the final message) the tokens after it. Through
    haproxy 2.6 the cut request ends with UNAVAILABLE (RST_STREAM REFUSED_STREAM
    before the response began), UNKNOWN "Stream removed" (after it began: haproxy
    resets the stream without gRPC trailers) or, on the retry, ABORTED while the dead
    replica's lease lasts; the client asks GetSession which it was.
  * Redis down: requests needing a session get UNAVAILABLE "session store unavailable"
    quickly (well within their deadline), throwaway Generates still work, and service
    comes back by itself when Redis does.

Tests (unittest; select one by name, e.g. ReplicasTest.test_fencing):
  test_hopping_conversation  3 replicas behind haproxy, 100 sessions x 10 turns
  test_replica_crash         the same under load, kill -9 of one replica
  test_fencing               SIGSTOP a replica past its lease; its late write is refused
  test_redis_restart         Redis SHUTDOWN and restart (append-only file): nothing lost
  test_redis_down            Redis stopped, then frozen: fast UNAVAILABLE, recovery

Usage: replicas_test.py --fwserve PATH --model DIR --proto-dir DIR
                        [--haproxy-config FILE] [--keep] [TEST ...]
Run it with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf); needs
redis-server and haproxy (scripts/install-deps.sh).
"""
import argparse
import collections
import concurrent.futures
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest
import warnings

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from fwserve_stubs import ensure_grpc, load_stubs, stream_generate  # noqa: E402
from fwserve_process import add_server_arguments  # noqa: E402
from replica_processes import Processes  # noqa: E402
from unittest_run import report_and_exit  # noqa: E402

ARGS = None
grpc = None
pb = None
pb_grpc = None

# Deadlines only catch hangs; no outcome depends on how fast anything is (timings are
# printed for information).
RPC_TIMEOUT_S = 60.0
HANG_S = 60.0
# How long one turn may keep failing (replica killed, its lease still held, haproxy
# not yet aware) before the test gives up on it.
TURN_RETRY_S = 30.0
STORE_UNAVAILABLE = "session store unavailable"
# The processes of each test, for the failure report; work directories to remove.
PROCESSES = {}
WORK_DIRS = []

NAMES = [b"ROMEO", b"JULIET", b"HAMLET", b"OPHELIA", b"KING LEAR", b"CORDELIA",
         b"MACBETH", b"BANQUO", b"PORTIA", b"BRUTUS", b"First Citizen", b"MENENIUS"]
PROMPTS = [b"\nJULIET:\n", b" and ", b"\nFirst Citizen:\n", b"; but ", b"\nROMEO:\n",
           b" my lord", b"\nKING HENRY:\n", b", I pray", b"\nQUEEN:\n", b" the "]


def greedy():
    return pb.SamplingParams(temperature=0.0)


class Conversation:
    """One session's script (prefix, then a prompt per turn) and what the client saw."""

    def __init__(self, index, turns, max_tokens, salt=0):
        self.index = index
        self.prefix = b"%s %d:\n" % (NAMES[(index + salt) % len(NAMES)], index)
        self.prompts = [PROMPTS[(3 * index + 7 * salt + t) % len(PROMPTS)]
                        for t in range(turns)]
        self.max_tokens = max_tokens
        self.session_id = None
        self.tokens = 0          # session tokens after the last completed turn
        self.done = 0            # turns completed
        self.outputs = {}        # turn -> token ids received in full
        self.unseen = []         # turns committed whose final message was lost

    def key(self):
        return (self.prefix, tuple(self.prompts), self.max_tokens)

    def expected_tokens(self, turns=None):
        turns = len(self.prompts) if turns is None else turns
        return len(self.prefix) + sum(len(p) + self.max_tokens for p in self.prompts[:turns])


class Reference:
    """One fwserve with --session-store memory for the whole run: the expected tokens of
    each turn of a conversation, each conversation run once on it."""

    def __init__(self):
        self.work = tempfile.mkdtemp(prefix="fwserve-replicas-ref-")
        WORK_DIRS.append(self.work)
        self.procs = Processes(self.work)
        self.server = None
        self.stub = None
        self.cache = {}

    def start(self):
        if self.server is None:
            self.server = self.procs.fwserve(ARGS.fwserve, ARGS.model,
                                             ["--session-store", "memory"])
            channel = grpc.insecure_channel(self.server.target)
            grpc.channel_ready_future(channel).result(timeout=30)
            self.stub = pb_grpc.FwserveStub(channel)

    def run_one(self, key):
        prefix, prompts, max_tokens = key
        info = self.stub.CreateSession(pb.CreateSessionRequest(prefix=prefix),
                                       timeout=RPC_TIMEOUT_S)
        turns = []
        for prompt in prompts:
            tokens = []
            for message in self.stub.Generate(pb.GenerateRequest(
                    session_id=info.session_id, prompt=prompt, max_tokens=max_tokens,
                    sampling=greedy()), timeout=RPC_TIMEOUT_S):
                tokens.extend(message.token_ids)
            turns.append(tokens)
        self.stub.DeleteSession(pb.DeleteSessionRequest(session_id=info.session_id),
                                timeout=RPC_TIMEOUT_S)
        return turns

    def turns(self, conversations):
        """Fills the cache for every conversation; returns {index: [tokens per turn]}."""
        missing = sorted({c.key() for c in conversations} - set(self.cache))
        if missing:
            self.start()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for key, turns in zip(missing, pool.map(self.run_one, missing)):
                    self.cache[key] = turns
        return {c.index: self.cache[c.key()] for c in conversations}

    def throwaway(self, prompt, max_tokens):
        """The tokens of a throwaway greedy Generate (no session)."""
        key = ("throwaway", prompt, max_tokens)
        if key not in self.cache:
            self.start()
            tokens = []
            for message in self.stub.Generate(pb.GenerateRequest(
                    prompt=prompt, max_tokens=max_tokens, sampling=greedy()),
                    timeout=RPC_TIMEOUT_S):
                tokens.extend(message.token_ids)
            self.cache[key] = tokens
        return self.cache[key]

    def cleanup(self):
        self.procs.cleanup()


REFERENCE = None


class TurnStats:
    """Failures the clients saw, by status code (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.codes = collections.Counter()
        self.examples = {}
        self.retried = 0         # turns run again (not committed)
        self.committed = 0       # failed turns that had committed anyway

    def failure(self, error, streamed):
        with self.lock:
            name = error.code().name
            self.codes[name] += 1
            self.examples.setdefault(name, "%s (after %d tokens streamed)"
                                     % (error.details(), streamed))

    def summary(self):
        with self.lock:
            return ("codes %s, retried %d, committed before the failure %d; examples: %s"
                    % (dict(self.codes), self.retried, self.committed, self.examples))


def call_retrying(call, codes=("UNAVAILABLE",), limit_s=TURN_RETRY_S):
    """call(), retrying the named status codes for up to limit_s."""
    deadline = time.time() + limit_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code().name not in codes or time.time() > deadline:
                raise
            time.sleep(0.1)


def get_session(stub, session_id, codes=("UNAVAILABLE",)):
    return call_retrying(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session_id),
                                                 timeout=RPC_TIMEOUT_S), codes)


def list_all(stub, page_size):
    """Every session of ListSessions, page by page: [(id, tokens)]."""
    listed = []
    token = ""
    for _ in range(10000):
        page = call_retrying(lambda: stub.ListSessions(pb.ListSessionsRequest(
            page_size=page_size, page_token=token), timeout=RPC_TIMEOUT_S))
        listed.extend((s.session_id, s.tokens) for s in page.sessions)
        token = page.next_page_token
        if not token:
            return listed
    raise AssertionError("ListSessions never ended")


def generate(stub, timeout=RPC_TIMEOUT_S, **fields):
    """One Generate: (tokens, last message); raises the RpcError (with .streamed)."""
    return stream_generate(stub, pb, timeout, **fields)


# What a request cut by a replica's death may end with (see test_replica_crash).
CUT_CODES = ("UNAVAILABLE", "UNKNOWN")


def create(stub, conversation, tolerate=False):
    """CreateSession for the conversation (CUT_CODES retried when tolerate: a
    CreateSession that failed created nothing, or an orphan the test ignores)."""
    info = call_retrying(lambda: stub.CreateSession(
        pb.CreateSessionRequest(prefix=conversation.prefix), timeout=RPC_TIMEOUT_S),
        codes=CUT_CODES if tolerate else ())
    conversation.session_id = info.session_id
    conversation.tokens = info.tokens
    return info


def run_turn(stub, conversation, stats=None):
    """Runs the conversation's next turn. Without stats any failure is raised; with
    stats a failed turn is looked up (GetSession) and retried when it did not commit."""
    turn = conversation.done
    prompt = conversation.prompts[turn]
    before = conversation.tokens
    after = before + len(prompt) + conversation.max_tokens
    deadline = time.time() + TURN_RETRY_S
    while True:
        try:
            tokens, last = generate(stub, session_id=conversation.session_id, prompt=prompt,
                                    max_tokens=conversation.max_tokens, sampling=greedy())
        except grpc.RpcError as error:
            if stats is None or time.time() > deadline:
                raise
            stats.failure(error, len(error.streamed))
            info = get_session(stub, conversation.session_id, CUT_CODES)
            if info.tokens == before:
                with stats.lock:
                    stats.retried += 1
                time.sleep(0.2 if error.code() == grpc.StatusCode.ABORTED else 0.05)
                continue
            if info.tokens != after:
                raise AssertionError(
                    "session %s (conversation %d) holds %d tokens after a failed turn %d "
                    "(%s %s); expected %d (not committed) or %d (committed)"
                    % (conversation.session_id, conversation.index, info.tokens, turn,
                       error.code().name, error.details(), before, after))
            with stats.lock:
                stats.committed += 1
            conversation.unseen.append(turn)
            if len(error.streamed) == conversation.max_tokens:
                conversation.outputs[turn] = error.streamed
            conversation.tokens = after
            conversation.done += 1
            return
        if last is None:
            raise AssertionError("turn %d of session %s: no final message"
                                 % (turn, conversation.session_id))
        if last.usage.session_tokens != after or len(tokens) != conversation.max_tokens:
            raise AssertionError("turn %d of session %s: usage %s with %d tokens streamed; "
                                 "expected session_tokens %d"
                                 % (turn, conversation.session_id, last.usage, len(tokens),
                                    after))
        conversation.outputs[turn] = tokens
        conversation.tokens = after
        conversation.done += 1
        return


def drive(stub, conversations, threads, stats=None, progress=None):
    """Runs every conversation to its end with `threads` client threads, each taking
    the next unfinished conversation and running all of its turns. Returns the list
    of exceptions raised (empty when all went well)."""
    work = queue.Queue()
    for c in conversations:
        work.put(c)
    errors = []

    def worker():
        while True:
            try:
                c = work.get_nowait()
            except queue.Empty:
                return
            try:
                if c.session_id is None:
                    create(stub, c, tolerate=stats is not None)
                while c.done < len(c.prompts):
                    run_turn(stub, c, stats)
                    if progress is not None:
                        progress()
            except Exception as error:  # noqa: BLE001 (reported by the test)
                errors.append("conversation %d (%s): %r" % (c.index, c.session_id, error))

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=600)
    return errors


class ReplicasTest(unittest.TestCase):

    def setUp(self):
        warnings.filterwarnings("ignore", category=ResourceWarning)
        self.work = tempfile.mkdtemp(prefix="fwserve-replicas-")
        WORK_DIRS.append(self.work)
        self.procs = Processes(self.work)
        PROCESSES[self.id()] = self.procs
        self.channels = []
        self.started = time.time()

    def tearDown(self):
        for channel in self.channels:
            channel.close()
        self.procs.cleanup()
        print("\n%s: %.1f s" % (self.id().split(".")[-1], time.time() - self.started))

    # ------------------------------------------------------------------ helpers
    def stub(self, target):
        channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(channel).result(timeout=30)
        self.channels.append(channel)
        return pb_grpc.FwserveStub(channel)

    def replicas(self, redis, count, extra=()):
        return [self.procs.fwserve(ARGS.fwserve, ARGS.model,
                                   ["--session-store", redis.url(), *extra])
                for _ in range(count)]

    def haproxy(self, replicas):
        proxy = self.procs.haproxy(ARGS.haproxy_config, [r.target for r in replicas])
        want = {"fwserve%d" % (i + 1): "UP" for i in range(len(replicas))}
        states = proxy.wait_servers(want, timeout_s=HANG_S)
        self.assertEqual({k: v[0] for k, v in states.items()}, want,
                         "haproxy health checks of running replicas: %s" % states)
        return proxy

    def assert_outputs(self, conversations, reference):
        wrong = []
        for c in conversations:
            for turn, tokens in sorted(c.outputs.items()):
                if tokens != reference[c.index][turn]:
                    wrong.append("conversation %d (%s) turn %d: %r, reference %r" % (
                        c.index, c.session_id, turn, bytes(tokens),
                        bytes(reference[c.index][turn])))
        self.assertEqual(wrong[:5], [], "%d turns differ from the reference" % len(wrong))

    def assert_final_tokens(self, stub, conversations):
        wrong = []
        for c in conversations:
            info = get_session(stub, c.session_id)
            if info.tokens != c.expected_tokens() or c.tokens != c.expected_tokens():
                wrong.append("conversation %d (%s): GetSession %d, client %d, expected %d"
                             % (c.index, c.session_id, info.tokens, c.tokens,
                                c.expected_tokens()))
        self.assertEqual(wrong[:5], [], "%d sessions with wrong token counts" % len(wrong))

    def served_by(self, replicas, session_ids):
        """{session id: set of replica indexes whose log has a Generate for it}.

        Logs show only the first 8 hex digits of a session id ("1a2b3c4d...")."""
        by_prefix = {sid[:8] + "...": sid for sid in session_ids}
        served = collections.defaultdict(set)
        for i, replica in enumerate(replicas):
            for line in replica.request_lines():
                sid = by_prefix.get(line.get("session"))
                if line.get("method") == "Generate" and sid is not None:
                    served[sid].add(i)
        return served

    # ------------------------------------------------------ hopping conversation
    def test_hopping_conversation(self):
        sessions, turns, max_tokens, threads = 100, 10, 8, 8
        conversations = [Conversation(i, turns, max_tokens) for i in range(sessions)]
        reference = REFERENCE.turns(conversations)
        print("\nreference (one server, --session-store memory): %.1f s"
              % (time.time() - self.started))

        redis = self.procs.redis()
        replicas = self.replicas(redis, 3)
        proxy = self.haproxy(replicas)
        stub = self.stub(proxy.target)
        start = time.time()
        errors = drive(stub, conversations, threads)
        elapsed = time.time() - start
        self.assertEqual(errors[:5], [], "%d conversations failed" % len(errors))
        self.assert_outputs(conversations, reference)
        self.assert_final_tokens(stub, conversations)

        generates = [r.requests_total(rpc="Generate") for r in replicas]
        generates_ok = [r.requests_total(rpc="Generate", code="OK") for r in replicas]
        ids = {c.session_id for c in conversations}
        served = self.served_by(replicas, ids)
        hopped = sum(1 for s in ids if len(served[s]) > 1)
        print("hopping: %d sessions x %d turns through haproxy in %.1f s; Generates per "
              "replica %s; %d sessions served by more than one replica"
              % (sessions, turns, elapsed, generates_ok, hopped))
        self.assertEqual(sum(generates_ok), sessions * turns,
                         "fwserve_requests_total{rpc=Generate,code=OK} over the replicas")
        self.assertEqual(sum(generates), sessions * turns, "Generates with another code")
        for i, count in enumerate(generates_ok):
            self.assertGreater(count, sessions * turns / 10,
                               "replica %d served too little: %s" % (i, generates_ok))
        self.assertGreaterEqual(hopped, sessions * 9 // 10,
                                "sessions whose turns ran on more than one replica")

        # Listing pages through the proxy, so that pages come from different replicas.
        listed = list_all(stub, page_size=7)
        listed_ids = [i for i, _ in listed]
        self.assertEqual(len(listed_ids), len(set(listed_ids)), "ListSessions repeated ids")
        self.assertEqual(set(listed_ids), ids, "ListSessions pages over the replicas")
        expected = {c.session_id: c.expected_tokens() for c in conversations}
        self.assertEqual(dict(listed), expected, "tokens listed by ListSessions")

        for replica in replicas:
            self.assertEqual(replica.terminate(), 0, "exit status of %s after SIGTERM"
                             % replica.name)

    # ------------------------------------------------------------ replica crash
    def test_replica_crash(self):
        sessions, turns, max_tokens, threads = 60, 10, 16, 8
        conversations = [Conversation(i, turns, max_tokens, salt=5) for i in range(sessions)]
        reference = REFERENCE.turns(conversations)

        redis = self.procs.redis()
        replicas = self.replicas(redis, 3, ["--session-lease-ttl", "2s"])
        proxy = self.haproxy(replicas)
        stub = self.stub(proxy.target)
        stats = TurnStats()
        victim = replicas[1]
        completed = [0]
        kill_at = sessions * turns // 4
        killed = threading.Event()
        lock = threading.Lock()

        def progress():
            with lock:
                completed[0] += 1

        result = {}
        runner = threading.Thread(target=lambda: result.setdefault(
            "errors", drive(stub, conversations, threads, stats, progress)), daemon=True)
        start = time.time()
        runner.start()
        while runner.is_alive() and completed[0] < kill_at:
            time.sleep(0.01)
        # Kill it with turns in flight on it, however fast it serves: freeze it
        # (SIGSTOP), so that what is routed to it stays unanswered, until haproxy has
        # forwarded at least one turn to it (HANG_S only catches a hang); then kill -9.
        victim_done = victim.requests_total(rpc="Generate")
        victim.signal(signal.SIGSTOP)
        wait_until = time.time() + HANG_S
        while True:
            streaming = proxy.current_streams("fwserve2")
            if streaming >= 1 or time.time() > wait_until:
                break
            time.sleep(0.002)
        victim.kill()
        killed.set()
        killed_at = time.time()
        self.assertGreater(completed[0], 0, "no turn completed before the kill")
        states = proxy.wait_servers({"fwserve2": "DOWN"}, timeout_s=HANG_S)
        down_after = time.time() - killed_at
        self.assertEqual(states["fwserve2"][0], "DOWN",
                         "haproxy's view of the killed replica: %s" % states)
        runner.join(timeout=280)
        self.assertFalse(runner.is_alive(), "the clients did not finish")
        elapsed = time.time() - start
        print("\nreplica crash: %d sessions x %d turns, kill -9 of replica 2 after %d turns "
              "(it had finished %d Generates, %d streaming); haproxy marked it DOWN after %.1f s; "
              "failures seen by clients: %s; %.1f s"
              % (sessions, turns, kill_at, victim_done, streaming, down_after,
                 stats.summary(), elapsed))
        errors = result.get("errors", [])
        self.assertEqual(errors[:5], [], "%d conversations failed" % len(errors))
        self.assert_outputs(conversations, reference)
        self.assert_final_tokens(stub, conversations)
        # UNAVAILABLE: the replica's connection broke, or haproxy refused the stream
        # (RST_STREAM REFUSED_STREAM) or had no replica; ABORTED: the session's lease is
        # still held by the dead replica (up to --session-lease-ttl); UNKNOWN "Stream
        # removed": the replica died after the response had started, and haproxy 2.6
        # resets the client's stream without gRPC trailers (a direct client gets
        # UNAVAILABLE "Socket closed"). Each means "outcome unknown: ask GetSession".
        allowed = {"UNAVAILABLE", "ABORTED", "UNKNOWN"}
        self.assertLessEqual(set(stats.codes), allowed,
                             "status codes of turns failed by the kill: %s" % stats.summary())
        self.assertGreater(sum(stats.codes.values()), 0,
                           "no turn was in flight on the killed replica")
        survivors = [r for r in replicas if r is not victim]
        for replica in survivors:
            self.assertGreater(replica.requests_total(rpc="Generate", code="OK"), 0)
            self.assertEqual(replica.terminate(), 0, "exit status of %s after SIGTERM"
                             % replica.name)

    # ------------------------------------------------------------------ fencing
    def test_fencing(self):
        redis = self.procs.redis()
        a, b = self.replicas(redis, 2, ["--session-lease-ttl", "1s"])
        stub_a, stub_b = self.stub(a.target), self.stub(b.target)
        script = Conversation(0, 2, 16, salt=3)   # B's turn, then one more turn
        reference = REFERENCE.turns([script])[0]
        create(stub_b, script)
        before = script.tokens

        long_result = {}
        first_tokens = threading.Event()

        def long_generate():
            received = []
            try:
                for message in stub_a.Generate(pb.GenerateRequest(
                        session_id=script.session_id, prompt=b"\nA long speech:\n",
                        max_tokens=20000, sampling=greedy()), timeout=RPC_TIMEOUT_S):
                    received.extend(message.token_ids)
                    first_tokens.set()
                    if message.HasField("usage"):
                        long_result["usage"] = message.usage
                long_result["code"] = "OK"
            except grpc.RpcError as error:
                long_result["code"] = error.code().name
                long_result["details"] = error.details()
            long_result["streamed"] = len(received)
            long_result["ended"] = time.time()
            first_tokens.set()

        thread = threading.Thread(target=long_generate, daemon=True)
        thread.start()
        self.assertTrue(first_tokens.wait(30), "replica A streamed nothing")
        self.assertNotIn("code", long_result, "A's Generate ended too soon: %s" % long_result)

        # A second request on the busy session, on the other replica: ABORTED (not
        # queued behind A's Generate, which runs on for as long as the test needs; the
        # generous RPC deadline only catches a hang). How long it took is printed for
        # information only.
        start = time.time()
        with self.assertRaises(grpc.RpcError) as raised:
            generate(stub_b, timeout=RPC_TIMEOUT_S, session_id=script.session_id,
                     prompt=b"x", max_tokens=1, sampling=greedy())
        aborted_after = time.time() - start
        self.assertEqual(raised.exception.code(), grpc.StatusCode.ABORTED,
                         raised.exception.details())

        a.signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            aborted = 0
            while True:
                try:
                    tokens, last = generate(stub_b, session_id=script.session_id,
                                            prompt=script.prompts[0], max_tokens=16,
                                            sampling=greedy(), timeout=RPC_TIMEOUT_S)
                    break
                except grpc.RpcError as error:
                    # A's lease (1 s) runs out while A is stopped; HANG_S only catches
                    # a lease that never expires.
                    if (error.code() != grpc.StatusCode.ABORTED
                            or time.time() > stopped_at + HANG_S):
                        raise
                    aborted += 1
                    time.sleep(0.1)
            b_done = time.time() - stopped_at
            self.assertIsNotNone(last)
            self.assertEqual(tokens, reference[0], "B's turn differs from the reference")
            self.assertEqual(last.usage.session_tokens, before + len(script.prompts[0]) + 16)
            # Keep A stopped for well past its lease.
            time.sleep(max(0.0, stopped_at + 3.0 - time.time()))
        finally:
            a.signal(signal.SIGCONT)
        continued_at = time.time()
        thread.join(timeout=60)
        self.assertFalse(thread.is_alive(), "A's Generate never ended")
        print("\nfencing: B's request on the busy session got ABORTED after %.3f s; B got "
              "ABORTED %d times, then succeeded %.2f s after A was stopped; A's Generate "
              "(resumed after %.1f s) ended %.2f s after SIGCONT with %s %r after %d "
              "tokens streamed"
              % (aborted_after, aborted, b_done, continued_at - stopped_at,
                 long_result["ended"] - continued_at, long_result["code"],
                 long_result.get("details"), long_result["streamed"]))
        self.assertNotEqual(long_result["code"], "OK",
                            "the fenced replica's Generate succeeded: %s" % long_result)
        self.assertEqual(long_result["code"], "ABORTED", long_result)

        script.tokens = before + len(script.prompts[0]) + 16
        script.done = 1
        for stub in (stub_b, stub_a):
            info = get_session(stub, script.session_id)
            self.assertEqual(info.tokens, script.tokens,
                             "the session after the fenced write (GetSession)")
        # The next turn, on the fenced replica: it must continue from B's state.
        run_turn(stub_a, script)
        self.assertEqual(script.outputs[1], reference[1], "the turn after the fencing")
        self.assertEqual(get_session(stub_b, script.session_id).tokens,
                         script.expected_tokens())
        for replica in (a, b):
            self.assertEqual(replica.terminate(), 0, "exit status of %s after SIGTERM"
                             % replica.name)

    # ------------------------------------------------------------ redis restart
    def test_redis_restart(self):
        sessions, max_tokens = 12, 8
        conversations = [Conversation(i, 6, max_tokens, salt=1) for i in range(sessions)]
        reference = REFERENCE.turns(conversations)
        password = "fw-redis-pw-%d" % os.getpid()
        password_file = os.path.join(self.work, "redis-password")
        with open(password_file, "w") as f:
            f.write(password + "\n")
        os.chmod(password_file, 0o600)
        redis = self.procs.redis(password=password)
        db = 3
        replicas = [self.procs.fwserve(ARGS.fwserve, ARGS.model, [
            "--session-store", redis.url(db), "--session-store-password-file", password_file])
            for _ in range(2)]
        stubs = [self.stub(r.target) for r in replicas]

        def turns(count):
            for c in conversations:
                for _ in range(count):
                    run_turn(stubs[(c.index + c.done) % 2], c)

        for c in conversations:
            create(stubs[c.index % 2], c)
        turns(3)
        self.assertGreater(redis.dbsize(db), 0, "no keys in Redis database %d" % db)
        self.assertEqual(redis.dbsize(0), 0, "keys in database 0 (the URL says /%d)" % db)
        for replica in replicas:
            self.assertNotIn(password, replica.log_text(), "the password is in the log")

        redis.shutdown()
        redis.restart()
        restarted = time.time()
        for c in conversations:
            info = get_session(stubs[c.index % 2], c.session_id)
            self.assertEqual(info.tokens, c.tokens, "conversation %d after the restart"
                             % c.index)
        back_after = time.time() - restarted
        turns(3)
        self.assert_outputs(conversations, reference)
        self.assert_final_tokens(stubs[0], conversations)
        listed = dict(list_all(stubs[1], page_size=5))
        self.assertEqual(listed, {c.session_id: c.expected_tokens() for c in conversations})
        print("\nredis restart: %d sessions, 3 turns before and 3 after a Redis restart; "
              "first answer %.2f s after Redis was back" % (sessions, back_after))
        for replica in replicas:
            self.assertEqual(replica.terminate(), 0, "exit status of %s after SIGTERM"
                             % replica.name)

    # --------------------------------------------------------------- redis down
    def assert_store_unavailable(self, call, what, deadline_s=60.0):
        """`call(deadline)` fails with the server's UNAVAILABLE "session store
        unavailable": the server gave up on the store by itself, within
        --session-store-timeout (the client's generous deadline, DEADLINE_EXCEEDED, only
        catches a hang)."""
        start = time.time()
        with self.assertRaises(grpc.RpcError, msg=what) as raised:
            call(deadline_s)
        took = time.time() - start
        error = raised.exception
        self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE,
                         "%s: %s" % (what, error.details()))
        self.assertIn(STORE_UNAVAILABLE, error.details() or "", what)
        return took, error.details()

    def test_redis_down(self):
        conversations = [Conversation(i, 3, 8, salt=2) for i in range(3)]
        reference = REFERENCE.turns(conversations)
        throwaway_prompt = b"HORATIO:\nWhat, has this thing appear'd again to-night?\n"
        throwaway_ref = REFERENCE.throwaway(throwaway_prompt, 12)
        redis = self.procs.redis()
        # A lease taken by a command that timed out while Redis was frozen is set when
        # Redis runs again (the replica never learnt its token): the session stays busy
        # until that lease expires. A short TTL keeps that wait short.
        replica = self.procs.fwserve(ARGS.fwserve, ARGS.model,
                                     ["--session-store", redis.url(),
                                      "--session-lease-ttl", "3s"])
        stub = self.stub(replica.target)
        for c in conversations:
            create(stub, c)
            run_turn(stub, c)
        observed = []

        def session_generate(c):
            return lambda deadline: generate(stub, timeout=deadline, session_id=c.session_id,
                                             prompt=c.prompts[c.done], max_tokens=8,
                                             sampling=greedy())

        def create_call(deadline):
            return stub.CreateSession(pb.CreateSessionRequest(prefix=b"GHOST:\n"),
                                      timeout=deadline)

        def throwaway():
            tokens, last = generate(stub, prompt=throwaway_prompt, max_tokens=12,
                                    sampling=greedy())
            self.assertIsNotNone(last)
            self.assertEqual(len(tokens), 12)
            return tokens

        def recover(what):
            """Waits until session requests work again; returns the seconds it took.
            (60 s only catches a replica that never reconnects: the backoff is 50 ms
            to 2 s.)"""
            start = time.time()
            c = conversations[0]
            while True:
                try:
                    run_turn(stub, c)
                    return time.time() - start
                except grpc.RpcError as error:
                    if (error.code() != grpc.StatusCode.UNAVAILABLE
                            or time.time() > start + 60):
                        raise AssertionError("%s: not back after %.1f s: %s %s" % (
                            what, time.time() - start, error.code().name, error.details()))
                    time.sleep(0.1)

        for phase in ("stopped", "frozen"):
            if phase == "stopped":
                redis.shutdown()
            else:
                redis.signal(signal.SIGSTOP)
            try:
                # A throwaway Generate does not need the store.
                self.assertEqual(len(throwaway()), 12, phase)
                for c in conversations[1:]:
                    took, details = self.assert_store_unavailable(
                        session_generate(c), "%s: Generate on a session" % phase)
                    observed.append("%s Generate: %.2f s %r" % (phase, took, details))
                took, details = self.assert_store_unavailable(
                    create_call, "%s: CreateSession" % phase)
                observed.append("%s CreateSession: %.2f s" % (phase, took))
                # GetSession (busy is any replica's lease, in Redis) and ListSessions
                # (the store's index) need the store too.
                for name, call in (
                        ("GetSession", lambda deadline: stub.GetSession(pb.GetSessionRequest(
                            session_id=conversations[1].session_id), timeout=deadline)),
                        ("ListSessions", lambda deadline: stub.ListSessions(
                            pb.ListSessionsRequest(), timeout=deadline))):
                    took, _ = self.assert_store_unavailable(call, "%s: %s" % (phase, name))
                    observed.append("%s %s: UNAVAILABLE in %.2f s" % (phase, name, took))
                self.assertEqual(throwaway(), throwaway_ref,
                                 "%s: a throwaway Generate" % phase)
            finally:
                if phase == "stopped":
                    redis.restart()
                else:
                    redis.signal(signal.SIGCONT)
            observed.append("%s: back after %.2f s" % (phase, recover(phase)))

        aborted = 0
        for c in conversations:
            deadline = time.time() + 60  # leftover leases expire after 3 s; catches a hang
            while c.done < len(c.prompts):
                try:
                    run_turn(stub, c)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ABORTED or time.time() > deadline:
                        raise
                    aborted += 1
                    time.sleep(0.2)
        observed.append("ABORTED %d times after the outages (leftover leases)" % aborted)
        self.assert_outputs(conversations, reference)
        self.assert_final_tokens(stub, conversations)
        print("\nredis down: %s" % "; ".join(observed))
        self.assertEqual(replica.terminate(), 0, "exit status after SIGTERM")


def main():
    global ARGS, grpc, pb, pb_grpc, REFERENCE
    ensure_grpc()
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--haproxy-config",
                        default=os.path.join(HERE, "..", "..", "deploy", "haproxy",
                                             "haproxy.cfg"))
    ARGS, rest = parser.parse_known_args()
    for tool in ("redis-server", "haproxy"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin") is None:
            sys.stderr.write("replicas_test: %s is missing (scripts/install-deps.sh)\n" % tool)
            print("0 passed, 1 failed")
            sys.exit(1)
    with tempfile.TemporaryDirectory() as tmp:
        grpc, pb, pb_grpc = load_stubs(ARGS.proto_dir, os.path.join(tmp, "stubs"), ARGS.protoc)
        REFERENCE = Reference()
        try:
            program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
        finally:
            REFERENCE.cleanup()

        def show_failure(test_id):
            procs = PROCESSES.get(test_id)
            if procs is not None:
                sys.stderr.write("=== %s: process logs (in %s)\n%s\n"
                                 % (test_id, procs.work, procs.tails()))

        report_and_exit("replicas_test", program.result, WORK_DIRS, ARGS.keep, show_failure)


if __name__ == "__main__":
    main()
