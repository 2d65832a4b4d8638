"""GPU check of ``examples/torchrun_trainer.py``: its CUDA paths (NCCL process group, bf16
autocast under DDP, FSDP2 with bf16 mixed precision) on real GPUs, without vLLM.

A random Qwen2-shaped ~105M model (``ops.local.tiny_model`` shape ``100m``), scored groups of 8
completions x 512 tokens on a redis-server this script starts, and the trainer under
``torchrun --nproc-per-node N`` (N: the GPUs here) for a few steps, DDP then FSDP, from the
same groups. Prints each variant's losses and step seconds; fails if a loss is not finite
or if DDP and FSDP disagree by more than bf16 can explain (first step: same weights, same
batch).

    python -m bench.gpu_torchrun_check [--steps 4] [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.gpu_trainer import Shape, fill, make_payloads
from bench.rollouts import RUN
from rollq.ops.local.stack import RedisProcess
from rollq.ops.local.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def run_variant(name: str, ranks: int, model: Path, url: str, out: Path, steps: int,
                device: str, extra: list[str]) -> list[dict[str, float]]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), str(ROOT / "examples" / "torchrun_trainer.py"), "--model", str(model),
            "--out", str(out), "--redis-url", url, "--run-name", RUN, "--steps", str(steps),
            "--batch-groups", "4", "--micro-batch-tokens", "4096", "--max-staleness", "1000",
            "--kl-coef", "0.1", "--checkpoint-every", "2", "--device", device,
            "--metrics", str(out / "metrics.jsonl"), *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))})
    if done.returncode != 0:
        print((done.stdout + done.stderr).decode(errors="replace")[-6000:], file=sys.stderr)
        raise SystemExit(f"gpu_torchrun_check: {name} exited {done.returncode}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--redis-server", help="redis-server binary [on PATH]")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny model and short groups on 2 CPU ranks: a wiring check")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.ranks = 2
    elif not torch.cuda.is_available():
        print("gpu_torchrun_check: needs CUDA (--tiny: a CPU wiring check)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rollq-gpu-torchrun-") as tmp:
        directory = Path(tmp)
        model = write_tiny_model(directory / "model", shape="tiny" if args.tiny else "100m")
        shape = Shape(4, 32, 8) if args.tiny else Shape(8, 512, 64)
        payloads = make_payloads(4 * args.steps * 2, shape, vocab=768)
        server = RedisProcess(directory / "redis", binary=args.redis_server).start()
        results = {}
        try:
            for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
                fill(server.url, payloads)
                rows = run_variant(name, args.ranks, model, server.url, directory / name,
                                   args.steps, device, extra)
                results[name] = rows
                losses = [row["loss"] for row in rows]
                seconds = sorted(row["seconds"] for row in rows[1:]) or [rows[0]["seconds"]]
                print(f"gpu torchrun {name}: {args.ranks} rank(s), steps {len(rows)}, losses "
                      f"{', '.join(f'{v:+.5f}' for v in losses)}, step p50 "
                      f"{seconds[len(seconds) // 2]:.3f} s", flush=True)
                if not all(math.isfinite(v) for v in losses):
                    print(f"gpu_torchrun_check: {name} has a non-finite loss", file=sys.stderr)
                    return 1
        finally:
            server.stop()
    first = abs(results["ddp"][0]["loss"] - results["fsdp"][0]["loss"])
    scale = max(abs(results["ddp"][0]["loss"]), 1e-3)
    print(f"gpu torchrun: first-step loss DDP vs FSDP differ by {first:.2e} "
          f"({first / scale:.1e} relative)", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_torchrun_check.json").write_text(json.dumps(results))
    return 0 if first / scale < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
