"""Chaos: the whole pipeline as real processes while roles are SIGKILLed and Redis restarts.

    python -m bench.chaos --groups 2000                # the full run (kills every 5-15 s)
    python -m bench.chaos --groups 300 --kill-every 2 6  # the CI-sized run (tests/chaos)

What runs, each as its own process, on a real redis-server (AOF, ``appendfsync everysec``)
this script starts: a zero-latency fake vLLM server (``bench.workers``), ``rollq feed``,
two ``rollq workers``, two ``rollq score`` and one trainer (``python -m bench.chaos
trainer``: the SDK's ``SyncTrainerClient``; its "model" is the list of group ids it trained,
checkpointed after every ``ack`` together with ``client.state()``, and restored with
``load_state`` on restart, as a real trainer does).

Every ``--kill-every`` seconds (uniform between the two bounds) a random worker, scorer or
the trainer gets SIGKILL and is started again (a supervisor's job); once, Redis is restarted
with a graceful SHUTDOWN. The roles must reconnect by themselves.

At the end: every admitted group must be trained exactly once (in the trainer's last
checkpoint) or dead-lettered / dropped with a reason. The script prints

    chaos: admitted A, trained once T, lost L, duplicated D, dead X (<reason>: n, ...)

and exits 1 when anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.workers import FakeServerProcess
from ops.stack import RedisProcess
from schemas import decode_dead
from schemas.keys import (
    ADMITTED_FIELD,
    DROP_PREFIX,
    counters_key,
    state_key,
    stream_key,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "chaos"
GSM8K_ITEMS = 200  # the sample dataset rollq ships (producers/data/gsm8k_sample.jsonl)
REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
          "advantages: {method: grpo, zero_variance: keep}\n")


# ------------------------------------------------------------------------------ the trainer

def trainer_main(args: argparse.Namespace) -> int:
    """A trainer whose model is the list of groups it trained (see the module doc)."""
    from consumers.trainer import SyncTrainerClient, TrainerClientSettings

    checkpoint = Path(args.checkpoint)
    settings = TrainerClientSettings(batch_groups=args.batch_groups, max_staleness=None,
                                     reclaim_idle_ms=3000, reclaim_every_s=1.0,
                                     block_ms=200)
    with SyncTrainerClient(args.redis_url, run=RUN, consumer="trainer-0",
                           settings=settings) as client:
        trained: list[str] = []
        step = 0
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            trained, step = saved["trained"], saved["step"]
            client.load_state(saved["client"])
        while True:
            batch = client.next_batch(groups=args.batch_groups, timeout_s=1.0)
            if not batch.groups:
                continue
            trained.extend(batch.group_ids)  # "the optimizer step"
            time.sleep(args.step_s)
            step += 1
            client.publish_policy(step, checkpoint.parent)  # no servers: bumps the version
            batch.ack()
            _write_atomically(checkpoint, {"trained": trained, "step": step,
                                           "client": client.state()})


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

    def start(self) -> None:
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


@dataclass
class Outcome:
    admitted: int
    trained_once: int
    lost: list[str]
    duplicated: list[str]
    dead: Counter[str]
    wall_s: float
    kills: dict[str, int] = field(default_factory=dict)
    exits: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.dead.items()))
        return (f"chaos: admitted {self.admitted}, trained once {self.trained_once}, "
                f"lost {len(self.lost)}, duplicated {len(self.duplicated)}, "
                f"dead {sum(self.dead.values())} ({reasons})")

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated


def _roles(redis_url: str, inference: str, directory: Path, args: argparse.Namespace) -> list[Role]:
    epochs = -(-args.groups // GSM8K_ITEMS)
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_url, "ROLLQ_RUN": RUN,
           "ROLLQ_LOG_FORMAT": "json", "ROLLQ_RECLAIM_IDLE_S": "3",
           "ROLLQ_JOB_TIMEOUT_S": str(args.job_timeout_s), "ROLLQ_MAX_TRIES": "5",
           "ROLLQ_REDIS_GIVE_UP_S": "120", "ROLLQ_BLOCK_MS": "200",
           "ROLLQ_REQUEST_TIMEOUT_S": "10"}
    reward = directory / "reward.yaml"
    reward.write_text(REWARD)
    rollq = [sys.executable, "-m", "ops.cli"]
    feeder = [*rollq, "feed", "--env", "gsm8k", "--epochs", str(epochs),
              "--batch-groups", str(args.batch_groups), "--max-staleness", "4"]
    feeder_env = {**env, "ROLLQ_POLL_S": "0.05"}
    roles = [Role("feeder", feeder, feeder_env, directory / "feeder.log")]
    for i in range(2):
        roles.append(Role(f"workers-{i}", [
            *rollq, "workers", "--env", "gsm8k", "--inference", inference, "--concurrency",
            "8", "--group-size", "4", "--max-tokens", "16"], env, directory / f"workers-{i}.log"))
        roles.append(Role(f"scorer-{i}", [*rollq, "score", "--reward-config", str(reward),
                                          "--consumer", f"scorer-{i}"],
                          env, directory / f"scorer-{i}.log"))
    roles.append(Role("trainer", [sys.executable, "-m", "bench.chaos", "trainer",
                                  "--redis-url", redis_url, "--checkpoint",
                                  str(directory / "trainer.json"),
                                  "--batch-groups", str(args.batch_groups),
                                  "--step-s", str(args.step_s)],
                      env, directory / "trainer.log"))
    return roles


async def _settled(redis: aioredis.Redis, total: int, checkpoint: Path) -> tuple[int, int]:
    """(admitted, trained + dropped/dead) as the run stands now."""
    admitted = int(await redis.hget(state_key(RUN), ADMITTED_FIELD) or 0)
    counters = await redis.hgetall(counters_key(RUN, 0))
    dropped = sum(int(v) for k, v in counters.items()
                  if k.startswith(DROP_PREFIX.encode()) and k != b"drop:duplicate")
    return admitted, len(set(_trained(checkpoint))) + dropped


def _trained(checkpoint: Path) -> list[str]:
    """The group ids in the trainer's last checkpoint (none before its first)."""
    try:
        return list(json.loads(checkpoint.read_text())["trained"])
    except (FileNotFoundError, json.JSONDecodeError):
        return []


