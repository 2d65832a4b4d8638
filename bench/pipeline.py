"""The whole rollq pipeline as real processes, for the chaos and soak benchmarks.

On a redis-server and a zero-latency fake vLLM server (``bench.fake_vllm``) it runs
``rollq feed``, two ``rollq workers``, two ``rollq score`` and one trainer
(``python -m bench.pipeline trainer``: the SDK's ``SyncTrainerClient``; its "model" is the
list of group ids it trained, checkpointed after every ``ack`` together with
``client.state()`` and restored with ``load_state`` on restart, as a real trainer does;
with ``trainer_ranks`` above 1, N torchrun ranks of which rank 0 consumes).
``Role`` starts, kills and restarts one process; ``outcome`` checks that every admitted
group was trained exactly once or dead-lettered with a reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from rollq.schemas import decode_dead
from rollq.schemas.keys import ADMITTED_FIELD, DROP_PREFIX, counters_key, state_key, stream_key

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "chaos"
GSM8K_ITEMS = 200  # the sample dataset rollq ships (producers/data/gsm8k_sample.jsonl)
REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
          "advantages: {method: grpo, zero_variance: keep}\n")


@dataclass(frozen=True)
class PipelineOptions:
    groups: int
    """Groups to admit (rounded up to whole epochs of the 200-item dataset)."""
    batch_groups: int = 8
    step_s: float = 0.4
    """Seconds per trainer step: the feeder paces the whole run to it."""
    job_timeout_s: float = 8.0
    """A killed worker's jobs are re-run after this."""
    run: str = RUN
    fixed_consumer_names: bool = True
    """Scorers keep their consumer name across restarts; False: the default host-pid name,
    so every restart adds a consumer (the soak checks they are cleaned up)."""
    retention_s: float = 3600.0
    """The roles' ``retention_s``: acknowledged entries kept this long."""
    dedup_window_s: float = 6 * 3600.0
    """The trainer's ``dedup_window_s``."""
    trainer_ranks: int = 1
    """Above 1: the trainer runs as this many torchrun ranks (``trainer --data-parallel``,
    restarted together by torchrun when one dies); ``rank_victims`` kill single ranks."""


# ------------------------------------------------------------------------------ the trainer

def trainer_main(args: argparse.Namespace) -> int:
    """A trainer whose model is how often it trained each dataset position (one byte a
    group, so its memory stays flat in a long soak); see the module doc."""
    from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings

    checkpoint = Path(args.checkpoint)
    settings = TrainerClientSettings(batch_groups=args.batch_groups, max_staleness=None,
                                     reclaim_idle_ms=3000, reclaim_every_s=1.0,
                                     block_ms=200, dedup_window_s=args.dedup_window_s)
    with SyncTrainerClient(args.redis_url, run=args.run, consumer="trainer-0",
                           settings=settings) as client:
        counts = bytearray()
        step = 0
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            counts, step = bytearray.fromhex(saved["counts"]), saved["step"]
            client.load_state(saved["client"])
        while True:
            batch = client.next_batch(groups=args.batch_groups, timeout_s=1.0)
            if not batch.groups:
                continue
            for group_id in batch.group_ids:  # "the optimizer step"
                _count(counts, group_id, 1)
            time.sleep(args.step_s)
            step += 1
            client.publish_policy(step, checkpoint.parent)  # no servers: bumps the version
            batch.ack()
            _write_atomically(checkpoint, {"counts": counts.hex(), "step": step,
                                           "client": client.state()})


