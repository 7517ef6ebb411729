#!/usr/bin/env python3
"""The GPU machine's checks (issue 26); scripts/gpu/check.sh runs this. See docs/gpu.md.

Writes OUT_DIR/report.md and OUT_DIR/report.json (plus the raw outputs beside them):
  machine      nvidia-smi, the versions used (compiler, CMake, nvcc, PyTorch, LibTorch, protoc)
  model_tests  fwserve_model_tests: the CUDA equivalence cases (CUDA logits and log-probs
               equal the CPU reference within 1e-4 relative, every architecture incl. PKM,
               RWKV-7 and RWKV-4,
               sequence and recurrent form, TF32 off) and, with CHECK_MODEL_TESTS=all
               (the default), every other model test (ctest, in parallel)
  serving      fwserve --device DEVICE beside fwserve --device cpu, every shipped model:
               a greedy generation; Score equal to the CPU server's; a session round trip
               (create, generate, fork, export, import onto the CPU server, Score of the
               session's continuation equal on both, export from the CPU server, import back)
  fwbench      tokens/s, ITL p50/p99, TTFT and GPU memory per stream at each level of
               streams; a 64 KB prefill (session create with a 65536-byte prefix)
  kernels      the decode kernel the device server uses (on CUDA: "graph", its steps
               captured as CUDA Graphs, in place, sampling inside the step, from its
               log), and an A/B/C of tokens/s at CHECK_KERNEL_STREAMS (1,64) streams
               against the same kernel with --sample-in-step=false and against
               --decode-kernel libtorch (eager Model::Step), 3 rounds alternating, the
               median ratios and their ranges
  real_shape   fwbench on an RWKV-7 of the 0.1B G1 shape and a DeltaNet of fla-hub's 340M
               shape (random weights, written by fwmodel init; 64-token replies; which:
               CHECK_REAL_SHAPES) at CHECK_REAL_SHAPE_STREAMS (1,64,512 on CUDA, 1,64 on
               CPU) streams; the RWKV-7 file is written in CHECK_REAL_SHAPE_STORAGE (BF16,
               as G1 ships); a 1,024-token prompt's prefill (CHECK_REAL_SHAPE_PREFILL
               tokens, 0 skips: fwbench, one stream, one reply token, prompt tokens over
               the time to first token); and the eager PyTorch baseline on the same file at
               the same batches (CHECK_REAL_SHAPE_BASELINE, 1; 0 skips)
  host_path    the null step (--benchmark-null-step, a CPU server: no model work) at the
               same levels, beside the device's: the host path's own ceiling (issue 48)
  baseline     bench/pytorch_baseline.py --device DEVICE at batch sizes equal to the levels
DEVICE is cuda when nvidia-smi sees a GPU and the build's LibTorch has CUDA, else cpu:
then the report says so, the CUDA cases are "needs a CUDA run", and the rest runs on CPU.

Environment: BUILD_DIR (build-gpu), CHECK_MODEL_TESTS (all | cuda | none),
CHECK_STREAMS (default 1,16,64,256,1024,4096 on CUDA, 1,16 on CPU), CHECK_DURATION (10s on
CUDA, 3s on CPU), CHECK_BENCH_MODEL (aft-shakespeare), CHECK_TOKENS (baseline tokens, 128),
CHECK_PREFILL_RUNS (3), CHECK_REAL_SHAPE_STREAMS (1,64,512 on CUDA; empty skips),
CHECK_REAL_SHAPES (rwkv7-0.1b,delta_net-340m), CHECK_REAL_SHAPE_STORAGE (BF16),
CHECK_REAL_SHAPE_PREFILL (1024), CHECK_REAL_SHAPE_MATRICES (bf16: the RWKV-7 server's
--gpu-matrices on CUDA; float32 for the other arm), CHECK_REAL_SHAPE_BASELINE (1), CHECK_KERNEL_STREAMS (1,64), CHECK_AB_LABEL and CHECK_AB_FLAGS (the
kernels section's second arm: apart, --sample-in-step=false), CHECK_AB_ARMS ("label=flags;..."
in place of that arm: several arms, each in every round), CHECK_KERNEL_DURATION (5s on CUDA, 2s
on CPU), CHECK_SANITIZER_TIMEOUT (240 s), CHECK_BENCH_PROCESSES (fwbench --processes: 4 on
CUDA, 1 on CPU), CHECK_HOST_PATH (1; 0 skips the null-step section).
Exit status: 0 when no check failed (skipped ones do not fail), 1 otherwise.
"""
import datetime
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-4


