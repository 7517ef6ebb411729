#!/usr/bin/env python3
"""fwctl end to end: the real fwserve binary (shipped model, port 0) driven by the real
fwctl binary, checking outputs and exit codes, including Ctrl-C (SIGINT) mid-stream.

Usage: fwctl_test.py --fwctl PATH --fwserve PATH --model DIR --fwmodel PATH [--example PATH]
                     [unittest args]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402

ARGS = None
SERVER = None  # (process, target, log path)


def fwctl(*args, stdin=None, target=True, timeout=60, env=None):
    """Runs fwctl; returns (exit code, stdout bytes, stderr text)."""
    command = [ARGS.fwctl] + (["--target", SERVER[1]] if target else []) + list(args)
    result = subprocess.run(command, input=stdin, capture_output=True, timeout=timeout,
                            env=env)
    return result.returncode, result.stdout, result.stderr.decode(errors="replace")


def cuda_usable(binary):
    """Whether `binary` can use CUDA, found without asking it: it links a CUDA LibTorch
    (libtorch_cuda / libc10_cuda among its shared libraries) and the machine has an
    NVIDIA device (/dev/nvidiactl)."""
    libraries = subprocess.run(["ldd", binary], capture_output=True, text=True,
                               timeout=60).stdout
    cuda_libtorch = re.search(r"lib(torch|c10)_cuda", libraries) is not None
    return cuda_libtorch and os.path.exists("/dev/nvidiactl")


class Pump:
    """Collects a pipe's bytes on a thread, so a test can wait for output to appear."""

    def __init__(self, pipe):
        self.data = b""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self.thread.start()

    def _run(self, pipe):
        while True:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                return
            with self.lock:
                self.data += chunk

    def get(self):
        with self.lock:
            return self.data

    def wait_for(self, predicate, timeout=60, what="output"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate(self.get()):
                return self.get()
            time.sleep(0.01)
        raise AssertionError("timed out waiting for %s; got %r" % (what, self.get()[-500:]))


class FwctlTest(unittest.TestCase):
    maxDiff = None

    def ok(self, *args, **kwargs):
        code, out, err = fwctl(*args, **kwargs)
        self.assertEqual(code, 0, "fwctl %s -> %d\nstderr: %s" % (" ".join(args), code, err))
        return out, err

    def session_info(self, session_id):
        out, _ = self.ok("session", "get", "--json", session_id)
        info = json.loads(out)
        info["tokens"] = int(info["tokens"])
        return info

    def wait_idle(self, session_id, timeout=60):
        """The session's info once it is not busy (timeout only catches a hang)."""
        deadline = time.time() + timeout
        while True:
            info = self.session_info(session_id)
            if not info["busy"] or time.time() > deadline:
                return info
            time.sleep(0.02)

    # ------------------------------------------------------------------------------
    # Usage, help and exit codes.

    def test_help_documents_every_command_and_flag(self):
        out, _ = self.ok("--help", target=False)
        text = out.decode()
        for command in ["generate", "chat", "score", "session create", "session get",
                        "session list", "session rm", "session fork", "session export",
                        "session import", "models", "health"]:
            self.assertIn(command, text)
        for flag in ["--target", "--lb-policy", "--api-key-file", "--token", "--insecure", "--timeout", "--retries", "--tls-ca",
                     "130"]:
            self.assertIn(flag, text)
        out, _ = self.ok("generate", "--help", target=False)
        for flag in ["--model", "--session", "--max-tokens", "--temperature", "--top-k",
                     "--top-p", "--min-p", "--repetition-penalty", "--seed", "--stop",
                     "--logprobs", "--json", "--json-schema", "--json-object"]:
            self.assertIn(flag, out.decode())
        self.assertEqual(self.ok("help", "score", target=False)[0],
                         self.ok("score", "--help", target=False)[0])
        for command in [["chat"], ["score"], ["session", "create"], ["session", "get"],
                        ["session", "list"], ["session", "rm"], ["session", "fork"],
                        ["session", "export"], ["session", "import"], ["models"], ["health"]]:
            out, _ = self.ok(*command, "-h", target=False)
            self.assertIn("Usage: fwctl " + " ".join(command), out.decode())

    def test_usage_errors_exit_2(self):
        for args, message in [
            ([], "Usage"),
            (["frobnicate"], "unknown command 'frobnicate'"),
            (["session"], "incomplete command 'session'"),
            (["generate", "--frob", "x"], "unknown option '--frob'"),
            (["generate", "--max-tokens", "many", "x"], "--max-tokens"),
            (["generate", "--temperature"], "needs a value"),
            (["generate"], "PROMPT is required"),
            (["session", "get"], "missing argument"),
            (["session", "get", "a", "b"], "unexpected argument 'b'"),
            (["--timeout", "soon", "health"], "--timeout"),
            (["--tls-cert", "c.pem", "health"], "--tls-cert and --tls-key"),
            (["--lb-policy", "random", "health"], "--lb-policy"),
            (["session", "list", "--page-size", "-1"], "--page-size"),
        ]:
            code, out, err = fwctl(*args, target=False)
            self.assertEqual(code, 2, (args, err))
            self.assertIn(message, out.decode() + err, args)

    def test_command_line_forms(self):
        # docs/client.md "fwctl reference": global options after the command, --name=VALUE,
        # underscores for dashes, an empty --name= value, '--' ending the options; the
        # PROMPT words are sent verbatim (a word like "[a,b]" is not a list).
        out, _ = self.ok("health", "--target", SERVER[1], target=False)
        self.assertEqual(out, b"SERVING\n")
        _, err = self.ok("generate", "--max_tokens=3", "--stream_timeout", "60s", "[a,b]")
        self.assertIn("[finish: length; prompt 5, generated 3, session 8 tokens]", err)
        _, err = self.ok("generate", "--max-tokens", "2", "--", "-x", "--y")
        self.assertIn("prompt 6, generated 2", err)  # "-x --y"
        self.ok("session", "list", "--page-size", "1", "--page-token=")
        self.assertEqual(self.ok("help", "session", "create", target=False)[0],
                         self.ok("session", "create", "--help", target=False)[0])
        for args, message in [
            (["generate", "--json=1", "x"], "fwctl generate: --json takes no value"),
            (["--frob=1", "health"], "unknown option '--frob=1'"),
            (["session", "--json", "get"], "(after an incomplete command 'session')"),
            (["session", "frob"], "unknown command 'session frob'"),
            (["health", "--retries", "101"],
             "--retries: expected an integer in [0, 100], got '101'"),
            (["chat", "--temperature", "hot"], "--temperature: expected a number, got 'hot'"),
            (["models", "a", "b"], "fwctl models: unexpected argument 'b'"),
        ]:
            code, _, err = fwctl(*args, target=False)
            self.assertEqual(code, 2, (args, err))
            self.assertIn(message, err, args)

    def test_server_errors_exit_1_with_the_grpc_code(self):
        code, _, err = fwctl("session", "get", "0" * 32)
        self.assertEqual(code, 1)
        self.assertIn("NOT_FOUND", err)
        code, _, err = fwctl("generate", "--max-tokens", "200000", "x")
        self.assertEqual(code, 1)
        self.assertIn("INVALID_ARGUMENT", err)
        code, _, err = fwctl("models", "no-such-model")
        self.assertEqual(code, 1)
        self.assertIn("NOT_FOUND", err)

    def test_unreachable_server_is_unavailable(self):
        code, _, err = fwctl("--target", "127.0.0.1:1", "--retries", "0", "health",
                             target=False)
        self.assertEqual(code, 1)
        self.assertIn("UNAVAILABLE", err)

    def test_tls_options(self):
        code, _, err = fwctl("--tls-ca", "/nonexistent/ca.pem", "health")
        self.assertEqual(code, 1)
        self.assertIn("cannot read '/nonexistent/ca.pem'", err)
        # fwserve listens in plaintext: a TLS handshake cannot succeed.
        code, _, err = fwctl("--tls", "--retries", "0", "--timeout", "5s", "health")
        self.assertEqual(code, 1)
        self.assertIn("UNAVAILABLE", err)

    def test_resolver_targets_and_lb_policies(self):
        port = SERVER[1].rsplit(":", 1)[1]
        for target, policy in [("dns:///localhost:" + port, "round_robin"),
                               ("dns:///127.0.0.1:" + port, "pick_first"),
                               ("ipv4:127.0.0.1:" + port, "round_robin")]:
            code, out, err = fwctl("--target", target, "--lb-policy", policy, "health",
                                   target=False)
            self.assertEqual((code, out), (0, b"SERVING\n"), (target, policy, err))

    def test_target_from_the_environment(self):
        env = dict(os.environ, FWSERVE_TARGET=SERVER[1])
        code, out, _ = fwctl("health", target=False, env=env)
        self.assertEqual((code, out), (0, b"SERVING\n"))

    # ------------------------------------------------------------------------------
    # Models and health.

    def test_health_and_models(self):
        out, _ = self.ok("health")
        self.assertEqual(out, b"SERVING\n")
        out, _ = self.ok("health", "--service", "fwserve.v1.Fwserve")
        self.assertEqual(out, b"SERVING\n")
        out, _ = self.ok("models")
        self.assertRegex(out.decode(), r"aft-shakespeare\s+yes\s+aft\s+\d+")
        out, _ = self.ok("models", "--json")
        models = json.loads(out)["models"]
        self.assertEqual([m["name"] for m in models], ["aft-shakespeare"])
        self.assertTrue(models[0]["is_default"])
        out, _ = self.ok("models", "aft-shakespeare")
        self.assertIn("fingerprint: " + models[0]["fingerprint"], out.decode())
        self.assertIn('"architecture"', out.decode())

    # ------------------------------------------------------------------------------
    # generate.

    def test_generate_streams_text_and_reports_usage(self):
        out1, err = self.ok("generate", "--seed", "7", "--max-tokens", "40", "ROMEO:")
        out2, _ = self.ok("generate", "--seed", "7", "--max-tokens", "40", "ROMEO:")
        self.assertEqual(out1, out2)
        self.assertGreater(len(out1), 0)
        self.assertIn("[finish: length; prompt 6, generated 40, session 46 tokens]", err)
        # The same prompt from stdin.
        out3, _ = self.ok("generate", "--seed", "7", "--max-tokens", "40", "-", stdin=b"ROMEO:")
        self.assertEqual(out3, out1)
        # Words are joined with spaces.
        out4, _ = self.ok("generate", "--seed", "7", "--max-tokens", "40", "--temperature=0",
                          "To", "be")
        out5, _ = self.ok("generate", "--seed", "8", "--max-tokens", "40", "--temperature=0",
                          "To be")
        self.assertEqual(out4, out5)
        _, err = self.ok("--verbose", "generate", "--max-tokens", "5", "x")
        self.assertIn("tokens/s", err)
        _, err = self.ok("generate", "--quiet", "--max-tokens", "5", "x")
        self.assertEqual(err, "")

    def test_generate_stop_json_and_logprobs(self):
        out, err = self.ok("generate", "--temperature", "0", "--max-tokens", "2000", "--stop",
                           "\\n", "ROMEO:\nWhat")
        self.assertTrue(out.endswith(b"\n"), out)
        self.assertEqual(out.count(b"\n"), 1)
        self.assertIn("[finish: stop;", err)

        out, _ = self.ok("generate", "--json", "--max-tokens", "12", "--seed", "3",
                         "--logprobs", "x")
        messages = [json.loads(line) for line in out.decode().splitlines()]
        self.assertEqual(sum(len(m["token_ids"]) for m in messages), 12)
        self.assertEqual(sum(len(m["logprobs"]) for m in messages), 12)
        self.assertEqual(messages[-1]["finish_reason"], "FINISH_REASON_LENGTH")
        self.assertEqual(messages[-1]["usage"]["generated_tokens"], "12")

        out, err = self.ok("generate", "--max-tokens", "12", "--seed", "3", "--logprobs", "x")
        self.assertEqual(out.decode(), "".join(m["text"] for m in messages))
        rows = [line.split(None, 3) for line in err.splitlines()
                if re.match(r"\s+\d+\s+\d+\s+-?\d+\.\d+  \"", line)]
        self.assertEqual(len(rows), 12)
        for row, token, logprob in zip(rows, [t for m in messages for t in m["token_ids"]],
                                       [p for m in messages for p in m["logprobs"]]):
            self.assertEqual(int(row[1]), int(token))
            self.assertAlmostEqual(float(row[2]), logprob, places=3)

    def test_generate_json_schema_and_json_object(self):
        # Structured output (docs/structured-output.md): the reply parses and matches.
        with tempfile.TemporaryDirectory() as tmp:
            schema_path = os.path.join(tmp, "schema.json")
            with open(schema_path, "w") as f:
                json.dump({"type": "object",
                           "properties": {"mood": {"enum": ["merry", "sad"]},
                                          "act": {"type": "integer", "minimum": 1, "maximum": 5}},
                           "required": ["mood", "act"], "additionalProperties": False}, f)
            out, err = self.ok("generate", "--json-schema", schema_path, "--seed", "4",
                               "--max-tokens", "200", "ROMEO:")
            reply = json.loads(out.decode())
            self.assertIn(reply["mood"], ["merry", "sad"])
            self.assertTrue(1 <= reply["act"] <= 5, reply)
            self.assertIn("[finish: stop;", err)
            out, _ = self.ok("generate", "--json-object", "--seed", "2", "--max-tokens", "300",
                             "x")
            self.assertIsInstance(json.loads(out.decode()), dict)
            with open(schema_path, "w") as f:
                json.dump({"type": "string", "if": {}}, f)
            code, _, err = fwctl("generate", "--json-schema", schema_path, "x")
            self.assertEqual(code, 1, err)
            self.assertIn("'if'", err)
            code, _, err = fwctl("generate", "--json-schema", schema_path, "--json-object", "x",
                                 target=False)
            self.assertEqual(code, 2, err)

    def generated_tokens(self, *args):
        """Runs `fwctl generate --json ARGS`; returns (text bytes, token ids, usage)."""
        out, _ = self.ok("generate", "--json", *args)
        messages = [json.loads(line) for line in out.decode().splitlines()]
        text = "".join(m.get("text", "") for m in messages).encode()
        tokens = [int(t) for m in messages for t in m.get("token_ids", [])]
        return text, tokens, messages[-1].get("usage", {})

    def test_sampling_flags_reach_the_server(self):
        n = 30
        # Greedy (temperature 0): deterministic, the seed does not matter, exactly
        # --max-tokens tokens, and the same text as the offline path (fwmodel generate,
        # no server) computes from the same checkpoint.
        greedy, tokens, usage = self.generated_tokens("--temperature", "0", "--seed", "1",
                                                      "--max-tokens", str(n), "Hark")
        self.assertEqual(len(tokens), n)
        self.assertEqual(usage["generated_tokens"], str(n))
        self.assertEqual(greedy, bytes(tokens))  # the byte tokenizer: one byte a token
        again, _ = self.ok("generate", "--temperature", "0", "--seed", "2", "--max-tokens",
                           str(n), "Hark")
        self.assertEqual(again, greedy)
        offline = subprocess.run(
            [ARGS.fwmodel, "generate", ARGS.model, "--prompt", "Hark", "--max_tokens", str(n),
             "--temperature", "0"], capture_output=True, timeout=120)
        self.assertEqual(offline.returncode, 0, offline.stderr)
        self.assertEqual(offline.stdout, b"Hark" + greedy + b"\n")

        # Sampling at temperature 1 with seed 9 is not greedy (this model, this prompt);
        # each filter that keeps only the top token makes the same request greedy again.
        sampled, _ = self.ok("generate", "--seed", "9", "--max-tokens", str(n), "Hark")
        self.assertNotEqual(sampled, greedy)
        for flags in (["--top-k", "1"], ["--top-p", "0.000001"], ["--min-p", "1"]):
            out, _ = self.ok("generate", *flags, "--seed", "9", "--max-tokens", str(n), "Hark")
            self.assertEqual(out, greedy, flags)
        # A seed reproduces a sampled output exactly (all flags together); another seed
        # gives another output; --max-tokens bounds the length exactly.
        flags = ["--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.3",
                 "--repetition-window", "16", "--max-tokens", str(n), "Hark"]
        one, tokens_one, usage = self.generated_tokens("--seed", "1", *flags)
        self.assertEqual(len(tokens_one), n)
        self.assertEqual(usage["generated_tokens"], str(n))
        self.assertEqual(self.generated_tokens("--seed", "1", *flags)[:2], (one, tokens_one))
        self.assertNotEqual(self.generated_tokens("--seed", "2", *flags)[1], tokens_one)
        for count in (1, 7):
            _, tokens, _ = self.generated_tokens("--seed", "3", "--max-tokens", str(count), "x")
            self.assertEqual(len(tokens), count)

        # --repetition-penalty over --repetition-window (prompt and output): at the
        # strongest penalty (10), greedy output on this model repeats none of the last W
        # tokens, for W = 16 and W = 4, while plain greedy does within 4; and with W = 4 it
        # does repeat within 16 (the window is 4, not more).
        def repeats(prompt, out, window):
            toks = list(prompt) + list(out)
            return [i for i in range(len(prompt), len(toks))
                    if toks[i] in toks[max(0, i - window):i]]

        plain, _ = self.ok("generate", "--temperature", "0", "--max-tokens", "60", "Hark")
        self.assertTrue(repeats(b"Hark", plain, 4), plain)
        for window in (16, 4):
            out, _ = self.ok("generate", "--temperature", "0", "--repetition-penalty", "10",
                             "--repetition-window", str(window), "--max-tokens", "60", "Hark")
            self.assertEqual(len(out), 60, out)
            self.assertEqual(repeats(b"Hark", out, window), [], (window, out))
            if window == 4:
                self.assertTrue(repeats(b"Hark", out, 16), out)

        code, _, err = fwctl("generate", "--top-p", "1.5", "--max-tokens", "3", "x")
        self.assertEqual(code, 1)
        self.assertIn("INVALID_ARGUMENT", err)

    def test_sigint_mid_stream_cancels_cleanly_and_keeps_the_session_consistent(self):
        session_id = self.ok("session", "create", "--prefix", "Hi")[0].decode().strip()
        process = subprocess.Popen(
            [ARGS.fwctl, "--target", SERVER[1], "generate", "--session", session_id,
             "--max-tokens", "100000", "x"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = Pump(process.stdout)
        err = Pump(process.stderr)
        out.wait_for(lambda data: len(data) >= 300, what="300 bytes of text")
        process.send_signal(signal.SIGINT)
        self.assertEqual(process.wait(timeout=30), 130)
        out.thread.join(5)
        err.thread.join(5)
        stderr = err.get().decode()
        match = re.search(r"interrupted after (\d+) generated tokens", stderr)
        self.assertIsNotNone(match, stderr)
        printed = int(match.group(1))
        self.assertGreaterEqual(printed, 300 if all(b < 0x80 for b in out.get()) else 1)
        match = re.search(r"session %s holds (\d+) tokens" % session_id, stderr)
        self.assertIsNotNone(match, stderr)

        info = self.wait_idle(session_id)
        self.assertFalse(info["busy"])
        self.assertEqual(info["tokens"], int(match.group(1)))
        generated = info["tokens"] - 3  # "Hi" + "x"
        self.assertGreaterEqual(generated, printed)
        self.assertLess(generated, 100000)

        # The session goes on from there.
        _, err_text = self.ok("generate", "--session", session_id, "--max-tokens", "5")
        self.assertIn("session %d tokens" % (info["tokens"] + 5), err_text)

    def test_second_sigint_while_waiting_for_the_session_exits_at_once(self):
        # docs/client.md: after a Ctrl-C on a --session stream, fwctl waits until the server
        # has released the session; a second Ctrl-C while it waits exits 130 at once. A
        # server stopped with SIGSTOP never answers that wait (--timeout 10m), so only the
        # second Ctrl-C can end it; the 60 s below only guards against a hung test.
        with tempfile.TemporaryDirectory() as tmp:
            process, target = start_server(ARGS.fwserve, ARGS.model,
                                           os.path.join(tmp, "fwserve.log"))
            stopped = False
            generate = None
            try:
                result = subprocess.run(
                    [ARGS.fwctl, "--target", target, "session", "create", "--prefix", "Hi"],
                    capture_output=True, timeout=60)
                self.assertEqual(result.returncode, 0, result.stderr)
                session_id = result.stdout.decode().strip()
                generate = subprocess.Popen(
                    [ARGS.fwctl, "--target", target, "--timeout", "10m", "generate",
                     "--session", session_id, "--max-tokens", "100000", "x"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                out = Pump(generate.stdout)
                err = Pump(generate.stderr)
                out.wait_for(lambda data: len(data) >= 100, what="100 bytes of text")
                process.send_signal(signal.SIGSTOP)
                stopped = True
                generate.send_signal(signal.SIGINT)
                # The first one cancelled the stream; fwctl now waits for the session.
                err.wait_for(lambda data: b"interrupted after" in data,
                             what="the first interrupt's report")
                self.assertIsNone(generate.poll(), "fwctl did not wait for the session")
                generate.send_signal(signal.SIGINT)
                try:
                    code = generate.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.fail("a second Ctrl-C did not end fwctl: %r" % err.get())
                self.assertEqual(code, 130)
                err.thread.join(5)
                stderr = err.get().decode()
                self.assertTrue(stderr.endswith("fwctl: interrupted\n"), stderr)
                self.assertNotIn("holds", stderr)
            finally:
                if generate is not None:
                    if generate.poll() is None:
                        generate.kill()
                        generate.wait()
                    generate.stdout.close()
                    generate.stderr.close()
                if stopped:
                    process.send_signal(signal.SIGCONT)
                stop_server(process)

    def test_sigint_without_a_session(self):
        process = subprocess.Popen(
            [ARGS.fwctl, "--target", SERVER[1], "generate", "--max-tokens", "100000", "x"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = Pump(process.stdout)
        out.wait_for(lambda data: len(data) >= 50)
        process.send_signal(signal.SIGINT)
        self.assertEqual(process.wait(timeout=30), 130)
        self.assertIn(b"interrupted after", process.stderr.read())

    # ------------------------------------------------------------------------------
    # chat.

    def test_chat_keeps_one_session_and_exits_0_at_eof(self):
        code, out, err = fwctl("chat", "--max-tokens", "8", "--seed", "1",
                               stdin=b"ROMEO:\nJULIET:\n")
        self.assertEqual(code, 0, err)
        match = re.search(r"session ([0-9a-f]{32})", err)
        self.assertIsNotNone(match, err)
        self.assertIn("resume with: fwctl chat --session " + match.group(1), err)
        self.assertTrue(out.endswith(b"\n"), out)  # each reply ends its line
        info = self.session_info(match.group(1))
        self.assertEqual(info["tokens"], 7 + 8 + 8 + 8)
        # Resuming adds to the same session.
        code, _, err = fwctl("chat", "--session", match.group(1), "--max-tokens", "3",
                             stdin=b"more")
        self.assertEqual(code, 0, err)
        self.assertEqual(self.session_info(match.group(1))["tokens"], 31 + 5 + 3)

    def test_chat_suffix_is_appended_to_each_line(self):
        # Each line plus --suffix (C escapes understood) goes into the session.
        code, _, err = fwctl("chat", "--max-tokens", "2", "--seed", "1", "--suffix", "<\\t>",
                             stdin=b"ab\ncd\n")
        self.assertEqual(code, 0, err)
        session_id = re.search(r"session ([0-9a-f]{32})", err).group(1)
        self.assertEqual(self.session_info(session_id)["tokens"], (2 + 3 + 2) * 2)

    def test_chat_uses_the_models_template_and_its_end_of_turn_marker(self):
        # docs/http.md "Chat template": a model whose config has a chat template (here the
        # shipped model's copy with G1's template and the marker "s", which its greedy
        # reply reaches) gets each line as a user turn; the reply ends at the marker, kept in the
        # session as gRPC keeps stop strings. --template none sends raw lines.
        with tempfile.TemporaryDirectory() as tmp:
            model = os.path.join(tmp, "templated")
            os.mkdir(model)
            for name in os.listdir(ARGS.model):
                os.symlink(os.path.abspath(os.path.join(ARGS.model, name)),
                           os.path.join(model, name))
            os.unlink(os.path.join(model, "config.json"))
            with open(os.path.join(ARGS.model, "config.json")) as f:
                config = json.load(f)
            config["chat_template"] = {"message": "{Role}: {content}\n\n",
                                       "generation_prompt": "Assistant:", "stop": ["s"]}
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(config, f)
            process, target = start_server(ARGS.fwserve, model, os.path.join(tmp, "fwserve.log"))
            try:
                def run(*args, stdin=None):
                    result = subprocess.run([ARGS.fwctl, "--target", target, *args], input=stdin,
                                            capture_output=True, timeout=60)
                    return result.returncode, result.stdout.decode(), result.stderr.decode()

                code, out, err = run("chat", "--max-tokens", "40", "--temperature", "0",
                                     stdin=b"Hi\n")
                self.assertEqual(code, 0, err)
                self.assertIn("the model's chat template", err)
                reply = out.rstrip("\n")
                self.assertTrue(reply.endswith("s"), out)
                self.assertNotIn("s", reply[:-1])
                session = re.search(r"session ([0-9a-f]{32})", err).group(1)
                code, out, err = run("session", "get", session, "--json")
                self.assertEqual(code, 0, err)
                self.assertEqual(int(json.loads(out)["tokens"]), len("User: Hi\n\nAssistant:") +
                                 len(reply))
                # The same line raw: "Hi" plus the suffix, no template, no marker.
                code, out, err = run("chat", "--template", "none", "--max-tokens", "40",
                                     "--temperature", "0", stdin=b"Hi\n")
                self.assertEqual(code, 0, err)
                self.assertNotIn("chat template", err)
                session = re.search(r"session ([0-9a-f]{32})", err).group(1)
                code, out, err = run("session", "get", session, "--json")
                self.assertEqual(code, 0, err)
                self.assertEqual(int(json.loads(out)["tokens"]), len("Hi\n") + 40)
                code, _, err = run("chat", "--template", "g1", stdin=b"")
                self.assertEqual(code, 2, err)
                self.assertIn("--template must be auto or none, got 'g1'", err)
            finally:
                stop_server(process)

    def test_stream_timeout_is_the_deadline_of_a_stream(self):
        # A 100,000-token stream cannot end within 1 ms; the unary --timeout is not it.
        code, _, err = fwctl("--stream-timeout", "1ms", "--timeout", "60s", "generate",
                             "--max-tokens", "100000", "x")
        self.assertEqual(code, 1, err)
        self.assertIn("fwctl: DEADLINE_EXCEEDED", err)
        code, _, err = fwctl("--stream-timeout", "1ms", "chat", "--max-tokens", "100000",
                             stdin=b"x\n")
        self.assertEqual(code, 1, err)
        self.assertIn("DEADLINE_EXCEEDED", err)
        # Without it, the same kind of stream runs to its end.
        self.ok("--timeout", "1ms", "generate", "--max-tokens", "3", "x")

    def test_fwserve_max_tokens_spelling_and_comma_separated_models(self):
        # docs/serving.md: --max_tokens is --max-tokens; --model takes a comma-separated
        # list (the first is the default). The later --max_tokens overrides the helper's
        # --max-tokens 100000.
        with tempfile.TemporaryDirectory() as tmp:
            second = os.path.join(tmp, "second")
            os.symlink(os.path.abspath(ARGS.model), second)
            log_path = os.path.join(tmp, "fwserve.log")
            process, target = start_server(ARGS.fwserve, ARGS.model + "," + second, log_path,
                                           extra=["--max_tokens", "5"])
            try:
                def run(*args):
                    result = subprocess.run([ARGS.fwctl, "--target", target, *args],
                                            capture_output=True, timeout=60)
                    return result.returncode, result.stdout, result.stderr.decode()

                code, out, err = run("models", "--json")
                self.assertEqual(code, 0, err)
                models = json.loads(out)["models"]
                self.assertEqual([m["name"] for m in models],
                                 [os.path.basename(os.path.normpath(ARGS.model)), "second"])
                self.assertEqual([bool(m.get("is_default")) for m in models], [True, False])
                code, _, err = run("generate", "--model", "second", "--max-tokens", "5", "x")
                self.assertEqual(code, 0, err)
                # fwctl's --max_tokens spelling too.
                code, _, err = run("generate", "--max_tokens", "6", "x")
                self.assertEqual(code, 1, err)
                self.assertIn("INVALID_ARGUMENT", err)
                self.assertIn("max_tokens", err)
            finally:
                stop_server(process)

    def test_fwserve_refuses_cuda_without_cuda_and_bad_devices(self):
        # docs/serving.md: --device cuda is compile-guarded and refuses cleanly where
        # LibTorch has no usable CUDA device (a CPU LibTorch, or no GPU): a message
        # naming the flag, and a failed start. Where both are there, it serves.
        usable = cuda_usable(ARGS.fwserve)
        print("\nCUDA LibTorch and an NVIDIA device: %s" % usable)
        for device, message in [
                ("cuda", None if usable else
                 "--device=cuda, but this LibTorch build has no usable CUDA device"),
                ("cuda:0", None if usable else
                 "--device=cuda, but this LibTorch build has no usable CUDA device"),
                ("gpu", "--device must be cpu, cuda or cuda:N, got 'gpu'")]:
            if message is None:
                with tempfile.TemporaryDirectory() as tmp:
                    process, _ = start_server(ARGS.fwserve, ARGS.model,
                                              os.path.join(tmp, "fwserve.log"),
                                              extra=("--device", device))
                    stop_server(process)
                continue
            result = subprocess.run(
                [ARGS.fwserve, "--listen", "127.0.0.1:0", "--metrics-listen", "",
                 "--model", ARGS.model, "--device", device],
                capture_output=True, timeout=120)
            stderr = result.stderr.decode(errors="replace")
            self.assertNotEqual(result.returncode, 0, stderr)
            self.assertIn(message, stderr)
            self.assertNotIn("listening", stderr)

    def test_fwserve_refuses_bf16_matrices_where_they_do_not_apply(self):
        # docs/serving.md --gpu-matrices and --gpu-tf32: bf16 matrices are for an RWKV-7
        # model on CUDA and TF32 for CUDA; on the CPU, and for a value other than float32
        # or bf16, the start fails naming the flag.
        for flags, message in [
                (("--gpu-matrices", "bf16"), "--gpu-matrices=bf16 needs --device=cuda"),
                (("--gpu-matrices", "fp8"), "--gpu-matrices must be float32 or bf16, got 'fp8'"),
                (("--gpu-tf32",), "--gpu-tf32 needs --device=cuda")]:
            result = subprocess.run(
                [ARGS.fwserve, "--listen", "127.0.0.1:0", "--metrics-listen", "",
                 "--model", ARGS.model] + list(flags),
                capture_output=True, timeout=120)
            stderr = result.stderr.decode(errors="replace")
            self.assertNotEqual(result.returncode, 0, stderr)
            self.assertIn(message, stderr)
            self.assertNotIn("listening", stderr)

    def test_fwserve_shutdown_ends_queued_requests_and_keeps_other_models_sessions(self):
        # docs/serving.md "Graceful shutdown": past --drain-timeout, queued requests get
        # UNAVAILABLE; sessions of models no longer served are left in the store.
        with tempfile.TemporaryDirectory() as tmp:
            second = os.path.join(tmp, "second")
            os.symlink(os.path.abspath(ARGS.model), second)
            store = os.path.join(tmp, "store")
            os.mkdir(store)
            flags = ["--session-store", "dir:" + store, "--max-active-streams", "1",
                     "--drain-timeout", "1s", "--max_tokens", "100000000"]
            log_path = os.path.join(tmp, "fwserve.log")
            process, target = start_server(ARGS.fwserve, ARGS.model + "," + second, log_path,
                                           extra=flags)
            held = None
            try:
                def run(*args):
                    result = subprocess.run([ARGS.fwctl, "--target", target, *args],
                                            capture_output=True, timeout=60)
                    return result.returncode, result.stdout.decode(), result.stderr.decode()

                code, out, err = run("session", "create", "--model", "second", "--prefix", "kept")
                self.assertEqual(code, 0, err)
                other = out.strip()
                code, out, err = run("session", "create", "--prefix", "q")
                self.assertEqual(code, 0, err)
                waiting = out.strip()
                # The one active stream is held open by flow control: its fwctl writes
                # to a pipe that is read once, then never again.
                held = subprocess.Popen(
                    [ARGS.fwctl, "--target", target, "generate", "--max-tokens", "100000000",
                     "x"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                self.assertTrue(held.stdout.read(1))
                queued = subprocess.Popen(
                    [ARGS.fwctl, "--target", target, "--retries", "0", "generate",
                     "--session", waiting, "--max-tokens", "5", "y"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                deadline = time.time() + 60
                while True:  # queued: it holds its session while it waits
                    code, out, err = run("session", "get", "--json", waiting)
                    self.assertEqual(code, 0, err)
                    if json.loads(out).get("busy"):
                        break
                    self.assertLess(time.time(), deadline, "the request never queued")
                    time.sleep(0.02)
                process.send_signal(signal.SIGTERM)
                _, queued_err = queued.communicate(timeout=60)
                self.assertEqual(queued.returncode, 1, queued_err)
                self.assertIn(b"fwctl: UNAVAILABLE", queued_err)
                self.assertEqual(process.wait(timeout=60), 0)
            finally:
                if held is not None:
                    held.kill()
                    held.wait()
                    held.stdout.close()
                if process.poll() is None:
                    process.kill()
                    process.wait()
            self.assertTrue(os.path.exists(os.path.join(store, other + ".fwstate")))

            # A run that serves only the first model leaves the other's session alone...
            process, target = start_server(ARGS.fwserve, ARGS.model, log_path,
                                           extra=["--session-store", "dir:" + store])
            stop_server(process)
            self.assertTrue(os.path.exists(os.path.join(store, other + ".fwstate")))
            # ...and serving that model again brings it back.
            process, target = start_server(ARGS.fwserve, ARGS.model + "," + second, log_path,
                                           extra=["--session-store", "dir:" + store])
            try:
                result = subprocess.run(
                    [ARGS.fwctl, "--target", target, "session", "get", "--json", other],
                    capture_output=True, timeout=60)
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertEqual(int(json.loads(result.stdout)["tokens"]), 4)
            finally:
                stop_server(process)

    def test_health_exits_3_while_the_server_drains(self):
        # docs/client.md: `fwctl health` prints NOT_SERVING and exits 3; a draining server
        # is NOT_SERVING. A stream held open by flow control (its fwctl's stdout is read
        # once, then never) keeps the server draining for as long as the test needs.
        with tempfile.TemporaryDirectory() as tmp:
            log_path = os.path.join(tmp, "fwserve.log")
            process, target = start_server(
                ARGS.fwserve, ARGS.model, log_path,
                extra=["--drain-timeout", "10m", "--max_tokens", "100000000"])
            held = subprocess.Popen(
                [ARGS.fwctl, "--target", target, "generate", "--max-tokens", "100000000", "x"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                self.assertTrue(held.stdout.read(1))
                health = [ARGS.fwctl, "--target", target, "health"]
                result = subprocess.run(health, capture_output=True, timeout=60)
                self.assertEqual((result.returncode, result.stdout), (0, b"SERVING\n"))
                process.send_signal(signal.SIGTERM)
                deadline = time.time() + 60
                while True:
                    result = subprocess.run(health, capture_output=True, timeout=60)
                    if result.returncode != 0 or time.time() > deadline:
                        break
                    time.sleep(0.02)  # until the signal has been handled
                self.assertEqual((result.returncode, result.stdout), (3, b"NOT_SERVING\n"),
                                 result.stderr)
            finally:
                held.kill()
                held.wait()
                held.stdout.close()
            # With the stream gone, the drain ends and the server exits 0.
            self.assertEqual(process.wait(timeout=60), 0)

    def test_chat_sigint_stops_only_the_reply(self):
        process = subprocess.Popen(
            [ARGS.fwctl, "--target", SERVER[1], "chat", "--max-tokens", "100000"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = Pump(process.stdout)
        err = Pump(process.stderr)
        session_id = re.search(
            rb"session ([0-9a-f]{32})",
            err.wait_for(lambda d: re.search(rb"session [0-9a-f]{32}", d),
                         what="session id")).group(1).decode()
        interrupted = []
        for turn, line in enumerate([b"go\n", b"again\n"]):
            before = len(out.get())
            process.stdin.write(line)
            process.stdin.flush()
            out.wait_for(lambda d: len(d) >= before + 100, what="a reply")
            process.send_signal(signal.SIGINT)
            text = err.wait_for(
                lambda d: len(re.findall(rb"reply interrupted after \d+", d)) > turn,
                what="the interrupted reply").decode()
            interrupted = [int(n) for n in re.findall(r"reply interrupted after (\d+)", text)]
        process.stdin.close()
        self.assertEqual(process.wait(timeout=30), 0, err.get())
        info = self.wait_idle(session_id)
        self.assertFalse(info["busy"])
        self.assertGreaterEqual(info["tokens"], 3 + interrupted[0] + 6 + interrupted[1])

    def test_chat_sigint_at_the_prompt_exits_130(self):
        process = subprocess.Popen(
            [ARGS.fwctl, "--target", SERVER[1], "chat"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        err = Pump(process.stderr)
        err.wait_for(lambda d: re.search(rb"session [0-9a-f]{32}", d), what="session id")
        time.sleep(0.2)  # at the prompt, waiting for input
        process.send_signal(signal.SIGINT)
        self.assertEqual(process.wait(timeout=30), 130)
        err.thread.join(5)
        self.assertIn(b"resume with: fwctl chat --session", err.get())
        process.stdin.close()
        process.stdout.close()

    # ------------------------------------------------------------------------------
    # score.

    def test_score_table_and_json(self):
        text = "To be, or not to be"
        out, _ = self.ok("score", "--json", text)
        scored = json.loads(out)
        self.assertEqual(len(scored["token_ids"]), len(text))
        self.assertEqual(len(scored["logprobs"]), len(text) - 1)
        self.assertAlmostEqual(scored["total_logprob"], sum(scored["logprobs"]), places=6)

        out, _ = self.ok("score", text)
        lines = out.decode().splitlines()
        # Columns: index, token id, log-prob, the token's byte C-quoted (may hold spaces).
        rows = [line.split(None, 3) for line in lines[1:1 + len(text)]]
        self.assertEqual(rows[0], ["0", str(ord("T")), "-", '"T"'])
        self.assertEqual(rows[2][3], '" "')
        self.assertEqual(rows[5][3], '","')
        for row, logprob in zip(rows[1:], scored["logprobs"]):
            self.assertAlmostEqual(float(row[2]), logprob, places=3)
        self.assertIn("total_logprob %.4f over %d scored tokens" %
                      (scored["total_logprob"], len(text) - 1), out.decode())
        perplexity = float(re.search(r"perplexity (\S+)", out.decode()).group(1))
        self.assertAlmostEqual(perplexity, scored["perplexity"], places=3)

        # Conditioned on a session: one log-prob per token, and the session is unchanged.
        session_id = self.ok("session", "create", "--prefix", "HAMLET:\n")[0].decode().strip()
        out, _ = self.ok("score", "--json", "--session", session_id, text)
        self.assertEqual(len(json.loads(out)["logprobs"]), len(text))
        self.assertEqual(self.session_info(session_id)["tokens"], 8)
        out_stdin, _ = self.ok("score", "--json", "-", stdin=text.encode())
        self.assertEqual(json.loads(out_stdin), scored)

    # ------------------------------------------------------------------------------
    # sessions.

    def test_session_lifecycle(self):
        out, _ = self.ok("session", "create", "--prefix", "ROMEO:\n")
        session_id = out.decode().strip()
        self.assertRegex(session_id, r"^[0-9a-f]{32}$")
        out, _ = self.ok("session", "get", session_id)
        self.assertIn("tokens: 7\n", out.decode())
        self.assertIn("model: aft-shakespeare\n", out.decode())
        self.assertIn("busy: false\n", out.decode())
        out, _ = self.ok("--verbose", "session", "create")
        self.assertIn("tokens: 0", out.decode())
        escaped = self.ok("session", "create", "--prefix", "a\\nb")[0].decode().strip()
        self.assertEqual(self.session_info(escaped)["tokens"], 3)  # "a", newline, "b"
        self.ok("session", "rm", escaped)
        self.ok("generate", "--session", session_id, "--max-tokens", "10", "--seed", "2")
        self.assertEqual(self.session_info(session_id)["tokens"], 17)

        out, _ = self.ok("session", "list", "--all")
        self.assertIn(session_id, out.decode())
        out, _ = self.ok("session", "list", "--all", "--json", "--model", "aft-shakespeare")
        listed = {s["session_id"]: s for s in json.loads(out)["sessions"]}
        self.assertEqual(int(listed[session_id]["tokens"]), 17)

        fork = self.ok("session", "fork", session_id)[0].decode().strip()
        self.assertNotEqual(fork, session_id)
        self.assertEqual(self.session_info(fork)["tokens"], 17)

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "session.blob")
            _, err = self.ok("session", "export", session_id, path)
            self.assertIn("17 tokens", err)
            self.assertGreater(os.path.getsize(path), 0)
            imported = self.ok("session", "import", path, "--model",
                               "aft-shakespeare")[0].decode().strip()
            self.assertEqual(self.session_info(imported)["tokens"], 17)
            # Through stdout and stdin.
            blob, _ = self.ok("session", "export", session_id, "-")
            with open(path, "rb") as f:
                self.assertEqual(blob, f.read())
            piped = self.ok("session", "import", "-", stdin=blob)[0].decode().strip()
            self.assertEqual(self.session_info(piped)["tokens"], 17)
            # Continuing the copies gives the same text as continuing the original.
            outs = [self.ok("generate", "--session", s, "--max-tokens", "20", "--seed", "4")[0]
                    for s in (session_id, fork, imported, piped)]
            self.assertEqual(len(set(outs)), 1, outs)
            code, _, err = fwctl("session", "import", os.path.join(tmp, "missing"))
            self.assertEqual(code, 1)
            self.assertIn("cannot read", err)
            with open(path, "wb") as f:
                f.write(b"garbage")
            code, _, err = fwctl("session", "import", path)
            self.assertEqual(code, 1)
            self.assertIn("INVALID_ARGUMENT", err)

        self.ok("session", "rm", session_id, fork, imported, piped)
        code, _, err = fwctl("session", "get", session_id)
        self.assertEqual(code, 1)
        self.assertIn("NOT_FOUND", err)
        code, _, err = fwctl("session", "rm", session_id)
        self.assertEqual(code, 1)
        self.assertIn("NOT_FOUND", err)

    def test_session_list_pages(self):
        mine = [self.ok("session", "create")[0].decode().strip() for _ in range(5)]

        def in_mine(sessions):
            return [s["session_id"] for s in sessions if s["session_id"] in mine]

        # Page by page (other tests' sessions may come between): each once, oldest first.
        seen, token, pages = [], "", 0
        while True:
            out, _ = self.ok("session", "list", "--json", "--page-size", "2",
                             "--page-token", token)
            page = json.loads(out)
            self.assertLessEqual(len(page["sessions"]), 2)
            seen += [s["session_id"] for s in page["sessions"]]
            token, pages = page["next_page_token"], pages + 1
            if not token:
                break
            self.assertLess(pages, 1000)
        self.assertEqual([s for s in seen if s in mine], mine)
        self.assertEqual(len(seen), len(set(seen)))
        # --all: every page at once, the same order.
        out, _ = self.ok("session", "list", "--all", "--json", "--page-size", "2")
        everything = json.loads(out)
        self.assertEqual(everything["next_page_token"], "")
        self.assertEqual([s["session_id"] for s in everything["sessions"]], seen)
        self.assertEqual(in_mine(everything["sessions"]), mine)
        # A table page with more to come says how to get it, on stderr.
        out, err = self.ok("session", "list", "--page-size", "1")
        self.assertEqual(len(out.decode().splitlines()), 2)  # the header and one session
        match = re.search(r"more sessions follow: --page-token (\S+)", err)
        self.assertIsNotNone(match, err)
        out, _ = self.ok("session", "list", "--page-size", "1", "--page-token", match.group(1))
        self.assertIn(seen[1], out.decode())
        code, _, err = fwctl("session", "list", "--page-token", "not-a-token")
        self.assertEqual(code, 1)
        self.assertIn("INVALID_ARGUMENT", err)
        self.ok("session", "rm", *mine)

    def test_busy_session_is_aborted(self):
        session_id = self.ok("session", "create", "--prefix", "x")[0].decode().strip()
        process = subprocess.Popen(
            [ARGS.fwctl, "--target", SERVER[1], "generate", "--session", session_id,
             "--max-tokens", "100000"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = Pump(process.stdout)
        out.wait_for(lambda d: len(d) >= 20)
        code, _, err = fwctl("generate", "--session", session_id, "--max-tokens", "1", "y")
        self.assertEqual(code, 1)
        self.assertIn("ABORTED", err)
        self.assertTrue(self.session_info(session_id)["busy"])
        process.send_signal(signal.SIGINT)
        self.assertEqual(process.wait(timeout=30), 130)
        self.assertFalse(self.wait_idle(session_id)["busy"])


class ExampleTest(unittest.TestCase):
    """client/examples/chat_example.cc, the program docs/client.md points users to."""

    def test_chat_example_runs(self):
        if not ARGS.example:
            self.fail("no --example given (tests/client/CMakeLists.txt passes the built example)")
        result = subprocess.run([ARGS.example, SERVER[1]], capture_output=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        out = result.stdout.decode(errors="replace")
        self.assertIn("--- first turn", out)
        self.assertRegex(out, r"session now holds \d+ tokens\n$")


def main():
    global ARGS, SERVER
    parser = argparse.ArgumentParser()
    parser.add_argument("--fwctl", required=True)
    parser.add_argument("--example", default=None)
    parser.add_argument("--fwserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--fwmodel", required=True)
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "fwserve.log")
        process, target = start_server(ARGS.fwserve, ARGS.model, log_path)
        SERVER = (process, target, log_path)
        try:
            program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
        finally:
            stop_server(process)
        result = program.result
        print("%d passed, %d failed" % (result.testsRun - len(result.failures) -
                                       len(result.errors) - len(result.skipped),
                                       len(result.failures) + len(result.errors)))
        if not result.wasSuccessful():
            with open(log_path, "rb") as f:
                sys.stderr.write("--- fwserve log (tail)\n")
                sys.stderr.write(f.read().decode(errors="replace")[-4000:])
        sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
