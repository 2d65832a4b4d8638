"""``rollq demo``: the whole loop on one machine, and proof that a model learns through it.

It starts (or uses) Redis and a vLLM server with a tiny local model, then the roles as
separate processes, exactly as a deployment runs them:

    rollq feed     -> admits rollout jobs at the trainer's pace
    rollq workers  -> generate groups on vLLM, publish them to the traj stream
    rollq score    -> reward (digit fraction: a dense toy reward), advantages, forward
    examples/grpo_trainer.py -> GRPO steps, weights published back to vLLM

and shows live progress until the trainer has done ``steps`` steps. Then it writes
``reward.png`` (reward vs step) and ``summary.json`` to the output directory and stops
every process it started.

``task="sums"`` (``rollq demo --task sums``) is a reasoning-shaped task instead: single-digit
sums (``producers.envs.sums``) scored by ``examples/rewards/sums.yaml`` (format + math-verify
accuracy), starting from the tiny model warm-started on the format with random answers
(``ops.local.warm_start``), trained with a KL term to that start. Every ``eval_every`` steps (and
at step 0) the served policy answers the 80 training and 20 held-out problems greedily
(``ops.local.evaluate``); ``learning.png`` plots the format reward, batch accuracy and both
evaluated accuracies, and ``summary.json`` holds the curves.

``task="smollm2"`` is the same ``sums`` problems asked of a real pretrained model,
SmolLM2-135M-Instruct, in its own chat format, with no warm start (``ops.local.demo_smollm2``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx
import redis

from rollq.consumers.trainer.settings import WeightSyncMethod
from rollq.ops.local import demo_smollm2
from rollq.ops.local.demo_sums import (
    SUMS_REWARD,
    SumsEvaluation,
    learning_curves,
    plot_learning,
    served_model,
    sums_evaluation,
)
from rollq.ops.local.demo_tools import TOOLS_REWARD, gateway_argv, tools_evaluation, wait_healthy
from rollq.ops.local.process_groups import Processes
from rollq.ops.local.stack import RedisProcess, VllmProcess, free_port
from rollq.producers.envs.tools import VLLM_TOOL_FLAGS
from rollq.schemas import ConfigError
from rollq.schemas.keys import POLICY_VERSION_FIELD, StreamName, counters_key, state_key, stream_key

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_TRAINER = EXAMPLES / "grpo_trainer.py"
TORCHRUN_TRAINER = EXAMPLES / "torchrun_trainer.py"
Task = Literal["digits", "sums", "tools", "smollm2"]
LEARNING_TASKS = ("sums", "tools", "smollm2")
"""Tasks evaluated greedily during the run, with learning curves (all but ``smollm2``
from a warm start)."""
TITLES = {"sums": "rollq demo --task sums: single-digit sums",
          "smollm2": "rollq demo --task smollm2: SmolLM2-135M-Instruct, single-digit sums",
          "tools": "rollq demo --task tools: arithmetic with a calc tool, through rollq gateway"}

DEMO_REWARD = """\
# The demo's reward: the fraction of digit characters in the completion. Dense, so a tiny
# random model gets a learning signal from its first step (accuracy would be 0 for all).
components:
  - name: digits
    component: char_fraction
    settings: {pattern: "[0-9]"}
