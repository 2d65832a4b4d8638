"""TRL's ``AsyncGRPOTrainer`` trains from rollq: a rollout worker and a weight transfer.

TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` takes an outside rollout
source (``rollout_worker=``, its ``RolloutWorkerProtocol``) and an outside weight sync
(``weight_transfer=``, its ``WeightTransferProtocol``)::

    worker = RollqRolloutWorker("redis://127.0.0.1:6379/0", run="gsm8k")
    trainer = AsyncGRPOTrainer(model=path, args=config, train_dataset=placeholder,
                               rollout_worker=worker, weight_transfer=RollqWeightTransfer(worker))
    worker.attach(trainer)                 # limits, resume, acks: before train()
    trainer.train(resume_from_checkpoint=last_checkpoint)

What each side does:

- **Samples.** A reader thread takes scored groups one at a time through the SDK
  (``SyncTrainerClient.next_batch(groups=1)``) and puts one ``RolloutSample`` per sequence on
  ``rollout_buffer``: prompt + completion ids, rollq's loss mask as ``completion_mask``
  (tool and user tokens stay masked), the sampler's logprobs, the scorer's advantage, the
  group's policy version and a group number. It keeps about one optimizer step's samples ready.
- **Acks.** A group is acked only after the optimizer step that trained its last sequence:
  the callback ``attach`` installs records which groups each micro-batch holds (TRL's
  collator) and, at each step's end, credits the step's micro-batches. Nothing is acked
  before it is trained; a crash leaves the rest pending for the restart.
- **Staleness.** The SDK drops groups older than ``max_staleness`` at hand-out (TRL's own
  setting is copied into it); a sample that became stale while queued is taken out of
  ``rollout_buffer.get`` before TRL's filter would drop it unseen: its group is acked as
  ``drop:stale`` (or, if part of it was trained, acked as trained) and counted
  (``stale_dropped`` in ``counts`` and TRL's log as ``rollq/stale_dropped_groups``).
- **Bad input.** A group with a completion longer than TRL's ``max_completion_length``, or a
  sequence longer than its ``token_budget``, is dead-lettered as ``sequence_too_long``;
  token ids at or above the model's vocabulary are dead-lettered by the SDK
  (``decode_error``): TRL's step never sees them.
- **Weights and versions.** ``RollqWeightTransfer.send_weights`` publishes through
  ``publish_policy`` (``weight_sync="transfer"``: ``rollq_tcp`` on CPU servers, ``nccl`` or
  ``ipc`` on GPUs), as version TRL's ``model_version + 1``, the number TRL gives it right
  after; ``pause``/``resume`` do nothing, rollq's sync pauses the servers itself (only for
  the apply). On resume the trainer's ``model_version`` is set to rollq's, so the two stay
  one number.
- **Exactly once across a crash.** At each save, ``client.state()`` (and how many
  sequences of a group split across the step boundary were trained) is written beside
  TRL's checkpoint as ``rollq_state.json``; on ``train(resume_from_checkpoint=...)`` it is
  loaded before the worker starts, so groups trained after that checkpoint are replayed and
  none is trained twice into the resumed model.
- **Health.** ``check_health`` raises when the reader thread failed, or when no group came
  for ``stale_after_s``, with the reason rollq knows (``TrainerClient.stall_reason``).

torch and trl are imported here alone (the ``trl`` extra). TRL's trainer needs CUDA as
shipped; ``use_cpu_kernels()`` lets it run on a CPU (the tests, the CPU demo:
``consumers.trainer.integrations.trl_cpu``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

with warnings.catch_warnings():  # "importing from trl.experimental": that is the point
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from rollq.consumers.trainer import SyncBatch, SyncTrainerClient, TrainerClientSettings
from rollq.schemas import ContractError
from rollq.schemas.failures import SEQUENCE_TOO_LONG

STATE_FILE = "rollq_state.json"
"""The SDK's resume state in each TRL checkpoint folder."""


class SequenceTooLong(ContractError):
    """A scored group holds a sequence longer than the trainer takes: dead-letter it."""

    reason = SEQUENCE_TOO_LONG


@dataclass
class _Group:
    """A group handed out by the SDK and not yet settled."""

    batch: SyncBatch
    total: int
    """Sequences put on the buffer for it."""
    trained: int = 0
    """Sequences an optimizer step has consumed."""
    dropped: int = 0
    """Sequences taken out as stale before TRL saw them."""
    skipped: int = 0
    """Sequences trained before the checkpoint this run resumed from (not put again)."""


