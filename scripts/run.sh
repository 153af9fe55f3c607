#!/usr/bin/env bash
# Set up a fresh virtual environment and serve the built-in model on http://127.0.0.1:8000 (CPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install -q --disable-pip-version-check -e .
exec "$VENV/bin/llmserve" --config config.example.toml "$@"
