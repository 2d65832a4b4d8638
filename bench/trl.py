"""TRL's AsyncGRPOTrainer fed by rollq against TRL's own rollout worker: steps/s.

Both train the tiny model on the demo task (gsm8k sample prompts, reward: the fraction of
digit characters in the completion, 8 groups of 8 completions of 24 tokens a step) against
one CPU vLLM server started here, with TRL's own loss and optimizer and the same weight
sync after every step (rollq's ``rollq_tcp`` transfer, ``publish_policy``):

- **rollq**: ``examples/trl_async_grpo.py`` with ``RollqRolloutWorker``, fed by rollq's
  feeder, an arq worker pool and a scorer (``ops.local.demo.start_roles``) on a Redis
  started here;
- **trl**: the same trainer with TRL's ``AsyncRolloutWorker`` (its spawned child generating
  on the server and scoring with a reward function computing the same reward).

Steps/s is over the steps after the first two (start-up and the first sync excluded),
median of ``--repeats`` runs each; each rollq run also prints its reward (the mean of the
first 5 steps and of the last 5: the learning test's figures, with ``--steps 30``), and
``--control`` adds one rollq run with the advantages negated (its reward must not rise).
Run from the repository root, under the heavy-work lock::

    python -m bench.trl [--vllm-python .venv-vllm/bin/python]

and it prints ``trl: steps/s rollq R, trl's own worker T, ratio R/T``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench.common import BenchRedis, median_of

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "trl.experimental is experimental"
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "trl_async_grpo.py"
DIGIT = re.compile(r"[0-9]")


def digit_fraction(completions: list[Any], **kwargs: Any) -> list[float]:
    """rollq's demo reward (``char_fraction`` of ``[0-9]``) as a TRL reward function."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(DIGIT.findall(t)) / len(t) if t else 0.0 for t in texts]


class UnseededLoop(_AsyncRolloutLoop):  # type: ignore[misc]
    """TRL's rollout loop without its per-request ``seed``: vLLM CPU 0.32's engine dies on a
    seeded request ("CPU Generator does not use offset"); the seed only decorrelates
    data-parallel engines, of which there is one here."""

    async def _post(self, path: str, payload: dict[str, Any], timeout: float,  # noqa: ASYNC109 (TRL's signature)
                    max_retries: int = 3) -> dict[str, Any]:
        payload = {k: v for k, v in payload.items() if k != "seed"}
        return await super()._post(path, payload, timeout, max_retries)  # type: ignore[no-any-return]


