"""TRL's AsyncGRPOTrainer training from rollq: the whole script a TRL user writes.

rollq's workers generate on the vLLM server, its scorers compute rewards and advantages;
TRL does the rest (its loss, optimizer, logging, checkpoints). Start the bus first (feeder,
workers, scorer: `rollq demo` does it, or see docs/guides/trl.md), then::

    python examples/trl_async_grpo.py --redis redis://127.0.0.1:6379/0 --run demo \\
        --model ./tiny-model --inference http://127.0.0.1:8000 --out ./trl-out

Each step's mean reward goes to ``--metrics`` (JSON lines) as well as TRL's log.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from rollq.consumers.trainer import TrainerClientSettings
from rollq.integrations.trl import RollqRolloutWorker, RollqWeightTransfer, use_cpu_kernels

warnings.filterwarnings("ignore", category=FutureWarning)  # TRL 1.16 on transformers 5
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "trl.experimental is experimental"
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer


class RewardLog(TrainerCallback):
    """Each logged step's mean reward (rollq's scorer's) into a JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "rollq/reward" in logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.time(),
                                    "reward_mean": logs["rollq/reward"]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--run", default="demo")
    parser.add_argument("--model", required=True, help="the model the vLLM server serves")
    parser.add_argument("--inference", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--transfer-backend", default="rollq_tcp", help="nccl on GPUs")
    parser.add_argument("--metrics", type=Path)
    parser.add_argument("--resume", help="a checkpoint folder of an earlier run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flip-advantages", action="store_true",
                        help="the control: train on the negated advantages")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # beside a CPU vLLM server on the same cores
        use_cpu_kernels()
    config = AsyncGRPOConfig(
        output_dir=str(args.out), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=args.group_size * args.batch_groups,
        num_generations=args.group_size, max_completion_length=args.max_tokens,
        learning_rate=args.lr, max_staleness=args.max_staleness, token_budget=0,
        vllm_server_base_url=args.inference, logging_steps=1, save_steps=10,
        report_to=[], use_cpu=not torch.cuda.is_available(), dtype="float32")
    worker = RollqRolloutWorker(
        args.redis, run=args.run, settings=TrainerClientSettings(
            weight_sync="transfer", transfer_backend=args.transfer_backend),
        sample_hook=flip if args.flip_advantages else None)
    trainer = AsyncGRPOTrainer(
        model=args.model, args=config,
        train_dataset=Dataset.from_dict({"prompt": ["rollq feeds the prompts"]}),
        rollout_worker=worker, weight_transfer=RollqWeightTransfer(worker),
        callbacks=[RewardLog(args.metrics)] if args.metrics else None)
    worker.attach(trainer)
    trainer.train(resume_from_checkpoint=args.resume)
    print(json.dumps({"groups": dict(worker.counts)}))


def flip(sample) -> None:  # type: ignore[no-untyped-def]
    sample.advantage = -sample.advantage


if __name__ == "__main__":
    main()
