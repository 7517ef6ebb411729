"""deploy/compose.yaml for real (ctest label "container"): Redis, three fwserve replicas
on the shared redis:// session store and HAProxy, all in containers of the fwserve
image and of deploy/docker/Dockerfile.stack (both built by build-image.sh).

Brings the stack up with `docker compose` or podman-compose (deploy/docker/engine.sh),
waits for HAProxy to see the three replicas UP (gRPC and HTTP backends), checks the
OpenAI-compatible HTTP API through the proxy (GET /v1/models, a streamed chat
completion), runs a greedy conversation through the
proxy whose turns land on several replicas (their request logs), forks it, kills one
replica container (SIGKILL), continues the conversation through the proxy (the turn
must equal the fork's, taken before the kill), and tears everything down (`down -v`).

Usage: compose_test.py --repo DIR --fwctl PATH [--keep]
Exit 77 (ctest SKIP_RETURN_CODE) when no container engine can run here.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from container_tools import Engine  # noqa: E402
from replica_processes import Haproxy, free_port  # noqa: E402
from unittest_run import check, report_and_exit  # noqa: E402

NAME = "compose_test"
ARGS = None


def prebuilt():
    """The build directory whose binaries the image takes: only when the image is built
    from the working tree, which that build compiled (not from HEAD)."""
    source = os.environ.get("FWSERVE_IMAGE_SOURCE") or "worktree"
    return ARGS.prebuilt if source == "worktree" else None


ENGINE = None
IMAGE = "fwserve-ctest:latest"
STACK_IMAGE = "fwserve-stack:latest"
REPLICAS = ("fwserve1", "fwserve2", "fwserve3")


class StackProxy(Haproxy):
    """replica_processes.Haproxy's stats readers, for the HAProxy in the stack."""

    def __init__(self, stats_port):  # noqa: super().__init__ starts a process; not here
        self.stats_port = stats_port


class Stack:
    def __init__(self, project, port, http_port, stats_port):
        self.project = project
        self.compose_file = os.path.join(ARGS.repo, "deploy", "compose.yaml")
        self.env = dict(os.environ, FWSERVE_IMAGE=IMAGE, FWSERVE_STACK_IMAGE=STACK_IMAGE,
                        FWSERVE_PORT=str(port), FWSERVE_HTTP_PORT=str(http_port),
                        FWSERVE_STATS_PORT=str(stats_port))
        self.target = "127.0.0.1:%d" % port
        self.http = "http://127.0.0.1:%d" % http_port

    def compose(self, *args, timeout=300, check_rc=True):
        argv = [ENGINE.script, "compose", "-p", self.project, "-f", self.compose_file]
        result = subprocess.run(argv + list(args), capture_output=True, text=True,
                                env=self.env, timeout=timeout)
        if check_rc and result.returncode != 0:
            raise AssertionError("compose %s: exit %d\n%s%s" % (
                " ".join(args), result.returncode, result.stdout[-3000:], result.stderr[-3000:]))
        return result

    def container(self, service):
        """The container of a service, by the compose labels both tools set."""
        out = ENGINE.run(["ps", "-a", "--filter", "label=com.docker.compose.project=%s"
                          % self.project, "--filter", "label=com.docker.compose.service=%s"
                          % service, "--format", "{{.Names}}"]).stdout.split()
        check(len(out) == 1, "containers of service %s: %s" % (service, out))
        return out[0]

    def requests(self, service):
        """The replica's "request id=... method=... session=..." log lines as dicts."""
        text = ENGINE.logs(self.container(service), lines=100000)
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in text.splitlines()
                if " request id=" in line]


def fwctl(target, *args, timeout=120):
    argv = [ARGS.fwctl, "--target", target, "--timeout", "60s"] + list(args)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError("fwctl %s: exit %d: %s" % (" ".join(args), result.returncode,
                                                       result.stderr.strip()))
    return result.stdout


