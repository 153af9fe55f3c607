#!/usr/bin/env bash
# Set up a fresh virtual environment and run the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="[test]"
source scripts/setup_venv.sh
# TEST_WORKERS processes share the tests (pytest-xdist; 1: none): the suite keeps about one core busy
# at a time, so two workers on two cores take about 15 minutes.
WORKERS=${TEST_WORKERS:-2}
echo "tests: about 15 minutes on 2 CPU cores with $WORKERS workers"
if [ "$WORKERS" -gt 1 ]; then
    exec "$VENV/bin/python" -m pytest -q -n "$WORKERS" "$@"
fi
exec "$VENV/bin/python" -m pytest -q "$@"
