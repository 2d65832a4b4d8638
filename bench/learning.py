"""Learning benchmark: the ``sums`` task through rollq's full loop against a bare loop.

Both learn the same task from the same start, in the same session, against one CPU vLLM
server (started here) with the tiny Qwen2 warm-started on the answer format with random
answers (``ops.local.warm_start``; accuracy at chance):

- **rollq**: ``rollq demo --task sums`` (``ops.local.demo.run_demo``) on a Redis started here: the
  feeder, an arq worker pool, a scorer (the reward bridge, math-verify in its process pool)
  and ``examples/grpo_trainer.py`` as separate processes. Run once per seed.
- **bare**: one Python process, no Redis: the same env's rollouts through the same inference
  client (16 groups in parallel), the same reward config through ``RewardBridge``, the
  example trainer's own loss functions (PPO-clip + ``--kl-coef`` KL term) on one torch
  thread, the same weight sync (``PolicyPublisher``), strictly on-policy and sequential.
- **control**: rollq with the advantages' sign flipped: accuracy must not rise.

Every run evaluates the served policy greedily on the 80 training and 20 held-out problems
every ``--eval-every`` steps (``ops.local.evaluate``). Steps/s is trainer steps over the time from
the start of the first step to the end of the last (evaluations included, in both). The
table gives each run's accuracy at fixed steps, its steps/s, the medians over the rollq
seeds, and the rollq/bare steps/s ratio (goal >= 0.8). Results: ``--out``/results.json.

Run from the repository root::

    python -m bench.learning [--vllm-python .venv-vllm/bin/python] [--bare-steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common import BenchRedis, median_of, print_table
from rollq.ops.local.demo import EXAMPLE_TRAINER, DemoOptions, run_demo
from rollq.ops.local.demo_sums import SUMS_REWARD, learning_curves
from rollq.ops.local.stack import VllmProcess
from rollq.producers.envs.sums import CHANCE

MARKS = (0, 100, 200, 300, 400, 500, 600, 650)
"""Steps at which the table shows accuracy (the nearest evaluation at or before)."""


@dataclass(frozen=True)
class BenchOptions:
    out: Path
    vllm_python: str
    seeds: int = 3
    steps: int = 600
    bare_steps: int = 600
    control_steps: int = 300
    eval_every: int = 25
    only: tuple[str, ...] = ("bare", "rollq", "control")


def prepare_model(work: Path, say: Any = print) -> Path:
    """The tiny model warm-started on the format (cached in ``work``)."""
    from rollq.ops.local.tiny_model import write_tiny_model
    from rollq.ops.local.warm_start import load_report, report_line, warm_start

    warmed = work / "sums-model"
    report = load_report(warmed)
    if report is None:
        report = warm_start(write_tiny_model(work / "tiny-model", seed=0), warmed)
    say(report_line(report))
    return warmed


def _trainer_module() -> ModuleType:
    """``examples/grpo_trainer.py`` as a module: the bare loop uses its loss functions."""
    spec = importlib.util.spec_from_file_location("grpo_trainer", EXAMPLE_TRAINER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the bare loop ------------------------------------------------------------------------

def run_bare(model_dir: Path, url: str, out: Path, options: DemoOptions,
             say: Any = print) -> dict[str, Any]:
    """GRPO on ``sums`` without rollq's bus; returns (and writes to ``out``/summary.json)
    the same curves as the demo's summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows, evals = asyncio.run(_bare_loop(model_dir, url, out / "weights", options, say))
    curves = learning_curves(rows, evals)
    (out / "summary.json").write_text(json.dumps({"task": "sums", "loop": "bare", **curves},
                                                 indent=2) + "\n")
    return curves


