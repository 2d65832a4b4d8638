"""Atropos envs (``BaseEnv`` subclasses written in ``tests.atropos.atropos_envs``: a
single-turn GSM8K-style env and a two-step one, both building their groups with atroposlib's
``managed_server``) on the real CPU vLLM, both ways rollq runs them:

(a) ``serve`` mode, atroposlib's own env CLI, against ``rollq atropos-api --inference``
    (trajectory API and atroposlib's ``vllm`` server type, ``/generate`` included);
(b) ``rollq workers --env atropos:...`` with ``rollq feed`` and ``rollq score``.

An Atropos-style trainer loop (``/register``, poll ``/batch``) and the rollq trainer SDK
each consume the groups. Mid-run the API process and Redis (AOF, fsync always) are
SIGKILLed and restarted: no group the API acknowledged (or a worker published) is lost,
and no group is handed out again once acked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient
from rollq.ops.local.stack import VllmProcess
from rollq.schemas.keys import stream_key
from tests.atropos.helpers import REGISTRATION, ApiProcess, Process, until
from tests.redis_server import RedisServer

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

GROUP_SIZE = 4  # tests.atropos.atropos_envs.GROUP_SIZE
SUMS_TOKENS, STEP_TOKENS = 16, 12  # max_tokens per call of the two envs


def digest(tokens: list[list[int]]) -> str:
    """``tests.atropos.atropos_envs.posted_digest`` (not imported: it imports atroposlib)."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


def trained_runs(mask: list[int]) -> list[int]:
    """Lengths of the stretches of trained (non -100) labels."""
    runs: list[int] = []
    inside = False
    for label in mask:
        if label != -100:
            if not inside:
                runs.append(0)
            runs[-1] += 1
        inside = label != -100
    return runs


def check_token_exact(group: dict[str, Any]) -> str:
    """The env of a group by its shape; every trained stretch is one generation of at most
    ``max_tokens`` server tokens (a re-tokenised reply of the tiny model's byte soup is
    several times longer), the single-turn env's with the server's logprobs."""
    runs = [trained_runs(mask) for mask in group["masks"]]
    assert len(group["tokens"]) == GROUP_SIZE
    if all(len(r) == 1 for r in runs):
        assert all(r[0] <= SUMS_TOKENS for r in runs), runs
        for mask, logprobs in zip(group["masks"], group["inference_logprobs"], strict=True):
            trained = [lp for label, lp in zip(mask, logprobs, strict=True) if label != -100]
            assert trained and all(lp <= 0.0 for lp in trained)
        return "sums"
    assert all(len(r) == 2 and max(r) <= STEP_TOKENS for r in runs), runs
    return "two_step"


