#!/usr/bin/env bash
# Create (or re-sync) the project's virtual environment from the lock file of its flavour.
#
#   scripts/setup_env.sh [VENV_DIR]        (default: .venv)
#
# The lock (requirements/cpu.lock or requirements/cuda.lock) pins every package, transitive ones
# included; they are installed with --no-deps and the result is checked against the lock
# (scripts/env_lock.py check), so the environment is the same on every machine and every day.
# Refresh the locks with `python scripts/env_lock.py refresh` (a deliberate commit).
#
# Flavours (DLRM_FBGEMM=cpu|cuda overrides the detection, which looks for an NVIDIA driver):
#   cpu   torch 2.13.0+cpu (the CPU-only build), fbgemm-gpu-cpu, triton's CPU interpreter:
#         about 2.2 GB in the venv, about a minute with a local wheel cache.
#   cuda  PyPI's torch 2.13.0 with its CUDA 13 libraries, fbgemm-gpu: about 5.3 GB.
# The CPU-only torch build is not on PyPI: set TORCH_INDEX to an index that has it (PyPI's own
# mirror of it at https://download.pytorch.org/whl/cpu is tried when the configured indexes lack it).
set -euo pipefail

VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAMP="$VENV/.dlrm-compress-stack"
LOCK_PYTHON=3.11   # the Python the locks were resolved for (their wheels and markers)
PYTORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

flavour=${DLRM_FBGEMM:-auto}
if [ "$flavour" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
case "$flavour" in
  cpu|cuda) LOCK="$ROOT/requirements/$flavour.lock" ;;
  *) echo "DLRM_FBGEMM must be cpu, cuda or auto (got '$flavour')" >&2; exit 1 ;;
esac
want="$flavour $(sha256sum "$LOCK" | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

command -v "$PYTHON" >/dev/null 2>&1 || {
  echo "setup: no interpreter '$PYTHON' on PATH; install Python $LOCK_PYTHON, or name one with PYTHON=python$LOCK_PYTHON" >&2
  exit 1
}
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$have" != "$LOCK_PYTHON" ]; then
  echo "setup: $PYTHON is Python $have; the lock files pin wheels for Python $LOCK_PYTHON: name it with PYTHON=python$LOCK_PYTHON" >&2
  exit 1
fi

if [ -d "$VENV" ]; then  # built from another lock or flavour (or half-built): start clean
  echo "setup: $VENV was not built from $(basename "$LOCK") as it is now; rebuilding it"
  rm -rf "$VENV"
fi
echo "setup: creating $VENV from requirements/$(basename "$LOCK") ($flavour flavour; see scripts/setup_env.sh for size and time)"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
pin() { grep -E "^$1==" "$LOCK" | head -1; }
"${PIP[@]}" install --no-deps "$(pin pip)" "$(pin setuptools)" "$(pin wheel)"

# torch first, as the exact build the lock names (=== : "2.13.0" must not take "2.13.0+cpu").
torch_version=$(pin torch | cut -d= -f3)
if [ -n "${TORCH_INDEX:-}" ]; then
  "${PIP[@]}" install --no-deps --extra-index-url "$TORCH_INDEX" "torch===$torch_version"
elif ! "${PIP[@]}" install --no-deps "torch===$torch_version" 2>/dev/null; then
  [ "$flavour" = cpu ] || { echo "setup: torch $torch_version is not on your package index" >&2; exit 1; }
  echo "setup: torch $torch_version (the CPU-only build) is not on the configured indexes; trying $PYTORCH_CPU_INDEX"
  "${PIP[@]}" install --no-deps --extra-index-url "$PYTORCH_CPU_INDEX" "torch===$torch_version" || {
    echo "setup: no torch $torch_version found. Set TORCH_INDEX to an index holding torch's CPU-only build," \
      "or install the CUDA flavour (DLRM_FBGEMM=cuda, about 5.3 GB)." >&2
    exit 1
  }
fi
grep -v -E '^(torch|pip|setuptools|wheel)==' "$LOCK" >"$VENV/.lock-rest.txt"
"${PIP[@]}" install --no-deps -r "$VENV/.lock-rest.txt"
rm -f "$VENV/.lock-rest.txt"
# The project itself, editable, built with the venv's pinned setuptools (not a fresh download).
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/python" "$ROOT/scripts/env_lock.py" check "$LOCK"
echo "$want" > "$STAMP"
echo "environment ready: $VENV ($flavour flavour, $(du -sh "$VENV" | cut -f1))"
