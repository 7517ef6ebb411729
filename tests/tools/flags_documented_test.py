#!/usr/bin/env python3
"""Every flag fwserve defines is documented in docs/serving.md's flag table, and every
flag in that table exists: runs `fwserve --helpfull`, takes the flags of
server/fwserve.cc, and compares them (dash spelling, `--max-tokens`) with the table's
first column.

Usage: flags_documented_test.py FWSERVE_BINARY DOCS_SERVING_MD
"""
import re
import subprocess
import sys


def main():
    binary, doc_path = sys.argv[1], sys.argv[2]
    helpfull = subprocess.run([binary, "--helpfull"], capture_output=True, text=True,
                              timeout=60)
    text = helpfull.stdout + helpfull.stderr
    section = re.search(r"Flags from [^\n]*server/fwserve\.cc:\n(.*?)(?:\n  Flags from |\Z)",
                        text, re.S)
    if section is None:
        sys.exit("flags_documented_test: no 'Flags from .../server/fwserve.cc' in --helpfull")
    defined = {name.replace("_", "-") for name in re.findall(r"^    --(\w+)", section.group(1),
                                                              re.M)}
    if len(defined) < 10:
        sys.exit(f"flags_documented_test: only {len(defined)} flags parsed: {sorted(defined)}")
    with open(doc_path, encoding="utf-8") as f:
        doc = f.read()
    documented = set()
    for first_cell in re.findall(r"^\| ([^|]*)\|", doc, re.M):  # a row may name several
        documented.update(re.findall(r"`--([a-z0-9-]+)", first_cell))
    undocumented = sorted(defined - documented)
    unknown = sorted(documented - defined)
    if undocumented or unknown:
        if undocumented:
            print("defined by fwserve but not in the flag table of docs/serving.md: " +
                  ", ".join("--" + n for n in undocumented))
        if unknown:
            print("in the flag table of docs/serving.md but not defined by fwserve: " +
                  ", ".join("--" + n for n in unknown))
        sys.exit(1)
    print(f"PASS: all {len(defined)} fwserve flags are in docs/serving.md's table")


if __name__ == "__main__":
    main()
