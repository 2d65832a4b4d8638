"""GPU trainer: does the trainer SDK slow a real training step down?

A random Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings: 0.49B parameters; built from its config, nothing is
downloaded) trains in bf16 on one GPU: forward, the PPO-clip loss of
``examples/grpo_trainer.py`` (``token_logprobs`` + ``grpo_loss``) on the batch's causal
targets, backward, AdamW (fused on CUDA). A batch is ``--groups`` GRPO groups of 16
completions x 2048 tokens (+256 prompt tokens), split into micro-batches of at most
``--micro-tokens`` tokens whose gradients accumulate.

On a redis-server this benchmark starts itself (loopback, persistence off), the scored
stream is filled with every group a run trains on before the clock starts
(``bench.rollouts``: as ``bench.trainer`` makes them), then a ``SyncTrainerClient`` feeds
the steps: ``next_batch(groups=G)`` -> step -> ``ack``. The baseline trains on the SAME
batches from memory: the padded arrays of the same entries (decoded and laid out as the
SDK does), built into a list before the clock starts. It runs first (it also warms the
GPU up) and again last (drift between the two shows how steady the machine was). If
``TrainerClientSettings`` has a ``prefetch`` field, the SDK runs with it off and on.

Reported per variant, medians over the steps after ``--warmup``: step seconds (batch in
hand to optimizer step done, GPU synchronised, ack included), tokens/s (prompt +
completion tokens of the batch over the step), and for the SDK its wait per step
(``next_batch`` + ``ack``, the time the training loop is blocked in the SDK) p50/p99 and
its share of the step. All sequences of a batch have the same length here, so the padded
layout carries no padding (``batch.pack()`` would need flash-attention's varlen kernels
to pay off, which a stock torch + transformers does not have).

A first step that runs out of GPU memory halves the micro-batch and retries (down to one
sequence, then with gradient checkpointing). If the first run's steps show the whole
benchmark would overrun ``--budget-s``, fewer steps are measured (noted in the output).

``--tiny`` runs the same flow with a tiny model and short sequences (CPU is fine): a
check of the wiring, not a measurement. ``$OUT/gpu_trainer.json`` gets every number when
the environment variable OUT is set.

Run from the repository root:  python -m bench.gpu_trainer  [--groups 2 --steps 15 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from bench.common import BenchRedis, print_table
from bench.rollouts import RUN, grpo_scored, make_groups
from examples.grpo_trainer import grpo_loss, token_logprobs
from rollq.consumers.trainer import (
    PaddedArrays,
    SyncTrainerClient,
    TrainerClientSettings,
    pad_groups,
)
from rollq.ops.logging import configure_logging
from rollq.schemas import Fields, encode
from rollq.schemas.decoding import decode_scored_columns
from rollq.schemas.heap import freeze_heap
from rollq.schemas.keys import stream_key

SCORED = stream_key(RUN, 0, "scored")

QWEN2_05B = {
    "vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}
TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Shape:
    group_size: int
    seq_len: int
    prompt_len: int

    @property
    def label(self) -> str:
        return f"{self.group_size}x{self.seq_len}"


@dataclass
class StepTimes:
    """One variant's steps: seconds each, and the SDK's part of them."""

    name: str
    step_s: list[float] = field(default_factory=list)
    """Batch requested (SDK) or taken from the list (memory) to ack returned."""
    next_batch_s: list[float] = field(default_factory=list)
    ack_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def measured(self, warmup: int) -> StepTimes:
        """The steps after the first ``warmup``."""
        return StepTimes(self.name, self.step_s[warmup:], self.next_batch_s[warmup:],
                         self.ack_s[warmup:], self.tokens[warmup:], self.losses[warmup:])

    def wait_s(self) -> list[float]:
        return [a + b for a, b in zip(self.next_batch_s, self.ack_s, strict=True)]

    def tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.step_s, strict=True)]


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


# ---------------------------------------------------------------------------------- model


def build_model(tiny: bool, device: torch.device) -> Any:
    """A randomly initialised Qwen2 causal LM in bf16 on ``device``, in training mode."""
    config = Qwen2Config(**(TINY if tiny else QWEN2_05B), use_cache=False)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    return model.train()


class Trainer:
    """One GRPO training step over a padded batch, in micro-batches of whole sequences."""

    def __init__(self, model: Any, device: torch.device, micro_tokens: int, clip: float,
                 lr: float) -> None:
        self.model = model
        self.device = device
        self.micro_tokens = micro_tokens
        self.micro_sequences = 0
        """Sequences per micro-batch (set from the first batch's length)."""
        self.checkpointing = False
        self.clip = clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr,
                                           fused=device.type == "cuda")

    def step(self, arrays: PaddedArrays) -> float:
        """Forward + backward over every micro-batch, then the optimizer step; returns
        the loss once the GPU has finished (a synchronisation, as logging a loss is)."""
        width = int(arrays.input_ids.shape[1])
        if not self.micro_sequences:
            self.micro_sequences = max(1, self.micro_tokens // max(1, width))
        targets = arrays.targets()
        tensors = {name: torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
                   for name, value in (
                       ("input_ids", arrays.input_ids), ("attention_mask", arrays.attention_mask),
                       ("labels", targets.labels), ("mask", targets.loss_mask),
                       ("advantages", targets.advantages),
                       ("sampler_logprobs", targets.sampler_logprobs))}
        trainable = tensors["mask"].sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for start in range(0, int(arrays.input_ids.shape[0]), self.micro_sequences):
            part = {name: t[start:start + self.micro_sequences] for name, t in tensors.items()}
            logprobs = token_logprobs(self.model, part["input_ids"], part["attention_mask"],
                                      part["labels"])
            loss, _ = grpo_loss(logprobs, part["sampler_logprobs"], part["advantages"],
                                part["mask"], self.clip)
            # grpo_loss averages over the micro-batch's tokens: weight it by their share
            # of the batch's, so the accumulated gradient is that of the whole batch
            weighted = loss * (part["mask"].sum() / trainable)
            weighted.backward()
            total += weighted.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(total)

    def fit(self, arrays: PaddedArrays) -> float:
        """``step``, halving the micro-batch on out-of-memory (then gradient
        checkpointing) until it fits; for the first step."""
        while True:
            try:
                return self.step(arrays)
            except torch.OutOfMemoryError:
                self.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                if self.micro_sequences > 1:
                    self.micro_sequences //= 2
                elif not self.checkpointing:
                    self.model.gradient_checkpointing_enable(
                        gradient_checkpointing_kwargs={"use_reentrant": False})
                    self.checkpointing = True
                else:
                    raise
                print(f"  out of GPU memory: {self.micro_sequences} sequences per "
                      f"micro-batch, gradient checkpointing {self.checkpointing}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- data


def make_payloads(count: int, shape: Shape, vocab: int) -> list[Fields]:
    """``count`` encoded scored groups of ``shape`` with token ids below ``vocab``."""
    rng = np.random.default_rng(1)
    groups = make_groups(count, shape.group_size, shape.seq_len, shape.prompt_len,
                         short_text=False, vocab=min(vocab, 150_000))
    return [encode(grpo_scored(g, rng)) for g in groups]


def memory_batches(payloads: list[Fields], groups: int, pad_token_id: int) -> list[PaddedArrays]:
    """The batches the SDK hands out for ``payloads`` (decoded to columns, padded), built
    now: the baseline's input."""
    columns = [decode_scored_columns(p) for p in payloads]
    return [pad_groups(columns[i:i + groups], pad_token_id)
            for i in range(0, len(columns), groups)]


def fill(url: str, payloads: list[Fields]) -> None:
    """Empty Redis, then XADD ``payloads`` to the scored stream with fresh group ids (the
    trainer drops a group id it has trained before)."""
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
        for start in range(0, len(payloads), 8):
            pipe = client.pipeline(transaction=False)
            for fields in payloads[start:start + 8]:
                pipe.xadd(SCORED, {**fields,  # type: ignore[dict-item]
                                   b"group_id": uuid.uuid4().hex.encode()})
            pipe.execute()
    finally:
        client.close()


# ---------------------------------------------------------------------------------- runs


def run_steps(name: str, steps: int, device: torch.device, trainer: Trainer,
              take: Callable[[], tuple[PaddedArrays, Callable[[], Any]]],
              first_fits: bool) -> StepTimes:
    """``steps`` x (take a batch, train on it, ack it), each timed."""
    times = StepTimes(name)
    for i in range(steps):
        synchronize(device)
        started = time.perf_counter()
        arrays, ack = take()
        taken = time.perf_counter()
        loss = trainer.fit(arrays) if i == 0 and first_fits else trainer.step(arrays)
        trained = time.perf_counter()
        ack()
        done = time.perf_counter()
        times.step_s.append(done - started)
        times.next_batch_s.append(taken - started)
        times.ack_s.append(done - trained)
        times.tokens.append(int(arrays.lengths.sum()))
        times.losses.append(loss)
    return times


def run_memory(name: str, batches: Sequence[PaddedArrays], device: torch.device,
               trainer: Trainer, first_fits: bool = False) -> StepTimes:
    queue: Iterator[PaddedArrays] = iter(batches)
    return run_steps(name, len(batches), device, trainer,
                     lambda: (next(queue), lambda: None), first_fits)


def run_sdk(name: str, url: str, payloads: list[Fields], groups: int, device: torch.device,
            trainer: Trainer, settings: TrainerClientSettings) -> StepTimes:
    fill(url, payloads)
    gc.collect()

    with SyncTrainerClient(url, run=RUN, consumer="gpu-trainer", settings=settings) as tc:
        def take() -> tuple[PaddedArrays, Callable[[], Any]]:
            batch = tc.next_batch(groups=groups, timeout_s=60.0)
            if len(batch) != groups:
                raise RuntimeError(f"next_batch gave {len(batch)} groups, wanted {groups}")
            return batch, batch.ack

        return run_steps(name, len(payloads) // groups, device, trainer, take, False)


def sdk_variants(base: dict[str, Any]) -> list[tuple[str, TrainerClientSettings]]:
    """The SDK's settings to run: as they are, or prefetch off and on when the SDK has a
    ``prefetch`` setting (a bool, or a count of batches: on is its default, or 1)."""
    found = {f.name: f for f in dataclasses.fields(TrainerClientSettings)}
    if "prefetch" not in found:
        return [("sdk", TrainerClientSettings(**base))]
    default = found["prefetch"].default
    if isinstance(default, bool) or default is dataclasses.MISSING:
        on: Any = True
        off: Any = False
    else:
        on, off = (default or 1), 0
    return [(f"sdk prefetch={off}", TrainerClientSettings(**base, prefetch=off)),
            (f"sdk prefetch={on}", TrainerClientSettings(**base, prefetch=on))]


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_trainer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2,
                        help="groups per batch (default 2: 32 sequences, 73,728 tokens)")
    parser.add_argument("--steps", type=int, default=15,
                        help="measured steps per variant (default 15)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps before them, not counted (default 3)")
    parser.add_argument("--micro-tokens", type=int,
                        help="most tokens per micro-batch (default 9216: 4 sequences; "
                             "--tiny: 160, 4 sequences)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--redis-server", metavar="PATH",
                        help="redis-server executable (default: the one on PATH)")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="seconds the training runs may take; fewer steps if the first "
                             "run says they would take longer (default 180)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny model, 16 x 32 tokens: checks the flow (CPU is fine)")
    return parser.parse_args(argv)


def summary(times: StepTimes) -> dict[str, float]:
    step = pct(times.step_s, 50)
    wait = times.wait_s()
    return {
        "steps": len(times.step_s),
        "step_s_p50": step,
        "tokens_per_s": pct(times.tokens_per_s(), 50),
        "wait_ms_p50": pct(wait, 50) * 1e3,
        "wait_ms_p99": pct(wait, 99) * 1e3,
        "next_batch_ms_p50": pct(times.next_batch_s, 50) * 1e3,
        "next_batch_ms_p99": pct(times.next_batch_s, 99) * 1e3,
        "ack_ms_p50": pct(times.ack_s, 50) * 1e3,
        "ack_ms_p99": pct(times.ack_s, 99) * 1e3,
        "wait_share_of_step": pct(wait, 50) / step if step else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("json", "warning")  # as a deployed trainer, minus info lines
    began = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # --tiny on shared cores: spinning OpenMP threads stall
    shape = Shape(16, 32, 8) if args.tiny else Shape(16, 2048, 256)
    model = build_model(args.tiny, device)
    params = sum(p.numel() for p in model.parameters())
    vocab = int(model.config.vocab_size)
    micro_tokens = args.micro_tokens or (4 * (shape.seq_len + shape.prompt_len))
    trainer = Trainer(model, device, micro_tokens, args.clip, args.lr)
    per_run = args.groups * (args.warmup + args.steps)
    payloads = make_payloads(per_run, shape, vocab)
    batches = memory_batches(payloads, args.groups, pad_token_id=0)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_trainer: {gpu}; torch {torch.__version__}; model {params / 1e9:.2f}B params; "
          f"{args.groups} groups of {shape.label} (+{shape.prompt_len} prompt) a step, "
          f"{int(batches[0].lengths.sum()):,} tokens; {args.warmup} + {args.steps} steps a "
          f"variant; python {sys.version.split()[0]}; {os.cpu_count()} CPUs; set-up "
          f"{time.monotonic() - began:.1f} s", flush=True)
    base = {"batch_groups": args.groups, "max_staleness": None, "vocab_size": vocab,
            "block_ms": 100}
    variants = sdk_variants(base)
    runs: dict[str, list[StepTimes]] = {}
    with BenchRedis(args.redis_server) as server:
        print(f"redis-server {server.version()} on 127.0.0.1:{server.port}", flush=True)
        freeze_heap()  # set-up done: the model and payloads stay out of the GC's walks
        started = time.monotonic()
        first = run_memory("memory", batches, device, trainer, first_fits=True)
        runs.setdefault("memory", []).append(first)
        per_step = pct(first.step_s[args.warmup:] or first.step_s, 50)
        left = args.budget_s - (time.monotonic() - started)
        # the SDK variants and the second memory run, each warm-up + steps
        affordable = int(left / (per_step * 1.15 * (len(variants) + 1))) - args.warmup
        steps = min(args.steps, max(3, affordable))
        if steps < args.steps:
            print(f"  {per_step:.2f} s a step: {steps} measured steps a variant to stay "
                  f"within --budget-s {args.budget_s:.0f}", flush=True)
        count = args.groups * (args.warmup + steps)
        report(first, args.warmup)
        for name, settings in variants:
            times = run_sdk(name, server.url, payloads[:count], args.groups, device,
                            trainer, settings)
            runs[name] = [times]
            report(times, args.warmup)
        last = run_memory("memory", batches[:args.warmup + steps], device, trainer)
        runs["memory"].append(last)
        report(last, args.warmup)
    results = {name: summary(merged([r.measured(args.warmup) for r in rs]))
               for name, rs in runs.items()}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    drift = [pct(r.measured(args.warmup).tokens_per_s(), 50) for r in runs["memory"]]
    setup = (f"micro-batch {trainer.micro_sequences} sequences, gradient checkpointing "
             f"{trainer.checkpointing}, peak GPU memory {peak:.1f} GiB")
    lines = print_results(results, [name for name, _ in variants], drift, setup,
                          f"{params / 1e9:.2f}B params", f"{args.groups} groups {shape.label}",
                          f"{gpu}, medians over the steps after {args.warmup} warm-up")
    out = os.environ.get("OUT")
    if out:
        record = {
            "device": gpu, "torch": torch.__version__, "params": params,
            "shape": dataclasses.asdict(shape), "groups": args.groups,
            "tokens_per_step": int(batches[0].lengths.sum()), "warmup": args.warmup,
            "steps": steps, "micro_sequences": trainer.micro_sequences,
            "gradient_checkpointing": trainer.checkpointing, "peak_gpu_gib": peak,
            "memory_tokens_per_s_by_run": drift, "results": results,
            "runs": {name: [dataclasses.asdict(r) for r in rs] for name, rs in runs.items()},
            "lines": lines, "seconds": time.monotonic() - began,
        }
        path = Path(out) / "gpu_trainer.json"
        path.write_text(json.dumps(record, indent=1))
        print(f"wrote {path}")
    print(f"gpu_trainer: done in {time.monotonic() - began:.0f} s")
    return 0


def print_results(results: dict[str, dict[str, float]], sdk: list[str], drift: list[float],
                  setup: str, model: str, batch: str, where: str) -> list[str]:
    """The table of every variant, then one line per SDK variant; returns the lines."""
    memory = results["memory"]["tokens_per_s"]
    rows = [[name, r["steps"], f"{r['step_s_p50']:.3f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['tokens_per_s'] / memory:.3f}", f"{r['next_batch_ms_p50']:.1f}",
             f"{r['ack_ms_p50']:.1f}", f"{r['wait_ms_p50']:.1f}", f"{r['wait_ms_p99']:.1f}",
             f"{100 * r['wait_share_of_step']:.2f}"] for name, r in results.items()]
    print()
    print_table(["variant", "steps", "step s p50", "tokens/s p50", "vs memory",
                 "next_batch ms p50", "ack ms p50", "wait ms p50", "wait ms p99",
                 "wait % of step"], rows,
                title=f"training step, {batch}, on {where} (memory: both runs, "
                      f"{' then '.join(f'{t:,.0f}' for t in drift)} tokens/s); {setup}")
    lines = []
    for name in sdk:
        r = results[name]
        label = "" if name == "sdk" else f" ({name.removeprefix('sdk ')})"
        lines.append(
            f"gpu trainer{label}: model {model}, {batch}, step {r['step_s_p50']:.3f} s, "
            f"tokens/s sdk {r['tokens_per_s']:,.0f} mem {memory:,.0f} (ratio "
            f"{r['tokens_per_s'] / memory:.3f}), sdk wait p50 {r['wait_ms_p50']:.1f} ms p99 "
            f"{r['wait_ms_p99']:.1f} ms ({100 * r['wait_share_of_step']:.2f}% of step)")
    for line in lines:
        print(line)
    return lines


def merged(runs: Sequence[StepTimes]) -> StepTimes:
    """The steps of several runs of one variant, as one."""
    out = StepTimes(runs[0].name)
    for run in runs:
        for name in ("step_s", "next_batch_s", "ack_s", "tokens", "losses"):
            getattr(out, name).extend(getattr(run, name))
    return out


def report(times: StepTimes, warmup: int) -> None:
    measured = times.measured(warmup)
    wait = measured.wait_s()
    print(f"  {times.name:18s} {len(measured.step_s)} steps: step p50 "
          f"{pct(measured.step_s, 50):.3f} s, {pct(measured.tokens_per_s(), 50):,.0f} "
          f"tokens/s, wait p50 {pct(wait, 50) * 1e3:.1f} ms p99 {pct(wait, 99) * 1e3:.1f} ms, "
          f"loss {measured.losses[-1] if measured.losses else float('nan'):+.4f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
