"""One bus, both ends: the rollq SDK reads groups that Atropos envs posted, ``/batch``
serves groups from rollq's own envs, and ``--rewards bridge`` hands groups to the scorers."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.scorer.advantages import compute_advantages
from rollq.consumers.trainer import TrainerClient
from rollq.ops.atropos.convert import ENV_SCORE
from rollq.schemas import decode_trajectory, encode
from rollq.schemas.keys import stream_key
from tests.atropos.helpers import REGISTRATION, api_client, atropos_group
from tests.factories import make_group, score

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")


async def test_the_rollq_sdk_reads_groups_posted_by_atropos_envs(redis: aioredis.Redis) -> None:
    posted = [atropos_group(1), atropos_group(2, advantages=[[0.0] * 3 + [0.5] * 4,
                                                            [0.0] * 3 + [-0.5] * 5])]
    async with api_client(redis, run="both") as client:
        for group in posted:
            assert (await client.post("/scored_data", json=group)).status_code == 200
    async with TrainerClient(redis, run="both", consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=2, timeout_s=5)
        assert len(batch) == 2
        first, second = batch.groups
        assert first.trajectory.prompt_ids.tolist() == posted[0]["tokens"][0][:3]
        for i, completion in enumerate(first.trajectory.completions):
            assert completion.completion_ids.tolist() == posted[0]["tokens"][i][3:]
            assert completion.loss_mask.tolist() == [1] * len(completion.completion_ids)
            assert completion.logprobs.tolist() == posted[0]["inference_logprobs"][i][3:]
            assert completion.info[ENV_SCORE] == posted[0]["scores"][i]
        assert [s.reward for s in first.scores] == posted[0]["scores"]
        grpo = compute_advantages(posted[0]["scores"])
        assert [s.advantage for s in first.scores] == pytest.approx(grpo.tolist())
        assert [s.advantage for s in second.scores] == [0.5, -0.5]  # the env's own
        row = batch.input_ids[0][: batch.lengths[0]].tolist()
        assert row == posted[0]["tokens"][0]
        assert await batch.ack() == 2


async def test_batch_serves_groups_from_rollqs_own_envs(redis: aioredis.Redis) -> None:
    groups = [score(make_group(run="both", group_size=2, seed=s), [1.0, 0.0]) for s in range(2)]
    for group in groups:
        await redis.xadd(stream_key("both", 0, "scored"), encode(group))  # type: ignore[arg-type]
    async with api_client(redis, run="both") as client:
        await client.post("/register", json=REGISTRATION)
        served = (await client.get("/batch")).json()["batch"]
    assert len(served) == 2
    for out, group in zip(served, groups, strict=True):
        trajectory = group.trajectory
        prompt = trajectory.prompt_ids.tolist()
        for i, completion in enumerate(trajectory.completions):
            assert out["tokens"][i] == prompt + completion.completion_ids.tolist()
            assert out["masks"][i] == [-100] * len(prompt) + completion.completion_ids.tolist()
            assert out["inference_logprobs"][i][len(prompt):] == pytest.approx(
                completion.logprobs.tolist())
            assert out["advantages"][i] == [0.0] * len(prompt) + [
                group.scores[i].advantage] * len(completion.completion_ids)
        assert out["scores"] == [1.0, 0.0]
        assert out["env_id"] is None and out["messages"] is None


async def test_bridge_mode_hands_posted_groups_to_the_scorers(redis: aioredis.Redis) -> None:
    posted = atropos_group(1, messages=[[{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": f"a{i}"}]
                                        for i in range(2)])
    async with api_client(redis, run="bridge", rewards="bridge") as client:
        assert (await client.post("/scored_data", json=posted)).status_code == 200
        assert await redis.xlen(stream_key("bridge", 0, "scored")) == 0
    [(_, fields)] = await redis.xrange(stream_key("bridge", 0, "traj"))
    trajectory = decode_trajectory(fields)
    assert [c.info[ENV_SCORE] for c in trajectory.completions] == posted["scores"]
    assert [c.text for c in trajectory.completions] == ["a0", "a1"]
    assert np.array_equal(trajectory.prompt_ids, posted["tokens"][0][:3])


async def test_the_bridge_adds_components_on_top_of_the_env_score(
        redis: aioredis.Redis) -> None:
    from rollq.consumers.scorer.bridge import RewardBridge
    from rollq.consumers.scorer.config import RewardConfig
    from rollq.consumers.scorer.consumer import Scorer

    posted = atropos_group(1, messages=[[{"role": "assistant", "content": "<think>x</think>"
                                          if i else "no tags"}] for i in range(2)])
    posted["scores"] = [0.25, 0.75]
    async with api_client(redis, run="bridge", rewards="bridge") as client:
        await client.post("/scored_data", json=posted)
    [(_, fields)] = await redis.xrange(stream_key("bridge", 0, "traj"))
    config = RewardConfig.model_validate({"components": [
        {"name": "env", "component": "env_score", "weight": 1.0},
        {"name": "think", "component": "char_fraction", "weight": 2.0,
         "settings": {"pattern": "[<>]"}}]})
    async with RewardBridge(config) as bridge:
        scored = await Scorer(bridge, "test").score(decode_trajectory(fields))
    assert not isinstance(scored, str)
    assert [s.components["env"] for s in scored.scores] == [0.25, 0.75]
    assert scored.scores[0].reward == pytest.approx(0.25)  # no '<' or '>' in "no tags"
    assert scored.scores[1].reward == pytest.approx(0.75 + 2 * 4 / 16)
