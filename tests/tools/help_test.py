#!/usr/bin/env python3
"""`fwserve --help` says what the server speaks (gRPC and the OpenAI-compatible HTTP
API), lists every flag of server/fwserve.cc once under the groups of docs/serving.md
(none left under "Other"), and names no build path; `-h` prints the same, and
`--helpfull` names the flags' files relative to the source tree.

Usage: help_test.py FWSERVE_BINARY SOURCE_DIR BINARY_DIR
"""
import re
import subprocess
import sys

GROUPS = ["Serving", "HTTP API", "Sessions", "Security", "Limits", "Overload", "Performance"]


def run(binary, flag):
    result = subprocess.run([binary, flag], capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def main():
    binary, source_dir, binary_dir = sys.argv[1:4]
    failures = []
    code, text = run(binary, "--help")
    if code != 0:
        failures.append(f"--help exited {code}")
    for phrase in ("gRPC", "OpenAI-compatible HTTP API", "--http-listen"):
        if phrase not in text.split("\n\n")[0]:
            failures.append(f"the first paragraph of --help does not mention {phrase!r}")
    headers = re.findall(r"^(\S[^\n:]*):$", text, re.M)
    if headers != GROUPS:
        failures.append(f"groups {headers}, want {GROUPS}")
    for path in (source_dir, binary_dir, "Flags from", ".cc"):
        if path in text:
            failures.append(f"--help names a build path or file: {path!r}")
    listed = re.findall(r"^  --([a-z0-9-]+)  \(default ", text, re.M)
    if len(listed) != len(set(listed)):
        failures.append("a flag is listed twice: " + ", ".join(
            sorted({n for n in listed if listed.count(n) > 1})))
    _, full = run(binary, "--helpfull")
    section = re.search(r"Flags from (\S*)server/fwserve\.cc:\n(.*?)(?:\n  Flags from |\Z)",
                        full, re.S)
    if section is None:
        failures.append("no 'Flags from server/fwserve.cc' in --helpfull")
    else:
        if section.group(1) != "":
            failures.append(f"--helpfull names fwserve.cc under {section.group(1)!r}")
        defined = {n.replace("_", "-") for n in re.findall(r"^    --(\w+)", section.group(2),
                                                            re.M)}
        if len(defined) < 10:
            failures.append(f"only {len(defined)} flags in --helpfull")
        missing = sorted(defined - set(listed))
        if missing:
            failures.append("not in --help: " + ", ".join("--" + n for n in missing))
    if source_dir in full:
        failures.append("--helpfull names the source directory")
    code, short = run(binary, "-h")
    if code != 0 or short != text:
        failures.append("-h does not print what --help prints")
    if failures:
        print("\n".join(failures))
        print("--- fwserve --help:\n" + text)
        sys.exit(1)
    print(f"PASS: {len(listed)} flags in {len(GROUPS)} groups, no build path")


if __name__ == "__main__":
    main()
