#!/usr/bin/env bash
# Start the ocr-latent HTTP service in the foreground.
#
#   ./serve.sh                                              # embedded nano model, CPU, 127.0.0.1:8000
#   HOST=0.0.0.0 ./serve.sh                                 # reachable from other machines
#   MODEL_DIR=/models/DeepSeek-OCR DEVICE=cuda DTYPE=bf16 ./serve.sh
#   BACKEND=ray DECODE_REPLICAS=2 ./serve.sh                # the same API on Ray Serve (serving/ray_serve.py, docs/deployment.md);
#                                                           # a local Ray, or the cluster at RAY_ADDRESS
#
# First sets up what is missing (setup.sh: .venv with the versions pinned in pyproject.toml; a no-op
# once its stamp matches pyproject.toml's hash), then runs `ocr-latent serve` (server.py on uvicorn) on
# ${HOST:-127.0.0.1}:${PORT:-8000}. Configuration is by environment variable: see README.md, "Configuration".
#
# Exit status: 1 when the model cannot be loaded (missing or mismatched quantizer, bad MODEL_DIR, ...;
# the reason and the fix are printed last), 2 when .venv cannot be set up, 0 after Ctrl-C; SIGTERM
# drains in-flight requests (SHUTDOWN_DRAIN_S, default 8 s; what is left gets a JSON 503) and ends the process.
set -euo pipefail
cd "$(dirname "$0")"

if ! ./setup.sh; then
  echo "serve.sh: could not set up .venv (see above); install the pins of pyproject.toml into .venv" >&2
  exit 2
fi

export HOST=${HOST:-127.0.0.1} PORT=${PORT:-8000}
exec .venv/bin/ocr-latent serve