def data_parallel_trainer_main(args: argparse.Namespace) -> int:
    """The same trainer as N torchrun ranks (gloo): rank 0 is the only consumer
    (``consumers.trainer.DataParallelSteps``) and scatters each step's sequences; every
    rank "trains" its share; the shares are gathered to rank 0 (the toy's gradient
    all-reduce), which counts a group trained only when every one of its sequences was
    trained exactly once that step (else it records 100: a duplicate to the checks), then
    acks and checkpoints. Every rank writes its pid to ``rank-<r>.pid`` beside the
    checkpoint (for the kill harness) and loads the checkpoint on start."""
    import torch
    import torch.distributed as dist

    from rollq.consumers.trainer import (
        DataParallelSteps,
        SyncTrainerClient,
        TrainerClientSettings,
        init_ranks,
    )

    _die_with_parent()
    torch.set_num_threads(1)
    rank, world_size = init_ranks("gloo", os.environ)
    checkpoint = Path(args.checkpoint)
    _write_atomically(checkpoint.parent / f"rank-{rank}.pid",
                      {"pid": os.getpid(), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
    settings = TrainerClientSettings(batch_groups=args.batch_groups, max_staleness=None,
                                     reclaim_idle_ms=3000, reclaim_every_s=1.0,
                                     block_ms=200, dedup_window_s=args.dedup_window_s)
    client = (SyncTrainerClient(args.redis_url, run=args.run, consumer="trainer-0",
                                settings=settings).open() if rank == 0 else None)
    try:
        steps = DataParallelSteps(client, groups=args.batch_groups,
                                  max_tokens=args.micro_batch_tokens)
        counts, step = bytearray(), 0
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            counts, step = bytearray.fromhex(saved["counts"]), saved["step"]
            steps.load_state(saved["client"] if rank == 0 else None)
        idle = 0
        while args.exit_when_idle is None or idle < args.exit_when_idle:
            shard = steps.next_step(timeout_s=1.0)
            if shard.empty:  # on every rank at once: they all agree when to stop
                idle += 1
                continue
            idle = 0
            mine = [i for micro in shard.sequences for i in micro]  # forward + backward
            time.sleep(args.step_s)
            shares: list[Any] | None = [None] * world_size if rank == 0 else None
            dist.gather_object(mine, shares, dst=0)  # the gradient all-reduce
            if steps.batch is None:
                continue  # ranks 1..N-1: rank 0 holds the model
            trained = sorted(i for share in shares or [] for i in share)
            exact = trained == list(range(steps.batch.num_sequences))
            for group_id in shard.group_ids:  # "the optimizer step"
                _count(counts, group_id, 1 if exact else 100)
            step += 1
            steps.client.publish_policy(step, checkpoint.parent)  # type: ignore[union-attr]
            steps.ack()
            _write_atomically(checkpoint, {"counts": counts.hex(), "step": step,
                                           "client": steps.state()})
    finally:
        if client is not None:
            client.close()
        dist.destroy_process_group()
    return 0


def _die_with_parent() -> None:
    """SIGKILL this rank when its torchrun launcher dies (Linux): a SIGKILLed launcher
    cannot stop its ranks, and orphaned ranks would go on training beside the restarted
    job, as two consumers of one name. A container runtime kills the whole tree; this
    does the same on a bare machine."""
    if sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher died before the call
            os._exit(1)


def _count(counts: bytearray, group_id: str, times: int) -> None:
    position = int(group_id.rsplit(":", 1)[-1].lstrip("g"))
    if position >= len(counts):
        counts.extend(bytes(position + 1 - len(counts)))
    counts[position] = min(255, counts[position] + times)


def _write_atomically(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document))
    tmp.replace(path)


# ------------------------------------------------------------------------------ the harness

@dataclass
class Role:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    kills: int = 0
    started_at: float = 0.0
    """``time.monotonic()`` of the last start."""
    log_offset: int = 0
    """The log's size at the last start: what this incarnation logged follows it."""

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=REPO_ROOT,
                                            stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.kills += 1

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def started_up(self) -> bool:
        """Whether this incarnation logged its start-up line (``scorer_started``,
        ``worker_started``, ``trainer_started``, ...): before it, a role needs Redis to
        answer at once, by design; after it, an outage is its rider's to ride out."""
        if not self.log.exists():
            return False
        with self.log.open("rb") as log:
            log.seek(self.log_offset)
            return b'_started"' in log.read()


@dataclass
class RankVictim:
    """One rank of the torchrun trainer, as a kill victim: ``kill`` SIGKILLs the process
    whose pid the rank wrote; ``start`` does nothing (torchrun restarts every rank)."""

    name: str
    pid_file: Path
    kills: int = 0

    def kill(self) -> None:
        try:
            pid = int(json.loads(self.pid_file.read_text())["pid"])
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, json.JSONDecodeError, ProcessLookupError):
            return  # between incarnations: nothing to kill
        self.kills += 1

    def start(self) -> None:
        """Nothing: the launcher restarts every rank from the last checkpoint."""


