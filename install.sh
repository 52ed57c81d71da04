#!/usr/bin/env bash
# Installs tawpipe from source with its dependencies.
# torch is pinned only where it is missing (a CPU wheel); an existing torch (e.g. a CUDA build) is kept.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-build-isolation -e .
