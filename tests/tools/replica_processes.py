"""Real processes for the multi-replica tests: redis-server, haproxy and fwserve
replicas on free loopback ports, each with its log in a file, stopped at the end.

    procs = Processes(work_dir)                  # every process started through it
    redis = procs.redis(port=None, persist=True) # Redis (its own directory under work)
    replica = procs.fwserve(fwserve, model, ["--session-store", redis.url()])
    proxy = procs.haproxy(config_path, [replica.target, ...])
    ...
    procs.cleanup()                              # SIGKILL to what is still running

Every child runs in its own process group and gets SIGKILL when the test process
dies (PR_SET_PDEATHSIG), so a test killed by ctest's timeout leaves nothing behind.
Start processes from the main thread: the death signal follows the starting thread.
"""
import atexit
import csv
import ctypes
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

from fwserve_process import kill_process_group

_LIVE = set()  # every Proc not known to have exited, for the atexit cleanup
_PR_SET_PDEATHSIG = 1
try:
    # Loaded here, not in the forked child (no dynamic loading between fork and exec).
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _child_setup():
    # In the child between fork and exec: die (SIGKILL) with the parent thread.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout_s, alive=lambda: True):
    """Waits until 127.0.0.1:port accepts a TCP connection; False on timeout."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and alive():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class Proc:
    """One child process; its stdout and stderr go to log_path."""

    def __init__(self, name, argv, log_path, env=None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.process = None
        self.start()

    def start(self):
        with open(self.log_path, "ab") as log:
            log.write(("=== %s: %s\n" % (time.strftime("%H:%M:%S"), " ".join(self.argv)))
                      .encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, preexec_fn=_child_setup)
        _LIVE.add(self)

    @property
    def pid(self):
        return self.process.pid

    def running(self):
        return self.process is not None and self.process.poll() is None

    def signal(self, signum):
        if self.running():
            os.killpg(self.process.pid, signum)

    def kill(self):
        """SIGKILL to the process group, then reaps."""
        if self.process is None:
            return
        kill_process_group(self.process)
        _LIVE.discard(self)

    def terminate(self, timeout_s=30):
        """SIGTERM (SIGCONT too, in case it is stopped), a wait, then SIGKILL. Returns
        the exit status, or "timeout" when it had to be killed."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return "timeout"
        _LIVE.discard(self)
        return self.process.returncode

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines=40, skip=()):
        """The last lines of the log, without those containing a string of skip."""
        text = [line for line in self.log_text().splitlines()
                if not any(s in line for s in skip)]
        return "\n".join(text[-lines:])