advantages: {method: grpo, zero_variance: keep}
pool: {workers: 1}
"""


@dataclass
class DemoOptions:
    """What ``run_demo`` runs. ``model``: the starting model (for ``sums``, already
    warm-started); None writes the tiny model (and, for ``sums``, warm-starts it)."""

    out: Path
    steps: int = 60
    run: str = "demo"
    redis_url: str | None = None
    inference: str | None = None
    model: Path | None = None
    vllm_python: str | None = None
    group_size: int = 8
    batch_groups: int = 8
    max_tokens: int = 24
    temperature: float = 1.0
    """The workers' sampling temperature (evaluations are greedy)."""
    max_staleness: int = 1
    lr: float = 2e-3
    flip_advantages: bool = False
    step_timeout_s: float = 120.0
    task: Task = "digits"
    kl_coef: float = 0.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up of the trainer over this many steps (0: none)."""
    torch_threads: int | None = None
    """torch's threads in the trainer and the warm start (None: torch's default)."""
    trainer_ranks: int = 1
    """Above 1: ``examples/torchrun_trainer.py`` as this many torchrun ranks (DDP, gloo on
    the CPU) instead of ``examples/grpo_trainer.py``."""
    eval_every: int = 25
    """``sums``, ``tools``: evaluate greedily every this many trainer steps, at step 0 and
    at the end (0: never; the sampled batches' accuracy is in every step's metrics)."""
    warm_start_steps: int = 300
    warm_start_right_fraction: float = 0.0
    """``WarmStartOptions.right_fraction`` (0: the answers start at chance)."""
    seed: int = 0
    weight_sync: WeightSyncMethod = "reload"
    """How the trainer moves weights into vLLM (the demo's own server serves rollq_tcp)."""
    freeze_embeddings: bool = False
    """The trainer leaves the token embeddings and the output layer as they are."""
    checkpoint_every: int | None = None
    """The trainer's ``--checkpoint-every`` (None: its default, 5)."""
    train_layers: int | None = None
    """The trainer trains only the last this many transformer blocks (None: all)."""

    @classmethod
    def for_task(cls, task: Task, **given: Any) -> DemoOptions:
        """Options for ``task``: its defaults (``TASK_DEFAULTS``), then ``given``."""
        return cls(task=task, **{**TASK_DEFAULTS.get(task, {}), **given})


TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # Measured on 2 CPU cores: accuracy on the training problems ~0.9 after ~600 steps.
    "sums": {"steps": 600, "batch_groups": 16, "group_size": 8, "max_tokens": 20, "lr": 5e-4,
             "kl_coef": 0.1, "torch_threads": 1},
    # Measured on 2 CPU cores: training accuracy 0.96-1.0 in 10-13 minutes, warm start and
    # vLLM start included (docs/guides/demo-tools.md). 40 tokens a call (the call is 22 with
    # the tools tokenizer); the 10-step warm-up keeps Adam's first full-lr step (KL 227 to
    # the start without it) from breaking the warm start.
    "tools": {"steps": 180, "batch_groups": 8, "group_size": 8, "max_tokens": 40, "lr": 1e-3,
              "kl_coef": 0.05, "warmup_steps": 10, "torch_threads": 1},
    "smollm2": demo_smollm2.DEFAULTS,
}


@dataclass
class DemoResult:
    steps: list[dict[str, Any]]
    wall_s: float
    out: Path
    plot: Path | None = None
    drops: dict[str, int] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """``sums``, ``tools``: one row per evaluation (step, seconds, train/held-out accuracy and
    format; ``tools``: the episodes not in format, by reason)."""
    warm_start: dict[str, Any] | None = None

    def reward_at(self, first: bool, window: int = 5) -> float:
        rows = self.steps[:window] if first else self.steps[-window:]
        return float(sum(r["reward_mean"] for r in rows)) / max(1, len(rows))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The trainer's complete rows: a read may catch it mid-line (a write crossing a page
    boundary shows its first part), so what follows the last newline waits for later."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _lag(client: redis.Redis, run: str) -> tuple[int, int]:
    """Entries waiting for the scorers and for the trainer (partition 0)."""
    waiting = []
    pairs: tuple[tuple[StreamName, str], ...] = (("traj", "scorers"), ("scored", "trainer"))
    for name, group in pairs:
        try:
            groups: list[dict[str, Any]] = client.xinfo_groups(  # type: ignore[assignment]
                stream_key(run, 0, name))
        except redis.ResponseError:
            waiting.append(0)
            continue
        info = next((g for g in groups if g["name"] == group.encode()), None)
        waiting.append(int((info or {}).get("lag") or 0) + int((info or {}).get("pending") or 0))
    return waiting[0], waiting[1]