async def sdk_groups(redis_url: str, run: str, count: int) -> list[Any]:
    """The rollq trainer SDK's read of the run: ``count`` groups, acked."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        async with TrainerClient(redis, run=run, consumer="sdk") as trainer:
            batch = await trainer.next_batch(groups=count, timeout_s=60)
            await batch.ack()
            return list(batch.groups)
    finally:
        await redis.aclose()


def stored(redis: RedisServer, run: str) -> int:
    async def count() -> int:
        client = aioredis.Redis.from_url(redis.url)
        try:
            return int(await client.xlen(stream_key(run, 0, "scored")))
        finally:
            await client.aclose()

    return asyncio.run(count())


class Trainer:
    """atroposlib's example trainer's calls: ``/register``, then ``/batch`` in a loop (each
    call acks the batch before it)."""

    def __init__(self, api: ApiProcess, batch_size: int) -> None:
        self.api = api
        self.batch_size = batch_size
        self.batches: list[list[dict[str, Any]]] = []

    def register(self) -> None:
        until(lambda: httpx.post(f"{self.api.url}/register", timeout=10, json={
            **REGISTRATION, "batch_size": self.batch_size}).is_success)

    def poll(self) -> list[dict[str, Any]] | None:
        response = httpx.get(f"{self.api.url}/batch", timeout=30)
        response.raise_for_status()
        batch: list[dict[str, Any]] | None = response.json()["batch"]
        if batch is not None:
            assert sum(len(g["tokens"]) for g in batch) == self.batch_size  # whole groups
            self.batches.append(batch)
        return batch

    def until_groups(self, count: int, timeout_s: float = 400,
                     supervise: Callable[[], None] = lambda: None) -> None:
        def enough() -> bool:
            supervise()
            self.poll()
            return len(self.groups) >= count

        until(enough, timeout_s=timeout_s)

    def until_envs(self, count: int, timeout_s: float = 400,
                   supervise: Callable[[], None] = lambda: None) -> None:
        """Poll on until the batches hold groups of ``count`` envs."""
        def enough() -> bool:
            supervise()
            if len({check_token_exact(g) for g in self.groups}) < count:
                self.poll()
            return len({check_token_exact(g) for g in self.groups}) >= count

        until(enough, timeout_s=timeout_s)

    @property
    def groups(self) -> list[dict[str, Any]]:
        return [group for batch in self.batches for group in batch]


def crash_and_restart(api: ApiProcess, redis: RedisServer) -> None:
    api.kill()
    redis.kill()
    redis.start()
    api.start()


@pytest.fixture
def aof_redis(make_redis_server: type[RedisServer]) -> RedisServer:
    return make_redis_server(appendonly=True).start()  # type: ignore[call-arg]


@pytest.fixture
def children() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for child in reversed(started):
        child.stop()


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted(tmp_path.glob("*.log")))


@pytest.fixture
def vllm_url(vllm_server: VllmProcess) -> str:
    return vllm_server.url


def test_serve_mode_envs_on_real_vllm_survive_api_and_redis_crashes(
        vllm_url: str, tiny_model: Path, aof_redis: RedisServer,
        children: list[Process], tmp_path: Path) -> None:
    run = "atropos-serve"
    api = ApiProcess(aof_redis.url, run, tmp_path / "api.log", "--inference", vllm_url)
    children.append(api)
    api.start()
    trainer = Trainer(api, batch_size=2 * GROUP_SIZE)
    trainer.register()
    assert trainer.poll() is None  # the trainer has started; nothing posted yet
    posted = tmp_path / "posted.txt"
    environment = {"ROLLQ_TEST_INFERENCE_URL": f"{api.url}/inference/v1",
                   "ROLLQ_TEST_TOKENIZER": str(tiny_model), "ROLLQ_TEST_POSTED": str(posted),
                   "ROLLQ_TEST_OPENAI_URL": "http://127.0.0.1:9/v1", "WANDB_MODE": "disabled",
                   "ROLLQ_TEST_ENV_LOG": "1"}  # the env's INFO log, in env_*.log on failure
    envs = [Process([sys.executable, "-m", "tests.atropos.atropos_envs", name, "serve",
                     "--env.rollout_server_url", api.url], tmp_path / f"env_{name}.log",
                    environment) for name in ("managed_sums", "managed_two_step")]
    children.extend(envs)
    for env in envs:
        env.start()

    def supervise() -> None:
        # atroposlib's env process exits when its API stays unreachable past its retries
        # (env_manager's /status-env poll raises): its supervisor starts it again
        for env in envs:
            if env.process is not None and env.process.poll() is not None:
                env.start()

    try:
        trainer.until_groups(2)
        before = len(trainer.groups)
        crash_and_restart(api, aof_redis)  # mid-run: groups in flight, a batch unacked
        trainer.until_groups(before + 4, supervise=supervise)
        trainer.until_envs(2, supervise=supervise)  # the first groups may all be one env's
    except AssertionError:
        raise AssertionError(f"the envs' groups did not come out:\n{_logs(tmp_path)}") from None
    for env in envs:
        env.stop()
    while trainer.poll() is not None:  # drain what is left in whole batches
        pass
    assert httpx.post(f"{api.url}/ack-batch", timeout=10).json()["status"] == "acked"
    queued = httpx.get(f"{api.url}/status", timeout=10).json()["queue_size"]

    handed = [digest(g["tokens"]) for g in trainer.groups]
    # At most the batch out when the API was killed is handed out twice: its answer may
    # have reached the trainer before the API recorded it sent (a duplicate, never a loss)
    assert len(handed) - len(set(handed)) in (0, 2), handed
    acknowledged = set(posted.read_text().split())
    total = stored(aof_redis, run)
    # Every acknowledged group is kept. A post cut short by the envs' stop (or by the
    # crash) may be stored without its answer reaching the env: stored, never lost.
    assert total >= len(acknowledged)
    assert total == len(set(handed)) + queued  # every stored group handed out, or waiting
    assert len(acknowledged - set(handed)) <= queued  # the rest waits for a full batch
    for group in trainer.groups:
        check_token_exact(group)

    groups = asyncio.run(sdk_groups(aof_redis.url, run, total))
    read = {digest([[*g.trajectory.prompt_ids.tolist(), *c.completion_ids.tolist()]
                    for c in g.trajectory.completions]) for g in groups}
    assert len(read) == total and acknowledged <= read and set(handed) <= read
    assert all(g.reward_config == "atropos:env_scores" for g in groups)


ENV_SCORE_ONLY = """\
components: [{name: env, component: env_score}]
advantages: {method: grpo, zero_variance: keep}
pool: {workers: 1}
"""


@pytest.mark.parametrize("env_class", ["ManagedSumsEnv", "ManagedTwoStepEnv"])
def test_atropos_envs_as_rollq_workers_on_real_vllm_survive_api_and_redis_crashes(
        env_class: str, vllm_url: str, tiny_model: Path, aof_redis: RedisServer,
        children: list[Process], tmp_path: Path) -> None:
    run, jobs = "atropos-workers", 6
    env = f"atropos:tests.atropos.atropos_envs:{env_class}"
    config = tmp_path / "env_score.yaml"
    config.write_text(ENV_SCORE_ONLY)
    common = ["--redis-url", aof_redis.url, "--run", run, "--log-format", "json"]
    environment = {"ROLLQ_TEST_TOKENIZER": str(tiny_model),
                   "ROLLQ_TEST_OPENAI_URL": "http://127.0.0.1:9/v1"}
    api = ApiProcess(aof_redis.url, run, tmp_path / "api.log")
    children.append(api)
    api.start()
    trainer = Trainer(api, batch_size=2 * GROUP_SIZE)
    trainer.register()
    roles = [
        Process([sys.executable, "-m", "rollq", "workers", *common, "--env", env,
                 "--inference", vllm_url, "--group-size", str(GROUP_SIZE), "--max-tokens",
                 "16", "--concurrency", "2"], tmp_path / "workers.log",
                # A job whose retry Redis could not record (it was down) stays claimed
                # until its job timeout runs out, then runs again: keep that short here.
                {**environment, "ROLLQ_JOB_TIMEOUT_S": "30"}),
        Process([sys.executable, "-m", "rollq", "feed", *common, "--env", env,
                 "--env-option", f"items={jobs}", "--epochs", "1"],
                tmp_path / "feed.log", environment),
        Process([sys.executable, "-m", "rollq", "score", *common, "--reward-config",
                 str(config)], tmp_path / "score.log"),
    ]
    children.extend(roles)
    for role in roles:
        role.start()
    try:
        trainer.until_groups(2)  # one batch from rollq's own workers
        crash_and_restart(api, aof_redis)  # mid-run: jobs in flight, a batch unacked
        trainer.until_groups(jobs)
        while len({digest(g["tokens"]) for g in trainer.groups}) < jobs:  # a batch seen twice
            trainer.until_groups(len(trainer.groups) + 1)
    except AssertionError:
        raise AssertionError(f"the groups did not come out:\n{_logs(tmp_path)}") from None
    assert httpx.post(f"{api.url}/ack-batch", timeout=10).json()["status"] == "acked"
    handed = [digest(g["tokens"]) for g in trainer.groups]
    assert len(set(handed)) == jobs  # every job's group
    # none again, but for the batch out when the API was killed: its answer may have
    # reached the trainer before the API recorded it sent (a duplicate, never a loss)
    assert len(handed) - jobs in (0, 2), handed
    shapes = {check_token_exact(g) for g in trainer.groups}
    assert shapes == {"sums" if env_class == "ManagedSumsEnv" else "two_step"}

    groups = asyncio.run(sdk_groups(aof_redis.url, run, jobs))
    name = "managed_sums" if env_class == "ManagedSumsEnv" else "managed_two_step"
    assert sorted(g.trajectory.group_id for g in groups) == sorted(
        f"{run}:{name}:{position}" for position in range(jobs))
    for group in groups:
        trajectory = group.trajectory
        assert {digest([[*trajectory.prompt_ids.tolist(), *c.completion_ids.tolist()]
                        for c in trajectory.completions])} <= set(handed)
        for completion, score in zip(trajectory.completions, group.scores, strict=True):
            assert completion.info["token_exact"] is True  # every trained token the server's
            trained = completion.logprobs[completion.loss_mask.astype(bool)]
            assert len(trained) and (trained < 0).all()  # the server's logprobs
            assert score.components["env"] == completion.info["env_score"]
        calls = 1 if name == "managed_sums" else 2 * GROUP_SIZE  # one n=4 call; 2 per sample
        assert trajectory.metadata["model_calls"] == calls
