"""GRPO under torchrun for any Hugging Face causal LM: DDP or FSDP, packed micro-batches.

    torchrun --nproc-per-node 8 examples/torchrun_trainer.py --model Qwen/Qwen3-1.7B \\
        --inference http://vllm-0:8000,http://vllm-1:8000 --out /ckpt/run1 --fsdp

The same step as ``examples/grpo_trainer.py`` (read that first: its loss and KL functions
are imported from it), spread over N ranks:

  1. rank 0 is the job's only consumer: ``DataParallelSteps.next_step`` pulls the batch,
     splits its sequences over the ranks by tokens (a group may be split: advantages are
     per token) into the same number of packed micro-batches on every rank, of at most
     ``--micro-batch-tokens`` tokens each, and scatters them;
  2. each rank runs forward/backward over its micro-batches, packed (one row, positions
     restart per sequence: no padding is computed), accumulating gradients; under DDP the
     gradients are all-reduced only after the last micro-batch (``no_sync`` before);
     each rank's loss is its SUM over trainable tokens divided by the step's global
     trainable tokens / world size, so the averaged gradient is the mean over every
     trainable token of the step, as on one device;
     ``--is-correction tis|mis|geo`` weights each token as ``examples/grpo_trainer.py``
     does (``geo`` over each sequence's own tokens in the packed row); a batch whose
     sampler logprobs cannot support it is refused on rank 0 before it is split: every
     rank exits 78, the batch stays pending;
  3. optimizer step; ``sync_weights`` publishes the weights from rank 0 (under FSDP the
     full state dict is gathered to rank 0 first); rank 0 acks the batch;
  4. every ``--checkpoint-every`` steps rank 0 writes the checkpoint atomically (full
     model and optimizer state, the step, and the SDK's ``state()``: the whole job's
     position in the run). ``--resume``: every rank loads it; rank 0 replays what was
     acked after it.

A crash of any rank (``--max-restarts`` on torchrun) restarts every rank: rank 0's
unacked batch is still pending under the same consumer name, so nothing is lost or
trained twice. bf16 (autocast; FSDP: bf16 params, fp32 reduction) on GPU, fp32 on CPU.
``--torch-threads 1`` per rank leaves the cores to a CPU vLLM server beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from grpo_trainer import (
    component_means,
    grpo_loss,
    kl_penalty,
    learning_rate,
    publish,
    sync_record,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from rollq.consumers.trainer import (
    DataParallelSteps,
    PackedBatch,
    SyncBatch,
    SyncTrainerClient,
    TorchObjectTransport,
    TrainerClientSettings,
    WeightSyncError,
    init_ranks,
)
from rollq.consumers.trainer.correction import (
    add_correction_arguments,
    check_logprobs,
    correction_from,
    importance_weights,
    staleness_histogram,
)
from rollq.schemas import BrokerUnavailable, ConfigError
from rollq.schemas.heap import freeze_heap

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("ROLLQ_REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    # not --run: torchrun would take it for an abbreviation of its own --run-path
    parser.add_argument("--run-name", default=os.environ.get("ROLLQ_RUN", "default"),
                        help="the run to train on [ROLLQ_RUN, else %(default)s]")
    parser.add_argument("--new-run", action="store_true",
                        help="this trainer starts a new run: publish weights even when no "
                        "other role had registered it")
    parser.add_argument("--model", required=True, help="initial model (HF id or directory)")
    parser.add_argument("--inference", default=os.environ.get("ROLLQ_INFERENCE", ""),
                        help="vLLM base URLs to publish weights to, comma-separated")
    parser.add_argument("--out", required=True, help="directory for weights and checkpoints")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                        help="tokens of a packed micro-batch (gradient accumulation) [8192]")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="raise the learning rate linearly over the first N steps [0: none]")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip range epsilon")
    parser.add_argument("--kl-coef", type=float, default=0.0,
                        help="β of the KL term to the frozen --model weights (0: none) [0]")
    add_correction_arguments(parser)
    parser.add_argument("--fsdp", action="store_true", help="shard the model (FSDP2)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch CPU threads per rank [torch's default]")
    parser.add_argument("--flip-advantages", action="store_true",
                        help="control run: train against the reward")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--weight-sync", choices=("reload", "transfer"), default="reload",
                        help="reload: rank 0 saves to --out/weights and every server reloads "
                             "it; transfer: send through vLLM's weight-transfer API [reload]")
    parser.add_argument("--transfer-backend",
                        help="the servers' --weight-transfer-config backend "
                             "[rollq_tcp on --device cpu, else nccl]")
    parser.add_argument("--sync-give-up-s", type=float, default=300.0,
                        help="retry a failed weight sync this long (vLLM restarting) [300]")
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    parser.add_argument("--metrics", help="JSONL file: one line per step (rank 0)")
    parser.add_argument("--consumer", default="trainer-0", help="rank 0's consumer name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--collective-timeout-s", type=float, default=3600.0,
                        help="how long ranks wait for each other (and for rank 0's batch)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def packed_logprobs(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | its sequence's tokens up to t) for a packed row, shape [N].

    No attention mask and no cache: transformers then keeps the packed sequences apart by
    their restarting ``position_ids`` (flash-attention varlen, or a block mask for sdpa).
    """
    logits = model(input_ids=input_ids[None], position_ids=position_ids[None],
                   use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def micro_tensors(micro: PackedBatch, device: str, flip: bool) -> dict[str, torch.Tensor]:
    targets = micro.targets()
    tensors = {name: torch.as_tensor(value, device=device) for name, value in {
        "input_ids": micro.input_ids, "position_ids": micro.position_ids,
        "labels": targets.labels, "mask": targets.loss_mask,
        "advantages": targets.advantages, "sampler_logprobs": targets.sampler_logprobs,
        "sequences": np.repeat(np.arange(len(micro.lengths)), micro.lengths),
    }.items()}
    if flip:
        tensors["advantages"] = -tensors["advantages"]
    return tensors


def sync_weights(client: SyncTrainerClient | None, step: int, model: Any, weights_dir: Path,
                 args: argparse.Namespace) -> None:
    """Serve the weights of ``step`` on every inference server. Every rank calls it.

    ``--weight-sync transfer`` under DDP: rank 0 sends its own replica through vLLM's
    weight-transfer API, chunk by chunk (no copy of the model). Otherwise the full state
    dict is gathered to rank 0 (under FSDP from the shards: a collective), then saved in
    the HF layout and reloaded (``reload``) or sent (``transfer``). Retried while vLLM is
    unreachable.
    """
    if args.weight_sync == "transfer" and not args.fsdp:
        if client is not None:
            publish(client, step, unwrap(model), args.sync_give_up_s)
        return
    state = get_model_state_dict(model, options=FULL)  # a collective under FSDP
    if client is None:
        return
    dtype = torch.bfloat16 if args.device.startswith("cuda") else None
    if dtype is not None:
        state = {name: value.to(dtype) for name, value in state.items()}
    if args.weight_sync == "transfer":
        publish(client, step, list(state.items()), args.sync_give_up_s)
        return
    unwrap(model).save_pretrained(weights_dir, state_dict=state, safe_serialization=True)
    publish(client, step, weights_dir, args.sync_give_up_s)


def unwrap(model: Any) -> Any:
    return model.module if isinstance(model, DistributedDataParallel) else model


def save_checkpoint(path: Path, model: Any, optimizer: Any, step: int,
                    client_state: dict[str, Any] | None) -> None:
    """Every rank calls it (gathering is a collective); rank 0 writes, atomically."""
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    if client_state is None:
        return
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model_state, "optimizer": optimizer_state, "step": step,
                "client": client_state}, tmp)
    tmp.replace(path)  # a crash mid-save leaves the previous checkpoint intact


