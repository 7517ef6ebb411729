#!/usr/bin/env python3
"""OpenBLAS core detection at start (common/load_time_env.h) in the real binaries.

Each binary is started with OpenBLAS's slow "Prescott" core really loaded
(OPENBLAS_CORETYPE=Prescott, with FWSERVE_OPENBLAS_CORETYPE_IS_DETECTED=1 so that it
counts as OpenBLAS's own detection, as on a CPU that Debian 12's OpenBLAS 0.3.21
misdetects), and must log that it set the core this CPU runs best and that
openblas_get_corename() in the started process now names it. OpenBLAS's own choice,
when it matches the CPU, and a user's own OPENBLAS_CORETYPE are left alone. Skips (77) on a CPU with no AVX, where Prescott is right.

Usage: openblas_core_test.py --fwserve PATH --fwmodel PATH --fwtrain PATH --model DIR
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import unittest

ARGS = None


def expected_core():
    """The core common/load_time_env.cc picks for this CPU, from /proc/cpuinfo's flags."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set()
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    if "avx" in flags:
        return "Sandybridge"
    return None


def run(command, env_extra, drop=("OPENBLAS_CORETYPE", "FWSERVE_OPENBLAS_CORETYPE_IS_DETECTED",
                                  "FWSERVE_OPENBLAS_CORE_DETECTED")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


# Instruction-set levels of OpenBLAS's x86-64 cores that match a CPU at or above them.
LEVELS = {"SkylakeX": 3, "Cooperlake": 3, "SapphireRapids": 3, "Haswell": 2, "Zen": 2,
          "Excavator": 2, "Sandybridge": 1, "Bulldozer": 1, "Piledriver": 1, "Steamroller": 1}
SLOW = {"OPENBLAS_CORETYPE": "Prescott", "FWSERVE_OPENBLAS_CORETYPE_IS_DETECTED": "1"}


class OpenBlasCoreTest(unittest.TestCase):
    def assert_fixed(self, result, core):
        text = result.stdout + result.stderr
        self.assertIn("OpenBLAS detected this", text)
        self.assertIn(f"as core Prescott; set OPENBLAS_CORETYPE={core} at start, "
                      f"running core {core} ", text)

    def test_fwmodel_runs_the_fast_core(self):
        result = run([ARGS.fwmodel, "info", ARGS.model], SLOW)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assert_fixed(result, CORE)

    def test_fwtrain_runs_the_fast_core(self):
        # No --text: it stops with a usage error after the start-up lines.
        result = run([ARGS.fwtrain], SLOW)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--text is required", result.stderr)
        self.assert_fixed(result, CORE)

    def test_fwserve_runs_the_fast_core(self):
        # A model directory that does not exist: it stops after logging the core.
        with tempfile.TemporaryDirectory() as work:
            result = run([ARGS.fwserve, "--model", os.path.join(work, "none"),
                          "--listen", "127.0.0.1:0", "--metrics-listen="], SLOW)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assert_fixed(result, CORE)

    def test_a_correct_detection_is_left_alone(self):
        # OpenBLAS's own choice on this CPU (OPENBLAS_VERBOSE=2 prints "Core: NAME" when it
        # loads, in the first process): at the CPU's level, nothing is set or logged.
        result = run([ARGS.fwmodel, "info", ARGS.model], {"OPENBLAS_VERBOSE": "2"})
        self.assertEqual(result.returncode, 0, result.stderr)
        text = result.stdout + result.stderr
        detected = re.search(r"Core: (\w+)", text)
        self.assertIsNotNone(detected, text)
        if LEVELS.get(detected.group(1), -1) >= LEVELS[CORE]:
            self.assertNotIn("OpenBLAS detected", text)
        else:  # a CPU that this OpenBLAS misdetects: the fix fires on its own
            self.assertIn(f"as core {detected.group(1)}; set OPENBLAS_CORETYPE={CORE} ", text)

    def test_a_users_core_wins(self):
        result = run([ARGS.fwmodel, "info", ARGS.model], {"OPENBLAS_CORETYPE": "Prescott"})
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("OpenBLAS detected", result.stdout + result.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--fwserve", "--fwmodel", "--fwtrain", "--model"):
        parser.add_argument(name, required=True)
    ARGS, rest = parser.parse_known_args()
    CORE = expected_core()
    if CORE is None:
        print("skipped: this CPU has no AVX; OpenBLAS's Prescott core is the right one")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + rest)
