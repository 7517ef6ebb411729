"""The container engine for the container tests (container_test.py, compose_test.py),
through the project's own scripts: deploy/docker/engine.sh (Docker when its daemon
answers, else Podman with deploy/docker/podman-containers.conf) and
deploy/docker/build-image.sh (the image from a clean export of the tree).

    engine = Engine(repo)            # exits SKIP_CODE, saying why, with no engine
    engine.build_image(tag)          # deploy/docker/build-image.sh --tag TAG
    engine.run(["ps", "-a"])         # subprocess.CompletedProcess, text
    engine.cleanup()                 # removes containers and volumes it named
"""
import os
import subprocess
import sys
import time

# ctest's SKIP_RETURN_CODE for these tests (tests/deploy/CMakeLists.txt).
SKIP_CODE = 77


class Engine:
    def __init__(self, repo, name):
        self.repo = repo
        self.script = os.path.join(repo, "deploy", "docker", "engine.sh")
        found = subprocess.run([self.script, "--which"], capture_output=True, text=True)
        if found.returncode == 3:
            # Visible in ctest's output (and counted as "Skipped", never "Passed").
            print("%s: SKIPPED: %s" % (name, found.stderr.strip()))
            sys.exit(SKIP_CODE)
        if found.returncode != 0:
            raise RuntimeError("engine.sh --which failed: %s" % found.stderr)
        self.name = found.stdout.strip()
        self.containers = []
        self.volumes = []
        print("%s: container engine %s" % (name, self.name), flush=True)

    def run(self, args, check=True, timeout=300, input=None):
        result = subprocess.run([self.script] + list(args), capture_output=True, text=True,
                                timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise RuntimeError("%s %s: exit %d\n%s%s" % (
                self.name, " ".join(args), result.returncode, result.stdout, result.stderr))
        return result

    def build_image(self, tag, source=None, dockerfile=None, prebuilt=None):
        """Builds with build-image.sh, its output streaming to ours; returns seconds.
        `prebuilt`: a build directory whose fwserve and fwctl the image takes."""
        argv = [os.path.join(self.repo, "deploy", "docker", "build-image.sh"), "--tag", tag]
        if source:
            argv += ["--source", source]
        if dockerfile:
            argv += ["--dockerfile", dockerfile]
        if prebuilt:
            argv += ["--prebuilt", prebuilt]
        start = time.monotonic()
        print("+ " + " ".join(argv), flush=True)
        subprocess.run(argv, check=True, stdout=sys.stdout, stderr=sys.stderr)
        return time.monotonic() - start

    def container(self, name):
        """Records a container name for cleanup() (and removes a leftover of that name)."""
        self.run(["rm", "-f", name], check=False)
        self.containers.append(name)
        return name

    def volume(self, name):
        self.run(["volume", "rm", "-f", name], check=False)
        self.volumes.append(name)
        return name

    def inspect(self, name, template):
        return self.run(["inspect", "--format", template, name]).stdout.strip()

    def inspect_json(self, name):
        """`inspect NAME` as a dict (the first object)."""
        import json
        return json.loads(self.run(["inspect", name]).stdout)[0]

    def logs(self, name, lines=60):
        out = self.run(["logs", "--tail", str(lines), name], check=False)
        return out.stdout + out.stderr

    def cleanup(self):
        for name in self.containers:
            self.run(["rm", "-f", "-t", "0", name], check=False)
        for name in self.volumes:
            self.run(["volume", "rm", "-f", name], check=False)
