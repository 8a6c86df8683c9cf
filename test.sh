#!/usr/bin/env bash
# Set up what is missing, then run the whole test suite (tests needing ../shared skip without it).
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
exec .venv/bin/python -m pytest -q "$@"
