"""Learning benchmark with a real pretrained model: ``rollq demo --task smollm2``, 3 seeds and
a flipped-advantage control, each judged on the issue's figures.

SmolLM2-135M-Instruct (``ops.local.smollm2``) answers the single-digit sums in its own chat
template, from its own weights (``ops.local.demo_smollm2``): feeder, workers, scorer (the
reward bridge, math-verify) and ``examples/grpo_trainer.py`` as separate processes on one
CPU vLLM server and one redis-server started here; the served weights are put back to the
converted ones before each run. Every run evaluates the served policy greedily on the 80
training and 20 held-out problems every ``--eval-every`` steps.

A seed passes when, within 30 minutes including the server's start-up, its greedy held-out
accuracy rises by at least 0.2 (absolute) and its sampled training accuracy (the batch's,
mean of the last 5 steps) is at least twice its start (the first 5 steps). The control
passes when neither rises. The per-step cost is split into generation (a group's
``finished_at - created_at``), scoring (``scored_at - finished_at``: includes the wait in
the stream), the trainer's step (forward, backward, AdamW) and the weight sync.
Results: ``--out``/results.json (an invocation adds its runs to those already there, so
runs can be made one at a time with ``--only``); one summary line at the end.

Run from the repository root (under the machine's heavy lock)::

    python -m bench.learning_real [--vllm-python .venv-vllm/bin/python] [--only seed-0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import BenchRedis, median_of, print_table
from bench.learning import serve_weights
from rollq.ops.local.artifacts import default_cache_dir
from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.demo_smollm2 import SERVER
from rollq.ops.local.demo_sums import learning_curves
from rollq.ops.local.smollm2 import smollm2_model
from rollq.ops.local.stack import VllmProcess
from rollq.schemas import decode_scored
from rollq.schemas.codec import TRAJECTORY_REF, join_trajectory
from rollq.schemas.keys import stream_key

BUDGET_S = 1800.0
"""A run's wall time with the server's start-up must stay under this (30 minutes)."""
GAIN, FACTOR = 0.2, 2.0
"""Held-out greedy accuracy gain (absolute) and sampled accuracy factor a seed must reach."""


def sampled(curves: dict[str, Any], first: bool, window: int = 5) -> float:
    """The batch's sampled accuracy, mean of the first or last ``window`` steps."""
    values = [v for v in curves["steps"]["batch_accuracy"] if v is not None]
    part = values[:window] if first else values[-window:]
    return sum(part) / max(1, len(part))