def plot_rewards(steps: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], marker=".")
    axis.set_xlabel("trainer step")
    axis.set_ylabel("mean reward of the batch")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def run_demo(options: DemoOptions, *, say: Callable[[str], None] = print) -> DemoResult:
    """Bring the stack up, train ``options.steps`` steps, write the plot, tear down."""
    out = options.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json", "evals.jsonl"):
        (out / stale).unlink(missing_ok=True)
    started = time.monotonic()
    embedded_redis: RedisProcess | None = None
    vllm: VllmProcess | None = None
    processes = Processes(logs)
    evals: list[dict[str, Any]] = []
    warm: dict[str, Any] | None = None
    try:
        redis_url = options.redis_url
        if redis_url is None:
            embedded_redis = RedisProcess(out / "redis").start()
            redis_url = embedded_redis.url
            say(f"redis: embedded redis-server on {redis_url}")
        model = options.model
        if model is None:
            model, warm = _write_model(options, out, say)
        inference = options.inference
        if inference is None:
            if not options.vllm_python:
                raise ConfigError("no --inference URL and no --vllm-python to start vLLM with")
            say("vllm: starting the CPU server (30-70 s, first compile ~20 s)...")
            cache = Path(options.vllm_python).resolve().parent.parent / "inductor-cache"
            vllm = VllmProcess(options.vllm_python, model, logs / "vllm.log",
                               compile_cache=cache, **demo_smollm2.SERVER
                               if options.task == "smollm2" else {},
                               weight_transfer="rollq_tcp" if options.weight_sync == "transfer"
                               else None,
                               extra_args=VLLM_TOOL_FLAGS if options.task == "tools" else ()
                               ).start()
            inference = vllm.url
            say(f"vllm: serving {model.name} at {inference}")
        client = redis.Redis.from_url(redis_url)
        if client.exists(stream_key(options.run, 0, "traj")):
            raise ConfigError(f"run {options.run!r} already has data in {redis_url}; "
                              "pick another --run or an empty Redis")
        env = {**os.environ, "ROLLQ_REDIS_URL": redis_url, "ROLLQ_RUN": options.run,
               "ROLLQ_LOG_FORMAT": "json"}
        with _evaluation(options, inference, out, say) as evaluation:
            start_roles(processes, options, inference, env)
            metrics = out / "metrics.jsonl"
            trainer = trainer_argv(options, model, inference, out / "trainer", metrics)
            trainer_process = processes.start("trainer", trainer, env)
            _follow(options, processes, trainer_process, client, metrics, say, evaluation)
            if evaluation is not None:
                evaluation.final(_policy_version(client, options.run))
                evals = evaluation.rows
        steps = read_metrics(metrics)
        drops = _drops(client, options.run)
        client.close()
    finally:
        processes.stop()
        if vllm is not None:
            vllm.stop()
        if embedded_redis is not None:
            embedded_redis.stop()
    result = DemoResult(steps=steps, wall_s=time.monotonic() - started, out=out, drops=drops,
                        evals=evals, warm_start=warm)
    flipped = " (flipped advantages)" if options.flip_advantages else ""
    if steps and options.task in LEARNING_TASKS:
        result.plot = plot_learning(steps, evals, out / "learning.png",
                                    TITLES[options.task] + flipped, **_plotted(options.task))
    elif steps:
        result.plot = plot_rewards(steps, out / "reward.png",
                                   "rollq demo: digit-fraction reward" + flipped)
    _write_summary(result, options)
    return result


def _plotted(task: Task) -> dict[str, Any]:
    """What ``plot_learning`` is told of ``task``'s evaluations: problems and chance (the
    ``sums`` values are its defaults)."""
    if task != "tools":
        return {}
    from rollq.producers.envs.tools import CHANCE, calc_records

    return {"problems": (len(calc_records("train")), len(calc_records("heldout"))),
            "chance": CHANCE, "chance_text": f"1/{round(1 / CHANCE)}"}


def _evaluation(options: DemoOptions, inference: str, out: Path,
                say: Callable[[str], None]) -> contextlib.AbstractContextManager[
                    SumsEvaluation | None]:
    """The task's greedy evaluations (None for ``digits``, or with ``eval_every`` 0)."""
    if options.eval_every == 0:
        return contextlib.nullcontext(None)
    if options.task == "tools":
        return tools_evaluation(inference, served_model(inference), out, say,
                                every=options.eval_every, max_tokens=options.max_tokens)
    if options.task == "smollm2":
        return sums_evaluation("sums", inference, out, say, every=options.eval_every,
                               max_tokens=options.max_tokens, reward=demo_smollm2.SMOLLM2_REWARD)
    return sums_evaluation(options.task, inference, out, say, every=options.eval_every,
                           max_tokens=options.max_tokens)


