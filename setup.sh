#!/usr/bin/env bash
# Make .venv hold exactly the dependencies pinned in pyproject.toml, and this project (editable). A no-op when it already does
# (a stamp named after pyproject.toml's hash), so serve.sh and test.sh can call it every time.
set -euo pipefail
cd "$(dirname "$0")"
stamp=".venv/.deps-$(sha256sum pyproject.toml | cut -c1-16)"
[ -f "$stamp" ] && exit 0
python3 -m venv .venv
python3 - > .venv/requirements.txt <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
echo "setup: installing pinned dependencies into .venv (first run only)" >&2
.venv/bin/python -m pip install --disable-pip-version-check --no-compile -q -r .venv/requirements.txt
# this project itself, editable: the `ocr_latent` package importable from anywhere, and the `ocr-latent` command
.venv/bin/python -m pip install --disable-pip-version-check --no-compile -q --no-deps -e .
# bytecode for every installed module, once: where PYTHONDONTWRITEBYTECODE is set, each process (the server, each
# CLI call, each Ray worker) would otherwise compile torch's sources again on import, seconds every start. A file
# this Python cannot compile (a newer Python's test syntax) is left to import, hence no failure on its error.
echo "setup: compiling the installed modules (first run only)" >&2
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages > /dev/null || true
rm -f .venv/.deps-*
touch "$stamp"
