#!/usr/bin/env python3
"""fwtrain as a binary (docs/training.md): a tiny aft model (d_model 16, one layer)
trained for a few steps of batch 4 x 32 bytes on the first 20,000 bytes of the corpus.

  test_train_serve_and_card   a run ends with status 0; its stderr has the start line,
        the progress lines in their documented format (step, loss, validation, tokens/s,
        elapsed, ETA; non-terminal: the first step and the last), the validation lines
        and the final summary; the directory is a checkpoint that `fwmodel info` loads,
        whose validation loss `fwmodel score` reproduces, that `fwserve --model` serves
        (its greedy continuation through fwctl equals `fwmodel generate`'s), with
        MODEL_CARD.md naming its steps, tokens, parameters, losses and fingerprint
  test_kill_and_resume_is_bit_identical   a run killed (SIGKILL) mid-way and started
        again with the same command says "resuming DIR at step K/N" for the last
        checkpoint K, goes on from step K + 1 and ends with the same model.safetensors,
        byte for byte, as an uninterrupted run; a resume with another --seed is refused
        naming the flag
  test_divergence_is_reported   --lr 1e30 makes the loss NaN: the run stops with status
        1 and the documented message (step, loss, gradient norm, lr, "The last checkpoint
        in DIR is intact"), the last checkpoint loads, and no model card is written

Each test can be made to fail on purpose with --break NAME (see BREAKS), to show that
its assertions can fail.

Usage: fwtrain_test.py --fwtrain PATH --fwmodel PATH --fwserve PATH --fwctl PATH
       --text CORPUS [--keep] [--break NAME] [TEST ...]
"""
import argparse
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402
from replica_processes import _child_setup  # noqa: E402
from unittest_run import check, report_and_exit  # noqa: E402

ARGS = None
WORK_DIRS = []
LOGS = {}  # test id -> texts to show when it fails

BREAKS = {
    "serve-other-model": "test_train_serve_and_card: fwserve serves the shipped "
                         "aft-shakespeare instead of the trained checkpoint",
    "reference-other-seed": "test_kill_and_resume_is_bit_identical: the uninterrupted "
                            "reference run uses --seed 2",
    "sane-lr": "test_divergence_is_reported: --lr 0.002 (nothing diverges)",
}

CONFIG = {"format_version": 1, "architecture": "aft", "d_model": 16, "n_layers": 1,
          "n_heads": 2, "d_ff": 32, "ffn": "squared_relu", "dconv_kernel": 4}
CORPUS_BYTES = 20000
BATCH, SEQ = 4, 32
RUN_TIMEOUT_S = 120  # only catches a hang; a run here takes about a second

NUM = r"\d+\.\d{4}"
PROGRESS = re.compile(
    r"^step (\d+)/(\d+) \| loss (%s) \| val (-|%s) nats/byte \| (\d+) tok/s \| "
    r"elapsed (\d+s|\d+m\d\ds|\d+h\d\dm) \| ETA (\d+s|\d+m\d\ds|\d+h\d\dm|\?)$" % (NUM, NUM))
VALIDATION = re.compile(
    r"^step (\d+): train (%s), validation (%s) nats/byte \((%s) bits/byte\)"
    r"( on the first (\d+) bytes)?$" % (NUM, NUM, NUM))


class FwtrainTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="fwtrain-test-")
        WORK_DIRS.append(self.work)
        self.text = os.path.join(self.work, "text.txt")
        with open(ARGS.text, "rb") as f:
            corpus = f.read(CORPUS_BYTES)
        with open(self.text, "wb") as f:
            f.write(corpus)
        # The contract's split: the last 10% of the bytes validate.
        self.validation = corpus[int(math.floor(len(corpus) * 0.9)):]
        self.config = os.path.join(self.work, "config.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)
        LOGS[self.id()] = []

    def train_argv(self, out, steps, *extra):
        return [ARGS.fwtrain, "--text", self.text, "--out", out, "--config", self.config,
                "--steps", str(steps), "--batch_size", str(BATCH), "--seq_len", str(SEQ),
                "--warmup_steps", "2", "--eval_bytes", "64", "--threads", "1", *extra]

    def run_tool(self, argv, stdin=None):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                                input=stdin, preexec_fn=_child_setup)
        LOGS[self.id()].append("$ %s\n[status %d]\n%s%s" % (
            " ".join(argv), result.returncode, result.stdout[-3000:], result.stderr[-3000:]))
        return result

    def train_state(self, out):
        with open(os.path.join(out, "train_state.json")) as f:
            return json.load(f)

    def test_train_serve_and_card(self):
        out = os.path.join(self.work, "run")
        steps, every = 150, 50
        run = self.run_tool(self.train_argv(out, steps, "--eval_interval", str(every),
                                            "--checkpoint_interval", str(every)))
        check(run.returncode == 0, "fwtrain exited %d" % run.returncode)
        lines = run.stderr.splitlines()
        start = re.match(r"^training aft: (\d+) parameters, (\d+) state bytes/session$",
                         lines[0])
        check(start is not None, "first line: %r" % lines[0])
        parameters, state_bytes = int(start.group(1)), int(start.group(2))

        # Progress lines (stderr is not a terminal: one at the first step, then one every
        # 30 s, and the last step's): every "step N/M" line has the documented format.
        progress = [line for line in lines if re.match(r"^step \d+/", line)]
        for line in progress:
            check(PROGRESS.match(line), "progress line not in the documented format: %r"
                  % line)
        matches = [PROGRESS.match(line) for line in progress]
        check(matches[0].group(1) == "1" and matches[0].group(4) == "-",
              "the first progress line is step 1 with no validation yet: %r" % progress[0])
        last = matches[-1]
        check(last.group(1) == str(steps) and last.group(2) == str(steps) and
              last.group(7) == "0s", "the last progress line: %r" % progress[-1])
        check(all(m.group(2) == str(steps) for m in matches), progress)

        # Validation every --eval_interval steps on --eval_bytes, the last on all bytes.
        validations = [VALIDATION.match(line) for line in lines if VALIDATION.match(line)]
        check([int(m.group(1)) for m in validations] == list(range(every, steps + 1, every)),
              "validation lines: %s" % [m.group(0) for m in validations])
        check(all(m.group(6) == "64" for m in validations[:-1]) and
              validations[-1].group(5) is None,
              "interim validations on the first 64 bytes, the last on all: %s"
              % [m.group(0) for m in validations])
        final_val = float(validations[-1].group(3))
        check(last.group(4) == validations[-1].group(3), "the last progress line shows the "
              "final validation %s: %r" % (validations[-1].group(3), progress[-1]))
        check(abs(float(validations[-1].group(4)) - final_val / math.log(2)) < 1e-3,
              "bits/byte = nats/byte / ln 2: %r" % validations[-1].group(0))
        done = [line for line in lines if line.startswith("done: ")]
        check(len(done) == 1 and re.match(
            r"^done: %d steps, %d tokens, validation %s nats/byte \(%s bits/byte\), "
            r"\d+\.\d min$" % (steps, steps * BATCH * SEQ, re.escape(validations[-1].group(3)),
                               re.escape(validations[-1].group(4))), done[0]),
              "summary line: %s" % done)
        check(any(re.match(r"^time: forward \d+ s, backward \d+ s, optimizer \d+ s, "
                           r"validation \d+ s$", line) for line in lines), "no time line")

        state = self.train_state(out)
        check(state["step"] == steps and state["tokens_seen"] == steps * BATCH * SEQ,
              "train_state.json: %s" % state)

        # A loadable checkpoint: fwmodel info, and fwmodel score reproduces the validation.
        info = self.run_tool([ARGS.fwmodel, "info", out, "--json"])
        check(info.returncode == 0, "fwmodel info exited %d" % info.returncode)
        info = json.loads(info.stdout)
        check(info["parameters"] == parameters and
              info["state_bytes_per_session"] == state_bytes, info)
        for key, value in CONFIG.items():
            check(info["config"][key] == value, "config %s: %s" % (key, info["config"]))
        validation_file = os.path.join(self.work, "validation.txt")
        with open(validation_file, "wb") as f:
            f.write(self.validation)
        score = self.run_tool([ARGS.fwmodel, "score", out, "--text-file", validation_file])
        check(score.returncode == 0, "fwmodel score exited %d" % score.returncode)
        mean = re.search(r"^mean: (\d+\.\d+) nats/byte", score.stdout, re.M)
        check(mean and abs(float(mean.group(1)) - final_val) < 1e-4,
              "fwmodel score %s vs the run's final validation %s"
              % (mean and mean.group(1), final_val))

        # The model card.
        card_path = os.path.join(out, "MODEL_CARD.md")
        check(os.path.exists(card_path), "no MODEL_CARD.md")
        with open(card_path) as f:
            card = f.read()
        rows = dict(re.findall(r"^\| ([^|]+?) \| (.*) \|$", card, re.M))
        check(rows.get("architecture") == "aft" and rows.get("parameters") == str(parameters)
              and rows.get("state bytes per session") == str(state_bytes)
              and rows.get("steps") == str(steps)
              and rows.get("tokens seen") == str(steps * BATCH * SEQ)
              and rows.get("fingerprint") == "`%s`" % info["fingerprint"]
              and rows.get("validation loss", "").startswith(
                  "%.4f nats/byte = %s bits/byte (all %d validation bytes)"
                  % (final_val, validations[-1].group(4), len(self.validation))),
              "card rows: %s" % rows)
        check(" ".join(self.train_argv(out, steps)[1:3]) in card, "the card has no command")
        check("trained on `%s`" % os.path.basename(self.train_argv(out, steps)[2]) in card,
              "the card does not name the training text: %s" % card[:300])

        # fwserve serves it: its scores of a text and its greedy continuation equal
        # fwmodel's (this tiny model's greedy text is mostly spaces; the scores are not).
        scored_file = os.path.join(self.work, "scored.txt")
        with open(scored_file, "wb") as f:
            f.write(self.validation[:256])
        offline = self.run_tool([ARGS.fwmodel, "score", out, "--text-file", scored_file,
                                 "--json"])
        check(offline.returncode == 0, "fwmodel score --json exited %d" % offline.returncode)
        offline = json.loads(offline.stdout)["logprobs"]
        prompt, tokens = "ROMEO:", 40
        generated = self.run_tool([ARGS.fwmodel, "generate", out, "--prompt", prompt,
                                   "--max_tokens", str(tokens), "--temperature", "0"])
        check(generated.returncode == 0 and generated.stdout.startswith(prompt),
              "fwmodel generate: %r" % generated.stdout)
        expected = generated.stdout[len(prompt):].rstrip("\n")
        check(len(expected.encode()) == tokens, "fwmodel generated %r" % expected)
        served = (os.path.join(os.path.dirname(os.path.dirname(ARGS.text)), "pretrained",
                               "aft-shakespeare")
                  if ARGS.break_ == "serve-other-model" else out)
        log = os.path.join(self.work, "fwserve.log")
        process, target = start_server(ARGS.fwserve, served, log, extra=("--threads", "1"))
        try:
            reply = self.run_tool([ARGS.fwctl, "--target", target, "generate", "--temperature",
                                   "0", "--max-tokens", str(tokens), prompt])
            online = self.run_tool([ARGS.fwctl, "--target", target, "score", "--json", "-"],
                                   stdin=self.validation[:256].decode())
        finally:
            stop_server(process)
        with open(log, errors="replace") as f:
            LOGS[self.id()].append(f.read()[-3000:])
        check(reply.returncode == 0 and online.returncode == 0,
              "fwctl exited %d, %d" % (reply.returncode, online.returncode))
        online = json.loads(online.stdout)["logprobs"]
        check(len(online) == len(offline) == 255 and
              all(abs(a - b) < 1e-6 for a, b in zip(online, offline)),
              "fwserve's scores differ from fwmodel's: %s vs %s" % (online[:8], offline[:8]))
        check(reply.stdout == expected, "fwserve's greedy %r != fwmodel's %r"
              % (reply.stdout, expected))

    def test_kill_and_resume_is_bit_identical(self):
        steps, every = 200, 5
        extra = ("--eval_interval", "1", "--checkpoint_interval", str(every))
        reference = os.path.join(self.work, "reference")
        ref_extra = extra + (("--seed", "2") if ARGS.break_ == "reference-other-seed" else ())
        run = self.run_tool(self.train_argv(reference, steps, *ref_extra))
        check(run.returncode == 0, "the reference run exited %d" % run.returncode)

        # The interrupted run writes a line per step into a 4 KiB pipe that this test
        # stops reading after step 3: fwtrain blocks within ~50 steps, long before step
        # 200, so the kill always lands mid-run.
        out = os.path.join(self.work, "run")
        argv = self.train_argv(out, steps, *extra)
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   preexec_fn=_child_setup)
        try:
            fcntl.fcntl(process.stderr.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
            seen = b""
            while not re.search(rb"^step 3: ", seen, re.M):
                chunk = os.read(process.stderr.fileno(), 128)  # small reads: little read ahead
                check(chunk, "fwtrain ended before step 3: %r" % seen[-2000:])
                seen += chunk
            # Wait for the first checkpoint (step 5) to be recorded, then kill.
            deadline = time.time() + RUN_TIMEOUT_S
            while self.train_state(out)["step"] < every:
                check(time.time() < deadline, "no checkpoint at step %d" % every)
                time.sleep(0.01)
            check(process.poll() is None, "fwtrain ended before the kill")
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stderr.close()
        killed_at = self.train_state(out)["step"]
        LOGS[self.id()].append("killed; the last checkpoint is step %d" % killed_at)
        check(killed_at % every == 0 and every <= killed_at < steps,
              "checkpoint after the kill at step %d" % killed_at)

        resumed = self.run_tool(argv)
        check(resumed.returncode == 0, "the resumed run exited %d" % resumed.returncode)
        lines = resumed.stderr.splitlines()
        check(lines[0] == "resuming %s at step %d/%d" % (out, killed_at, steps),
              "first line: %r" % lines[0])
        check(not any(line.startswith("training aft:") for line in lines),
              "a resumed run does not start anew")
        evals = [int(m.group(1)) for m in map(VALIDATION.match, lines) if m]
        check(evals == list(range(killed_at + 1, steps + 1)),
              "the resumed run validated at steps %s..%s, not %d..%d"
              % (evals[:1], evals[-1:], killed_at + 1, steps))
        check(self.train_state(out)["step"] == steps, self.train_state(out))
        for name in ("model.safetensors", "config.json"):
            with open(os.path.join(reference, name), "rb") as a, \
                    open(os.path.join(out, name), "rb") as b:
                check(a.read() == b.read(),
                      "%s differs from the uninterrupted run's (killed at step %d)"
                      % (name, killed_at))
        check(self.train_state(out)["val_loss"] == self.train_state(reference)["val_loss"],
              "final validation %s vs %s" % (self.train_state(out)["val_loss"],
                                             self.train_state(reference)["val_loss"]))

        # A resume with an option that defines the run changed is refused, naming it.
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            weights = f.read()
        other = self.run_tool(argv + ["--seed", "2"])
        check(other.returncode == 1, "a resume with another --seed exited %d"
              % other.returncode)
        check("fwtrain: cannot resume %s: --seed=2 differs from the run's 1 (use a new --out "
              "directory, or the original options)" % out in other.stderr, other.stderr)
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            check(f.read() == weights, "the refused resume changed the checkpoint")

    def test_divergence_is_reported(self):
        out = os.path.join(self.work, "run")
        lr = "0.002" if ARGS.break_ == "sane-lr" else "1e30"
        run = self.run_tool(self.train_argv(out, 20, "--lr", lr, "--checkpoint_interval",
                                            "1", "--eval_interval", "20"))
        check(run.returncode == 1, "a diverging run exited %d" % run.returncode)
        match = re.search(
            r"^fwtrain: training diverged at step (\d+): loss (\S+), gradient norm "
            r"(not computed|\S+) "
            r"\(lr 1e\+30\)\. The last checkpoint in (\S+) is intact; lower --lr or raise "
            r"--warmup_steps and start a new run$", run.stderr, re.M)
        check(match, "no divergence message: %r" % run.stderr[-2000:])
        step, loss = int(match.group(1)), float(match.group(2))
        # The norm is computed only from a finite loss: "not computed" after a NaN/Inf one.
        check((match.group(3) == "not computed") == (not math.isfinite(loss)), match.group(0))
        norm = float("nan") if match.group(3) == "not computed" else float(match.group(3))
        check(not (math.isfinite(loss) and math.isfinite(norm)),
              "loss %s, norm %s: nothing was NaN/Inf" % (loss, norm))
        check(match.group(4) == out, match.group(0))
        # --checkpoint_interval 1: the last checkpoint is the step before the bad one.
        check(self.train_state(out)["step"] == step, self.train_state(out))
        info = self.run_tool([ARGS.fwmodel, "info", out, "--json"])
        check(info.returncode == 0, "the last checkpoint does not load")
        check(not os.path.exists(os.path.join(out, "MODEL_CARD.md")),
              "a diverged run wrote a model card")


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    for name in ("fwtrain", "fwmodel", "fwserve", "fwctl", "text"):
        parser.add_argument("--" + name, required=True)
    parser.add_argument("--keep", action="store_true", help="keep the work directories")
    parser.add_argument("--break", dest="break_", choices=sorted(BREAKS), default=None,
                        help="a deliberately wrong setup that must turn one test red")
    ARGS, rest = parser.parse_known_args()
    for name in ("fwtrain", "fwmodel", "fwserve", "fwctl", "text"):
        setattr(ARGS, name, os.path.abspath(getattr(ARGS, name)))
    if ARGS.break_:
        print("fwtrain_test: deliberate break %s: %s" % (ARGS.break_, BREAKS[ARGS.break_]))
    program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)

    def show_failure(test_id):
        for text in LOGS.get(test_id, []):
            sys.stderr.write("--- %s\n%s\n" % (test_id, text))

    report_and_exit("fwtrain_test", program.result, WORK_DIRS, ARGS.keep, show_failure)


if __name__ == "__main__":
    main()