def build_model(args: argparse.Namespace, world_size: int, trainable: bool) -> Any:
    """The model on this rank: DDP-wrapped, or FSDP-sharded (``--fsdp``)."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.to(args.device)
    if not trainable:
        model.eval().requires_grad_(False)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if args.device.startswith("cuda") else MixedPrecisionPolicy())
        for layer in model.model.layers:  # one all-gather a decoder layer, then the rest
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if not trainable or world_size == 1:
        return model
    device_ids = [torch.device(args.device).index or 0] if args.device.startswith("cuda") \
        else None
    return DistributedDataParallel(model, device_ids=device_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except WeightSyncError as exc:
        print(f"torchrun_trainer: {exc}; is vLLM up at {args.inference}?", file=sys.stderr)
        return 69
    except BrokerUnavailable as exc:
        print(f"torchrun_trainer: cannot reach Redis at {args.redis_url}: {exc}",
              file=sys.stderr)
        return 69
    except ConfigError as exc:  # a batch the off-policy correction cannot use (every rank)
        print(f"torchrun_trainer: {exc}", file=sys.stderr)
        return 78


def train(args: argparse.Namespace) -> int:
    cuda = args.device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    rank, world_size = init_ranks("nccl" if cuda else "gloo", os.environ,
                                  timeout_s=args.collective_timeout_s)
    # objects (the shards) travel over gloo, on the CPU, whatever trains
    objects = dist.new_group(backend="gloo") if cuda else None
    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights_dir, checkpoint = out / "weights", out / "checkpoint.pt"
    model = build_model(args, world_size, trainable=True)
    model.train()
    reference = build_model(args, world_size, trainable=False) if args.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    urls = tuple(u for u in args.inference.split(",") if u)
    backend = args.transfer_backend or ("rollq_tcp" if args.device == "cpu" else "nccl")
    settings = TrainerClientSettings(batch_groups=args.batch_groups,
                                     max_staleness=args.max_staleness, inference_urls=urls,
                                     weight_sync=args.weight_sync, transfer_backend=backend,
                                     new_run=args.new_run)
    client = (SyncTrainerClient(args.redis_url, run=args.run_name, consumer=args.consumer,
                                settings=settings).open() if rank == 0 else None)
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None
    correction = correction_from(args)
    steps = DataParallelSteps(client, groups=args.batch_groups,
                              max_tokens=args.micro_batch_tokens,
                              transport=TorchObjectTransport(objects),
                              check=None if correction.method == "none" else
                              lambda batch: check_logprobs(batch.sampling, correction.method))
    def autocast() -> Any:  # bf16 on GPU under DDP (FSDP casts by its policy); fp32 on CPU
        if cuda and not args.fsdp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    try:
        step = 0
        if args.resume and checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
            set_model_state_dict(model, saved["model"], options=FULL)
            set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=FULL)
            step = saved["step"]
            replayed = steps.load_state(saved["client"] if rank == 0 else None)
            if rank == 0:
                print(f"resumed at step {step}; replaying {replayed} groups", flush=True)
        sync_weights(client, step, model, weights_dir, args)  # servers start from these
        freeze_heap()  # set-up is done: keep the GC's full walks off torch and the model
        while step < args.steps:
            started = time.monotonic()
            shard = steps.next_step()
            batch = steps.batch  # rank 0: the whole batch (rewards, groups) for the metrics
            share = shard.trainable_tokens / world_size  # divide each rank's sum by this
            # loss, ratio, clipped, kl, tokens, IS ratio, IS dropped
            totals = torch.zeros(7, dtype=torch.float64)
            last = len(shard.micro_batches) - 1
            for i, micro in enumerate(shard.micro_batches):
                t = micro_tensors(micro, args.device, args.flip_advantages)
                with no_sync(model, sync=i == last), autocast():
                    logprobs = packed_logprobs(model, t["input_ids"], t["position_ids"],
                                               t["labels"])
                    weights, weighing = importance_weights(
                        logprobs, t["sampler_logprobs"], t["mask"], correction,
                        sequences=t["sequences"])
                    loss, stats = grpo_loss(
                        logprobs, t["sampler_logprobs"], t["advantages"], t["mask"], args.clip,
                        per=share, weights=None if correction.method == "none" else weights)
                    kl = torch.zeros(())
                    if reference is not None:
                        with torch.no_grad():
                            reference_logprobs = packed_logprobs(
                                reference, t["input_ids"], t["position_ids"], t["labels"])
                        kl = kl_penalty(logprobs, reference_logprobs, t["mask"], per=share)
                        loss = loss + args.kl_coef * kl
                    loss.backward()
                local = float(t["mask"].sum())
                totals += torch.tensor([float(loss.detach()), stats["ratio_mean"] * local,
                                        stats["clip_fraction"] * local, float(kl.detach()), local,
                                        weighing["is_ratio_mean"] * local,
                                        weighing["is_filter_drop_frac"] * local],
                                       dtype=torch.float64)
            clip_gradients(model)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step + 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            sync_weights(client, step, model, weights_dir, args)
            steps.ack()
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint(checkpoint, model, optimizer, step, steps.state())
            totals = totals.to(args.device)
            dist.all_reduce(totals)  # the step's loss and statistics over every rank
            if metrics is not None and batch is not None:
                write_metrics(metrics, step, totals.cpu(), started, batch, args, world_size, client)
    finally:
        if metrics is not None:
            metrics.close()
        if client is not None:
            client.close()
        # DDP's reducer holds the process group: free it first. Left to the collection at
        # interpreter exit (freeze_heap keeps it from any earlier one), its gloo group's
        # destructor ran after destroy_process_group and hung on a mutex: a rank that
        # never exited, seen in CI about once in five runs.
        model = reference = optimizer = None
        gc.unfreeze()
        gc.collect()
        dist.destroy_process_group()
    return 0


def no_sync(model: Any, sync: bool) -> Any:
    """DDP: all-reduce gradients only on the step's last micro-batch. FSDP2 reduces every
    micro-batch (its per-layer reduce-scatter keeps memory flat)."""
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def clip_gradients(model: Any) -> None:
    """Clip the global gradient norm to 1 (over every rank's shard under FSDP)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def write_metrics(metrics: Any, step: int, totals: torch.Tensor, started: float,
                  batch: SyncBatch, args: argparse.Namespace, world_size: int,
                  client: SyncTrainerClient) -> None:
    """One JSON line a step (rank 0), the fields of examples/grpo_trainer.py's."""
    loss, ratio, clipped, kl, tokens, is_ratio, is_dropped = totals.tolist()
    loss, kl = loss / world_size, kl / world_size  # each rank's sum was scaled by N
    data = batch.targets()
    record = {
        "step": step, "loss": loss, "reward_mean": float(batch.rewards.mean()),
        "tokens": int(tokens), "groups": len(batch), "ranks": world_size,
        "staleness": step - 1 - min(g.policy_version for g in batch.groups),
        "seconds": time.monotonic() - started, "time": time.time(),
        "group_ids": batch.group_ids, "components": component_means(batch.groups),
        "ratio_mean": ratio / max(tokens, 1.0), "clip_fraction": clipped / max(tokens, 1.0),
        "is_ratio_mean": is_ratio / max(tokens, 1.0),
        "is_filter_drop_frac": is_dropped / max(tokens, 1.0),
        "staleness_histogram": staleness_histogram(data.versions, data.loss_mask, step - 1),
        **sync_record(client),
    }
    if args.kl_coef > 0:
        record["kl"] = kl
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    print(f"step {step} reward {record['reward_mean']:.3f} loss {loss:+.4f} "
          f"ratio {record['ratio_mean']:.4f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
