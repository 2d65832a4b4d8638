"""A reference GRPO trainer over rollq's SDK: copy it into your own trainer, not a framework.

One step:
  1. ``client.next_batch(groups=B)``: B scored groups, as padded numpy arrays;
  2. forward the policy over prompt + completion tokens and take the log-probability of each
     token (``batch.targets()`` lines the arrays up with the logits);
  3. PPO-clip loss against the sampler's logprobs (the importance ratio corrects for the
     policy having moved since the rollout was generated), masked to model tokens;
  4. optimizer step, then ``client.publish_policy``: with ``--weight-sync reload`` the
     weights are saved (safetensors, HF layout) and every vLLM server reloads them; with
     ``transfer`` they are sent through vLLM's weight-transfer API (``rollq_tcp`` on CPU
     servers, ``nccl`` on GPUs); with ``lora`` only a LoRA adapter trains (PEFT, rank
     ``--lora-rank``) and every server loads each version at run time, nothing paused;
     the run's policy version becomes the step;
  5. ``batch.ack()``: the groups are consumed; then, every ``--checkpoint-every`` steps, a
     checkpoint with the model, the optimizer and ``client.state()``.

Resume with ``--resume``: the model and optimizer come back from the checkpoint and
``client.load_state`` replays the groups acked after it, so every group is trained into
the final weights exactly once. ``--flip-advantages`` is the control experiment: it trains
against the signal, and the reward must not rise.

``--is-correction tis|mis|geo`` corrects for the sampler not being the policy being trained
(it is up to ``--max-staleness`` versions older, on another engine): each token's term is
weighted by its importance ratio, truncated (``tis``, at ``--is-tis-cap``), masked outside
``--is-token-mask`` (``mis``), or whole sequences masked when their geometric-mean ratio is
outside ``--is-geo-mask`` (``geo``); ``consumers.trainer.correction`` has the math. A batch
whose sampler logprobs cannot be compared with the trainer's (``processed_logprobs`` with
top_p < 1, a logprobs mode nobody recorded) is refused: the trainer stops with exit 78,
the batch stays pending. ``none`` (the default) keeps the sampler's logprobs as PPO's old
policy. Every step logs ``is_ratio_mean``, ``is_filter_drop_frac`` and
``staleness_histogram`` (trainable tokens by versions behind).

``--kl-coef β`` adds β·KL(policy ‖ reference) to the loss, the reference being a frozen copy
of ``--model`` (the starting weights, also on resume): the k3 estimator
``exp(r - p) - (r - p) - 1`` per trainable token (p, r: the policy's and the reference's
log-probabilities), averaged like the PPO term. It keeps a small model from collapsing onto
one answer. ``--torch-threads 1`` leaves the other cores to a CPU vLLM server beside it.
``--freeze-embeddings`` trains everything but the token embeddings and the output layer
(a pretrained model's vocabulary stays put; on a 135M model it is 40 % of the weights, and
the step is cheaper without their gradients and Adam state). ``--train-layers N`` trains
only the last N transformer blocks and the final norm: the backward pass stops at the
lowest of them, which on a CPU is most of a step's cost.

Each step appends one JSON line to ``--metrics`` (with the seconds it waited for the batch,
trained, and synced the weights). Runs on CPU here, on a GPU elsewhere
(``--device cuda``).

SIGINT (Ctrl-C) or SIGTERM: a step in progress finishes (trained, weights synced, acked),
then the trainer saves a checkpoint and exits with one line (status 130 after SIGINT, 0
after SIGTERM); while it waits for data or starts up, it stops at once. A second signal
stops at once in any case. Nothing is lost either way: an unacked batch stays pending and
comes back to ``--resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings, WeightSyncError
from rollq.consumers.trainer.correction import (
    add_correction_arguments,
    check_logprobs,
    correction_from,
    importance_weights,
    staleness_histogram,
)
from rollq.consumers.trainer.lora import LoraAdapter
from rollq.schemas import BrokerUnavailable, ConfigError
from rollq.schemas.heap import freeze_heap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("ROLLQ_REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    parser.add_argument("--run", default=os.environ.get("ROLLQ_RUN", "default"),
                        help="the run to train on [ROLLQ_RUN, else %(default)s]")
    parser.add_argument("--new-run", action="store_true",
                        help="this trainer starts a new run: publish weights even before "
                        "another role works on it (without: a warning, and none are sent)")
    parser.add_argument("--redis-ca-file", help="rediss://: the server's CA bundle "
                        "[ROLLQ_REDIS_CA_FILE]")
    parser.add_argument("--redis-cert-file", help="client certificate [ROLLQ_REDIS_CERT_FILE]")
    parser.add_argument("--redis-key-file", help="its key [ROLLQ_REDIS_KEY_FILE]")
    parser.add_argument("--model", required=True, help="initial model directory (HF layout)")
    parser.add_argument("--inference", default=os.environ.get("ROLLQ_INFERENCE", ""),
                        help="vLLM base URLs to publish weights to, comma-separated")
    parser.add_argument("--out", required=True, help="directory for weights and checkpoints")
    parser.add_argument("--steps", type=int, default=60,
                        help="optimizer steps to train, then stop [%(default)s]")
    parser.add_argument("--batch-groups", type=int, default=8,
                        help="scored groups per optimizer step; the feeder's --batch-groups "
                        "must be at least this [%(default)s]")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="drop groups more than this many policy versions old, as the "
                        "feeder's --max-staleness [%(default)s]")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip range epsilon")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="raise the learning rate linearly over the first N steps (Adam's "
                             "first steps move every weight by about lr) [0: none]")
    parser.add_argument("--kl-coef", type=float, default=0.0,
                        help="β of the KL term to the frozen --model weights (0: none) [0]")
    add_correction_arguments(parser)
    parser.add_argument("--freeze-embeddings", action="store_true",
                        help="do not train the token embeddings and the output layer")
    parser.add_argument("--train-layers", type=int,
                        help="train only the last N transformer blocks (and the final norm; "
                             "with --freeze-embeddings, nothing below them) [all]")
    parser.add_argument("--torch-threads", type=int,
                        help="torch CPU threads (1 beside a CPU vLLM server) [torch's default]")
    parser.add_argument("--flip-advantages", action="store_true",
                        help="control run: train against the reward")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--weight-sync", choices=("reload", "transfer", "lora"),
                        default="reload",
                        help="reload: save to --out/weights and every server reloads it; "
                             "transfer: send through vLLM's weight-transfer API; lora: "
                             "train a LoRA adapter that every server loads at run time "
                             "(vLLM --enable-lora; the peft extra) [reload]")
    parser.add_argument("--lora-rank", type=int, default=8, help="lora: the adapter's rank [8]")
    parser.add_argument("--lora-alpha", type=float, default=16.0,
                        help="lora: its scale numerator (scale = alpha / rank) [16]")
    parser.add_argument("--transfer-backend",
                        help="the servers' --weight-transfer-config backend "
                             "[rollq_tcp on --device cpu, else nccl]")
    parser.add_argument("--sync-give-up-s", type=float, default=300.0,
                        help="retry a failed weight sync this long (vLLM restarting) [300]")
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    parser.add_argument("--metrics", help="JSONL file: one line per step")
    parser.add_argument("--consumer", default="trainer-0")
    parser.add_argument("--wait-log-s", type=float, default=30.0,
                        help="while waiting for data, log trainer_waiting every S seconds [30]")
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ["ROLLQ_METRICS_PORT"])
                        if os.environ.get("ROLLQ_METRICS_PORT") else None,
                        help="serve Prometheus /metrics here (the 'metrics' extra)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log p(labels[t] | tokens[..t]) at every position t, shape [B, T]. With ``mask``, only
    where it is set (0 elsewhere): the output layer then runs on those positions alone,
    which for a 49k-token vocabulary and prompts longer than the answers is most of the
    forward's logits (and their memory) saved."""
    if mask is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    hidden = model.get_decoder()(input_ids=input_ids,
                                 attention_mask=attention_mask).last_hidden_state
    where = mask.bool()
    logits = model.get_output_embeddings()(hidden[where]).float()
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, labels[where].unsqueeze(-1))
    return torch.zeros(mask.shape, dtype=chosen.dtype, device=chosen.device).masked_scatter(
        where, chosen.squeeze(-1))