class _HandOutQueue(queue.Queue[RolloutSample]):
    """``rollout_buffer``: a ``queue.Queue`` whose ``get`` takes out what TRL would drop as
    stale (and settles it) instead of handing it to TRL's silent filter."""

    def __init__(self, worker: RollqRolloutWorker) -> None:
        super().__init__()
        self._worker = worker

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            sample = super().get(block, left)
            if not self._worker._stale(sample):
                return sample


class RollqRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` on rollq's trainer SDK (module docstring).

    ``redis``: the run's Redis URL; ``run``: the run; ``consumer``: this trainer's name in
    the consumer group (keep it across restarts); ``settings``: the SDK's settings, of
    which ``max_staleness``, ``vocab_size``, ``inference_urls`` and ``pad_token_id`` are
    taken from the trainer by ``attach`` (defaults: ``transfer`` weight sync on
    ``rollq_tcp``, the CPU backend; set ``transfer_backend="nccl"`` on GPUs);
    ``sample_hook``: called on each sample before it is queued (to log or adjust it: the
    learning test's control negates the advantage). ``queued_samples``: how many sequences
    to keep ready on ``rollout_buffer`` (default: one optimizer step's, set by ``attach``);
    the reader takes the next group only below it.
    """

    def __init__(self, redis: str, *, run: str, consumer: str = "trl",
                 settings: TrainerClientSettings | None = None,
                 queued_samples: int | None = None, poll_s: float = 1.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sample_hook: Callable[[RolloutSample], None] | None = None) -> None:
        self.redis_url = redis
        self.run = run
        self.consumer = consumer
        self.settings = settings or TrainerClientSettings(weight_sync="transfer",
                                                          transfer_backend="rollq_tcp")
        if self.settings.weight_sync not in ("transfer", "external"):
            raise ValueError("RollqRolloutWorker publishes TRL's weights with weight_sync "
                             f"'transfer' or 'external', got {self.settings.weight_sync!r}")
        self.transport = transport
        self.sample_hook = sample_hook
        self.queued_samples = queued_samples
        self.poll_s = poll_s
        self.rollout_buffer: queue.Queue[RolloutSample] = _HandOutQueue(self)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue(maxsize=4096)
        self.counts: Counter[str] = Counter()
        """Groups by outcome: ``trained``, ``stale_dropped``, ``sequence_too_long``."""
        self.model_version = 0
        self.max_completion_length: int | None = None
        self.token_budget = 0
        self.max_staleness: int | None = None
        self.client: SyncTrainerClient | None = None
        self._groups: dict[int, _Group] = {}
        self._resumed_skips: dict[str, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._last_group = time.monotonic()
        self._microbatches: deque[Counter[int]] = deque()

    # -- set-up ------------------------------------------------------------------------------

    def attach(self, trainer: Any) -> None:
        """Take the limits from ``trainer`` (an ``AsyncGRPOTrainer`` built with this worker),
        open the SDK client and install the callback that acks, saves and resumes. Call
        once, before ``trainer.train()``. On data-parallel ranks other than the main one it
        does nothing: TRL reads rollouts, syncs weights and checkpoints this state on rank 0."""
        if not trainer.accelerator.is_main_process:
            return
        args = trainer.args
        self.max_completion_length = args.max_completion_length
        self.token_budget = max(args.token_budget or 0, 0)
        self.max_staleness = args.max_staleness
        if self.queued_samples is None:
            self.queued_samples = (args.per_device_train_batch_size
                                   * args.gradient_accumulation_steps
                                   * trainer.accelerator.num_processes)
        embeddings = trainer.model.get_input_embeddings()
        self.settings = replace(
            self.settings, max_staleness=args.max_staleness,
            vocab_size=int(embeddings.num_embeddings),
            pad_token_id=int(trainer.processing_class.pad_token_id or 0),
            inference_urls=self.settings.inference_urls or (args.vllm_server_base_url,))
        self.client = SyncTrainerClient(self.redis_url, run=self.run, consumer=self.consumer,
                                        settings=self.settings,
                                        transport=self.transport).open()
        # first in line: the resume must run before TRL's own train-begin callback syncs
        # the weights and starts this worker
        trainer.callback_handler.callbacks.insert(0, RollqCallback(self, trainer))

    def _client(self) -> SyncTrainerClient:
        if self.client is None:
            raise RuntimeError("RollqRolloutWorker.attach(trainer) was not called")
        return self.client

    # -- RolloutWorkerProtocol ---------------------------------------------------------------

    def start(self) -> None:
        self._client()
        self._last_group = time.monotonic()
        self._thread = threading.Thread(target=self._read, name="rollq-trl-reader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop reading and close the client; groups not yet acked stay pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._failure is not None:
            raise RuntimeError("rollq's reader thread failed") from self._failure
        waited = time.monotonic() - self._last_group
        if waited > stale_after_s:
            reason = self._client().stall_reason()
            raise RuntimeError(f"no scored group from rollq for {waited:.0f} s: {reason}")

    # -- the reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        client = self._client()
        try:
            while not self._stop.is_set():
                if self.rollout_buffer.qsize() >= (self.queued_samples or 1):
                    self._stop.wait(0.02)
                    continue
                batch = client.next_batch(groups=1, timeout_s=self.poll_s)
                if not len(batch):
                    continue
                self._last_group = time.monotonic()
                self._put(client, batch)
        except BaseException as exc:
            self._failure = exc

    def _put(self, client: SyncTrainerClient, batch: SyncBatch) -> None:
        try:
            samples = self._samples(batch)
        except SequenceTooLong as exc:
            client.dead_letter(batch, exc)
            self._count("sequence_too_long")
            return
        with self._lock:
            number = self._next_id
            self._next_id += 1
            skip = self._resumed_skips.pop(batch.group_ids[0], 0)
            self._groups[number] = _Group(batch, total=len(samples) - skip, skipped=skip)
        if skip >= len(samples):  # all trained before the checkpoint, then a crash
            self._settle(number)
            return
        for sample in samples[skip:]:
            sample.group_id = number
            if self.sample_hook is not None:
                self.sample_hook(sample)
            self.rollout_buffer.put(sample)

    def _samples(self, batch: SyncBatch) -> list[RolloutSample]:
        """One ``RolloutSample`` per sequence of the batch's one group; raises SequenceTooLong."""
        (group,) = batch.groups
        prompt = list(group.trajectory.prompt_messages or [
            {"role": "user", "content": group.trajectory.prompt_text}])
        prompt_length = len(group.trajectory.prompt_ids)
        samples = []
        for i, (completion, score) in enumerate(
                zip(group.trajectory.completions, group.scores, strict=True)):
            length = int(batch.lengths[i])
            if self.max_completion_length and length - prompt_length > self.max_completion_length:
                raise SequenceTooLong(
                    f"sequence {i} of group {group.group_id}: {length - prompt_length} "
                    f"completion tokens > TRL's max_completion_length "
                    f"{self.max_completion_length}")
            if self.token_budget and length > self.token_budget:
                raise SequenceTooLong(f"sequence {i} of group {group.group_id}: {length} tokens "
                                      f"> TRL's token_budget {self.token_budget}")
            samples.append(RolloutSample(
                prompt=prompt,
                completion=list(completion.messages or [
                    {"role": "assistant", "content": completion.text}]),
                input_ids=np.asarray(batch.input_ids[i, :length], dtype=np.int64),
                completion_mask=np.asarray(batch.loss_mask[i, :length] > 0, dtype=np.int64),
                old_log_probs=np.asarray(batch.sampler_logprobs[i, :length], dtype=np.float32),
                advantage=float(score.advantage),
                model_version=group.policy_version,
                group_id=-1,
                metrics={"rollq/reward": float(score.reward)},
                enqueued_at=time.time(),
            ))
        return samples

    # -- settling (the trainer's thread) -----------------------------------------------------

    def _stale(self, sample: RolloutSample) -> bool:
        """TRL's rule (``version - sample version > max_staleness``): true, and the sample
        counted out of its group, when TRL would drop it."""
        if self.max_staleness is None:
            return False
        if self.model_version - sample.model_version <= self.max_staleness:
            return False
        with self._lock:
            self._groups[sample.group_id].dropped += 1
        self._settle(sample.group_id)
        return True

    def microbatch(self, group_ids: Counter[int]) -> None:
        """TRL's collator laid out a micro-batch holding these sequences (by group)."""
        self._microbatches.append(group_ids)

    def stepped(self, microbatches: int) -> None:
        """An optimizer step consumed the first ``microbatches`` micro-batches laid out."""
        for _ in range(min(microbatches, len(self._microbatches))):
            for number, sequences in self._microbatches.popleft().items():
                with self._lock:
                    self._groups[number].trained += sequences
                self._settle(number)

    def _settle(self, number: int) -> None:
        """Ack a group once every sequence of it is trained or dropped."""
        with self._lock:
            group = self._groups[number]
            if group.trained + group.dropped < group.total:
                return
            del self._groups[number]
        client = self._client()
        if group.trained or group.skipped:  # trained, wholly or in part
            group.batch.ack()
            self._count("trained")
        else:
            client.drop(group.batch, "stale")
            self._count("stale_dropped")

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if outcome != "trained":
            key = f"rollq/{outcome}_groups"
            try:
                self.metrics_queue.put_nowait({key: 1.0})
            except queue.Full:
                pass

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Write the SDK's state (after this step's acks) and the split groups' progress."""
        with self._lock:
            partial = {g.batch.group_ids[0]: g.trained + g.skipped
                       for g in self._groups.values() if g.trained}
        state = {"client": self._client().state(), "partial": partial}
        path = os.path.join(folder, STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def resume(self, folder: str) -> int:
        """Load the state saved in ``folder``; returns rollq's policy version in force."""
        with open(os.path.join(folder, STATE_FILE)) as f:
            state = json.load(f)
        client = self._client()
        client.load_state(state["client"])
        self._resumed_skips = {str(k): int(v) for k, v in state["partial"].items()}
        return client.current_version()


class RollqCallback(TrainerCallback):
    """Installed by ``RollqRolloutWorker.attach``: resume on train begin, credit micro-batches
    and ack at each step's end, save the SDK's state with each checkpoint."""

    def __init__(self, worker: RollqRolloutWorker, trainer: Any) -> None:
        self.worker = worker
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        worker = self.worker
        if state.global_step > 0:  # resumed: TRL loaded checkpoint-<step>
            folder = os.path.join(args.output_dir or "", f"checkpoint-{state.global_step}")
            if not os.path.isfile(os.path.join(folder, STATE_FILE)):
                raise FileNotFoundError(f"{folder} holds no {STATE_FILE}: resuming it would "
                                        "train groups again or skip them")
            version = worker.resume(folder)
        else:
            version = worker._client().current_version()
        self.trainer.model_version = version
        worker.update_model_version(version)
        loader = kwargs["train_dataloader"]
        base = getattr(loader, "base_dataloader", loader)
        collate = base.collate_fn

        def recorded(examples: list[Any]) -> Any:
            (rows,) = examples
            worker.microbatch(Counter(s["group_id"] for row in rows for s in row.samples))
            return collate(examples)

        base.collate_fn = recorded

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self.worker.stepped(args.gradient_accumulation_steps)

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir or "", f"checkpoint-{state.global_step}")
        self.worker.save(folder)


class RollqWeightTransfer:
    """TRL's ``WeightTransferProtocol`` through rollq's weight sync: ``send_weights``
    publishes the ``(name, tensor)`` stream as the next policy version (module docstring).

    With ``weight_sync="external"`` in the worker's settings, ``move`` gets the stream while
    every server is paused and moves the weights itself."""

    def __init__(self, worker: RollqRolloutWorker,
                 move: Callable[[Iterator[tuple[str, torch.Tensor]]], None] | None = None
                 ) -> None:
        self.worker = worker
        self.move = move

    def init_weight_transfer(self) -> None:
        """Nothing: rollq's transfer sets its engine up on the first sync."""

    def pause(self) -> None:
        """Nothing: rollq's sync pauses the servers itself, for the apply only."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        client = self.worker._client()
        weights: Any = iterator
        if client.client.settings.weight_sync == "external":
            move = self.move
            weights = None if move is None else (lambda: move(iterator))
        client.publish_policy(self.worker.model_version + 1, weights)

    def resume(self) -> None:
        """Nothing: every server resumes inside ``publish_policy``."""

    def destroy(self) -> None:
        """Nothing: the worker's ``stop`` closes the client."""
