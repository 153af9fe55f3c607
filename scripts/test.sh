#!/usr/bin/env bash
# Set up a fresh virtual environment and run the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch first and pinned: the CPU build, so nothing pulls a CUDA torch.
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test]'
exec "$VENV/bin/python" -m pytest -q "$@"
