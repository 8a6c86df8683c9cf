#!/usr/bin/env bash
# The first GPU hour in one run of at most 8 minutes: bash bench/gpu_suite.sh [--tiny] [--out DIR] [--only NAMES]
# (bench/gpu_suite.py says what each section runs; docs/gpu.md "The first GPU hour" where the outputs go).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
# a copy that is not installed (a GPU machine's): the package is this directory, imported as ocr_latent
if ! "$py" -c "import ocr_latent" 2>/dev/null; then
  link=$(mktemp -d)
  ln -s "$PWD" "$link/ocr_latent"
  export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$py" bench/gpu_suite.py "$@"