async def _bare_loop(model_dir: Path, url: str, weights: Path, options: DemoOptions,
                     say: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rollq.consumers.scorer import RewardBridge, RewardConfig
    from rollq.consumers.trainer.weights import PolicyPublisher
    from rollq.ops.local.evaluate import Evaluator
    from rollq.producers.envs.sums import sums_env
    from rollq.producers.inference import InferencePool, SamplingParams

    trainer = _trainer_module()
    torch.manual_seed(options.seed)
    if options.torch_threads:
        torch.set_num_threads(options.torch_threads)
    config = RewardConfig.from_yaml(SUMS_REWARD)
    env = sums_env(split="train")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=options.lr)
    sampling = SamplingParams(max_tokens=options.max_tokens)
    step = 0

    async def version() -> int:
        return step

    rows: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    async with InferencePool([url]) as pool, RewardBridge(config) as bridge, \
            PolicyPublisher([url]) as publisher:
        policy.save_pretrained(weights, safe_serialization=True)
        await publisher.publish(0, str(weights))
        with Evaluator(url, (await pool.model_info()).name, config,
                       max_tokens=options.max_tokens) as evaluator:
            problems = {split: evaluator.problems(sums_env(split=split))
                        for split in ("train", "heldout")}

            def evaluate() -> None:
                row: dict[str, Any] = {"step": step, "time": time.time()}
                for split, found in problems.items():
                    for name, value in evaluator.evaluate(found).items():
                        row[f"{split}_{name}"] = value
                evals.append(row)
                say(f"bare: eval at step {step:>4}: train accuracy {row['train_accuracy']:.3f}"
                    f"  held-out {row['heldout_accuracy']:.3f}")

            evaluate()
            while step < options.steps:
                started = time.monotonic()
                items = [env.item((step * options.batch_groups + i) % len(env))
                         for i in range(options.batch_groups)]
                rollouts = await asyncio.gather(*(
                    env.rollout(item, pool, group_size=options.group_size, sampling=sampling,
                                policy_version=version) for item in items))
                groups = [[bridge.make_sample(c.text, c.completion_ids, reasoning=c.reasoning,
                                              finish_reason=c.finish_reason,
                                              metadata=rollout.metadata,
                                              prompt=rollout.prompt_text)
                           for c in rollout.completions] for rollout in rollouts]
                scores = await bridge.score_batch(groups)
                tensors = _pad(rollouts, scores, options.flip_advantages)
                logprobs = trainer.token_logprobs(policy, tensors["input_ids"],
                                                  tensors["attention_mask"], tensors["labels"])
                loss, stats = trainer.grpo_loss(logprobs, tensors["sampler_logprobs"],
                                                tensors["advantages"], tensors["mask"], 0.2)
                with torch.no_grad():
                    reference_logprobs = trainer.token_logprobs(
                        reference, tensors["input_ids"], tensors["attention_mask"],
                        tensors["labels"])
                kl = trainer.kl_penalty(logprobs, reference_logprobs, tensors["mask"])
                loss = loss + options.kl_coef * kl
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                step += 1
                policy.save_pretrained(weights, safe_serialization=True)
                await publisher.publish(step, str(weights))
                rows.append({
                    "step": step, "time": time.time(), "seconds": time.monotonic() - started,
                    "reward_mean": float(np.mean([r for s in scores for r in s.rewards])),
                    "components": {name: float(np.mean([v for s in scores
                                                        for v in s.components[name]
                                                        if v is not None]))
                                   for name in scores[0].components},
                    "kl": float(kl.detach()), **stats})
                if step % options.eval_every == 0 or step == options.steps:
                    evaluate()
    return rows, evals