def _write_model(options: DemoOptions, out: Path,
                 say: Callable[[str], None]) -> tuple[Path, dict[str, Any] | None]:
    """The tiny model (``digits``), or the tiny model warm-started on the format (``sums``,
    ``tools``; reused when ``out`` already holds one)."""
    from rollq.ops.local.tiny_model import write_tiny_model

    if options.task == "smollm2":
        raise ConfigError("the smollm2 task needs its model: `rollq model "
                          "smollm2-135m-instruct` prints the folder to pass as --model")
    tiny = out / "tiny-model"
    if options.task not in LEARNING_TASKS:
        write_tiny_model(tiny, seed=0)
        say(f"model: wrote the tiny Qwen2 model to {tiny}")
        return tiny, None
    from rollq.ops.local.warm_start import WarmStartOptions, load_report, report_line, warm_start
    from rollq.ops.local.warm_start_tools import (
        TOOLS_WARM_START,
        describe_tools,
        load_tools_report,
        warm_start_tools,
    )

    warmed = out / f"{options.task}-model"
    warm_options = dataclasses.replace(
        TOOLS_WARM_START if options.task == "tools" else WarmStartOptions(),
        steps=options.warm_start_steps, seed=options.seed,
        right_fraction=options.warm_start_right_fraction)
    load, train, show = ((load_report, warm_start, report_line) if options.task == "sums" else
                         (load_tools_report, warm_start_tools, describe_tools))
    report = load(warmed, warm_options)
    if report is None:
        write_tiny_model(tiny, seed=0, tools=options.task == "tools")
        say(f"model: wrote the tiny Qwen2 model; warm-starting it on the {options.task} "
            f"format with random answers ({options.warm_start_steps} steps)...")
        report = train(tiny, warmed, warm_options, threads=options.torch_threads)
    say(show(report))  # type: ignore[arg-type]  # each loader goes with its describer
    return warmed, asdict(report)


def start_roles(processes: Processes, options: DemoOptions, inference: str,
                env: dict[str, str]) -> None:
    """Start the scorer, a worker pool and the feeder for ``options.run`` (for ``tools``,
    and first, the ``rollq gateway`` the workers' agents call the model through)."""
    env_options: list[str] = []
    if options.task == "sums":
        reward, task_env = SUMS_REWARD, "sums"
    elif options.task == "smollm2":
        reward, task_env = demo_smollm2.SMOLLM2_REWARD, demo_smollm2.ENV
    elif options.task == "tools":
        reward, task_env = TOOLS_REWARD, "tools"
        gateway = f"http://127.0.0.1:{(port := free_port())}"
        processes.start("gateway", gateway_argv(inference, port), env)
        wait_healthy(gateway, processes.check)
        env_options = ["--env-option", f"gateway={gateway}",
                       "--env-option", f"max_tokens={options.max_tokens}"]
    else:
        reward, task_env = processes.logs.parent / "reward.yaml", "gsm8k"
        reward.write_text(DEMO_REWARD)
    python = sys.executable
    processes.start("scorer", [python, "-m", "rollq", "score", "--reward-config",
                               str(reward), "--processes", "1"], env)
    processes.start("workers", [
        python, "-m", "rollq", "workers", "--env", task_env, *env_options,
        "--inference", inference,
        "--group-size", str(options.group_size), "--max-tokens", str(options.max_tokens),
        "--temperature", str(options.temperature), "--concurrency", str(options.batch_groups),
        *(["--lora-name", "policy"] if options.weight_sync == "lora" else [])], env)
    processes.start("feeder", [
        python, "-m", "rollq", "feed", "--env", task_env, "--epochs", "100000",
        "--max-staleness", str(options.max_staleness),
        "--batch-groups", str(options.batch_groups), "--shuffle-seed", str(options.seed)], env)


def trainer_argv(options: DemoOptions, model: Path, inference: str, out: Path,
                 metrics: Path) -> list[str]:
    """The example trainer's command line for ``options`` (under torchrun with
    ``trainer_ranks`` above 1)."""
    trainer = [sys.executable, str(EXAMPLE_TRAINER)]
    if options.trainer_ranks > 1:
        trainer = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(options.trainer_ranks), str(TORCHRUN_TRAINER)]
    argv = [*trainer, "--model", str(model),
            "--inference", inference, "--out", str(out), "--steps", str(options.steps),
            "--batch-groups", str(options.batch_groups), "--lr", str(options.lr),
            "--max-staleness", str(options.max_staleness), "--metrics", str(metrics),
            "--seed", str(options.seed), "--new-run"]  # the demo's run is its own
    if options.kl_coef:
        argv += ["--kl-coef", str(options.kl_coef)]
    if options.warmup_steps:
        argv += ["--warmup-steps", str(options.warmup_steps)]
    if options.torch_threads:
        argv += ["--torch-threads", str(options.torch_threads)]
    if options.weight_sync != "reload":
        argv += ["--weight-sync", options.weight_sync, "--transfer-backend", "rollq_tcp"]
    if options.freeze_embeddings:
        argv += ["--freeze-embeddings"]
    if options.checkpoint_every is not None:
        argv += ["--checkpoint-every", str(options.checkpoint_every)]
    if options.train_layers is not None:
        argv += ["--train-layers", str(options.train_layers)]
    return argv + (["--flip-advantages"] if options.flip_advantages else [])