def rank_victims(directory: Path, options: PipelineOptions) -> list[RankVictim]:
    """The trainer's ranks as kill victims (none for a single-process trainer)."""
    if options.trainer_ranks < 2:
        return []
    return [RankVictim(f"trainer-rank-{r}", directory / f"rank-{r}.pid")
            for r in range(options.trainer_ranks)]


@dataclass
class Outcome:
    admitted: int
    trained_once: int
    lost: list[str]
    duplicated: list[str]
    dead: Counter[str]
    wall_s: float
    kills: dict[str, int] = field(default_factory=dict)
    self_exits: dict[str, int] = field(default_factory=dict)
    """Roles that exited on their own (they must ride out kills and Redis restarts)."""

    def line(self, name: str = "chaos") -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.dead.items()))
        return (f"{name}: admitted {self.admitted}, trained once {self.trained_once}, "
                f"lost {len(self.lost)}, duplicated {len(self.duplicated)}, "
                f"dead {sum(self.dead.values())} ({reasons})")

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated and not self.self_exits


def build_roles(redis_url: str, inference: str, directory: Path,
                options: PipelineOptions) -> list[Role]:
    """The pipeline's processes (not started), logging JSON to files in ``directory``."""
    epochs = -(-options.groups // GSM8K_ITEMS)
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_url, "ROLLQ_RUN": options.run,
           "ROLLQ_LOG_FORMAT": "json", "ROLLQ_RECLAIM_IDLE_S": "3",
           "ROLLQ_JOB_TIMEOUT_S": str(options.job_timeout_s), "ROLLQ_MAX_TRIES": "5",
           "ROLLQ_REDIS_GIVE_UP_S": "120", "ROLLQ_BLOCK_MS": "200",
           "ROLLQ_REQUEST_TIMEOUT_S": "10", "ROLLQ_RETENTION_S": str(options.retention_s),
           "ROLLQ_JOB_RESULT_TTL_S": str(options.retention_s),
           "ROLLQ_CONSUMER_IDLE_S": str(max(10.0, options.retention_s))}
    reward = directory / "reward.yaml"
    reward.write_text(REWARD)
    rollq = [sys.executable, "-m", "rollq"]
    feeder = [*rollq, "feed", "--env", "gsm8k", "--epochs", str(epochs),
              "--batch-groups", str(options.batch_groups), "--max-staleness", "4"]
    feeder_env = {**env, "ROLLQ_POLL_S": "0.05"}
    roles = [Role("feeder", feeder, feeder_env, directory / "feeder.log")]
    for i in range(2):
        roles.append(Role(f"workers-{i}", [
            *rollq, "workers", "--env", "gsm8k", "--inference", inference, "--concurrency",
            "8", "--group-size", "4", "--max-tokens", "16"], env, directory / f"workers-{i}.log"))
        named = ["--consumer", f"scorer-{i}"] if options.fixed_consumer_names else []
        roles.append(Role(f"scorer-{i}", [*rollq, "score", "--reward-config", str(reward),
                                          *named], env, directory / f"scorer-{i}.log"))
    trainer = [sys.executable, "-m", "bench.pipeline", "trainer"]
    if options.trainer_ranks > 1:  # torchrun restarts every rank when one dies
        trainer = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(options.trainer_ranks), "--max-restarts", "1000",
                   "--monitor-interval", "0.5", "-m", "bench.pipeline", "trainer",
                   "--data-parallel"]
    roles.append(Role("trainer", [*trainer, "--run-name", options.run,
                                  "--redis-url", redis_url, "--checkpoint",
                                  str(directory / "trainer.json"),
                                  "--batch-groups", str(options.batch_groups),
                                  "--step-s", str(options.step_s),
                                  "--dedup-window-s", str(options.dedup_window_s)],
                      env, directory / "trainer.log"))
    return roles