def _pad(rollouts: Any, scores: Any, flip: bool) -> dict[str, Any]:
    """Padded tensors aligned with the logits, as ``batch.targets()`` gives the trainer."""
    import torch

    sequences = []
    for rollout, score in zip(rollouts, scores, strict=True):
        for completion, advantage in zip(rollout.completions, score.advantages, strict=True):
            sequences.append((list(rollout.prompt_ids), list(completion.completion_ids),
                              list(completion.logprobs), float(advantage)))
    width = max(len(p) + len(c) for p, c, _, _ in sequences)
    count = len(sequences)
    ids = torch.zeros((count, width), dtype=torch.long)
    attention = torch.zeros((count, width), dtype=torch.long)
    labels = torch.zeros((count, width), dtype=torch.long)
    mask = torch.zeros((count, width))
    sampler = torch.zeros((count, width))
    advantages = torch.zeros((count, width))
    for row, (prompt, completion, logprobs, advantage) in enumerate(sequences):
        tokens = prompt + completion
        ids[row, :len(tokens)] = torch.tensor(tokens)
        attention[row, :len(tokens)] = 1
        labels[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
        # position t predicts token t + 1: completion tokens are predicted from len(prompt)-1
        first, last = len(prompt) - 1, len(tokens) - 1
        mask[row, first:last] = 1
        sampler[row, first:last] = torch.tensor(logprobs, dtype=torch.float)
        advantages[row, first:last] = -advantage if flip else advantage
    return {"input_ids": ids, "attention_mask": attention, "labels": labels, "mask": mask,
            "sampler_logprobs": sampler, "advantages": advantages}


async def serve_weights(url: str, model: Path) -> None:
    """Load ``model`` on the server before a run: rollouts the workers start before the
    trainer's first publish must not come from the previous run's weights."""
    from rollq.consumers.trainer.weights import PolicyPublisher

    async with PolicyPublisher([url]) as publisher:
        await publisher.publish(0, str(model))


# -- the session --------------------------------------------------------------------------

def run_session(options: BenchOptions) -> dict[str, Any]:
    """Start vLLM and Redis once, run every loop, return the results by run name."""
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(out)
    results: dict[str, Any] = {}
    cache = Path(options.vllm_python).resolve().parent.parent / "inductor-cache"
    vllm = VllmProcess(options.vllm_python, model, out / "vllm.log", compile_cache=cache)
    print("vllm: starting the CPU server...", flush=True)
    vllm.start()
    try:
        with BenchRedis() as redis_server:
            def demo(name: str, seed: int, steps: int, flip: bool = False) -> dict[str, Any]:
                started = time.monotonic()
                asyncio.run(serve_weights(vllm.url, model))
                result = run_demo(DemoOptions.for_task(
                    "sums", out=out / name, run=name, redis_url=redis_server.url,
                    inference=vllm.url, model=model, steps=steps, seed=seed,
                    eval_every=options.eval_every, flip_advantages=flip),
                    say=lambda line: print(f"{name}: {line}", flush=True)
                    if line.startswith("eval") else None)
                curves = learning_curves(result.steps, result.evals)
                print(f"{name}: done in {time.monotonic() - started:.0f}s", flush=True)
                return curves

            if "bare" in options.only:
                bare = DemoOptions.for_task("sums", out=out / "bare", steps=options.bare_steps,
                                            eval_every=options.eval_every)
                results["bare"] = run_bare(model, vllm.url, out / "bare", bare,
                                           say=lambda line: print(line, flush=True))
            for seed in range(options.seeds if "rollq" in options.only else 0):
                results[f"rollq-{seed}"] = demo(f"rollq-{seed}", seed, options.steps)
            if "control" in options.only:
                results["control"] = demo("control", 0, options.control_steps, flip=True)
    finally:
        vllm.stop()
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def at_step(curves: dict[str, Any], split: str, step: int) -> float | None:
    """Accuracy of the last evaluation at or before ``step`` (None past the run's end)."""
    evals = curves["evals"]
    if not evals["step"] or step > evals["step"][-1] + 1:
        return None
    found = [value for s, value in zip(evals["step"], evals[f"{split}_accuracy"], strict=True)
             if s <= step]
    return found[-1] if found else None


def report(results: dict[str, Any]) -> None:
    """Print the accuracy curves, steps/s, medians and the ratio."""
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for split in ("train", "heldout"):
        rows = [[name, *(cell(at_step(c, split, mark)) for mark in MARKS)]
                for name, c in results.items()]
        print_table(["run", *(f"step {m}" for m in MARKS)], rows,
                    f"{split} accuracy (greedy; chance {CHANCE:.3f})")
    rows = [[name, f"{c['steps_per_s']:.3f}", c["steps"]["step"][-1] if c["steps"]["step"] else 0,
             cell(c["format_min"]), cell(c["format_min_10"]),
             cell(min(c["evals"]["train_format"], default=None)), cell(c["train_accuracy_final"]),
             cell(c["heldout_accuracy_final"]),
             "-" if c["seconds_to_train_accuracy_0_9"] is None
             else f"{c['seconds_to_train_accuracy_0_9']:.0f}"]
            for name, c in results.items()]
    print_table(["run", "steps/s", "steps", "format min", "min of 10", "greedy format min",
                 "train final",
                 "held-out final",
                 "s to train 0.9"], rows, "runs")
    seeds = [c for name, c in results.items() if name.startswith("rollq-")]
    if seeds:
        median_rate = median_of(c["steps_per_s"] for c in seeds)
        print(f"rollq median of {len(seeds)} seeds: steps/s {median_rate:.3f}, train accuracy "
              f"{median_of(c['train_accuracy_final'] for c in seeds):.3f}, held-out "
              f"{median_of(c['heldout_accuracy_final'] for c in seeds):.3f}, format min "
              f"{median_of(c['format_min'] for c in seeds):.3f}")
        if "bare" in results:
            bare_rate = results["bare"]["steps_per_s"]
            print(f"bare loop: steps/s {bare_rate:.3f}; rollq / bare = "
                  f"{median_rate / bare_rate:.2f} (goal >= 0.8)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--out", type=Path, default=Path("bench-learning"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=650, help="rollq steps per seed "
                        "(about 10 minutes of RL on 2 cores) [650]")
    parser.add_argument("--bare-steps", type=int, default=600)
    parser.add_argument("--control-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--only", default="bare,rollq,control",
                        help="comma-separated subset of bare, rollq, control")
    parser.add_argument("--report", type=Path, help="print the table of a results.json")
    args = parser.parse_args(argv)
    from rollq.ops.logging import configure_logging

    configure_logging("console", "warning")  # not a line per request of the bare loop
    if args.report:
        report(json.loads(args.report.read_text()))
        return 0
    results = run_session(BenchOptions(
        out=args.out, vllm_python=args.vllm_python, seeds=args.seeds, steps=args.steps,
        bare_steps=args.bare_steps, control_steps=args.control_steps,
        eval_every=args.eval_every, only=tuple(args.only.split(","))))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