def _follow(options: DemoOptions, processes: Processes, trainer: subprocess.Popen[bytes],
            client: redis.Redis, metrics: Path, say: Callable[[str], None],
            evaluation: SumsEvaluation | None = None) -> None:
    shown, last_progress = 0, time.monotonic()
    first_reward: float | None = None
    while True:
        processes.check()
        steps = read_metrics(metrics)
        for row in steps[shown:]:
            first_reward = row["reward_mean"] if first_reward is None else first_reward
            traj_lag, scored_lag = _lag(client, options.run)
            tokens_per_s = row["tokens"] / max(row["seconds"], 1e-9)
            say(f"step {row['step']:>3}/{options.steps}  reward {row['reward_mean']:.3f} "
                f"(first {first_reward:.3f})  lag traj {traj_lag} scored {scored_lag}  "
                f"staleness {row['staleness']}  {tokens_per_s:,.0f} trained tok/s")
            last_progress = time.monotonic()
        shown = len(steps)
        # The first evaluation waits for the trainer's first publish (version 0: its
        # starting weights), since a reused server may still serve another run's.
        version = _policy_version(client, options.run) if evaluation is not None else None
        if evaluation is not None and version is not None and evaluation.due(version):
            evaluation.run(version)
            last_progress = time.monotonic()
        if trainer.poll() == 0:
            return
        if time.monotonic() - last_progress > options.step_timeout_s:
            raise RuntimeError(f"no trainer step for {options.step_timeout_s:.0f}s; "
                               f"see the logs in {processes.logs}")
        time.sleep(0.2)


def _policy_version(client: redis.Redis, run: str) -> int | None:
    value = client.hget(state_key(run), POLICY_VERSION_FIELD)
    return None if value is None else int(value)  # type: ignore[arg-type]


def _drops(client: redis.Redis, run: str) -> dict[str, int]:
    counters: dict[bytes, bytes] = client.hgetall(counters_key(run, 0))  # type: ignore[assignment]
    return {k.decode()[5:]: int(v) for k, v in counters.items() if k.startswith(b"drop:")}


def _write_summary(result: DemoResult, options: DemoOptions) -> None:
    summary: dict[str, Any] = {
        "steps": len(result.steps),
        "reward_first_5": result.reward_at(first=True) if result.steps else None,
        "reward_last_5": result.reward_at(first=False) if result.steps else None,
        "reward_first_step": result.steps[0]["reward_mean"] if result.steps else None,
        "reward_last_step": result.steps[-1]["reward_mean"] if result.steps else None,
        "wall_s": round(result.wall_s, 1),
        "drops": result.drops,
        "plot": str(result.plot) if result.plot else None,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
    }
    if options.task in LEARNING_TASKS:
        curves = learning_curves(result.steps, result.evals)
        summary = {"task": options.task,
                   **{k: v for k, v in curves.items() if not isinstance(v, dict)},
                   **summary, "warm_start": result.warm_start,
                   "curves": {"steps": curves.get("steps"), "evals": curves.get("evals")}}
    (result.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def print_summary(result: DemoResult, stream: TextIO = sys.stdout) -> None:
    if not result.steps:
        print("no training step completed", file=stream)
        return
    print(f"\nreward: first 5 steps {result.reward_at(True):.3f} -> last 5 steps "
          f"{result.reward_at(False):.3f} over {len(result.steps)} steps in "
          f"{result.wall_s:.0f}s", file=stream)
    if result.evals:
        first, last = result.evals[0], result.evals[-1]
        print(f"accuracy (greedy): training problems {first['train_accuracy']:.3f} -> "
              f"{last['train_accuracy']:.3f}, held-out {first['heldout_accuracy']:.3f} -> "
              f"{last['heldout_accuracy']:.3f} (step {first['step']} -> {last['step']})",
              file=stream)
    print(f"plot: {result.plot}\nsummary: {result.out / 'summary.json'}", file=stream)


def check_inference(url: str) -> None:
    try:
        httpx.get(f"{url}/health", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(f"--inference {url} does not answer /health: {exc}") from None