def run(argv, timeout=600, env=None, **kw):
    """subprocess.run with text output; never raises on a non-zero exit or a timeout."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=env, **kw)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(argv, 124, e.stdout or "", (e.stderr or "") +
                                           "\n(timed out after %d s)" % timeout)
    except OSError as e:
        return subprocess.CompletedProcess(argv, 127, "", str(e))


def first_line(argv):
    r = run(argv, timeout=60)
    text = (r.stdout or r.stderr).strip()
    return text.splitlines()[0] if r.returncode == 0 and text else None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Report:
    def __init__(self, out):
        self.out = out
        self.data = {"started_at": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "checks": []}

    def check(self, section, name, status, detail="", **data):
        assert status in ("pass", "fail", "skip", "needs a CUDA run", "info")
        entry = {"section": section, "name": name, "status": status, "detail": detail}
        entry.update(data)
        self.data["checks"].append(entry)
        print("check.sh: [%s] %s: %s%s" % (status, section, name,
                                           (" — " + detail) if detail else ""), flush=True)
        # So far, after every check: a run cut off by its time limit still reports.
        with open(os.path.join(self.out, "report-partial.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        return entry

    def failed(self):
        return [c for c in self.data["checks"] if c["status"] == "fail"]


# ---------------------------------------------------------------------------------------
# Machine and versions.

def machine(rep, build_info):
    out = rep.out
    smi = shutil.which("nvidia-smi")
    gpu = None
    if smi:
        r = run([smi], timeout=60)
        with open(os.path.join(out, "nvidia-smi.txt"), "w") as f:
            f.write(r.stdout + r.stderr)
        q = run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                 "--format=csv,noheader"], timeout=60)
        if r.returncode == 0 and q.returncode == 0 and q.stdout.strip():
            name, driver, memory, cap = [x.strip() for x in q.stdout.splitlines()[0].split(",")]
            gpu = {"name": name, "driver": driver, "memory": memory, "compute_cap": cap}
    torch_py = run([sys.executable, "-c",
                    "import json, torch; print(json.dumps({'version': torch.__version__, "
                    "'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), "
                    "'cxx11_abi': bool(torch._C._GLIBCXX_USE_CXX11_ABI), "
                    "'cuda_available': torch.cuda.is_available()}))"], timeout=120)
    versions = {
        "uname": " ".join(os.uname()),
        "g++": first_line(["g++", "--version"]),
        "cmake": first_line(["cmake", "--version"]),
        "nvcc": None,
        "python3": sys.version.split()[0],
        "python3 torch": json.loads(torch_py.stdout) if torch_py.returncode == 0 else None,
        "build (scripts/gpu/build.sh)": build_info,
    }
    nvcc = (build_info or {}).get("cuda_nvcc") or shutil.which("nvcc")
    if nvcc:
        r = run([nvcc, "--version"], timeout=60)
        m = re.search(r"release [0-9.]+, V[0-9.]+", r.stdout)
        versions["nvcc"] = m.group(0) if m else None
    sums = os.path.join(REPO, ".gpu-kit", "SHA256SUMS")
    if os.path.exists(sums):
        versions["kit SHA256SUMS sha256"] = hashlib.sha256(open(sums, "rb").read()).hexdigest()
    git = run(["git", "-C", REPO, "rev-parse", "HEAD"], timeout=30)
    versions["tree"] = git.stdout.strip() if git.returncode == 0 else "(no git here)"
    rep.data["gpu"] = gpu
    rep.data["versions"] = versions
    torch_cuda = (build_info or {}).get("torch_cuda")
    if gpu and torch_cuda:
        device = "cuda"
        rep.check("machine", "GPU", "pass", "%s, driver %s, %s, compute capability %s; LibTorch "
                  "CUDA %s" % (gpu["name"], gpu["driver"], gpu["memory"], gpu["compute_cap"],
                               torch_cuda))
    elif gpu:
        device = "cpu"
        rep.check("machine", "GPU", "fail", "nvidia-smi sees %s, but the LibTorch fwserve was "
                  "built against has no CUDA (%s)" % (gpu["name"], (build_info or {}).get(
                      "torch_from")))
    else:
        device = "cpu"
        rep.check("machine", "GPU", "needs a CUDA run",
                  "no GPU on this machine (%s): the CUDA checks are skipped; the CPU parts run"
                  % ("nvidia-smi fails" if smi else "no nvidia-smi"))
    rep.data["device"] = device
    return device


# ---------------------------------------------------------------------------------------
# Model tests.

def model_tests(rep, build, device):
    which = os.environ.get("CHECK_MODEL_TESTS", "all")
    binary = os.path.join(build, "tests", "fwserve_model_tests")
    if which == "none":
        rep.check("model_tests", "fwserve_model_tests", "skip", "CHECK_MODEL_TESTS=none")
        return
    if not os.path.exists(binary):
        rep.check("model_tests", "fwserve_model_tests", "fail", "%s is missing" % binary)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The CUDA equivalence cases: the test binary itself, for its per-case differences.
    json_path = os.path.join(rep.out, "model-tests-cuda.json")
    start = time.monotonic()
    r = run([binary, "--gtest_filter=*CudaEquivalence*", "--gtest_output=json:" + json_path],
            timeout=1800, env=env)
    seconds = round(time.monotonic() - start, 1)
    with open(os.path.join(rep.out, "model-tests-cuda.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    failed_names = []
    try:
        doc = json.load(open(json_path))
        for suite in doc.get("testsuites", []):
            for t in suite.get("testsuite", []):
                counts["tests"] += 1
                if t.get("failures"):
                    counts["failed"] += 1
                    failed_names.append("%s.%s" % (suite["name"], t["name"]))
                elif t.get("result") == "SKIPPED":
                    counts["skipped"] += 1
                else:
                    counts["passed"] += 1
    except (OSError, ValueError):
        pass
    diffs = []
    for m in re.finditer(r"^cuda-vs-cpu (\S+) max_rel_logits=(\S+) max_rel_logprobs=(\S+)$",
                         r.stdout, re.M):
        diffs.append({"case": m.group(1), "max_rel_logits": float(m.group(2)),
                      "max_rel_logprobs": float(m.group(3))})
    detail = "%(tests)d cases: %(passed)d passed, %(failed)d failed, %(skipped)d skipped" % counts
    detail += " in %s s" % seconds
    if r.returncode != 0 or counts["failed"] or counts["tests"] == 0:
        status = "fail"
        detail += "; exit %d%s" % (r.returncode, (": " + ", ".join(failed_names[:10]))
                                    if failed_names else "")
    elif counts["skipped"] == counts["tests"]:
        status = "needs a CUDA run"
        detail += " (no usable CUDA device in this LibTorch build)"
    else:
        status = "pass"
    if diffs:
        worst = max(diffs, key=lambda d: max(d["max_rel_logits"], d["max_rel_logprobs"]))
        detail += "; largest CUDA-CPU difference %.3g (%s), tolerance %g" % (
            max(worst["max_rel_logits"], worst["max_rel_logprobs"]), worst["case"], TOLERANCE)
    rep.check("model_tests", "CUDA equivalence", status, detail, counts=counts, seconds=seconds,
              cuda_vs_cpu=diffs)
    captured = re.findall(r"^in-place graph step (\S+): captured=(\d)$", r.stdout, re.M)
    if captured:
        rep.data["in_place_graph_step_captured"] = {c: v == "1" for c, v in captured}

    # compute-sanitizer (memcheck) over one configuration of the in-place graph step and
    # the equivalence test: out-of-bounds or misaligned device accesses fail it.
    sanitizer = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if device != "cuda":
        rep.check("model_tests", "compute-sanitizer memcheck", "needs a CUDA run", "")
    elif not sanitizer:
        rep.check("model_tests", "compute-sanitizer memcheck", "skip", "no compute-sanitizer")
    else:
        start = time.monotonic()
        r = run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", binary,
                 "--gtest_filter=*CudaEquivalence*aft_squared_relu_dconv3_nu1*"],
                timeout=int(os.environ.get("CHECK_SANITIZER_TIMEOUT", "240")), env=env)
        with open(os.path.join(rep.out, "compute-sanitizer.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        summary = re.findall(r"ERROR SUMMARY: (\d+) error", r.stdout + r.stderr)
        rep.check("model_tests", "compute-sanitizer memcheck (aft_squared_relu_dconv3_nu1)",
                  "pass" if r.returncode == 0 else "fail",
                  "exit %d, %s errors, %.0f s" % (r.returncode, summary[-1] if summary else "?",
                                                   time.monotonic() - start))

    if which != "all":
        return
    # Every other model test (fwserve_model_tests, fwserve_core_tests), through ctest in
    # parallel as the suite runs them.
    ctest = shutil.which("ctest")
    if not ctest:
        rep.check("model_tests", "the other model tests", "skip", "no ctest here")
        return
    start = time.monotonic()
    r = run([ctest, "--test-dir", build, "--output-on-failure", "--parallel",
             str(os.cpu_count() or 2), "-E", "CudaEquivalence", "--timeout", "900"],
            timeout=3600, env=env)
    seconds = round(time.monotonic() - start, 1)
    with open(os.path.join(rep.out, "model-tests-other.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    m = re.search(r"(\d+)% tests passed, (\d+) tests failed out of (\d+)", r.stdout)
    if m and r.returncode == 0:
        rep.check("model_tests", "the other model tests", "pass",
                  "%s tests passed (ctest, %d jobs) in %s s" % (m.group(3), os.cpu_count() or 2,
                                                                seconds))
    else:
        failed = re.findall(r"^\s*\d+ - (\S+) \(Failed\)", r.stdout, re.M)
        rep.check("model_tests", "the other model tests", "fail",
                  "ctest exit %d%s in %s s%s" % (
                      r.returncode, (": %s of %s failed" % (m.group(2), m.group(3))) if m else "",
                      seconds, (": " + ", ".join(failed[:10])) if failed else ""))


# ---------------------------------------------------------------------------------------
# Servers.

class Server:
    def __init__(self, rep, build, device, models, key_file, name, extra=()):
        self.port, self.metrics_port = free_port(), free_port()
        self.device, self.name = device, name
        self.log_path = os.path.join(rep.out, "fwserve-%s.log" % name)
        self.argv = [os.path.join(build, "server", "fwserve"), "--device", device,
                     "--listen", "127.0.0.1:%d" % self.port,
                     "--metrics-listen", "127.0.0.1:%d" % self.metrics_port,
                     "--session-key-file", key_file, "--log-level", "info",
                     "--max-active-streams", "4096", "--max-queued-requests", "8192",
                     "--max-streams-per-connection", "8192"] + list(extra)
        for m in models:
            self.argv += ["--model", m]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.fwctl = os.path.join(build, "client", "fwctl")

    def target(self):
        return "127.0.0.1:%d" % self.port

    def wait_healthy(self, seconds=300):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.ctl(["health"], timeout=10).returncode == 0:
                return True
            time.sleep(0.5)
        return False

    def ctl(self, args, timeout=300):
        return run([self.fwctl, "--target", self.target(), "--retries", "0"] + args,
                   timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def scores_close(a, b):
    """max |a - b| of two Score replies' logprobs, and whether it is within tolerance."""
    la, lb = a.get("logprobs", []), b.get("logprobs", [])
    if len(la) != len(lb) or not la:
        return float("inf"), False
    diff = max(abs(x - y) for x, y in zip(la, lb))
    return diff, diff <= TOLERANCE


