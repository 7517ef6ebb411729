#!/usr/bin/env bash
# Measures what a new user waits for: from a fresh clone to the first token of
# `fwctl generate`, through the README's serve command (scripts/serve.sh). Prints the
# time of each phase (clone, packages, configure and build, server start, first token)
# from the timestamped output of serve.sh, and leaves the full log.
#
# Usage: scripts/first_token_time.sh [--ccache] [REPO]
#          clones REPO (default: this repository, its committed HEAD) into a temporary
#          directory and measures there, on this machine (packages already installed
#          or not: serve.sh installs what is missing).
#        scripts/first_token_time.sh --container [--ccache]
#          the same in a clean debian:12 container (podman; no package installed yet, so
#          apt is included): the committed HEAD goes in with `git archive` in place of
#          a clone. The image is pulled, or made with mmdebstrap when no registry answers.
#        scripts/first_token_time.sh --here
#          measures in the current directory (used inside the container).
# ccache is off (CCACHE_DISABLE=1) unless --ccache: a fresh machine has an empty cache.
# Last, the build's summed compile time and its ten slowest steps (from build/.ninja_log,
# scripts/ninja_log_summary.py): the stable measure where wall time swings with load.
# The server listens on free ports (port 0) and is stopped at the end.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
mode=clone
ccache=0
source_repo="$repo"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --container) mode=container; shift ;;
    --here) mode=here; shift ;;
    --ccache) ccache=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) source_repo="$1"; shift ;;
  esac
done

if [[ "$mode" == container ]]; then
  engine=podman
  command -v "$engine" >/dev/null || { echo "first_token_time.sh: podman is missing" >&2; exit 1; }
  base=docker.io/library/debian:12
  if ! "$engine" image exists "$base"; then
    if ! timeout 120 "$engine" pull -q "$base" >/dev/null 2>&1; then
      echo "first_token_time.sh: no registry answers; making $base with mmdebstrap" >&2
      rootfs=$(mktemp --suffix=.tar "${TMPDIR:-/tmp}/fwserve-debian12-rootfs.XXXXXX")
      mmdebstrap --quiet --variant=minbase bookworm "$rootfs"
      "$engine" import "$rootfs" "$base" >/dev/null
      rm -f "$rootfs"
    fi
  fi
  flags=(--here)
  [[ "$ccache" == 1 ]] && flags+=(--ccache)
  # The script itself comes from the working tree, the sources from HEAD.
  git -C "$repo" archive --format=tar HEAD |
    "$engine" run --rm -i --network host --pull=never \
      --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
      -v "$repo/scripts/first_token_time.sh:/first_token_time.sh:ro" "$base" \
      bash -c "mkdir /fwserve && cd /fwserve && tar x && /first_token_time.sh ${flags[*]}"
  exit $?
fi

start=$(date +%s.%N)
if [[ "$mode" == clone ]]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/fwserve-first-token.XXXXXX")
  git clone --quiet "$source_repo" "$work/fwserve"
  cd "$work/fwserve"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/fwserve-first-token.XXXXXX")
fi
cloned=$(date +%s.%N)
[[ "$ccache" == 1 ]] || export CCACHE_DISABLE=1
log="$work/serve.log"
export FWSERVE_STATE_DIR="$work/state"
# serve.sh execs fwserve: $serve is the server's pid once it runs.
: >"$log"
scripts/serve.sh --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --metrics-listen= \
  >"$log" 2>&1 &
serve=$!
stop() {
  kill -INT "$serve" 2>/dev/null || true
  wait "$serve" 2>/dev/null || true
}
trap stop EXIT
# When each phase's first line appears in the log (polled every 0.1 s).
build_start="" build_end="" port=""
while [[ -z "$port" ]]; do
  if ! kill -0 "$serve" 2>/dev/null; then
    echo "first_token_time.sh: serve.sh stopped; its log:" >&2
    cat "$log" >&2
    exit 1
  fi
  now=$(date +%s.%N)
  [[ -z "$build_start" ]] && grep -q '^\[[0-9]*/[0-9]*\] ' "$log" && build_start=$now
  [[ -z "$build_end" ]] && grep -q '^serve.sh: ' "$log" && build_end=$now
  port=$(sed -n 's/.*fwserve listening on [^ ]* (port \([0-9]*\)).*/\1/p' "$log" | head -1)
  sleep 0.1
done
listening=$(date +%s.%N)
build_end=${build_end:-$listening}
build_start=${build_start:-$build_end}
# The first byte of the reply on stdout is the first token (head then closes the pipe).
FWSERVE_TARGET="127.0.0.1:$port" build/client/fwctl generate --max-tokens 16 "ROMEO:" |
  head -c 1 >/dev/null || true
token=$(date +%s.%N)
stop
trap - EXIT
# CPU time of everything serve.sh ran (the compilers included), reaped by now: on a
# shared machine the wall time above is longer than on an idle one.
times >"$work/times"  # the builtin, in this shell: its children's times
read -r cpu_user cpu_sys < <(tail -1 "$work/times" | awk '{ for (i = 1; i <= 2; i++) {
  split($i, t, "m"); sub("s", "", t[2]); printf "%.1f ", t[1] * 60 + t[2] } print "" }')

steps=$(grep -c '^\[[0-9]*/[0-9]*\] ' "$log" || true)
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
echo "first_token_time.sh: $(nproc) CPUs, ccache $([[ $ccache == 1 ]] && echo on || echo off)"
echo "  clone:                           $(elapsed "$start" "$cloned") s"
echo "  packages and cmake configure:    $(elapsed "$cloned" "$build_start") s"
echo "  build of fwserve, fwctl ($steps steps): $(elapsed "$build_start" "$build_end") s"
echo "  server start (model load):       $(elapsed "$build_end" "$listening") s"
echo "  first token after listening:     $(elapsed "$listening" "$token") s"
echo "  total, clone to first token:     $(elapsed "$start" "$token") s"
echo "  CPU time of serve.sh and its children: user ${cpu_user:-?} s, system ${cpu_sys:-?} s"
echo "  load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
# What the build weighs: the summed compile time of its steps (stable where the wall
# time swings with the load) and the slowest objects.
if [[ -f build/.ninja_log ]] && command -v python3 >/dev/null; then
  python3 scripts/ninja_log_summary.py build --top 10 | sed 's/^/  /'
fi
echo "  log: $log"