def step_costs(redis_url: str, run: str, steps: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per step of each part (module docstring)."""
    client = redis.Redis.from_url(redis_url)
    try:
        scored = client.xrange(stream_key(run, 0, "scored"))
        trajectories = dict(client.xrange(stream_key(run, 0, "traj")))  # type: ignore[arg-type]
    finally:
        client.close()
    groups = []
    for _, fields in scored:  # type: ignore[union-attr]
        reference = fields.get(TRAJECTORY_REF)  # the scored entry names its traj entry
        if reference is not None and reference in trajectories:
            fields = join_trajectory(fields, trajectories[reference])
        groups.append(decode_scored(fields))
    generation = [g.trajectory.finished_at - g.trajectory.created_at for g in groups]
    scoring = [g.scored_at - g.trajectory.finished_at for g in groups]

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3) if values else float("nan")

    return {"generation_group_s": median(generation), "scoring_group_s": median(scoring),
            "train_step_s": median([r.get("train_seconds", float("nan")) for r in steps]),
            "sync_s": median([r.get("sync_seconds", float("nan")) for r in steps]),
            "wait_s": median([r.get("wait_seconds", float("nan")) for r in steps]),
            "step_s": median([r["seconds"] for r in steps])}


def judge(curves: dict[str, Any], wall_s: float, start_s: float) -> dict[str, Any]:
    """The issue's figures for one run."""
    held_first, held_final = curves["heldout_accuracy_first"], curves["heldout_accuracy_final"]
    first, last = sampled(curves, True), sampled(curves, False)
    return {"heldout_first": held_first, "heldout_final": held_final,
            "heldout_gain": round(held_final - held_first, 4),
            "train_first": curves["train_accuracy_first"],
            "train_final": curves["train_accuracy_final"],
            "sampled_first": round(first, 4), "sampled_last": round(last, 4),
            "sampled_factor": round(last / first, 2) if first else None,
            "wall_with_start_s": round(wall_s + start_s, 1),
            "passed": (held_final - held_first >= GAIN and last >= FACTOR * first
                       and wall_s + start_s <= BUDGET_S)}


def run_session(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = smollm2_model(default_cache_dir(os.environ))
    cache = Path(args.vllm_python).resolve().parent.parent / "inductor-cache"
    started = time.monotonic()
    vllm = VllmProcess(args.vllm_python, model, out / "vllm.log", compile_cache=cache,
                       weight_transfer="rollq_tcp", **SERVER).start(timeout_s=600)
    start_s = round(time.monotonic() - started, 1)
    print(f"vllm: SmolLM2 served after {start_s} s", flush=True)
    saved = out / "results.json"  # runs of earlier invocations are kept (one run a lock hold)
    results: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {"runs": {}}
    runs = [(f"seed-{seed}", seed, False) for seed in range(args.seeds)] + [("control", 0, True)]
    runs = [run for run in runs if run[0] in args.only.split(",")] if args.only else runs
    try:
        with BenchRedis() as redis_server:
            for name, seed, flip in runs:
                asyncio.run(serve_weights(vllm.url, model))
                given = {"steps": args.steps} if args.steps else {}
                options = DemoOptions.for_task(
                    "smollm2", out=out / name, run=name, redis_url=redis_server.url,
                    inference=vllm.url, model=model, seed=seed, flip_advantages=flip,
                    eval_every=args.eval_every, **given)
                result = run_demo(options, say=lambda line, n=name: print(
                    f"{n}: {line}", flush=True) if line.startswith("eval") else None)
                curves = learning_curves(result.steps, result.evals)
                row = {**judge(curves, result.wall_s, start_s), "server_start_s": start_s,
                       "cost": step_costs(redis_server.url, name, result.steps),
                       "steps": len(result.steps), "wall_s": round(result.wall_s, 1),
                       "curves": {"steps": curves["steps"], "evals": curves["evals"]}}
                if flip:
                    row["passed"] = (row["heldout_gain"] < GAIN / 2
                                     and row["sampled_last"] <= row["sampled_first"] + 0.05)
                results["runs"][name] = row
                print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'curves'})}",
                      flush=True)
                saved.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        vllm.stop()
    return results


def report(results: dict[str, Any]) -> None:
    runs = results["runs"]
    rows = [[name, f"{r['heldout_first']:.2f} -> {r['heldout_final']:.2f}",
             f"{r['train_first']:.3f} -> {r['train_final']:.3f}",
             f"{r['sampled_first']:.3f} -> {r['sampled_last']:.3f}", r["steps"],
             f"{r['wall_with_start_s']:.0f}", r["cost"]["generation_group_s"],
             r["cost"]["train_step_s"], r["cost"]["sync_s"], "yes" if r["passed"] else "NO"]
            for name, r in runs.items()]
    print_table(["run", "held-out greedy", "train greedy", "sampled (5 steps)", "steps",
                 "s with start", "gen s/group", "train s", "sync s", "passed"], rows,
                "SmolLM2-135M-Instruct, single-digit sums (s with start: the run and its "
                "server's start-up)")
    seeds = [r for name, r in runs.items() if name.startswith("seed-")]
    if seeds:
        gains = [r["heldout_gain"] for r in seeds]
        factors = [r["sampled_factor"] or 0.0 for r in seeds]
        control = runs.get("control")
        print(f"smollm2: {sum(r['passed'] for r in seeds)}/{len(seeds)} seeds passed; held-out "
              f"gain median {median_of(gains):+.2f} ({min(gains):+.2f}..{max(gains):+.2f}), "
              f"sampled x{median_of(factors):.2f} ({min(factors):.2f}..{max(factors):.2f}), "
              f"wall with start median {median_of(r['wall_with_start_s'] for r in seeds):.0f} s"
              + ("" if control is None else
                 f"; control held-out {control['heldout_gain']:+.2f}, sampled "
                 f"{control['sampled_first']:.3f} -> {control['sampled_last']:.3f} "
                 f"({'flat' if control['passed'] else 'ROSE'})"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--out", type=Path, default=Path("bench-learning-real"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="trainer steps per run [the demo's]")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--only", help="comma-separated runs of seed-0..seed-N, control, one "
                        "server start each invocation; results.json gathers them [all]")
    parser.add_argument("--report", type=Path, help="print the table of a results.json")
    args = parser.parse_args(argv)
    from rollq.ops.logging import configure_logging

    configure_logging("console", "warning")
    results = json.loads(args.report.read_text()) if args.report else run_session(args)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
