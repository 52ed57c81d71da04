#!/usr/bin/env bash
# Installs tawpipe from source with its dependencies, a line per step.
# torch is installed only where it is missing (the CPU wheel, with the triton it runs with); an
# existing torch (a CUDA build, say) is kept. Everything else comes at the versions of
# constraints.txt, the ones the test suite runs with.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q -c constraints.txt)
step() {  # step N WHAT COMMAND...
  local t0=$SECONDS
  echo "install.sh [$1/3] $2 ..."
  "${@:3}"
  echo "install.sh [$1/3] done in $((SECONDS - t0)) s"
}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh [1/3] torch $("$PY" -c "import torch; print(torch.__version__)") is installed: kept"
else
  step 1 "torch 2.13.0 and triton 3.9.0 (CPU)" "${PIP[@]}" torch==2.13.0 triton==3.9.0
fi
step 2 "the requirements (requirements.txt at the versions of constraints.txt)" "${PIP[@]}" -r requirements.txt
step 3 "tawpipe, compiling its native ops against this torch (pip install -e .)" \
  "${PIP[@]}" --no-build-isolation -e .
echo "install.sh: done; try: tawpipe train"
