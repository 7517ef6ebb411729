#!/usr/bin/env python3
"""Prints the README's table of shipped models from their MODEL_CARD.md files."""
import glob
import os
import re

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
rows = []
for card_path in sorted(glob.glob(os.path.join(root, "models/pretrained/*/MODEL_CARD.md"))):
    card = open(card_path, encoding="utf-8").read()
    field = lambda name: re.search(r"\| " + name + r" \| ([^|]+) \|", card).group(1).strip()
    val = re.search(r"\| validation loss \| ([0-9.]+) nats/byte = ([0-9.]+) bits/byte", card)
    minutes = re.search(r"\(([0-9.]+) min\)", field("wall time")).group(1)
    name = os.path.basename(os.path.dirname(card_path))
    rows.append(f"| `{name}` | {field('architecture')} | {int(field('parameters')):,} | "
                f"{int(field('state bytes per session')):,} | {val.group(1)} | {val.group(2)} | "
                f"{minutes} min |")
print("| model | architecture | parameters | state bytes/session | validation nats/byte | "
      "validation bits/byte | training time |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print("\n".join(rows))
