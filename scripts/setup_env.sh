#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the pinned stack of DESIGN.md.
#
#   scripts/setup_env.sh [VENV_DIR]        (default: .venv)
#
# torchrec is installed with --no-deps: its metadata asks for the CUDA `fbgemm-gpu`, which clashes
# with the CPU build. The FBGEMM flavour follows the host: `fbgemm-gpu` when an NVIDIA driver is
# present, `fbgemm-gpu-cpu` otherwise; DLRM_FBGEMM=cpu|cuda overrides the detection.
set -euo pipefail

VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.dlrm-compress-stack"
STACK_VERSION=6   # bump when the pinned stack below changes, so existing venvs are refreshed

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STACK_VERSION" ]; then
  exit 0
fi

command -v "$PYTHON" >/dev/null 2>&1 || {
  echo "setup: no interpreter '$PYTHON' on PATH; install Python 3.10 or later, or name one with PYTHON=python3.X" >&2
  exit 1
}
"$PYTHON" - <<'PY' || { echo "dlrm-compress needs Python 3.10 or later ($PYTHON is $("$PYTHON" -V 2>&1))" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)
PY

flavour=${DLRM_FBGEMM:-auto}
if [ "$flavour" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
case "$flavour" in
  cpu)  FBGEMM="fbgemm-gpu-cpu==1.8.0"; TRITON="triton~=3.7.0" ;;
  # on CUDA hosts keep the triton that the torch CUDA wheel pins
  cuda) FBGEMM="fbgemm-gpu==1.8.0"; TRITON="" ;;
  *) echo "DLRM_FBGEMM must be cpu, cuda or auto (got '$flavour')" >&2; exit 1 ;;
esac

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip wheel setuptools
# torch first: with the CPU wheel in place, later resolution never pulls a CUDA build.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install "$FBGEMM" $TRITON
"${PIP[@]}" install --no-deps "torchrec==1.8.0"
"${PIP[@]}" install -e ".[test,lint]"
echo "$STACK_VERSION" > "$STAMP"
echo "environment ready: $VENV ($flavour FBGEMM)"