class ComposeTest(unittest.TestCase):
    def test_conversation_hops_replicas_and_survives_a_killed_one(self):
        start = time.monotonic()
        timings = []
        ENGINE.build_image(IMAGE, os.environ.get("FWSERVE_IMAGE_SOURCE"), prebuilt=prebuilt())
        ENGINE.build_image(STACK_IMAGE, dockerfile="deploy/docker/Dockerfile.stack")
        timings.append(("images", time.monotonic() - start))

        stats_port = free_port()
        stack = Stack("fwserve-ctest-%d" % os.getpid(), free_port(), free_port(), stats_port)
        STACKS.append(stack)
        STACKS_SEEN.append(stack)
        t = time.monotonic()
        stack.compose("up", "-d")
        proxy = StackProxy(stats_port)
        deadline = time.monotonic() + 120
        for backend in ("fwserve", "fwserve_http"):  # gRPC health; GET /ready
            states = {}
            while time.monotonic() < deadline:
                try:
                    states = proxy.servers(backend)
                except OSError:
                    states = {}
                if len(states) == 3 and all(s[0] == "UP" for s in states.values()):
                    break
                time.sleep(1)
            check(len(states) == 3 and all(s[0] == "UP" for s in states.values()),
                  "HAProxy does not see 3 replicas UP in backend %s: %s" % (backend, states))
        check("SERVING" in fwctl(stack.target, "health"), "not SERVING through HAProxy")
        timings.append(("up", time.monotonic() - t))

        # The OpenAI-compatible HTTP API through HAProxy's HTTP front door.
        with urllib.request.urlopen(stack.http + "/v1/models", timeout=30) as response:
            models = [m["id"] for m in json.loads(response.read())["data"]]
        check("aft-shakespeare" in models, "GET /v1/models through HAProxy: %s" % models)
        request = urllib.request.Request(
            stack.http + "/v1/chat/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"stream": True, "max_tokens": 16, "temperature": 0, "messages": [
                {"role": "user", "content": "Good morrow"}]}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            check(response.headers.get("Content-Type", "").startswith("text/event-stream"),
                  "streamed chat through HAProxy: Content-Type %s" % response.headers.get(
                      "Content-Type"))
            events = [line.strip() for line in response if line.startswith(b"data: ")]
        check(len(events) >= 2 and events[-1] == b"data: [DONE]",
              "streamed chat through HAProxy: events %s" % events[-3:])

        # A greedy conversation through the proxy: round robin puts its turns on
        # different replicas, each reading the session from Redis.
        session = fwctl(stack.target, "session", "create", "--prefix", "JULIET:\\n").strip()
        check(session != "", "no session id")
        turns = ["Wherefore art thou", "\nROMEO:", "\nJULIET:", "\nROMEO:"]
        for text in turns:
            out = fwctl(stack.target, "generate", "--session", session, "--temperature", "0",
                        "--max-tokens", "12", "--quiet", text)
            check(out != "", "empty turn")
        # Logs name a session by its first characters ("d1946b70...").
        def of_session(line):
            logged = line.get("session", "").rstrip(".")
            return len(logged) >= 8 and session.startswith(logged)

        served = {r: [x for x in stack.requests(r) if of_session(x)] for r in REPLICAS}
        hopped = [r for r, lines in served.items() if lines]
        check(len(hopped) >= 2, "the conversation stayed on %s: %s" % (hopped, served))
        print("conversation served by: %s" % ", ".join(
            "%s %d" % (r, len(served[r])) for r in REPLICAS), flush=True)

        # Fork now; its next turn is what the original must produce after the kill.
        fork = fwctl(stack.target, "session", "fork", session).strip()
        expected = fwctl(stack.target, "generate", "--session", fork, "--temperature", "0",
                         "--max-tokens", "24", "--quiet", "\nJULIET:")
        check(expected != "", "empty turn on the fork")

        victim = stack.container("fwserve2")
        ENGINE.run(["kill", "--signal", "KILL", victim])
        # At once, before HAProxy's checks notice: a connection refused is redispatched.
        after = fwctl(stack.target, "generate", "--session", session, "--temperature", "0",
                      "--max-tokens", "24", "--quiet", "\nJULIET:")
        check(after == expected, "turn after the kill differs from the fork's:\n%r\n%r" % (
            after, expected))
        # A killed container is not restarted (`restart: unless-stopped` leaves a container
        # that was killed through the engine stopped), so HAProxy's checks must find it
        # down: both are asserted, neither is skipped.
        deadline = time.monotonic() + 60
        status = ENGINE.inspect(victim, "{{.State.Status}}")
        while status == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
            status = ENGINE.inspect(victim, "{{.State.Status}}")
        check(status != "running", "the killed container is still (or again) running")
        states = proxy.wait_servers({"fwserve2": "DOWN"}, timeout_s=60)
        check(states.get("fwserve2", ("?",))[0] == "DOWN",
              "HAProxy did not take the killed replica out: %s" % states)
        print("after the kill: HAProxy %s; the killed container is %s" % (
            {k: v[0] for k, v in states.items()}, ENGINE.inspect(victim, "{{.State.Status}}")),
            flush=True)
        for text in ["\nROMEO:", "\nJULIET:", "\nROMEO:"]:
            check(fwctl(stack.target, "generate", "--session", session, "--temperature", "0",
                        "--max-tokens", "8", "--quiet", text) != "", "empty turn after kill")
        info = fwctl(stack.target, "session", "get", session)
        check(session in info, "session get after the kill: %s" % info)

        t = time.monotonic()
        stack.compose("down", "-v", timeout=300)
        timings.append(("down", time.monotonic() - t))
        left = ENGINE.run(["ps", "-a", "-q", "--filter", "label=com.docker.compose.project=%s"
                           % stack.project]).stdout.split()
        check(not left, "containers left after down: %s" % left)
        STACKS.remove(stack)
        timings.append(("total", time.monotonic() - start))
        print("timings: " + ", ".join("%s %.0f s" % step for step in timings), flush=True)


STACKS = []  # stacks up (taken down at the end whatever happened)
STACKS_SEEN = []


def main():
    global ARGS, ENGINE
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--fwctl", required=True)
    parser.add_argument("--prebuilt", default=None,
                        help="a CMake build directory of this tree whose fwserve and fwctl the "
                             "image takes instead of compiling them (build-image.sh --prebuilt)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    ARGS = parser.parse_args()
    ARGS.repo = os.path.abspath(ARGS.repo)
    ENGINE = Engine(ARGS.repo, NAME)
    work = tempfile.mkdtemp(prefix="fwserve-compose-test-")
    result = None
    try:
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(ComposeTest)
        result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    finally:
        for stack in list(STACKS):
            if result is None or not result.wasSuccessful():
                for service in ("redis",) + REPLICAS + ("haproxy",):
                    try:
                        name = stack.container(service)
                        print("--- logs of %s:\n%s" % (name, ENGINE.logs(name, lines=30)))
                    except (AssertionError, RuntimeError) as error:
                        print("--- %s: %s" % (service, error))
            if not ARGS.keep:
                stack.compose("down", "-v", check_rc=False)
        if not ARGS.keep:
            # podman-compose 1.0.3 leaves the project's network behind.
            for stack in STACKS_SEEN:
                ENGINE.run(["network", "rm", stack.project + "_default"], check=False)
    report_and_exit(NAME, result, [work], ARGS.keep, lambda test_id: None)


if __name__ == "__main__":
    main()