def score(server, text, model, session=None):
    args = ["score", "--json", "--model", model]
    if session:
        args += ["--session", session]
    r = server.ctl(args + ["--", text])
    if r.returncode != 0:
        raise RuntimeError("%s score: exit %d: %s" % (server.name, r.returncode, r.stderr.strip()))
    return json.loads(r.stdout)


def ctl_ok(server, args, what):
    r = server.ctl(args)
    if r.returncode != 0:
        raise RuntimeError("%s %s: exit %d: %s" % (server.name, what, r.returncode,
                                                   r.stderr.strip()))
    return r.stdout.strip()


def serving(rep, build, device, models, text):
    key = os.path.join(rep.out, "tmp", "session.key")
    os.makedirs(os.path.dirname(key), exist_ok=True)
    with open(key, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(key, 0o600)
    dev = Server(rep, build, device, models, key, "device-" + device)
    dev.role = "under test"
    cpu = Server(rep, build, "cpu", models, key, "cpu")
    cpu.role = "reference"
    servers = [dev, cpu]
    try:
        for s in servers:
            start = time.monotonic()
            what = "fwserve %s (--device %s) starts" % (s.role, s.device)
            if not s.wait_healthy():
                rep.check("serving", what, "fail",
                          "not healthy; log %s: %s" % (s.log_path,
                                                       open(s.log_path).read()[-2000:]))
                return None, servers
            rep.check("serving", what, "pass",
                      "healthy in %.1f s with %d models" % (time.monotonic() - start,
                                                            len(models)))
        names = [os.path.basename(m) for m in models]
        score_text = text[:256]
        for name in names:
            # A greedy generation on each server.
            gen = {}
            for s in servers:
                r = s.ctl(["generate", "--model", name, "--temperature", "0", "--max-tokens",
                           "48", "--quiet", "--", "ROMEO:"])
                gen[s.name] = (r.returncode, r.stdout)
            rc, out = gen[dev.name]
            same = gen[dev.name] == gen[cpu.name]
            rep.check("serving", "%s: generation on %s" % (name, device),
                      "pass" if rc == 0 and out else "fail",
                      "%d bytes; greedy text %s the CPU server's" % (
                          len(out), "equals" if same else "differs from"),
                      text=out, cpu_text=gen[cpu.name][1])
            # Score equal to the CPU server's.
            try:
                a, b = score(dev, score_text, name), score(cpu, score_text, name)
                diff, ok = scores_close(a, b)
                rep.check("serving", "%s: Score on %s equals CPU" % (name, device),
                          "pass" if ok else "fail",
                          "%d tokens, max |Δ logprob| %.3g (tolerance %g)" % (
                              len(a.get("logprobs", [])), diff, TOLERANCE), max_abs_diff=diff)
            except (RuntimeError, ValueError) as e:
                rep.check("serving", "%s: Score on %s equals CPU" % (name, device), "fail", str(e))
            # Session round trip.
            try:
                sid = ctl_ok(dev, ["session", "create", "--model", name, "--prefix",
                                   "KING RICHARD III:\\n"], "session create")
                ctl_ok(dev, ["generate", "--session", sid, "--temperature", "0",
                             "--max-tokens", "16", "--quiet", "--", "Now is the"], "generate")
                fork = ctl_ok(dev, ["session", "fork", sid], "session fork")
                blob = os.path.join(rep.out, "tmp", "%s-%s.session" % (name, device))
                ctl_ok(dev, ["session", "export", fork, blob], "session export")
                on_cpu = ctl_ok(cpu, ["session", "import", "--model", name, blob],
                                "session import")
                cont = text[300:428]
                a = score(dev, cont, name, session=fork)
                b = score(cpu, cont, name, session=on_cpu)
                diff1, ok1 = scores_close(a, b)
                back_blob = blob + ".back"
                ctl_ok(cpu, ["session", "export", on_cpu, back_blob], "session export")
                back = ctl_ok(dev, ["session", "import", "--model", name, back_blob],
                              "session import")
                c = score(dev, cont, name, session=back)
                diff2, ok2 = scores_close(a, c)
                orig = score(dev, cont, name, session=sid)
                diff3, ok3 = scores_close(a, orig)
                ok = ok1 and ok2 and ok3
                rep.check("serving", "%s: session round trip %s -> cpu -> %s" % (
                    name, device, device), "pass" if ok else "fail",
                    "create, generate, fork, export (%d bytes), import on cpu, export, import "
                    "back; Score of a continuation: fork vs its cpu import %.3g, vs the import "
                    "back %.3g, vs the original session %.3g (tolerance %g)" % (
                        os.path.getsize(blob), diff1, diff2, diff3, TOLERANCE),
                    max_abs_diff={"cpu_import": diff1, "import_back": diff2, "original": diff3})
            except (RuntimeError, ValueError, OSError) as e:
                rep.check("serving", "%s: session round trip" % name, "fail", str(e))
        return dev, servers
    except Exception:
        for s in servers:
            s.stop()
        raise


# ---------------------------------------------------------------------------------------
# Benchmarks.

def rounded(v, digits=4):
    """v to `digits` significant digits (None stays None)."""
    return None if v is None else float("%.*g" % (digits, v))


class GpuMemory(threading.Thread):
    """Samples the GPU memory nvidia-smi reports for one process, every 0.25 s."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop_flag = pid, 0, threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def read(self):
        if not self.smi:
            return None
        r = run([self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                timeout=30)
        for line in r.stdout.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0] == str(self.pid) and parts[1].isdigit():
                return int(parts[1])
        return None

    def run(self):
        while not self.stop_flag.is_set():
            v = self.read()
            if v is not None:
                self.peak = max(self.peak, v)
            time.sleep(0.25)


def level_row(level):
    """A report row of one fwbench level (its --json "levels" entry)."""
    engine = level.get("server_engine") or {}
    return {
        "tokens_per_s": round(level["output_tokens_per_s"], 1),
        "itl_p50_ms": rounded(level["itl_ms"].get("p50")),
        "itl_p99_ms": rounded(level["itl_ms"].get("p99")),
        "ttft_p50_ms": rounded(level["ttft_ms"].get("p50")),
        "errors": level.get("errors"),
        "mean_batch_size": rounded(engine.get("mean_batch_size")),
        "mean_step_ms": rounded(engine.get("mean_step_ms")),
        "tokens_per_message": rounded(level.get("tokens_per_message")),
        "server_cpu_us_per_token": rounded(level.get("server_cpu_us_per_token")),
        "engine_thread_cpu_us_per_token": rounded(
            level.get("server_engine_thread_cpu_us_per_token")),
        "bench_cpu_us_per_token": rounded(level.get("bench_cpu_us_per_token")),
    }


def bench_processes(device):
    """fwbench --processes: CHECK_BENCH_PROCESSES, else 4 on CUDA (a GPU machine has the
    cores; one client process caps near 200k tokens/s) and 1 on the CPU."""
    return os.environ.get("CHECK_BENCH_PROCESSES", "4" if device == "cuda" else "1")


def bench(rep, build, device, server, models, text):
    model = os.environ.get("CHECK_BENCH_MODEL", "aft-shakespeare")
    cuda = device == "cuda"
    levels = [int(x) for x in os.environ.get(
        "CHECK_STREAMS", "1,16,64,256,1024,4096" if cuda else "1,16").split(",")]
    duration = os.environ.get("CHECK_DURATION", "10s" if cuda else "3s")
    fwbench = os.path.join(build, "bench", "fwbench")
    state_bytes = None
    r = server.ctl(["models"])
    for line in r.stdout.splitlines():
        cols = line.split()
        if cols and cols[0] == model and len(cols) >= 6 and cols[-2].isdigit():
            state_bytes = int(cols[-2])
    mem = GpuMemory(server.proc.pid) if cuda else None
    idle = mem.read() if mem else None
    rows = []
    for c in levels:
        json_path = os.path.join(rep.out, "fwbench-%d.json" % c)
        if mem:
            mem = GpuMemory(server.proc.pid)
            mem.start()
        start = time.monotonic()
        r = run([fwbench, "--target", server.target(), "--model", model, "--concurrency",
                 str(c), "--duration", duration, "--warmup", "2s" if cuda else "1s",
                 "--max_tokens", "128", "--json", json_path,
                 "--processes", bench_processes(device),
                 "--metrics_target", "127.0.0.1:%d" % server.metrics_port,
                 "--server_pid", str(server.proc.pid), "--label", "scripts/gpu/check.sh"],
                timeout=900)
        if mem:
            mem.stop_flag.set()
            mem.join()
        with open(os.path.join(rep.out, "fwbench-%d.log" % c), "w") as f:
            f.write(r.stdout + r.stderr)
        row = {"streams": c, "exit": r.returncode, "seconds": round(time.monotonic() - start, 1)}
        try:
            level = json.load(open(json_path))["levels"][0]
            row.update(level_row(level))
        except (OSError, ValueError, KeyError, IndexError) as e:
            row["error"] = "no result (%s): %s" % (e, r.stderr.strip()[-500:])
        if mem and idle is not None and mem.peak:
            row["gpu_mib_peak"] = mem.peak
            row["gpu_mib_per_stream"] = round((mem.peak - idle) / c, 3)
        rows.append(row)
        # A level with no tokens, or any error, fails: every request failing must not
        # read as served.
        ok = (r.returncode == 0 and row.get("tokens_per_s", 0) > 0 and not row.get("errors")
              and "error" not in row)
        rep.check("fwbench", "%d streams on %s" % (c, device), "pass" if ok else "fail",
                  ", ".join("%s %s" % (k, v) for k, v in row.items() if k != "streams"))
    rep.data["fwbench"] = {"model": model, "device": device, "duration": duration,
                           "state_bytes_per_session": state_bytes, "gpu_mib_idle": idle,
                           "levels": rows}

    # A 64 KB prefill: a session created with a 65536-byte prefix (bench/prefill_bench.sh).
    prefix = text.replace("\\", "")[:65536]
    times = []
    runs = int(os.environ.get("CHECK_PREFILL_RUNS", "3"))
    for _ in range(runs):
        start = time.monotonic()
        r = server.ctl(["session", "create", "--model", model, "--prefix", prefix], timeout=600)
        if r.returncode != 0:
            rep.check("fwbench", "64 KB prefill on %s" % device, "fail", r.stderr.strip()[-500:])
            break
        times.append(time.monotonic() - start)
        server.ctl(["session", "rm", r.stdout.strip()])
    if times and len(times) == runs:
        best = min(times)
        rep.data["prefill_64k"] = {"bytes": len(prefix), "seconds": [round(t, 3) for t in times],
                                   "tokens_per_s_best": round(len(prefix) / best)}
        rep.check("fwbench", "64 KB prefill on %s" % device, "pass",
                  "%d tokens: %s s (best %.0f tokens/s)" % (
                      len(prefix), ", ".join("%.2f" % t for t in times), len(prefix) / best))


def fwbench_tokens_per_s(rep, build, server, model, streams, duration, label):
    json_path = os.path.join(rep.out, "tmp", "kernels-%s.json" % label)
    r = run([os.path.join(build, "bench", "fwbench"), "--target", server.target(), "--model",
             model, "--concurrency", str(streams), "--duration", duration, "--warmup", "1s",
             "--max_tokens", "128", "--json", json_path], timeout=600)
    try:
        level = json.load(open(json_path))["levels"][0]
        tokens = level["output_tokens_per_s"]
    except (OSError, ValueError, KeyError, IndexError):
        raise RuntimeError("fwbench %s: exit %d: %s" % (label, r.returncode,
                                                       r.stderr.strip()[-500:]))
    if r.returncode != 0 or not tokens or level.get("errors"):
        raise RuntimeError("fwbench %s: exit %d, %s tokens/s, %s errors: %s" % (
            label, r.returncode, tokens, level.get("errors"), r.stderr.strip()[-500:]))
    return tokens


def kernels(rep, build, device, server, models):
    """The device server's decode kernel, and its speed against --decode-kernel libtorch."""
    log = open(server.log_path).read()
    m = re.search(r"model (\S+): (graph decode step[^\n]*|graph decode step unavailable[^\n]*)",
                  log)
    line = m.group(0) if m else None
    if device == "cuda":
        ok = line is not None and "captured as CUDA Graphs" in line
        rep.check("kernels", "decode step on cuda replays CUDA Graphs", "pass" if ok else "fail",
                  line or "no graph decode step line in %s" % server.log_path)
    else:
        rep.check("kernels", "decode step on cuda replays CUDA Graphs", "needs a CUDA run",
                  "device %s: its default kernel is native" % device)
    model = os.environ.get("CHECK_BENCH_MODEL", "aft-shakespeare")
    path = [m for m in models if os.path.basename(m) == model]
    key = os.path.join(rep.out, "tmp", "session.key")
    # The same kernel with sampling in a separate pass (the graph step before issue 39),
    # and LibTorch's eager reference.
    # CHECK_AB_LABEL / CHECK_AB_FLAGS name another arm in its place (a flag's A/B).
    # CHECK_AB_ARMS ("label=flags;label=flags", e.g. the multi-step and overlap arms of
    # issue 39) runs several arms beside the default, each in every round.
    ab = os.environ.get("CHECK_AB_LABEL", "apart")
    others = [(ab, os.environ.get("CHECK_AB_FLAGS", "--sample-in-step=false").split())]
    if os.environ.get("CHECK_AB_ARMS"):
        others = []
        for arm in os.environ["CHECK_AB_ARMS"].split(";"):
            label, _, flags = arm.partition("=")
            others.append((label.strip(), flags.split()))
    others.append(("libtorch", ["--decode-kernel", "libtorch"]))
    servers = {"default": server}
    try:
        for label, extra in others:
            alt = Server(rep, build, device, path, key, "%s-%s" % (label, device), extra=extra)
            servers[label] = alt
            if not alt.wait_healthy():
                rep.check("kernels", "%s server starts" % " ".join(extra), "fail",
                          open(alt.log_path).read()[-2000:])
                return
        levels = [int(x) for x in os.environ.get("CHECK_KERNEL_STREAMS", "1,64").split(",")]
        duration = os.environ.get("CHECK_KERNEL_DURATION", "5s" if device == "cuda" else "2s")
        rep.data["kernels"] = {"model": model, "duration": duration, "levels": {}}
        for streams in levels:
            rounds = []
            for i in range(3):  # A, B, C, A, B, C, ...
                got = {}
                for label in servers:
                    got[label] = round(fwbench_tokens_per_s(
                        rep, build, servers[label], model, streams, duration,
                        "%s-%d-%d" % (label, streams, i)), 1)
                for other, _ in others:
                    got["vs_" + other] = round(got["default"] / got[other], 3)
                rounds.append(got)
            rep.data["kernels"]["levels"][str(streams)] = rounds
            for other, _ in others:
                ratios = sorted(r["vs_" + other] for r in rounds)
                rep.check("kernels", "default vs %s, %d streams on %s" % (other, streams, device),
                          "pass",
                          "tokens/s ratio median %.2f (range %.2f-%.2f); rounds %s" % (
                              ratios[1], ratios[0], ratios[2],
                              "; ".join("%.0f vs %.0f" % (r["default"], r[other])
                                        for r in rounds)))
    except RuntimeError as e:
        # The first GPU run lost a server mid-A/B with no log to show why: keep the tails.
        tails = []
        for label, s_ in servers.items():
            if label == "default":
                continue
            alive = s_.proc.poll() is None
            tails.append("the %s server %s; its log ends: %s" % (
                label, "is running" if alive else "exited with %s" % s_.proc.returncode,
                open(s_.log_path).read()[-1200:]))
        rep.check("kernels", "kernel A/B on %s" % device, "fail", "%s; %s" % (e, " | ".join(tails)))
    finally:
        for label, s_ in servers.items():
            if label != "default":
                s_.stop()


def baseline(rep, device):
    model = os.environ.get("CHECK_BENCH_MODEL", "aft-shakespeare")
    levels = [int(x) for x in os.environ.get(
        "CHECK_STREAMS", "1,16,64,256,1024,4096" if device == "cuda" else "1,16").split(",")]
    probe = run([sys.executable, "-c", "import torch"], timeout=120)
    if probe.returncode != 0:
        rep.check("baseline", "PyTorch eager baseline on %s" % device, "skip",
                  "python3 has no torch here")
        return
    argv = [sys.executable, os.path.join(REPO, "bench", "pytorch_baseline.py"),
            os.path.join(REPO, "models", "pretrained", model), "--device", device,
            "--modes", ",".join("batch%d" % c for c in levels),
            "--tokens", os.environ.get("CHECK_TOKENS", "128"), "--threads", str(os.cpu_count())]
    r = run(argv, timeout=1800)
    with open(os.path.join(rep.out, "pytorch-baseline.jsonl"), "w") as f:
        f.write(r.stdout)
    with open(os.path.join(rep.out, "pytorch-baseline.log"), "w") as f:
        f.write(r.stderr)
    rows = []
    for line in r.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    rep.data["baseline"] = {"model": model, "device": device, "rows": rows}
    rep.check("baseline", "PyTorch eager baseline on %s" % device,
              "pass" if r.returncode == 0 and rows else "fail",
              "; ".join("batch %d: %.0f tokens/s, %.3f ms/step" % (
                  x["batch"], x["tokens_per_second"], x["ms_per_step"]) for x in rows)
              or r.stderr.strip()[-500:])


# ---------------------------------------------------------------------------------------
# The report.

def write_markdown(rep):
    d = rep.data
    lines = ["# fwserve GPU check (scripts/gpu/check.sh)", "",
             "Started %s; device **%s**%s." % (
                 d["started_at"], d.get("device"),
                 "" if d.get("gpu") else " — no GPU on this machine: the CUDA checks need a "
                 "CUDA run"), ""]
    if d.get("gpu"):
        g = d["gpu"]
        lines += ["GPU: %s, driver %s, %s, compute capability %s." % (
            g["name"], g["driver"], g["memory"], g["compute_cap"]), ""]
    lines += ["## Checks", "", "| section | check | status | detail |", "|---|---|---|---|"]
    for c in d["checks"]:
        lines.append("| %s | %s | %s | %s |" % (c["section"], c["name"], c["status"],
                                                c["detail"].replace("|", "\\|")))
    fb = d.get("fwbench")
    if fb:
        lines += ["", "## fwbench (%s, %s, %s per level)" % (fb["model"], fb["device"],
                                                             fb["duration"]), "",
                  "State per session: %s bytes. %s" % (
                      fb["state_bytes_per_session"],
                      "GPU memory per stream: the server's peak over the level (nvidia-smi) "
                      "less its idle %s MiB, / streams." % fb["gpu_mib_idle"]
                      if fb["gpu_mib_idle"] is not None else "GPU memory: not measured (no GPU)."),
                  "",
                  "| streams | tokens/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | mean batch | "
                  "GPU MiB/stream | PyTorch eager tokens/s (batch = streams) |",
                  "|---|---|---|---|---|---|---|---|"]
        base = {x["batch"]: x for x in (d.get("baseline") or {}).get("rows", [])}

        def fmt(v, f="%.3g"):
            return "—" if v is None else (f % v if isinstance(v, float) else str(v))
        for row in fb["levels"]:
            b = base.get(row["streams"])
            lines.append("| %d | %s | %s | %s | %s | %s | %s | %s |" % (
                row["streams"], fmt(row.get("tokens_per_s"), "%.0f"), fmt(row.get("itl_p50_ms")),
                fmt(row.get("itl_p99_ms")), fmt(row.get("ttft_p50_ms")),
                fmt(row.get("mean_batch_size")), fmt(row.get("gpu_mib_per_stream")),
                fmt(b["tokens_per_second"], "%.0f") if b else "—"))
    hp = d.get("host_path_null_step")
    if hp and hp.get("levels"):
        device_rows = {r["streams"]: r for r in (fb or {}).get("levels", [])}
        lines += ["", "## The host path: the device's levels beside the null step", "",
                  "The null step (`--benchmark-null-step`, a CPU server, no model work) is the "
                  "ceiling the host puts on any device. CPU figures are microseconds per "
                  "generated token, from /proc.", "",
                  "| streams | device tokens/s | device tok/msg | device server us/tok | "
                  "device engine us/tok | null tokens/s | null tok/msg | null server us/tok | "
                  "null engine us/tok | fwbench us/tok (null) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]

        def cell(row, key, f="%.3g"):
            v = (row or {}).get(key)
            return "—" if v is None else (f % v if isinstance(v, float) else str(v))
        for row in hp["levels"]:
            dev_row = device_rows.get(row["streams"])
            lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                row["streams"], cell(dev_row, "tokens_per_s", "%.0f"),
                cell(dev_row, "tokens_per_message"), cell(dev_row, "server_cpu_us_per_token"),
                cell(dev_row, "engine_thread_cpu_us_per_token"),
                cell(row, "tokens_per_s", "%.0f"), cell(row, "tokens_per_message"),
                cell(row, "server_cpu_us_per_token"), cell(row, "engine_thread_cpu_us_per_token"),
                cell(row, "bench_cpu_us_per_token")))
    if d.get("prefill_64k"):
        p = d["prefill_64k"]
        lines += ["", "64 KB prefill: %d tokens in %s s (best %d tokens/s)." % (
            p["bytes"], ", ".join(str(t) for t in p["seconds"]), p["tokens_per_s_best"])]
    diffs = [c for c in d["checks"] if c.get("cuda_vs_cpu")]
    if diffs:
        lines += ["", "## CUDA vs CPU, per case (largest difference / (1 + max |logit|))", "",
                  "| case | logits | log-probs |", "|---|---|---|"]
        for c in diffs:
            for x in c["cuda_vs_cpu"]:
                lines.append("| %s | %.3g | %.3g |" % (x["case"], x["max_rel_logits"],
                                                      x["max_rel_logprobs"]))
    lines += ["", "## Versions", "", "```", json.dumps(d.get("versions"), indent=1), "```", ""]
    with open(os.path.join(rep.out, "report.md"), "w") as f:
        f.write("\n".join(lines))