class Redis(Proc):
    """redis-server on 127.0.0.1:port, data in directory `data_dir` (append-only file
    fsynced on every write when persist is set)."""

    def __init__(self, binary, port, data_dir, log_path, persist=True, password=None):
        self.port = port
        self.data_dir = data_dir
        self.password = password
        os.makedirs(data_dir, exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", data_dir,
                "--save", "", "--daemonize", "no", "--logfile", "", "--protected-mode", "no"]
        if persist:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        if password is not None:
            argv += ["--requirepass", password]
        super().__init__("redis-%d" % port, argv, log_path)
        self.wait_ready()

    def url(self, db=None):
        return "redis://127.0.0.1:%d" % self.port + ("" if db is None else "/%d" % db)

    def command(self, *args, timeout_s=5.0):
        """One command in RESP; returns the reply decoded roughly (str, int, list,
        None) or raises RuntimeError for an error reply / OSError."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as s:
            f = s.makefile("rb")
            commands = []
            if self.password is not None:
                commands.append(("AUTH", self.password))
            commands.append(args)
            for command in commands:
                parts = [str(a).encode() if not isinstance(a, bytes) else a for a in command]
                s.sendall(b"*%d\r\n" % len(parts)
                          + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
            replies = [_read_reply(f) for _ in commands]
            return replies[-1]

    def wait_ready(self, timeout_s=20):
        deadline = time.time() + timeout_s
        last = None
        while time.time() < deadline and self.running():
            try:
                if self.command("PING", timeout_s=1) == "PONG":
                    # With an append-only file, wait until it is loaded.
                    info = self.command("INFO", "persistence")
                    if "loading:0" in info:
                        return
            except (OSError, RuntimeError) as error:
                last = error
            time.sleep(0.05)
        raise RuntimeError("redis-server on port %d did not start (%s):\n%s"
                           % (self.port, last, self.tail()))

    def shutdown(self, timeout_s=20):
        """SHUTDOWN (it flushes the append-only file), then waits for the exit."""
        try:
            self.command("SHUTDOWN")
        except (OSError, RuntimeError):
            pass  # the connection closes without a reply when it works
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError("redis-server did not shut down")
        _LIVE.discard(self)

    def restart(self):
        """A new redis-server on the same port and directory (after shutdown())."""
        self.start()
        self.wait_ready()

    def dbsize(self, db):
        info = self.command("INFO", "keyspace")
        match = re.search(r"^db%d:keys=(\d+)" % db, info, re.M)
        return int(match.group(1)) if match else 0


def _read_reply(f):
    line = f.readline()
    if not line:
        raise OSError("redis closed the connection")
    kind, rest = line[:1], line[1:].rstrip(b"\r\n")
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)[:n]
        return data.decode(errors="replace")
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read_reply(f) for _ in range(n)]
    raise OSError("unexpected redis reply %r" % line)


class Fwserve(Proc):
    """One fwserve replica on a fixed loopback port (so that it can be restarted on the
    same address) with its metrics on another."""

    LISTENING = re.compile(r"fwserve listening on \S+ \(port (\d+)\)")

    def __init__(self, binary, model, log_path, extra=(), port=None, threads=1):
        self.port = port or free_port()
        self.metrics_port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        argv = [binary, "--listen", "127.0.0.1:%d" % self.port,
                "--metrics-listen", "127.0.0.1:%d" % self.metrics_port,
                "--model", model, "--threads", str(threads), "--max-tokens", "100000",
                *extra]
        super().__init__("fwserve-%d" % self.port, argv, log_path, env=env)
        self.wait_listening()

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def wait_listening(self, timeout_s=60):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            # Only this start's lines (the log is appended to across restarts).
            text = self.log_text().rsplit("=== ", 1)[-1]
            if self.LISTENING.search(text):
                return
            if not self.running():
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("fwserve did not start:\n" + self.tail())

    def restart(self):
        self.start()
        self.wait_listening()

    def metrics(self):
        """{(name, frozenset(labels)): value} of the Prometheus text format."""
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics_port,
                                      timeout=10).read().decode()
        values = {}
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)", text, re.M):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            values[(m.group(1), labels)] = float(m.group(3))
        return values

    def requests_total(self, rpc=None, code=None):
        """Sum of fwserve_requests_total over the series matching rpc and code."""
        total = 0.0
        for (name, labels), value in self.metrics().items():
            labels = dict(labels)
            if (name == "fwserve_requests_total" and (rpc is None or labels.get("rpc") == rpc)
                    and (code is None or labels.get("code") == code)):
                total += value
        return total

    def metric(self, name):
        """Sum of every series of one metric."""
        return sum(v for (n, _), v in self.metrics().items() if n == name)

    def request_lines(self):
        """The "request id=... method=... session=... status=..." log lines as dicts."""
        lines = []
        for line in self.log_text().splitlines():
            if " request id=" in line:
                lines.append(dict(re.findall(r"(\w+)=(\S+)", line)))
        return lines


MARK_BEGIN = "# BEGIN fwserve replicas"
MARK_END = "# END fwserve replicas"


def haproxy_config(shipped_path, replica_count, out_path):
    """The shipped config as the test runs it. With as many replicas as the file has
    server lines between the markers, the file is used unchanged (addresses come from
    FWSERVE_REPLICA_<i>); otherwise a copy gets replica_count lines made from the first
    one, renumbered. Returns the path to run."""
    with open(shipped_path) as f:
        text = f.read()
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    if begin < 0 or end < begin or text.count(MARK_BEGIN) != 1:
        raise RuntimeError("%s: no single '%s' ... '%s' block" % (shipped_path, MARK_BEGIN,
                                                                  MARK_END))
    block_start = text.index("\n", begin) + 1
    block_end = text.rindex("\n", 0, end) + 1
    servers = [line for line in text[block_start:block_end].splitlines()
               if line.strip().startswith("server ")]
    if not servers or any("${FWSERVE_REPLICA_%d" % (i + 1) not in line
                          for i, line in enumerate(servers)):
        raise RuntimeError("%s: the server lines between the markers must use "
                           "${FWSERVE_REPLICA_1}, ${FWSERVE_REPLICA_2}, ... in order"
                           % shipped_path)
    if len(servers) == replica_count:
        return shipped_path
    template = servers[0]
    lines = []
    for i in range(1, replica_count + 1):
        line = re.sub(r"\bserver\s+(\S*?)1\b", r"server \g<1>%d" % i, template, count=1)
        line = line.replace("FWSERVE_REPLICA_1", "FWSERVE_REPLICA_%d" % i)
        line = re.sub(r"(\$\{FWSERVE_REPLICA_%d)-[^}]*\}" % i, r"\1}", line)
        lines.append(line + "\n")
    with open(out_path, "w") as f:
        f.write(text[:block_start] + "".join(lines) + text[block_end:])
    return out_path


class Haproxy(Proc):
    """haproxy -db on the shipped config; clients connect to 127.0.0.1:port."""

    def __init__(self, binary, shipped_config, replicas, work_dir, log_path):
        self.port = free_port()
        self.stats_port = free_port()
        self.config = haproxy_config(shipped_config, len(replicas),
                                     os.path.join(work_dir, "haproxy.cfg"))
        # The HTTP front door too (the replicas here serve gRPC only): on a free port,
        # not the file's default :8000.
        self.http_port = free_port()
        env = dict(os.environ, FWSERVE_HAPROXY_BIND="127.0.0.1:%d" % self.port,
                   FWSERVE_HAPROXY_HTTP_BIND="127.0.0.1:%d" % self.http_port,
                   FWSERVE_HAPROXY_STATS="127.0.0.1:%d" % self.stats_port)
        for i, replica in enumerate(replicas, 1):
            env["FWSERVE_REPLICA_%d" % i] = replica
        check = subprocess.run([binary, "-c", "-f", self.config], env=env,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError("haproxy -c -f %s failed:\n%s%s" % (self.config, check.stdout,
                                                                   check.stderr))
        self.check_output = check.stdout + check.stderr
        super().__init__("haproxy", [binary, "-db", "-f", self.config], log_path, env=env)
        if not wait_port(self.port, 20, self.running):
            raise RuntimeError("haproxy did not listen:\n" + self.tail())

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def _server_rows(self, backend="fwserve"):
        """{server name: its row of the stats page's CSV}, the servers of `backend`
        ("fwserve": gRPC; "fwserve_http": the HTTP API)."""
        text = urllib.request.urlopen("http://127.0.0.1:%d/stats;csv" % self.stats_port,
                                      timeout=10).read().decode()
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows
                if r["svname"] not in ("FRONTEND", "BACKEND") and r["pxname"] == backend}

    def servers(self, backend="fwserve"):
        """{server name: (status, check_status)} from the stats page's CSV."""
        return {name: (r["status"], r["check_status"])
                for name, r in self._server_rows(backend).items()}

    def current_streams(self, name):
        """Requests haproxy has forwarded to server `name` and not seen answered (the
        stats CSV's scur)."""
        row = self._server_rows().get(name)
        return int(row["scur"] or 0) if row is not None else 0

    def wait_servers(self, want, timeout_s=20, backend="fwserve"):
        """Waits until each named server's status is want[name] ("UP", "DOWN"). Returns
        the last states seen (the caller asserts)."""
        deadline = time.time() + timeout_s
        while True:
            states = self.servers(backend)
            if all(states.get(name, ("?",))[0] == status for name, status in want.items()):
                return states
            if time.time() > deadline:
                return states
            time.sleep(0.1)


class Processes:
    """Every process of one test, with its logs under work_dir."""

    def __init__(self, work_dir):
        self.work = work_dir
        self.procs = []
        self.count = 0

    def _log(self, name):
        self.count += 1
        return os.path.join(self.work, "%02d-%s.log" % (self.count, name))

    def redis(self, port=None, persist=True, password=None, binary=None):
        port = port or free_port()
        binary = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        proc = Redis(binary, port, os.path.join(self.work, "redis-%d" % port),
                     self._log("redis"), persist=persist, password=password)
        self.procs.append(proc)
        return proc

    def fwserve(self, binary, model, extra=(), port=None):
        proc = Fwserve(binary, model, self._log("fwserve"), extra=extra, port=port)
        self.procs.append(proc)
        return proc

    def haproxy(self, shipped_config, replicas, binary=None):
        binary = binary or shutil.which("haproxy") or "/usr/sbin/haproxy"
        proc = Haproxy(binary, shipped_config, replicas, self.work, self._log("haproxy"))
        self.procs.append(proc)
        return proc

    def cleanup(self):
        for proc in reversed(self.procs):
            proc.kill()

    def tails(self, lines=40, skip=(" INFO request id=", ' HTTP/2.0"')):
        """The end of every log, without the per-request lines of fwserve and haproxy."""
        out = []
        for proc in self.procs:
            out.append("--- %s (%s), last lines%s:\n%s" % (
                proc.name, proc.log_path, " without request lines" if skip else "",
                proc.tail(lines, skip)))
        return "\n".join(out)


@atexit.register
def _kill_leftovers():
    for proc in list(_LIVE):
        try:
            proc.kill()
        except Exception:  # noqa: BLE001
            pass
