"""The fwserve image, built and run for real (ctest label "container").

Builds the image with deploy/docker/build-image.sh (a clean export of the tree), then:
a container with a read-only root filesystem, as uid 10001, a named session volume;
health SERVING (fwctl from the host, and the image's own HEALTHCHECK); the HTTP API on
the published port 8000 (GET /health, /ready, /v1/models, a greedy /v1/completions,
counted on /metrics); a greedy generate with fwctl from the host; a session with one
turn, forked; SIGTERM stops the
container (exit 0, drained); a new container on the same volume continues the session,
whose next greedy turn must equal the fork's (taken before the stop).

Usage: container_test.py --repo DIR --fwctl PATH [--keep]
Exit 77 (ctest SKIP_RETURN_CODE) when no container engine can run here.
Environment: FWSERVE_IMAGE_SOURCE=worktree|head (build-image.sh --source),
FWSERVE_CONTAINER_ENGINE=docker|podman (skip the detection).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from container_tools import Engine  # noqa: E402
from replica_processes import free_port  # noqa: E402
from unittest_run import check, report_and_exit  # noqa: E402

NAME = "container_test"
ARGS = None


def prebuilt():
    """The build directory whose binaries the image takes: only when the image is built
    from the working tree, which that build compiled (not from HEAD)."""
    source = os.environ.get("FWSERVE_IMAGE_SOURCE") or "worktree"
    return ARGS.prebuilt if source == "worktree" else None


ENGINE = None
TAG = "fwserve-ctest:latest"
UID = "10001"


def fwctl(target, *args, timeout=120, check_rc=True):
    argv = [ARGS.fwctl, "--target", target, "--timeout", "60s"] + list(args)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check_rc and result.returncode != 0:
        raise AssertionError("fwctl %s: exit %d: %s" % (" ".join(args), result.returncode,
                                                       result.stderr.strip()))
    return result


def wait_serving(container, target, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        state = ENGINE.inspect(container, "{{.State.Status}}")
        check(state == "running", "container %s is %s:\n%s" % (container, state,
                                                                ENGINE.logs(container)))
        last = fwctl(target, "--retries", "0", "--timeout", "2s", "health", timeout=30,
                     check_rc=False)
        if last.returncode == 0:
            check("SERVING" in last.stdout, "health printed %r" % last.stdout)
            return
        time.sleep(1)
    raise AssertionError("not SERVING after %d s (last: %s %s):\n%s" % (
        timeout_s, last.stdout, last.stderr, ENGINE.logs(container)))


def start_container(name, volume):
    """Runs the image as it ships (its USER and CMD), with a read-only root, /tmp on a
    tmpfs and the sessions on `volume`; returns (gRPC target, HTTP port, metrics port)."""
    ENGINE.container(name)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    ENGINE.run(["run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp",
                "-p", "127.0.0.1:%d:50051" % grpc_port, "-p", "127.0.0.1:%d:8000" % http_port,
                "-p", "127.0.0.1:%d:9464" % metrics_port,
                "-v", "%s:/var/lib/fwserve/sessions" % volume, TAG])
    target = "127.0.0.1:%d" % grpc_port
    wait_serving(name, target)
    # fwserve opens the HTTP port just after the gRPC one.
    deadline = time.monotonic() + 30
    while True:
        try:
            last = http_json(http_port, "/health", timeout=5)
            if last[0] == 200:
                break
        except (OSError, ValueError) as error:  # refused or reset before it listens
            last = error
        check(time.monotonic() < deadline, "GET /health on port %d: %s\n%s" % (
            http_port, last, ENGINE.logs(name)))
        time.sleep(0.5)
    return target, http_port, metrics_port


def http_json(port, path, body=None, timeout=60):
    """(status, parsed JSON body) of GET path, or POST with the JSON `body`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


