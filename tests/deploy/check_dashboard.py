#!/usr/bin/env python3
"""Checks the Grafana dashboard and the alert rules against the metrics fwserve exports.

The exported names come from the text exposition printed by `--exposition` (a program
that exercises every Metrics method), so the check follows server/core/metrics.cc rather
than a hand-kept list. Checks:
  * the dashboard is valid JSON with the fields Grafana needs, unique panel ids and
    non-overlapping panels inside the 24-column grid;
  * every fwserve_* / process_* name in the dashboard's queries, the alert rules and the
    alert tests is an exported series (histograms as _bucket/_sum/_count);
  * every dashboard query parses as PromQL (via `promtool check rules` on a generated
    rule file, with Grafana's variables substituted);
  * the dashboard shows the key series listed in KEY_SERIES.

Usage: check_dashboard.py --exposition BIN --promtool PROMTOOL DASHBOARD [RULE_FILES...]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

NAME = re.compile(r"\b((?:fwserve|process)_[a-zA-Z0-9_:]*)")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')

# Series the dashboard must show (issue: key panels).
KEY_SERIES = [
    "fwserve_generated_tokens_total",
    "fwserve_requests_total",
    "fwserve_time_to_first_token_seconds_bucket",
    "fwserve_inter_token_latency_seconds_bucket",
    "fwserve_engine_batch_size_sum",
    "fwserve_engine_active_streams",
    "fwserve_engine_queued_requests",
    "fwserve_sessions",
    "fwserve_session_state_resident_bytes",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
]

# Grafana's variables, replaced by values that keep the query valid PromQL.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$instance": ".*",
    "$model": ".*",
}


def exported_names(exposition_binary):
    out = subprocess.run([exposition_binary], check=True, capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            name, kind = parts[2], parts[3]
            if kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
            elif kind == "summary":
                names.update([name, name + "_sum", name + "_count"])
            else:
                names.add(name)
    if not any(n.startswith("fwserve_") for n in names):
        sys.exit(f"no fwserve_ series in the output of {exposition_binary}:\n{out}")
    return names


def names_in(text):
    return set(NAME.findall(text))


def check_layout(dashboard, errors):
    for key in ("title", "uid", "panels", "schemaVersion", "templating"):
        if key not in dashboard:
            errors.append(f"dashboard has no '{key}'")
    ids = set()
    cells = {}
    for panel in dashboard.get("panels", []):
        title = panel.get("title", "?")
        pid = panel.get("id")
        if pid in ids:
            errors.append(f"panel '{title}': duplicate id {pid}")
        ids.add(pid)
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("x", "y", "w", "h")):
            errors.append(f"panel '{title}': gridPos needs integer x, y, w, h")
            continue
        if grid["x"] < 0 or grid["x"] + grid["w"] > 24:
            errors.append(f"panel '{title}': outside the 24-column grid")
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                if (x, y) in cells:
                    errors.append(f"panel '{title}' overlaps '{cells[(x, y)]}'")
                    break
                cells[(x, y)] = title
            else:
                continue
            break
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets", [])
        if not targets:
            errors.append(f"panel '{title}': no targets")
        ref_ids = [t.get("refId") for t in targets]
        if len(set(ref_ids)) != len(ref_ids) or None in ref_ids:
            errors.append(f"panel '{title}': refIds must be present and unique")
        if "datasource" not in panel:
            errors.append(f"panel '{title}': no datasource")


def dashboard_queries(dashboard):
    """(where, expr) for every panel query; template queries are label_values(), not PromQL."""
    queries = []
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            where = f"panel '{panel.get('title')}' target {target.get('refId')}"
            expr = target.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                queries.append((where, None))
            else:
                queries.append((where, expr))
    return queries


def template_queries(dashboard):
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if var.get("type") == "query":
            out.append((f"variable '{var.get('name')}'", query or ""))
    return out


def substitute(expr):
    for var, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    if "$" in QUOTED.sub("", expr).replace("$labels", ""):
        return None
    return expr


def check_promql(promtool, queries, errors):
    rules = []
    for i, (where, expr) in enumerate(queries):
        if expr is None:
            continue
        concrete = substitute(expr)
        if concrete is None:
            errors.append(f"{where}: unknown Grafana variable in {expr!r}")
            continue
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete})
    # JSON is YAML: no YAML library needed.
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
        path = f.name
    try:
        result = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
        if result.returncode != 0:
            errors.append("dashboard queries are not valid PromQL:\n" + result.stdout + result.stderr)
    finally:
        os.unlink(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--exposition", required=True)
    parser.add_argument("--promtool", required=True)
    parser.add_argument("dashboard")
    parser.add_argument("rule_files", nargs="*")
    args = parser.parse_args()

    exported = exported_names(args.exposition)
    errors = []
    with open(args.dashboard) as f:
        try:
            dashboard = json.load(f)
        except json.JSONDecodeError as e:
            sys.exit(f"{args.dashboard}: not valid JSON: {e}")

    check_layout(dashboard, errors)
    queries = dashboard_queries(dashboard)
    used = set()
    for where, expr in queries + template_queries(dashboard):
        if expr is None:
            errors.append(f"{where}: no expr")
            continue
        names = names_in(QUOTED.sub('""', expr))
        used |= names
        for name in sorted(names - exported):
            errors.append(f"{args.dashboard}: {where} uses {name}, which fwserve does not export")
    for name in KEY_SERIES:
        if name not in used:
            errors.append(f"{args.dashboard}: no panel shows {name}")
    check_promql(args.promtool, queries, errors)

    for path in args.rule_files:
        with open(path) as f:
            text = f.read()
        for name in sorted(names_in(text) - exported):
            errors.append(f"{path}: uses {name}, which fwserve does not export")

    if errors:
        print("\n".join(errors))
        return 1
    print(f"OK: {len(queries)} dashboard queries, {len(args.rule_files)} rule files; "
          f"{len(used)} series used of {len(exported)} exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
