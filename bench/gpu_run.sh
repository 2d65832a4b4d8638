#!/bin/bash
# The GPU checks on a machine with python3 + torch + transformers but no package index:
# python -m bench.gpu_trainer (the trainer SDK feeding a bf16 Qwen2-0.5B-shaped training
# step, against the same batches from memory), then python -m bench.gpu_weight_sync.
# Prepare .gpu/ here with `bash bench/gpu_setup.sh`, copy the checkout with it to the GPU
# machine, and run from the repository root:  bash .gpu/run.sh [bench.gpu_trainer flags]
# .gpu/whl: the wheels of the SDK's import chain that the device lacks (cp312);
# .gpu/bin/redis-server: a wrapper giving Debian 12's redis-server its libraries.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" .gpu/whl/*.whl; then
    echo "pip failed: unpacking the wheels instead" >&2
    python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$SITE" .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$PWD"
export PATH="$PWD/.gpu/bin:$PATH"
nvidia-smi -L
redis-server --version
python3 -c 'import sys, torch, transformers, consumers.trainer, bench.gpu_trainer; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' || exit 1
PYTHONUNBUFFERED=1 timeout 300 python3 -m bench.gpu_trainer \
    --redis-server "$PWD/.gpu/bin/redis-server" "$@" 2>&1 | tee "$OUT/gpu_trainer.log"
status=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 timeout 180 python3 -m bench.gpu_weight_sync 2>&1 | tee "$OUT/gpu_weight_sync.log"
exit $(( status || PIPESTATUS[0] ))
