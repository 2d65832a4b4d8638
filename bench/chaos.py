"""Chaos: the whole pipeline as real processes while roles are SIGKILLed and Redis restarts.

    python -m bench.chaos --groups 2000                # the full run (kills every 5-15 s)
    python -m bench.chaos --groups 300 --kill-every 2 6  # the CI-sized run (tests/chaos)

What runs, each as its own process, on a real redis-server (AOF, ``appendfsync everysec``)
this script starts, the pipeline of ``bench.pipeline``: a zero-latency fake vLLM server,
``rollq feed``, two ``rollq workers``, two ``rollq score`` and one SDK trainer that
checkpoints what it trained with ``client.state()`` after every ``ack`` and resumes with
``load_state``, as a real trainer does. ``--trainer-ranks 2`` runs that trainer as 2
torchrun ranks (rank 0 the only consumer, ``consumers.trainer.DataParallelSteps``): a
SIGKILL of one rank makes torchrun restart both from the last checkpoint, a SIGKILL of
the launcher takes its ranks with it and the supervisor starts the group again.

Every ``--kill-every`` seconds (uniform between the two bounds) a random worker, scorer,
the trainer or (with ``--trainer-ranks``) one trainer rank gets SIGKILL and is started
again (a supervisor's job; torchrun's for a rank); once, Redis is restarted with a
graceful SHUTDOWN. The roles must reconnect by themselves.

At the end: every admitted group must be trained exactly once (in the trainer's last
checkpoint) or dead-lettered / dropped with a reason. The script prints

    chaos: admitted A, trained once T, lost L, duplicated D, dead X (<reason>: n, ...)

and exits 1 when anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from bench.fake_vllm import FakeServerProcess
from bench.pipeline import (
    RUN,
    Outcome,
    PipelineOptions,
    RankVictim,
    Role,
    build_roles,
    outcome,
    rank_victims,
    settled,
)
from rollq.ops.local.stack import RedisProcess


async def run_chaos(args: argparse.Namespace, directory: Path) -> Outcome:
    rng = random.Random(args.seed)
    redis_server = RedisProcess(directory / "redis", appendonly=True,
                                appendfsync="everysec").start()
    fake = FakeServerProcess().start()
    options = PipelineOptions(groups=args.groups, batch_groups=args.batch_groups,
                              step_s=args.step_s, job_timeout_s=args.job_timeout_s,
                              trainer_ranks=args.trainer_ranks)
    roles = build_roles(redis_server.url, fake.url, directory, options)
    ranks = rank_victims(directory, options)
    redis = aioredis.Redis.from_url(redis_server.url)
    checkpoint = directory / "trainer.json"
    started = time.monotonic()
    try:
        for role in roles:
            role.start()
        victims: list[Role | RankVictim] = [r for r in roles if r.name != "feeder"]
        victims += ranks
        next_kill = started + rng.uniform(*args.kill_every)
        restart_redis_at = started + args.redis_restart_after_s
        restarted = False
        outage = (float("inf"), float("inf"))  # monotonic start and end of the restart
        self_exits: dict[str, int] = {}
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            with contextlib.suppress(aioredis.ConnectionError, OSError):
                admitted, finished = await settled(redis, RUN, checkpoint)
                if admitted >= args.groups and finished >= admitted:
                    break
            if now - started > args.timeout_s:
                print(f"chaos: timed out after {args.timeout_s:.0f} s", file=sys.stderr)
                break
            if not restarted and now >= restart_redis_at:
                print(f"[{now - started:6.1f}s] restarting redis-server (SHUTDOWN)", flush=True)
                outage = (time.monotonic(), 0.0)
                await asyncio.to_thread(redis_server.restart)
                outage = (outage[0], time.monotonic())
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
                    if code == 69 and outage[0] - 1 <= now and (
                            outage[0] - 1 <= role.started_at <= outage[1] + 2
                            or not role.started_up()):
                        # still starting up when Redis went (started into the restart, or
                        # slow to import on a loaded machine): at start-up Redis must answer
                        # at once, by design; the supervisor starts it again
                        print(f"[{now - started:6.1f}s] {role.name} was starting up during "
                              "the Redis restart and exited 69, as designed; starting it "
                              "again", flush=True)
                        role.start()
                        continue
                    print(f"[{now - started:6.1f}s] {role.name} exited {code} by itself "
                          f"(see {role.log}); restarting it", flush=True)
                    self_exits[role.name] = self_exits.get(role.name, 0) + 1
                    role.start()
        await asyncio.sleep(1.0)  # the trainer's last checkpoint lands after its ack
        result = await outcome(redis, RUN, checkpoint, started)
        result.kills = {r.name: r.kills for r in [*roles, *ranks] if r.kills}
        result.self_exits = self_exits
        return result
    finally:
        for role in roles:
            role.stop()
        await redis.aclose()
        fake.stop()
        redis_server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--trainer-ranks", type=int, default=1,
                        help="run the trainer as N torchrun ranks; single ranks are kill "
                             "victims too (torchrun restarts them all) [1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep logs and the trainer state here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollq-chaos-") as scratch:
        directory = args.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        outcome = asyncio.run(run_chaos(args, directory))
    print(f"wall {outcome.wall_s:.1f} s; kills {outcome.kills}; roles that exited by "
          f"themselves: {outcome.self_exits or 'none'}")
    if outcome.lost:
        print(f"lost (first 10): {outcome.lost[:10]}")
    if outcome.duplicated:
        print(f"duplicated (first 10): {outcome.duplicated[:10]}")
    print(outcome.line(), flush=True)
    return 0 if outcome.ok and outcome.admitted >= args.groups else 1


if __name__ == "__main__":
    sys.exit(main())