class ContainerTest(unittest.TestCase):
    def test_image_serves_and_keeps_sessions_across_containers(self):
        steps = []
        start = time.monotonic()
        steps.append(("build", ENGINE.build_image(TAG, os.environ.get("FWSERVE_IMAGE_SOURCE"),
                                               prebuilt=prebuilt())))

        # The image's metadata: the user, the health check, the session volume.
        check(ENGINE.inspect(TAG, "{{.Config.User}}").startswith(UID),
              "image USER is %r" % ENGINE.inspect(TAG, "{{.Config.User}}"))
        image = ENGINE.inspect_json(TAG)
        # Docker: Config.Healthcheck; Podman: Healthcheck (kept with --format docker).
        health = str(image.get("Config", {}).get("Healthcheck") or image.get("Healthcheck"))
        check("fwctl" in health and "health" in health, "image HEALTHCHECK is %s" % health)
        size = int(ENGINE.inspect(TAG, "{{.Size}}"))
        print("image %s: %d MB" % (TAG, size // 1000000), flush=True)

        volume = ENGINE.volume("fwserve-ctest-sessions-%d" % os.getpid())
        ENGINE.run(["volume", "create", volume])
        first = "fwserve-ctest-a-%d" % os.getpid()
        t = time.monotonic()
        target, http_port, metrics_port = start_container(first, volume)
        steps.append(("start+SERVING", time.monotonic() - t))

        # OpenBLAS, not the reference BLAS (20x slower), is what LibTorch loaded.
        check("reference BLAS" not in ENGINE.logs(first), "slow BLAS in the image:\n%s"
              % ENGINE.logs(first))
        # uid 10001 and a read-only root; the session directory is writable.
        check(ENGINE.run(["exec", first, "id", "-u"]).stdout.strip() == UID, "not uid 10001")
        check(ENGINE.inspect(first, "{{.HostConfig.ReadonlyRootfs}}") == "true",
              "root filesystem not read-only")
        touch = ENGINE.run(["exec", first, "touch", "/opt/fwserve/x"], check=False)
        check(touch.returncode != 0 and "Read-only" in touch.stderr,
              "writing under / should fail read-only: %d %s" % (touch.returncode, touch.stderr))
        # The image's own HEALTHCHECK command passes (podman/docker run it in the container).
        if ENGINE.name == "podman":
            hc = ENGINE.run(["healthcheck", "run", first], check=False)
            check(hc.returncode == 0, "podman healthcheck run: %d %s%s" % (
                hc.returncode, hc.stdout, hc.stderr))
        else:
            deadline = time.monotonic() + 90
            while ENGINE.inspect(first, "{{.State.Health.Status}}") != "healthy":
                check(time.monotonic() < deadline, "docker health never 'healthy'")
                time.sleep(2)
        # The HTTP API (the image's CMD has --http-listen=0.0.0.0:8000) on its published
        # port: the probes, the model list and a greedy completion.
        status, body = http_json(http_port, "/health")
        check(status == 200 and body == {"status": "ok"}, "GET /health: %s %s" % (status, body))
        status, body = http_json(http_port, "/ready")
        check(status == 200 and body.get("status") == "ready" and body.get("models", 0) >= 1,
              "GET /ready: %s %s" % (status, body))
        status, body = http_json(http_port, "/v1/models")
        models = [m.get("id") for m in (body or {}).get("data", [])]
        check(status == 200 and "aft-shakespeare" in models, "GET /v1/models: %s %s" % (
            status, body))
        status, body = http_json(http_port, "/v1/completions", {
            "prompt": "ROMEO:", "max_tokens": 16, "temperature": 0})
        choices = (body or {}).get("choices") or [{}]
        check(status == 200 and choices[0].get("text"), "POST /v1/completions: %s %s" % (
            status, body))
        # Metrics are published too, the HTTP requests among them.
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics_port,
                                    timeout=10) as response:
            exposition = response.read()
        check(b"fwserve_" in exposition, "no fwserve_ series on /metrics")
        check(b'rpc="GET /v1/models"' in exposition, "no GET /v1/models requests on /metrics")

        # A greedy generate from the host.
        out = fwctl(target, "generate", "--temperature", "0", "--max-tokens", "24", "--quiet",
                    "ROMEO:")
        check(len(out.stdout) > 0, "empty generation")

        # A session: one turn, then a fork taken before the stop; the fork's next turn is
        # what the original must produce after the restart.
        session = fwctl(target, "session", "create", "--prefix", "JULIET:\\n").stdout.strip()
        check(session != "", "no session id")
        fwctl(target, "generate", "--session", session, "--temperature", "0",
              "--max-tokens", "16", "--quiet", "Wherefore art thou")
        fork = fwctl(target, "session", "fork", session).stdout.strip()
        expected = fwctl(target, "generate", "--session", fork, "--temperature", "0",
                         "--max-tokens", "24", "--quiet", "\nROMEO:").stdout
        check(len(expected) > 0, "empty turn on the fork")

        # SIGTERM (the image's STOPSIGNAL): fwserve drains and exits 0 well within 60 s.
        t = time.monotonic()
        ENGINE.run(["stop", "-t", "60", first], timeout=120)
        stop_s = time.monotonic() - t
        steps.append(("SIGTERM stop", stop_s))
        code = ENGINE.inspect(first, "{{.State.ExitCode}}")
        check(code == "0", "exit code after SIGTERM is %s (137 = killed):\n%s" % (
            code, ENGINE.logs(first)))
        # The exit code tells a drain from the engine's SIGKILL at 60 s; stop_s is reported
        # with the steps, not judged (a slow machine is not a failure).

        # A new container, the same volume: the session is there and continues greedily
        # exactly as its fork did.
        second = "fwserve-ctest-b-%d" % os.getpid()
        t = time.monotonic()
        target, http_port, _ = start_container(second, volume)
        steps.append(("restart+SERVING", time.monotonic() - t))
        got = fwctl(target, "session", "get", session)
        check(session in got.stdout, "session %s missing after restart: %s" % (session,
                                                                                got.stdout))
        status, body = http_json(http_port, "/fwserve/v1/sessions/%s" % session)
        check(status == 200 and (body or {}).get("id") == session,
              "GET /fwserve/v1/sessions/%s after restart: %s %s" % (session, status, body))
        after = fwctl(target, "generate", "--session", session, "--temperature", "0",
                      "--max-tokens", "24", "--quiet", "\nROMEO:").stdout
        check(after == expected, "continued session differs after restart:\n%r\n%r" % (
            after, expected))
        ENGINE.run(["stop", "-t", "60", second], timeout=120)
        check(ENGINE.inspect(second, "{{.State.ExitCode}}") == "0", "second exit code")
        steps.append(("total", time.monotonic() - start))
        print("timings: " + ", ".join("%s %.0f s" % step for step in steps), flush=True)


def main():
    global ARGS, ENGINE
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--fwctl", required=True)
    parser.add_argument("--prebuilt", default=None,
                        help="a CMake build directory of this tree whose fwserve and fwctl the "
                             "image takes instead of compiling them (build-image.sh --prebuilt)")
    parser.add_argument("--keep", action="store_true", help="keep containers and volume")
    ARGS = parser.parse_args()
    ENGINE = Engine(os.path.abspath(ARGS.repo), NAME)
    work = tempfile.mkdtemp(prefix="fwserve-container-test-")
    result = None
    try:
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(ContainerTest)
        result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    finally:
        if result is None or not result.wasSuccessful():
            for name in ENGINE.containers:
                print("--- logs of %s:\n%s" % (name, ENGINE.logs(name)))
        if not ARGS.keep:
            ENGINE.cleanup()
    report_and_exit(NAME, result, [work], ARGS.keep, lambda test_id: None)


if __name__ == "__main__":
    main()
