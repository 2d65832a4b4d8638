#!/usr/bin/env bash
# Shared set-up for .ci/test and .ci/demo: everything a fresh machine needs, idempotent.
#   - redis-server (Debian package) when missing
#   - .venv: rollq with its dev and train extras (torch pinned to the CPU wheel)
#   - .venv-vllm: vLLM's CPU build in its own environment (see .ci/vllm.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${ROLLQ_PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! command -v redis-server >/dev/null; then
  echo "setup: installing redis-server"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x .venv/bin/rollq ] || ! .venv/bin/python -c "import torch, transformers, fakeredis" 2>/dev/null; then
  echo "setup: creating .venv (rollq + dev + train extras)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[dev,train]"
fi

if [ "${ROLLQ_SKIP_VLLM:-0}" != 1 ]; then
  echo "setup: vLLM CPU environment (.venv-vllm)"
  VLLM_PYTHON=$PYTHON bash .ci/vllm.sh install .venv-vllm
fi