async def _outcome(redis: aioredis.Redis, checkpoint: Path, total: int,
                   started: float) -> Outcome:
    admitted = int(await redis.hget(state_key(RUN), ADMITTED_FIELD) or 0)
    counts = Counter(_trained(checkpoint))
    dead: Counter[str] = Counter()
    dead_ids: set[str] = set()
    for _, fields in await redis.xrange(stream_key(RUN, 0, "dead")):
        letter = decode_dead(fields)
        dead[letter.reason] += 1
        group_id = letter.payload.get(b"group_id", letter.source_id.encode()).decode()
        dead_ids.add(group_id)
    counters = await redis.hgetall(counters_key(RUN, 0))
    for key, value in counters.items():  # drops that are not dead letters (stale, ...)
        reason = key.decode()[len(DROP_PREFIX):]
        if key.startswith(DROP_PREFIX.encode()) and reason not in dead and reason != "duplicate":
            dead[reason] += int(value)
    expected = {f"{RUN}:gsm8k:{position}" for position in range(admitted)}
    lost = sorted(expected - set(counts) - dead_ids)
    return Outcome(admitted=admitted, trained_once=sum(1 for n in counts.values() if n == 1),
                   lost=lost, duplicated=sorted(g for g, n in counts.items() if n > 1),
                   dead=dead, wall_s=time.monotonic() - started)


async def run_chaos(args: argparse.Namespace, directory: Path) -> Outcome:
    rng = random.Random(args.seed)
    redis_server = RedisProcess(directory / "redis", appendonly=True,
                                appendfsync="everysec").start()
    fake = FakeServerProcess().start()
    roles = _roles(redis_server.url, fake.url, directory, args)
    redis = aioredis.Redis.from_url(redis_server.url)
    checkpoint = directory / "trainer.json"
    started = time.monotonic()
    try:
        for role in roles:
            role.start()
        victims = [r for r in roles if r.name != "feeder"]
        next_kill = started + rng.uniform(*args.kill_every)
        restart_redis_at = started + args.redis_restart_after_s
        restarted = False
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            with contextlib.suppress(aioredis.ConnectionError, OSError):
                admitted, settled = await _settled(redis, args.groups, checkpoint)
                if admitted >= args.groups and settled >= admitted:
                    break
            if now - started > args.timeout_s:
                print(f"chaos: timed out after {args.timeout_s:.0f} s", file=sys.stderr)
                break
            if not restarted and now >= restart_redis_at:
                print(f"[{now - started:6.1f}s] restarting redis-server (SHUTDOWN)", flush=True)
                await asyncio.to_thread(redis_server.restart)
                restarted = True
            if now >= next_kill:
                victim = rng.choice(victims)
                print(f"[{now - started:6.1f}s] SIGKILL {victim.name}", flush=True)
                victim.kill()
                victim.start()
                next_kill = now + rng.uniform(*args.kill_every)
            for role in roles:  # a role that exits on its own is a finding, not a kill
                code = role.exited
                if code is not None and not (role.name == "feeder" and code == 0):
                    print(f"[{now - started:6.1f}s] {role.name} exited {code} by itself "
                          f"(see {role.log}); restarting it", flush=True)
                    role.start()
        await asyncio.sleep(1.0)  # the trainer's last checkpoint lands after its ack
        outcome = await _outcome(redis, checkpoint, args.groups, started)
        outcome.kills = {r.name: r.kills for r in roles if r.kills}
        return outcome
    finally:
        for role in roles:
            role.stop()
        await redis.aclose()
        fake.stop()
        redis_server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode")
    trainer = sub.add_parser("trainer", help=argparse.SUPPRESS)
    trainer.add_argument("--redis-url", required=True)
    trainer.add_argument("--checkpoint", required=True)
    trainer.add_argument("--batch-groups", type=int, default=8)
    trainer.add_argument("--step-s", type=float, default=0.4)
    parser.add_argument("--groups", type=int, default=2000, help="groups to admit [2000]")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(5.0, 15.0),
                        metavar=("MIN_S", "MAX_S"), help="seconds between kills [5 15]")
    parser.add_argument("--redis-restart-after-s", type=float, default=20.0,
                        help="restart redis-server once, this long into the run [20]")
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.4,
                        help="seconds per trainer step; the feeder paces the run to it [0.4]")
    parser.add_argument("--job-timeout-s", type=float, default=8.0,
                        help="rollout job timeout: a killed worker's jobs re-run after it [8]")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep logs and the trainer state here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "trainer":
        return trainer_main(args)
    with tempfile.TemporaryDirectory(prefix="rollq-chaos-") as scratch:
        directory = args.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        outcome = asyncio.run(run_chaos(args, directory))
    print(f"wall {outcome.wall_s:.1f} s; kills {outcome.kills}")
    if outcome.lost:
        print(f"lost (first 10): {outcome.lost[:10]}")
    if outcome.duplicated:
        print(f"duplicated (first 10): {outcome.duplicated[:10]}")
    print(outcome.line(), flush=True)
    return 0 if outcome.ok and outcome.admitted >= args.groups else 1


if __name__ == "__main__":
    sys.exit(main())
