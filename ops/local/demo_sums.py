"""The ``sums`` task of the demo: greedy evaluations of the served policy during the run,
the learning curves of ``summary.json``, and their plot."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

SUMS_REWARD = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "sums.yaml"


class SumsEvaluation:
    """The demo's evaluations of the served policy on the sums problems (``ops.local.evaluate``)."""

    def __init__(self, evaluator: Any, problems: dict[str, Any], every: int,
                 path: Path, say: Callable[[str], None]) -> None:
        self.evaluator, self.problems, self.every = evaluator, problems, every
        self.path, self.say = path, say
        self.rows: list[dict[str, Any]] = []

    def run(self, step: int) -> None:
        """Evaluate now and record it as ``step``, the policy version in force (a reload
        may land during the evaluation, so some answers may come from ``step + 1``)."""
        started = time.time()
        row: dict[str, Any] = {"step": step, "time": started}
        for split, problems in self.problems.items():
            for name, value in self.evaluator.evaluate(problems).items():
                row[f"{split}_{name}"] = value
        row["eval_s"] = round(time.time() - started, 3)
        self.rows.append(row)
        with self.path.open("a") as log:
            log.write(json.dumps(row) + "\n")
        failures = ", ".join(f"{why} {count}" for why, count in
                             row.get("train_failures", {}).items())  # tools: why not well formed
        shape = f"  format {row['train_format']:.3f}" if "train_format" in row else ""
        self.say(f"eval at step {step:>4}: train accuracy {row['train_accuracy']:.3f}  "
                 f"held-out {row['heldout_accuracy']:.3f}{shape}"
                 + (f" ({failures})" if failures else ""))

    def due(self, step: int) -> bool:
        last = self.rows[-1]["step"] if self.rows else -1
        return step // self.every > last // self.every

    def final(self, version: int | None) -> None:
        if version is not None and (not self.rows or self.rows[-1]["step"] < version):
            self.run(version)


@contextlib.contextmanager
def sums_evaluation(task: str, inference: str, out: Path, say: Callable[[str], None], *,
                    every: int, max_tokens: int, reward: Path = SUMS_REWARD
                    ) -> Iterator[SumsEvaluation | None]:
    """Evaluations every ``every`` steps for the ``sums`` task (scored by ``reward``); None
    for any other task."""
    if task != "sums":
        yield None
        return
    from rollq.consumers.scorer import RewardConfig
    from rollq.ops.local.evaluate import Evaluator
    from rollq.producers.envs.sums import sums_env

    config = RewardConfig.from_yaml(reward)
    with Evaluator(inference, served_model(inference), config,
                   max_tokens=max_tokens) as evaluator:
        problems = {split: evaluator.problems(sums_env(split=split))
                    for split in ("train", "heldout")}
        yield SumsEvaluation(evaluator, problems, every, out / "evals.jsonl", say)


def served_model(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def learning_curves(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``sums`` curves from the trainer's metrics rows and the evaluation rows.

    Time is RL time: seconds since the first trainer step began (evaluations before it at 0).
    ``format`` and ``batch_accuracy`` are per step, over the batch's sampled completions;
    ``train_accuracy`` and ``heldout_accuracy`` are greedy, per evaluation.
    """
    if not steps:
        return {}
    began = steps[0]["time"] - steps[0]["seconds"]

    def component(row: dict[str, Any], name: str) -> float | None:
        value = row.get("components", {}).get(name)
        return None if value is None else round(float(value), 4)

    formats = [component(r, "format") for r in steps]
    curves: dict[str, Any] = {
        "steps": {"step": [r["step"] for r in steps],
                  "seconds": [round(r["time"] - began, 2) for r in steps],
                  "format": formats,
                  "batch_accuracy": [component(r, "accuracy") for r in steps],
                  "kl": [r.get("kl") for r in steps]},
        "evals": {"step": [e["step"] for e in evals],
                  "seconds": [round(max(0.0, e["time"] - began), 2) for e in evals],
                  "train_accuracy": [e["train_accuracy"] for e in evals],
                  "heldout_accuracy": [e["heldout_accuracy"] for e in evals],
                  "train_format": [e.get("train_format") for e in evals]},
        "steps_per_s": round(len(steps) / max(1e-9, steps[-1]["time"] - began), 4),
        "format_min": min((f for f in formats if f is not None), default=None),
        "format_min_10": _rolling_min(formats, 10),
        "train_accuracy_first": evals[0]["train_accuracy"] if evals else None,
        "heldout_accuracy_first": evals[0]["heldout_accuracy"] if evals else None,
        "train_accuracy_final": evals[-1]["train_accuracy"] if evals else None,
        "heldout_accuracy_final": evals[-1]["heldout_accuracy"] if evals else None,
    }
    reached = [e for e in evals if e["train_accuracy"] >= 0.9]
    curves["seconds_to_train_accuracy_0_9"] = (
        round(max(0.0, reached[0]["time"] - began), 1) if reached else None)
    return curves


def _rolling_min(values: list[float | None], window: int) -> float | None:
    """The lowest mean of ``window`` consecutive values (None values skipped)."""
    present = [v for v in values if v is not None]
    means = [sum(present[i:i + window]) / window for i in range(len(present) - window + 1)]
    return round(min(means), 4) if means else None


def plot_learning(steps: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path,
                  title: str, *, problems: tuple[int, int] = (80, 20), chance: float = 1 / 19,
                  chance_text: str = "1/19") -> Path:
    """Format reward and batch accuracy per step, evaluated accuracies, chance: one plot.
    ``problems``: how many training and held-out problems the evaluations answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, heldout = problems
    curves = learning_curves(steps, evals)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    if any(value is not None for value in curves["steps"]["format"]):  # tools has none
        axis.plot(curves["steps"]["step"], curves["steps"]["format"], color="tab:gray",
                  linewidth=1, label="format reward (batch)")
    axis.plot(curves["steps"]["step"], curves["steps"]["batch_accuracy"], color="tab:blue",
              alpha=0.35, linewidth=1, label="accuracy, sampled (batch)")
    if any(value is not None for value in curves["evals"]["train_format"]):  # smollm2 has none
        axis.plot(curves["evals"]["step"], curves["evals"]["train_format"], color="tab:gray",
                  linestyle="--", marker=".",
                  label=f"format, {train} training problems (greedy)")
    axis.plot(curves["evals"]["step"], curves["evals"]["train_accuracy"], color="tab:blue",
              marker="o", label=f"accuracy, {train} training problems (greedy)")
    axis.plot(curves["evals"]["step"], curves["evals"]["heldout_accuracy"], color="tab:orange",
              marker="s", label=f"accuracy, {heldout} held-out problems (greedy)")
    axis.axhline(chance, color="tab:red", linestyle=":", label=f"chance ({chance_text})")
    axis.set_xlabel("trainer step")
    axis.set_ylim(-0.02, 1.05)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(loc="center left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