# The real shapes (CHECK_REAL_SHAPES, default both), random weights written by fwmodel init,
# with the byte tokenizer (fwbench's prompts are bytes either way):
# - RWKV-7 at the 0.1B G1 shape (docs/models.md);
# - DeltaNet at fla-hub's 340M shape (issue 49): hidden 1024, 24 layers, 8 heads of 128,
#   SwiGLU of 2,816, short convolutions of 4, untied head over 32,000 tokens.
REAL_SHAPES = {
    "rwkv7-0.1b": {"format_version": 1, "architecture": "rwkv7", "vocab_size": 65536,
                   "tokenizer": "bytes", "bos_token_id": 0, "d_model": 768, "n_layers": 12,
                   "n_heads": 12, "d_ff": 3072, "decay_low_rank_dim": 64, "a_low_rank_dim": 64,
                   "v_low_rank_dim": 32, "gate_low_rank_dim": 128},
    "delta_net-340m": {"format_version": 1, "architecture": "delta_net", "vocab_size": 32000,
                       "tokenizer": "bytes", "bos_token_id": 1, "d_model": 1024,
                       "n_layers": 24, "n_heads": 8, "num_v_heads": 8, "head_k_dim": 128,
                       "head_v_dim": 128, "d_ff": 2816, "ffn": "swiglu",
                       "use_short_conv": True, "conv_size": 4, "use_gate": False,
                       "tie_embeddings": False, "norm_eps": 1e-6},
}
REAL_SHAPE = REAL_SHAPES["rwkv7-0.1b"]