async def settled(redis: aioredis.Redis, run: str, checkpoint: Path) -> tuple[int, int]:
    """(admitted, trained + dropped/dead) as the run stands now."""
    admitted = int(await redis.hget(state_key(run), ADMITTED_FIELD) or 0)
    counters = await redis.hgetall(counters_key(run, 0))
    dropped = sum(int(v) for k, v in counters.items()
                  if k.startswith(DROP_PREFIX.encode()) and k != b"drop:duplicate")
    return admitted, len(trained(checkpoint)) + dropped


def trained(checkpoint: Path) -> Counter[int]:
    """Times each dataset position was trained, per the trainer's last checkpoint."""
    try:
        counts = bytes.fromhex(json.loads(checkpoint.read_text())["counts"])
    except (FileNotFoundError, json.JSONDecodeError):
        return Counter()
    return Counter({position: n for position, n in enumerate(counts) if n})


async def outcome(redis: aioredis.Redis, run: str, checkpoint: Path, started: float) -> Outcome:
    """Check every admitted group: trained once (in the last checkpoint) or dead/dropped."""
    admitted = int(await redis.hget(state_key(run), ADMITTED_FIELD) or 0)
    counts = Counter(trained(checkpoint))
    dead: Counter[str] = Counter()
    dead_ids: set[str] = set()
    for _, fields in await redis.xrange(stream_key(run, 0, "dead")):
        letter = decode_dead(fields)
        dead[letter.reason] += 1
        group_id = letter.payload.get(b"group_id", letter.source_id.encode()).decode()
        dead_ids.add(group_id)
    counters = await redis.hgetall(counters_key(run, 0))
    for key, value in counters.items():  # drops that are not dead letters (stale, ...)
        reason = key.decode()[len(DROP_PREFIX):]
        if key.startswith(DROP_PREFIX.encode()) and reason not in dead and reason != "duplicate":
            dead[reason] += int(value)
    lost = [f"{run}:gsm8k:{p}" for p in range(admitted)
            if p not in counts and f"{run}:gsm8k:{p}" not in dead_ids]
    return Outcome(admitted=admitted, trained_once=sum(1 for n in counts.values() if n == 1),
                   lost=lost, duplicated=[f"{run}:gsm8k:{p}" for p, n in counts.items() if n > 1],
                   dead=dead, wall_s=time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline")
    sub = parser.add_subparsers(dest="mode", required=True)
    trainer = sub.add_parser("trainer", help="the pipeline's trainer process")
    trainer.add_argument("--redis-url", required=True)
    trainer.add_argument("--run", "--run-name", default=RUN,
                         help="the run (--run-name under torchrun, whose --run-path clashes)")
    trainer.add_argument("--checkpoint", required=True)
    trainer.add_argument("--batch-groups", type=int, default=8)
    trainer.add_argument("--step-s", type=float, default=0.4)
    trainer.add_argument("--dedup-window-s", type=float, default=6 * 3600.0)
    trainer.add_argument("--data-parallel", action="store_true",
                         help="run as one of N torchrun ranks (rank 0 consumes)")
    trainer.add_argument("--micro-batch-tokens", type=int,
                         help="--data-parallel: token budget of a micro-batch")
    trainer.add_argument("--exit-when-idle", type=int,
                         help="exit 0 after this many empty 1-s reads in a row [never]")
    args = parser.parse_args(argv)
    return data_parallel_trainer_main(args) if args.data_parallel else trainer_main(args)


if __name__ == "__main__":
    sys.exit(main())