def grpo_loss(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip: float, per: float | None = None,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip objective with per-token advantages, averaged over trainable tokens
    (``per``: divide the sum by this instead; examples/torchrun_trainer.py's ranks do).

    ``weights``: an off-policy correction's token weights; the PPO ratio is then taken
    against the policy before this step (``logprobs.detach()``), the sampler's part of it
    being in the weights (decoupled PPO)."""
    old = sampler_logprobs if weights is None else logprobs.detach()
    ratio = torch.exp(logprobs - old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / (tokens if per is None else per)
    with torch.no_grad():
        stats = {
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "clip_fraction": float((((ratio - 1).abs() > clip).float() * mask).sum() / tokens),
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor,
               mask: torch.Tensor, per: float | None = None) -> torch.Tensor:
    """KL(policy ‖ reference), k3 estimator per token, averaged over trainable tokens
    (``per`` as in ``grpo_loss``)."""
    log_ratio = reference_logprobs - logprobs
    per_token = torch.exp(log_ratio) - log_ratio - 1
    return (per_token * mask).sum() / (mask.sum().clamp(min=1) if per is None else per)


def component_means(groups: Any) -> dict[str, float]:
    """Mean raw value of each reward component over a batch's completions (None skipped)."""
    values: dict[str, list[float]] = {}
    for group in groups:
        for score in group.scores:
            for name, value in score.components.items():
                if value is not None:
                    values.setdefault(name, []).append(value)
    return {name: sum(found) / len(found) for name, found in values.items()}


def save_checkpoint(path: Path, model: Any, optimizer: Any, step: int,
                    client_state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "client": client_state}, tmp)
    tmp.replace(path)  # atomic: a crash mid-save leaves the previous checkpoint intact


def publish(client: SyncTrainerClient, step: int, weights: Any, give_up_s: float) -> None:
    """``publish_policy`` (``weights``: the saved directory for reload, the model or its
    ``(name, tensor)`` pairs for transfer), retried while vLLM is unreachable (it may be
    restarting)."""
    deadline = time.monotonic() + give_up_s
    pause = 1.0
    while True:
        try:
            client.publish_policy(step, weights)
            return
        except WeightSyncError as exc:
            if time.monotonic() + pause > deadline:
                raise
            print(f"weight sync to step {step} failed, retrying in {pause:.0f} s: {exc}",
                  file=sys.stderr, flush=True)
            time.sleep(pause)
            pause = min(30.0, pause * 2)


def sync_record(client: SyncTrainerClient) -> dict[str, Any]:
    """What the step's weight sync cost, for the metrics line."""
    sync = client.client.last_sync
    if sync is None:
        return {}
    return {"weight_sync": sync.method, "sync_seconds": sync.seconds,
            "paused_seconds": sync.paused_seconds, "sync_aborted_requests": sync.aborted_requests}


def sync_weights(client: SyncTrainerClient, step: int, model: Any, weights_dir: Path,
                 args: argparse.Namespace) -> None:
    """Serve the model as policy version ``step``: saved and reloaded, or transferred."""
    if args.weight_sync == "reload":
        model.save_pretrained(weights_dir, safe_serialization=True)
        publish(client, step, weights_dir, args.sync_give_up_s)
    elif args.weight_sync == "lora":  # the adapter's tensors only: megabytes, no pause
        from peft import get_peft_model_state_dict

        adapter = LoraAdapter(model.peft_config["default"].to_dict(),
                              get_peft_model_state_dict(model))
        publish(client, step, adapter, args.sync_give_up_s)
    else:
        publish(client, step, model, args.sync_give_up_s)


class Stopped(Exception):
    """A stop signal came while nothing needed finishing (waiting for data, starting)."""


class StopSignals:
    """SIGINT/SIGTERM: finish the step in hand, then stop; stop at once outside a step or
    on a second signal (module docstring)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._busy = False
        self.mid_step = False
        """A second signal stopped a step that had not finished."""

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = signal.Signals(signum)
        if not self._busy or not first:
            self.mid_step = self._busy
            raise Stopped(self.received.name)

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """A block that a first signal lets finish."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    @property
    def exit_code(self) -> int:
        return 130 if self.received == signal.SIGINT else 0


def trainable(model: Any, args: argparse.Namespace) -> list[Any]:
    """Freeze what ``--freeze-embeddings`` and ``--train-layers`` leave out; the parameters
    that still train."""
    if args.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
        model.get_output_embeddings().requires_grad_(False)
    if args.train_layers is not None:  # HF decoders keep their blocks in .layers
        blocks = model.get_decoder().layers
        for block in blocks[:max(0, len(blocks) - args.train_layers)]:
            block.requires_grad_(False)
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """``--lr``, ramped linearly over the first ``--warmup-steps`` steps (``step`` from 1;
    from the step itself, so a resumed run carries on the ramp)."""
    return args.lr * min(1.0, step / args.warmup_steps) if args.warmup_steps > 0 else args.lr


def train_on(batch: Any, step: int, model: Any, reference: Any, optimizer: Any,
             args: argparse.Namespace) -> dict[str, Any]:
    """One optimizer step on ``batch`` (the ``step``-th); its metrics record."""
    correction = correction_from(args)
    check_logprobs(batch.sampling, correction.method)  # ConfigError: the batch stays pending
    data = batch.targets()
    tensors = {name: torch.as_tensor(value, device=args.device) for name, value in {
        "input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
        "labels": data.labels, "mask": data.loss_mask,
        "advantages": data.advantages, "sampler_logprobs": data.sampler_logprobs,
    }.items()}
    if args.flip_advantages:
        tensors["advantages"] = -tensors["advantages"]
    logprobs = token_logprobs(model, tensors["input_ids"], tensors["attention_mask"],
                              tensors["labels"], tensors["mask"])
    weights, stats = importance_weights(logprobs, tensors["sampler_logprobs"], tensors["mask"],
                                        correction)
    loss, ppo = grpo_loss(logprobs, tensors["sampler_logprobs"], tensors["advantages"],
                          tensors["mask"], args.clip,
                          weights=None if correction.method == "none" else weights)
    stats |= ppo
    if reference is not None:
        with torch.no_grad():
            reference_logprobs = token_logprobs(
                reference, tensors["input_ids"], tensors["attention_mask"],
                tensors["labels"], tensors["mask"])
        kl = kl_penalty(logprobs, reference_logprobs, tensors["mask"])
        loss = loss + args.kl_coef * kl
        stats["kl"] = float(kl.detach())
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(args, step)
    optimizer.step()
    return {
        "step": step, "loss": float(loss.detach()), "reward_mean": float(batch.rewards.mean()),
        "tokens": int(batch.loss_mask.sum()), "groups": len(batch.groups),
        "staleness": step - 1 - min(g.policy_version for g in batch.groups),
        "staleness_histogram": staleness_histogram(data.versions, data.loss_mask, step - 1),
        "group_ids": batch.group_ids, "components": component_means(batch.groups), **stats,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopSignals()
    stop.install()
    try:
        return train(args, stop)
    except Stopped:
        print(f"grpo_trainer: stopped by {stop.received.name if stop.received else 'a signal'}"
              " before the first step; nothing to save", file=sys.stderr, flush=True)
        return stop.exit_code
    except WeightSyncError as exc:
        print(f"grpo_trainer: {exc}; is vLLM up at {args.inference}?", file=sys.stderr)
        return 69
    except BrokerUnavailable as exc:
        print(f"grpo_trainer: cannot reach Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 69
    except ConfigError as exc:  # a batch the off-policy correction cannot use
        print(f"grpo_trainer: {exc}", file=sys.stderr)
        return 78


def train(args: argparse.Namespace, stop: StopSignals) -> int:
    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights_dir, checkpoint = out / "weights", out / "checkpoint.pt"
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    if args.weight_sync == "lora":  # only the adapter trains (initialised as the base model)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                                 target_modules="all-linear"))
    model.to(args.device).train()
    reference = None
    if args.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        reference.to(args.device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(trainable(model, args), lr=args.lr)
    urls = tuple(u for u in args.inference.split(",") if u)
    backend = args.transfer_backend or ("rollq_tcp" if args.device == "cpu" else "nccl")
    settings = TrainerClientSettings(batch_groups=args.batch_groups,
                                     max_staleness=args.max_staleness, inference_urls=urls,
                                     weight_sync=args.weight_sync, transfer_backend=backend,
                                     lora_dir=str(out / "adapters"),
                                     wait_log_s=args.wait_log_s, new_run=args.new_run,
                                     redis_ca_file=args.redis_ca_file,
                                     redis_cert_file=args.redis_cert_file,
                                     redis_key_file=args.redis_key_file)
    metrics = open(args.metrics, "a") if args.metrics else None
    with SyncTrainerClient(args.redis_url, run=args.run, consumer=args.consumer,
                           settings=settings) as client:
        if args.metrics_port is not None:  # steps, staleness, consumed + the run's series
            from rollq.ops.role_metrics import serve_trainer_metrics

            serve_trainer_metrics(client.client, args.metrics_port, redis_url=args.redis_url,
                                  redis_options=settings.redis_tls(os.environ).options(
                                      args.redis_url))
        step = 0
        if args.resume and checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=False)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
            replayed = client.load_state(saved["client"])
            print(f"resumed at step {step}; replaying {replayed} groups", flush=True)
        # The servers start from the weights this trainer holds (fresh or resumed).
        sync_weights(client, step, model, weights_dir, args)
        # Set-up is done: keep the cyclic collector's full walks off torch, the model and
        # everything else that lives as long as this process (schemas.heap: ~15 % of the
        # SDK's CPU a group at 16 x 2048).
        freeze_heap()
        saved_step = step
        try:
            while step < args.steps and stop.received is None:
                started = time.monotonic()
                batch = client.next_batch(groups=args.batch_groups)  # a signal: Stopped
                waited = time.monotonic() - started
                with stop.finishing():  # a first signal lets the step finish
                    record = train_on(batch, step + 1, model, reference, optimizer, args)
                    record |= {"wait_seconds": waited,
                               "train_seconds": time.monotonic() - started - waited}
                    sync_weights(client, step + 1, model, weights_dir, args)
                    batch.ack()
                    step += 1  # done: only now may a stop save it
                    if step % args.checkpoint_every == 0 or step == args.steps:
                        save_checkpoint(checkpoint, model, optimizer, step, client.state())
                        saved_step = step
                    record |= {"seconds": time.monotonic() - started, "time": time.time(),
                               **sync_record(client)}
                    if metrics is not None:
                        metrics.write(json.dumps(record) + "\n")
                        metrics.flush()
                    print(f"step {step} reward {record['reward_mean']:.3f} loss "
                          f"{record['loss']:+.4f} ratio {record['ratio_mean']:.4f}", flush=True)
        except Stopped:
            pass  # while it waited for data (the last step is done), or a second signal
        if stop.received is not None:
            if stop.mid_step:  # the model may hold an update whose batch is unacked
                saved = (f", in step {step + 1}: not saved (its batch stays pending; --resume "
                         "replays from the last checkpoint)")
            elif step > saved_step:
                with stop.finishing():
                    save_checkpoint(checkpoint, model, optimizer, step, client.state())
                saved = f"; checkpoint saved to {checkpoint} (continue with --resume)"
            else:
                saved = "; nothing new to save"
            print(f"grpo_trainer: stopped by {stop.received.name} after step {step}{saved}",
                  file=sys.stderr, flush=True)
    if metrics is not None:
        metrics.close()
    return 0 if stop.received is None else stop.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