def real_shape(rep, build, device):
    """fwbench on each of CHECK_REAL_SHAPES at CHECK_REAL_SHAPE_STREAMS (default 1,64)."""
    levels = [int(x) for x in os.environ.get(
        "CHECK_REAL_SHAPE_STREAMS", "1,64,512" if device == "cuda" else "1,64").split(",") if x]
    names = [x for x in os.environ.get("CHECK_REAL_SHAPES", ",".join(REAL_SHAPES)).split(",") if x]
    if not levels or not names:
        rep.check("real_shape", "real shapes", "skip",
                  "CHECK_REAL_SHAPE_STREAMS or CHECK_REAL_SHAPES is empty")
        return
    for name in names:
        if name not in REAL_SHAPES:
            rep.check("real_shape", name, "fail", "unknown shape; known: %s" % ", ".join(REAL_SHAPES))
            continue
        real_shape_one(rep, build, device, name, REAL_SHAPES[name], levels)


def real_shape_one(rep, build, device, name, shape, levels):
    model_dir = os.path.join(rep.out, "tmp", name)
    os.makedirs(model_dir, exist_ok=True)
    config = os.path.join(rep.out, "tmp", name + ".json")
    with open(config, "w") as f:
        json.dump(shape, f)
    # RWKV-7 as users hold it (G1 ships bf16); DeltaNet as fla-hub's float32 files.
    storage = os.environ.get("CHECK_REAL_SHAPE_STORAGE", "BF16") if name.startswith("rwkv7") \
        else "F32"
    r = run([os.path.join(build, "tools", "fwmodel"), "init", model_dir, "--config", config,
             "--seed", "1", "--storage_dtype", storage], timeout=600)
    if r.returncode != 0:
        rep.check("real_shape", "fwmodel init at the %s shape" % name, "fail",
                  r.stderr.strip()[-500:])
        return
    text_file = os.path.join(REPO, "models", "data", "tinyshakespeare.txt")
    prefill_tokens = int(os.environ.get("CHECK_REAL_SHAPE_PREFILL", "1024"))
    key = os.path.join(rep.out, "tmp", "session.key")
    # 512 streams of RWKV-7 0.1B hold 1.2 GB of state: above the 1 GiB default budget,
    # whose refusals (RESOURCE_EXHAUSTED) the first 512-stream level counted.
    # The RWKV-7 matrices stay bf16 on the GPU (--gpu-matrices) unless
    # CHECK_REAL_SHAPE_MATRICES is float32 (the A/B's other arm).
    matrices = os.environ.get("CHECK_REAL_SHAPE_MATRICES", "bf16") \
        if name.startswith("rwkv7") and device == "cuda" else "float32"
    server = Server(rep, build, device, [model_dir], key, name + "-" + device,
                    extra=["--max-state-memory-bytes", str(2 << 30), "--gpu-matrices", matrices])
    try:
        if not server.wait_healthy():
            rep.check("real_shape", "%s shape serves" % name, "fail",
                      open(server.log_path).read()[-2000:])
            return
        rows = []
        for c in levels:
            json_path = os.path.join(rep.out, "tmp", "real-shape-%s-%d.json" % (name, c))
            r = run([os.path.join(build, "bench", "fwbench"), "--target", server.target(),
                     "--model", name, "--concurrency", str(c), "--duration",
                     os.environ.get("CHECK_DURATION", "10s" if device == "cuda" else "3s"),
                     "--warmup", "1s", "--max_tokens", "64", "--json", json_path,
                     "--metrics_target", "127.0.0.1:%d" % server.metrics_port], timeout=600)
            try:
                level = json.load(open(json_path))["levels"][0]
                row = {"streams": c, **level_row(level)}
            except (OSError, ValueError, KeyError, IndexError) as e:
                row = {"streams": c, "error": "no result (%s): %s" % (e, r.stderr.strip()[-300:])}
            rows.append(row)
            ok = r.returncode == 0 and row.get("tokens_per_s", 0) > 0 and not row.get("errors")
            rep.check("real_shape", "%s shape, %d streams on %s" % (name, c, device),
                      "pass" if ok else "fail",
                      ", ".join("%s %s" % (k, v) for k, v in row.items() if k != "streams"))
        key_name = "real_shape" if name == "rwkv7-0.1b" else "real_shape_" + name.replace("-", "_")
        rep.data[key_name] = {"config": shape, "device": device, "storage": storage,
                              "gpu_matrices": matrices, "levels": rows}
        if prefill_tokens > 0:
            # A prompt of that many byte tokens, one reply token, one stream at a time:
            # the prefill's rate is its tokens over the time to the first token.
            json_path = os.path.join(rep.out, "tmp", "real-shape-%s-prefill.json" % name)
            r = run([os.path.join(build, "bench", "fwbench"), "--target", server.target(),
                     "--model", name, "--concurrency", "1", "--duration", "4s", "--warmup",
                     "0.5s", "--max_tokens", "1", "--prompt_bytes", str(prefill_tokens),
                     "--text_file", text_file, "--json", json_path], timeout=600)
            try:
                level = json.load(open(json_path))["levels"][0]
                ttft = level["ttft_ms"]["p50"]
                prefill = {"prompt_tokens": prefill_tokens, "ttft_p50_ms": rounded(ttft),
                           "tokens_per_s": round(prefill_tokens / (ttft / 1000.0), 0)}
                ok = r.returncode == 0 and not level.get("errors")
            except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as e:
                prefill = {"error": "no result (%s): %s" % (e, r.stderr.strip()[-300:])}
                ok = False
            rep.data[key_name]["prefill"] = prefill
            rep.check("real_shape", "%s shape, a %d-token prompt's prefill on %s" % (
                name, prefill_tokens, device), "pass" if ok else "fail",
                ", ".join("%s %s" % (k, v) for k, v in prefill.items()))
    finally:
        server.stop()
    if os.environ.get("CHECK_REAL_SHAPE_BASELINE", "1") != "0":
        real_shape_baseline(rep, device, name, model_dir, levels, key_name)


