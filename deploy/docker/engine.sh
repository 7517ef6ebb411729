#!/usr/bin/env bash
# The container engine of this machine: Docker when its daemon answers, else Podman
# with deploy/docker/podman-containers.conf (runc, ulimits the machine allows).
#
#   deploy/docker/engine.sh --which     prints "docker" or "podman"; exit 3 (and why on
#                                       stderr) when neither can run containers here
#   deploy/docker/engine.sh ARGS...     runs that engine with ARGS, e.g.
#                                       deploy/docker/engine.sh run --rm fwserve --help
#   deploy/docker/engine.sh compose ARGS...
#                                       "docker compose" or podman-compose
#
# FWSERVE_CONTAINER_ENGINE=docker|podman skips the detection. Podman runs need root
# here (rootless Podman is not set up on the build machines).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

detect() {
  if [[ -n "${FWSERVE_CONTAINER_ENGINE:-}" ]]; then
    echo "$FWSERVE_CONTAINER_ENGINE"
    return 0
  fi
  local why=()
  if command -v docker >/dev/null 2>&1; then
    if timeout 20 docker info >/dev/null 2>&1; then
      echo docker
      return 0
    fi
    why+=("docker: the client is installed but 'docker info' fails (no daemon)")
  else
    why+=("docker: not installed")
  fi
  if command -v podman >/dev/null 2>&1; then
    if CONTAINERS_CONF="${CONTAINERS_CONF:-$here/podman-containers.conf}" \
        timeout 60 podman info >/dev/null 2>&1; then
      echo podman
      return 0
    fi
    why+=("podman: installed but 'podman info' fails")
  else
    why+=("podman: not installed (scripts/install-deps.sh installs it)")
  fi
  local IFS=";"
  echo "no container engine can run here: ${why[*]}" >&2
  return 3
}

if [[ "${1:-}" == "--which" ]]; then
  detect
  exit $?
fi
engine=$(detect) || exit 3
case "$engine" in
  docker)
    if [[ "${1:-}" == "compose" ]]; then
      shift
      if docker compose version >/dev/null 2>&1; then exec docker compose "$@"; fi
      exec docker-compose "$@"
    fi
    exec docker "$@"
    ;;
  podman)
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/podman-containers.conf}"
    if [[ "${1:-}" == "compose" ]]; then
      shift
      exec podman-compose "$@"
    fi
    exec podman "$@"
    ;;
  *)
    echo "engine.sh: FWSERVE_CONTAINER_ENGINE must be docker or podman, not '$engine'" >&2
    exit 2
    ;;
esac
