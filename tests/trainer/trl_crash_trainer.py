"""A TRL AsyncGRPOTrainer on rollq that a test kills: it logs, at each optimizer step, how
many sequences of which rollq group the step trained (``--log``, one JSON line a step).

    python -m tests.trainer.trl_crash_trainer REDIS_URL MODEL OUT --log LOG --steps N
        [--save-steps K] [--resume CHECKPOINT]
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import Counter

from rollq.consumers.trainer import TrainerClientSettings
from rollq.integrations.trl import RollqRolloutWorker, RollqWeightTransfer, use_cpu_kernels
from tests.trainer.helpers import RUN, FakeVllm


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("redis", "model", "out"):
        parser.add_argument(name)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--resume", default=None)
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    torch.set_num_threads(1)
    use_cpu_kernels()
    worker = RollqRolloutWorker(options.redis, run=RUN, consumer="trl", poll_s=0.2,
                                transport=FakeVllm().transport(),
                                settings=TrainerClientSettings(weight_sync="external",
                                                               block_ms=50))
    args = AsyncGRPOConfig(
        output_dir=options.out, max_steps=options.steps, per_device_train_batch_size=4,
        num_generations=6, max_completion_length=16, token_budget=0, learning_rate=1e-3,
        max_staleness=1000, logging_steps=1, save_strategy="steps",
        save_steps=options.save_steps, report_to=[], use_cpu=True, dtype="float32",
        vllm_server_base_url="http://vllm.test:8000")
    trainer = AsyncGRPOTrainer(
        model=options.model, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}),
        rollout_worker=worker, weight_transfer=RollqWeightTransfer(worker))
    worker.attach(trainer)
    stepped = worker.stepped

    def logged(microbatches: int) -> None:
        trained: Counter[str] = Counter()
        for held in list(worker._microbatches)[:microbatches]:
            for number, sequences in held.items():
                trained[worker._groups[number].batch.group_ids[0]] += sequences
        stepped(microbatches)
        with open(options.log, "a") as f:
            f.write(json.dumps({"step": trainer.state.global_step, "trained": trained}) + "\n")

    worker.stepped = logged  # type: ignore[method-assign]
    trainer.train(resume_from_checkpoint=options.resume)


if __name__ == "__main__":
    main()
