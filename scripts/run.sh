#!/usr/bin/env bash
# Set up a fresh virtual environment, write a tiny demo checkpoint if there is none, and generate.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install -q --disable-pip-version-check -e .
[ -f models/tiny/config.json ] || "$VENV/bin/python" -m llmserve.testing models/tiny >/dev/null
exec "$VENV/bin/llmserve" --config config.example.toml "$@"
