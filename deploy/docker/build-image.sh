#!/usr/bin/env bash
# Builds the fwserve image (deploy/docker/Dockerfile) from a clean export of this
# checkout, so local build output (build/, caches) can never leak into it.
#
# Usage: deploy/docker/build-image.sh [--tag TAG] [--source worktree|head|DIR]
#                                     [--dockerfile PATH] [--prebuilt BUILD_DIR]
#                                     [-- EXTRA BUILD ARGS...]
#   --tag         image name (default fwserve:latest; Podman stores it as
#                 localhost/fwserve:latest)
#   --source      worktree (default): the tracked and the untracked, not ignored files
#                 as they are on disk now, uncommitted changes included (what the rest
#                 of the test suite builds); head: `git archive HEAD`; or a directory:
#                 an export made by hand (used as it is, not copied)
#   --dockerfile  relative to the repository root (default deploy/docker/Dockerfile)
#   --prebuilt    a CMake build directory of this tree on a Debian 12 host (BUILD_DIR/
#                 server/fwserve and client/fwctl, Release): the build stage installs
#                 the same packages and takes these binaries instead of compiling them
#                 (the test suite's image, which its own build has just compiled). Only
#                 with --source worktree or head: the binaries must be of that tree
#
# Engine (deploy/docker/engine.sh): `docker build` when a Docker daemon answers.
# Otherwise Podman, with the recipe for machines without a registry (issue 14):
#   - runtime runc and ulimits nofile/nproc 1024 (deploy/docker/podman-containers.conf);
#   - `--network host` for the build, so apt in the build stage reaches the mirror;
#   - a local debian:12: pulled when a registry answers, else made with
#     `mmdebstrap --variant=minbase bookworm` and `podman import`ed as
#     docker.io/library/debian:12; then `--pull=never`;
#   - `--format docker`, which keeps the HEALTHCHECK (the OCI format drops it).
# Exit status 3: no container engine can run on this machine.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
engine_sh="$repo/deploy/docker/engine.sh"
tag=fwserve:latest
source=worktree
dockerfile=deploy/docker/Dockerfile
prebuilt=""
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --source) source="$2"; shift 2 ;;
    --dockerfile) dockerfile="$2"; shift 2 ;;
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

engine=$("$engine_sh" --which) || exit 3
start=$(date +%s)

context=$(mktemp -d "${TMPDIR:-/tmp}/fwserve-image-context.XXXXXX")
tmp_context="$context"
rootfs=""
trap 'rm -rf "$tmp_context" ${rootfs:+"$rootfs"}' EXIT
case "$source" in
  head)
    git -C "$repo" archive --format=tar HEAD | tar -x -C "$context"
    ;;
  worktree)
    # Tracked files deleted on disk are left out (tar skips what it cannot read).
    git -C "$repo" ls-files -z --cached --others --exclude-standard --deduplicate \
      | (cd "$repo" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
      | tar -x -C "$context"
    ;;
  *)
    if [[ ! -f "$source/$dockerfile" ]]; then
      echo "build-image.sh: --source is worktree, head or a directory with $dockerfile," \
        "not '$source'" >&2
      exit 2
    fi
    rmdir "$context"
    tmp_context=""
    context="$(cd "$source" && pwd)"
    ;;
esac
if [[ -n "$prebuilt" ]]; then
  if [[ -z "$tmp_context" ]]; then
    echo "build-image.sh: --prebuilt goes with --source worktree or head" >&2
    exit 2
  fi
  for binary in server/fwserve client/fwctl; do
    if [[ ! -x "$prebuilt/$binary" ]]; then
      echo "build-image.sh: --prebuilt $prebuilt has no $binary" >&2
      exit 2
    fi
  done
  # The Dockerfile's build stage takes what it finds in prebuilt/ (deploy/docker/Dockerfile).
  mkdir -p "$context/prebuilt"
  cp "$prebuilt/server/fwserve" "$prebuilt/client/fwctl" "$context/prebuilt/"
fi
echo "build-image.sh: $engine, context from $source ($(du -sh "$context" | cut -f1))${prebuilt:+, fwserve and fwctl prebuilt in $prebuilt}"

if [[ "$engine" == docker ]]; then
  "$engine_sh" build -f "$context/$dockerfile" -t "$tag" "${extra[@]}" "$context"
else
  base=docker.io/library/debian:12
  if ! "$engine_sh" image exists "$base"; then
    if ! timeout 120 "$engine_sh" pull -q "$base" >/dev/null 2>&1; then
      echo "build-image.sh: no registry answers; making $base with mmdebstrap"
      if ! command -v mmdebstrap >/dev/null; then
        echo "build-image.sh: mmdebstrap is missing (scripts/install-deps.sh installs it)" >&2
        exit 1
      fi
      rootfs=$(mktemp --suffix=.tar "${TMPDIR:-/tmp}/fwserve-debian12-rootfs.XXXXXX")
      mmdebstrap --quiet --variant=minbase bookworm "$rootfs"
      "$engine_sh" import "$rootfs" "$base" >/dev/null
      rm -f "$rootfs"
      rootfs=""
    fi
  fi
  build=("$engine_sh" build --format docker --network host --pull=never --layers
         --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 -f "$context/$dockerfile")
  "${build[@]}" -t "$tag" "${extra[@]}" "$context"
  # Podman keeps every build stage as an image (3 GB for fwserve's). Name the current
  # one (cached: seconds) and remove the stale ones, so that rebuilding after each
  # source change does not fill the disk. Only images labelled by our Dockerfiles.
  if grep -qE '^FROM .* AS build$' "$context/$dockerfile"; then
    "${build[@]}" --target build -t "${tag%:*}-build-stage:latest" "${extra[@]}" \
      "$context" >/dev/null
  fi
  "$engine_sh" image prune -f --filter label=org.fwserve.stage >/dev/null || true
fi
size=$("$engine_sh" image inspect --format '{{.Size}}' "$tag")
echo "build-image.sh: built $tag ($((size / 1000000)) MB) in $(( $(date +%s) - start )) s"