def real_shape_baseline(rep, device, name, model_dir, levels, key_name):
    """bench/pytorch_baseline.py on the real-shape file at the same batches: the eager
    PyTorch loop a user would write, float32 and (RWKV-7) with bf16 matrix products."""
    probe = run([sys.executable, "-c", "import torch"], timeout=120)
    if probe.returncode != 0:
        rep.check("real_shape", "%s shape, PyTorch eager baseline" % name, "skip",
                  "python3 has no torch here")
        return
    variants = [("float32", [])]
    if name.startswith("rwkv7"):
        variants.append(("bf16 matmuls", ["--matmul-dtype", "bf16"]))
    results = []
    for label, extra in variants:
        argv = [sys.executable, os.path.join(REPO, "bench", "pytorch_baseline.py"), model_dir,
                "--device", device, "--modes", ",".join("batch%d" % c for c in levels),
                "--tokens", os.environ.get("CHECK_REAL_SHAPE_TOKENS", "32"),
                "--prompt-bytes", "16", "--threads", str(os.cpu_count())] + extra
        r = run(argv, timeout=900)
        rows = []
        for line in r.stdout.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
        results.append({"variant": label, "rows": rows})
        rep.check("real_shape", "%s shape, PyTorch eager baseline (%s) on %s" % (
            name, label, device), "pass" if r.returncode == 0 and rows else "fail",
            "; ".join("batch %d: %.0f tokens/s, %.3f ms/step" % (
                x["batch"], x["tokens_per_second"], x["ms_per_step"]) for x in rows)
            or r.stderr.strip()[-500:])
    rep.data.setdefault(key_name, {})["baseline"] = results


