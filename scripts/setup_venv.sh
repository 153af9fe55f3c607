#!/usr/bin/env bash
# Sourced by run.sh and test.sh: a virtual environment ($VENV, .venv by default) with torch and
# llmserve (plus the extras in $EXTRAS, e.g. "[test]"), pip's progress shown as it goes.
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || { echo "setup: creating the virtual environment $VENV"; python3 -m venv "$VENV"; }
pip=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar on)
# torch first and pinned. On Linux, PyPI's torch is the CUDA build (several GB of NVIDIA libraries);
# without an NVIDIA GPU the CPU build (~200 MB) from PyTorch's own index is taken where it can be
# reached (its local version, 2.13.0+cpu, ranks above PyPI's 2.13.0); otherwise PyPI's.
if command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup: torch 2.13.0, the CUDA build (an NVIDIA GPU is present)"
    "${pip[@]}" torch==2.13.0
else
    echo "setup: torch 2.13.0, the CPU build (no NVIDIA GPU here)"
    "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu --timeout 20 --retries 1 torch==2.13.0
fi
echo "setup: llmserve${EXTRAS:-} and its dependencies"
"${pip[@]}" -e ".${EXTRAS:-}"
