#!/usr/bin/env bash
# The GPU suite in one device call.
#
#   here (has pip and the registry):  bash scripts/gpu_suite.sh prepare
#       -> .whl/: llmserve itself plus the packages the GPU box lacks (structlog, trio and its needs)
#   on the GPU box (device tool, carry [".whl"]):  bash scripts/gpu_suite.sh run [w-small|none]
#       -> installs .whl into /tmp/site, runs the GPU and kernel tests, then the benchmark;
#          logs and JSON results under $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

case "${1:-}" in
prepare)
    rm -rf .whl && mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl structlog==26.1.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1
    "$PY" -m pip wheel -q --no-deps -w .whl .
    ls -la .whl
    ;;
run)
    OUT=${OUT:-/tmp/llmserve-gpu-out}
    mkdir -p "$OUT"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    { nvidia-smi; "$PY" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; } \
        > "$OUT/env.txt" 2>&1
    set +e
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 --durations 12 tests/test_gpu.py tests/test_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    bench=${2:-w-small}
    if [ "$bench" != none ]; then
        timeout 330 "$PY" -m llmserve.bench.throughput --workload "$bench" ${BENCH_ARGS:---peer hf} \
            --profile "$OUT/$bench-profile" --json "$OUT/$bench.json" \
            > "$OUT/$bench.log" 2>&1
        tail -30 "$OUT/$bench.log"
    fi
    ;;
*)
    echo "usage: $0 prepare | run [w-small|w-large|none]" >&2
    exit 2
    ;;
esac