def host_path(rep, build, device, models, key):
    """The null step beside the device's figures (issue 48): a CPU server with
    --benchmark-null-step (no model work, pre-drawn tokens; --batch-wait 0 as on CUDA) at
    the same stream counts, so the host path's own ceiling reads next to what the GPU
    delivered."""
    levels = [int(x) for x in os.environ.get(
        "CHECK_STREAMS", "1,16,64,256,1024,4096" if device == "cuda" else "1,16").split(",")]
    duration = os.environ.get("CHECK_DURATION", "10s" if device == "cuda" else "3s")
    server = Server(rep, build, "cpu", models[:1], key, "null-step",
                    extra=["--benchmark-null-step", "--batch-wait", "0"])
    rows = []
    try:
        if not server.wait_healthy():
            rep.check("host_path", "null-step server", "fail", "not healthy: see its log")
            return
        for c in levels:
            json_path = os.path.join(rep.out, "null-step-%d.json" % c)
            r = run([os.path.join(build, "bench", "fwbench"), "--target", server.target(),
                     "--concurrency", str(c), "--duration", duration, "--warmup", "1s",
                     "--max_tokens", "128", "--json", json_path,
                     "--processes", bench_processes(device),
                     "--metrics_target", "127.0.0.1:%d" % server.metrics_port,
                     "--server_pid", str(server.proc.pid)], timeout=900)
            row = {"streams": c, "exit": r.returncode}
            try:
                row.update(level_row(json.load(open(json_path))["levels"][0]))
            except (OSError, ValueError, KeyError, IndexError) as e:
                row["error"] = "no result (%s): %s" % (e, r.stderr.strip()[-500:])
            rows.append(row)
            ok = (r.returncode == 0 and row.get("tokens_per_s", 0) > 0 and not row.get("errors")
                  and "error" not in row)
            rep.check("host_path", "null step, %d streams" % c, "pass" if ok else "fail",
                      ", ".join("%s %s" % (k, v) for k, v in row.items() if k != "streams"))
    finally:
        server.stop()
        rep.data["host_path_null_step"] = {"duration": duration, "levels": rows}


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    rep = Report(out)
    build = os.path.abspath(os.environ.get("BUILD_DIR", os.path.join(REPO, "build-gpu")))
    info_path = os.path.join(build, "gpu-build.json")
    build_info = json.load(open(info_path)) if os.path.exists(info_path) else None
    if build_info is None:
        rep.check("machine", "build", "fail", "no %s: run scripts/gpu/build.sh first" % info_path)
    start = time.monotonic()
    device = machine(rep, build_info)
    model_tests(rep, build, device)
    models = sorted(os.path.dirname(p) for p in
                    glob.glob(os.path.join(REPO, "models", "pretrained", "*", "config.json")))
    # The default model first (fwserve's first --model is its default).
    models.sort(key=lambda m: os.path.basename(m) != "aft-shakespeare")
    text = open(os.path.join(REPO, "models", "data", "tinyshakespeare.txt"),
                encoding="utf-8", errors="replace").read(200000)
    servers = []
    try:
        dev, servers = serving(rep, build, device, models, text)
        if dev:
            bench(rep, build, device, dev, models, text)
            kernels(rep, build, device, dev, models)
    finally:
        for s in servers:
            s.stop()
    if os.environ.get("CHECK_HOST_PATH", "1") != "0":
        host_path(rep, build, device, models, os.path.join(rep.out, "tmp", "session.key"))
    real_shape(rep, build, device)
    baseline(rep, device)
    rep.data["seconds"] = round(time.monotonic() - start, 1)
    rep.data["failed"] = [c["section"] + ": " + c["name"] for c in rep.failed()]
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(rep.data, f, indent=1)
    write_markdown(rep)
    shutil.rmtree(os.path.join(out, "tmp"), ignore_errors=True)
    print("check.sh: %d checks, %d failed, in %.0f s; %s/report.md, report.json" % (
        len(rep.data["checks"]), len(rep.failed()), rep.data["seconds"], out))
    return 1 if rep.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
