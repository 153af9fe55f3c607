#!/usr/bin/env bash
# Set up a fresh virtual environment and run the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="[test]"
source scripts/setup_venv.sh
echo "tests: 15 to 35 minutes on 2 CPU cores"
exec "$VENV/bin/python" -m pytest -q "$@"
