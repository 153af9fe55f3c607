#!/usr/bin/env bash
# Set up a fresh virtual environment and serve the built-in model on http://127.0.0.1:8000 (CPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec "$VENV/bin/llmserve" --config config.example.toml "$@"