def own_worker(redis_url: str, run: str, model: str, inference: str, out: str, steps: int,
               times: str) -> None:
    """The trainer with TRL's own AsyncRolloutWorker (a child process of the bench)."""
    warnings.simplefilter("ignore")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_rollout_worker

    from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings
    from rollq.integrations.trl import use_cpu_kernels
    from rollq.producers.envs.registry import make_env

    torch.set_num_threads(1)
    use_cpu_kernels()
    # TRL's worker generates over HTTP; it checks only that vllm imports (it lives in the
    # server's environment here)
    setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)  # noqa: B010
    async_rollout_worker.AsyncRolloutWorker._loop_cls = UnseededLoop
    env: Any = make_env("gsm8k")
    prompts = [env.style.render(r, env.format.question_field) for r in env.records]
    client = SyncTrainerClient(redis_url, run=run, consumer="trl", settings=TrainerClientSettings(
        weight_sync="transfer", transfer_backend="rollq_tcp", inference_urls=(inference,))).open()

    class Publish:  # the same weight sync as rollq's path
        version = 0

        def init_weight_transfer(self) -> None: ...
        def pause(self) -> None: ...
        def resume(self) -> None: ...
        def destroy(self) -> None: ...

        def send_weights(self, iterator: Any) -> None:
            self.version += 1
            client.publish_policy(self.version, iterator)

    class Times(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            with open(times, "a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.time()}) + "\n")

    config = AsyncGRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=24, learning_rate=2e-3, max_staleness=1, token_budget=0,
        vllm_server_base_url=inference, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, dtype="float32", temperature=1.0)
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    # TRL's worker parses replies by a response template it knows per chat template; the
    # tiny model's ChatML is not on its list, and Qwen3's parses plain ChatML replies
    tokenizer.response_template = qwen3_template
    trainer = AsyncGRPOTrainer(model=model, args=config, reward_funcs=digit_fraction,
                               train_dataset=Dataset.from_dict({"prompt": prompts}),
                               processing_class=tokenizer,
                               weight_transfer=Publish(), callbacks=[Times()])
    trainer.train()
    client.close()


def steps_per_s(rows: list[dict[str, Any]]) -> float:
    timed = [r for r in rows if r["step"] > 2]
    return (len(timed) - 1) / (timed[-1]["time"] - timed[0]["time"])


def first5(rows: list[dict[str, Any]]) -> float:
    return sum(float(r["reward_mean"]) for r in rows[:5]) / len(rows[:5])


def last5(rows: list[dict[str, Any]]) -> float:
    return sum(float(r["reward_mean"]) for r in rows[-5:]) / len(rows[-5:])


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run_rollq(tmp: Path, name: str, redis_url: str, vllm: Any, model: Path, steps: int,
              *extra: str) -> list[dict[str, Any]]:
    from rollq.ops.local.demo import DemoOptions, start_roles
    from rollq.ops.local.process_groups import Processes

    logs = tmp / name / "logs"
    logs.mkdir(parents=True)
    metrics = tmp / name / "metrics.jsonl"
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_url, "ROLLQ_RUN": name,
           "ROLLQ_LOG_FORMAT": "json", "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    processes = Processes(logs)
    try:
        start_roles(processes, DemoOptions(out=tmp / name, run=name, redis_url=redis_url,
                                           inference=vllm.url, model=model), vllm.url, env)
        trainer = processes.start("trainer", [
            sys.executable, str(EXAMPLE), "--redis", redis_url, "--run", name, "--model",
            str(model), "--inference", vllm.url, "--out", str(tmp / name / "trl"), "--steps",
            str(steps), "--metrics", str(metrics), *extra], env)
        while trainer.poll() is None:
            processes.check()
            time.sleep(0.5)
        if trainer.returncode:
            raise RuntimeError((logs / "trainer.log").read_text()[-3000:])
    finally:
        processes.stop()
    return rows_of(metrics)


def run_own(tmp: Path, name: str, redis_url: str, vllm: Any, model: Path,
            steps: int) -> list[dict[str, Any]]:
    import subprocess

    times = tmp / name / "times.jsonl"
    times.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    with open(tmp / name / "trainer.log", "w") as log:
        subprocess.run([sys.executable, "-m", "bench.trl", "--own-worker", redis_url, name,
                        str(model), vllm.url, str(tmp / name / "trl"), str(steps), str(times)],
                       cwd=ROOT, env=env, stdout=log, stderr=log, check=True)
    return rows_of(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--control", action="store_true")
    parser.add_argument("--own-worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.own_worker:
        *head, steps, times = args.own_worker
        own_worker(*head, int(steps), times)
        return
    from rollq.ops.local.stack import VllmProcess
    from rollq.ops.local.tiny_model import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rollq-bench-trl-"))
    model = write_tiny_model(tmp / "tiny-model", seed=0)
    cache = Path(args.vllm_python).resolve().parent.parent / "inductor-cache"
    vllm = VllmProcess(args.vllm_python, model, tmp / "vllm.log", served_name=str(model),
                       max_model_len=1024, compile_cache=cache,
                       weight_transfer="rollq_tcp").start()
    rollq, own = [], []
    try:
        with BenchRedis() as redis:
            for i in range(args.repeats):  # interleaved: drift in the machine's load hits both
                rows = run_rollq(tmp, f"rollq{i}", redis.url, vllm, model, args.steps)
                rollq.append(steps_per_s(rows))
                own.append(steps_per_s(run_own(tmp, f"own{i}", redis.url, vllm, model,
                                               args.steps)))
                print(f"run {i}: rollq {rollq[-1]:.3f} steps/s (reward, mean of the first 5 "
                      f"steps -> the last 5: {first5(rows):.3f} -> {last5(rows):.3f}), trl's own "
                      f"{own[-1]:.3f}", flush=True)
            if args.control:
                rows = run_rollq(tmp, "control", redis.url, vllm, model, args.steps,
                                 "--flip-advantages")
                print(f"control (flipped advantages, {args.steps} steps): reward "
                      f"{first5(rows):.3f} -> {last5(rows):.3f}", flush=True)
    finally:
        vllm.stop()
    r, t = median_of(rollq), median_of(own)
    print(f"trl: steps/s rollq {r:.3f}, trl's own worker {t:.3f}, ratio {r / t:.2f}")


if __name__ == "__main__":
    main()
