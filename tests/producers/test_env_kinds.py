"""Built-in env kinds (``gem:``, ``skyrl:``, ``areal:``) and the ``env_return`` reward.

The acceptance run: ``rollq feed``, ``rollq workers --env gem:...`` and ``rollq score`` (the
CLI itself, each in its own thread) on a real redis-server, against the fake vLLM on a
loopback port, to the trainer SDK; the gem game is scored on its episode return with no
user code (a two-line reward config naming ``env_return``).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient
from rollq.ops.cli import Exit, main
from rollq.producers.envs import EpisodeEnv, RecordEpisodeEnv, make_env
from rollq.producers.envs.episode import GatewayEpisodeEnv
from rollq.producers.envs.kinds import DEFAULT_MAX_EPISODE_TURNS
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError
from tests.agents.agents import QUESTIONS
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import tool_script
from tests.agents.pipeline import run_workers
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer

gem = pytest.importorskip("gem", reason="the gem extra (gem-llm) is not installed")

GAME = "game:GuessTheNumber-v0-easy"  # 1..10, 4 turns; \boxed{N} guesses
RUN = "gemkind"
_HINT = re.compile(r"target number is (higher|lower) than (\d+)")


def lowest_guesser(prompt: str, index: int) -> str:
    """A scripted player: guesses the lowest number the hints leave open (so low secrets
    are found, high ones run out of turns and score by distance), in gem's ``\\boxed{}``."""
    low, high = 1, 10
    for direction, number in _HINT.findall(prompt):
        if direction == "higher":
            low = max(low, int(number) + 1)
        else:
            high = min(high, int(number) - 1)
    return f"I guess \\boxed{{{low}}}"


def replayed_return(seed: int, replies: list[str]) -> tuple[list[float], bool]:
    """The game's own rewards for ``replies`` (a fresh gem env), and whether it ended."""
    env = gem.make(GAME)
    env.reset(seed=seed)
    rewards, ended = [], False
    for reply in replies:
        _, reward, terminated, truncated, _ = env.step(reply)
        rewards.append(float(reward))
        ended = bool(terminated or truncated)
        if ended:
            break
    return rewards, ended


@pytest.mark.slow
async def test_rollq_workers_runs_a_gem_game_scored_on_its_return_to_the_trainer(
        redis_server: RedisServer, real_redis: aioredis.Redis, tmp_path: Path) -> None:
    fake = FakeVLLM(max_model_len=4096)
    fake.responder = lowest_guesser
    reward = tmp_path / "reward.yaml"
    reward.write_text("components: [{name: game, component: env_return}]\n"
                      "advantages: {zero_variance: keep}\n")
    common = ["--redis-url", redis_server.url, "--run", RUN]
    env = ["--env", f"gem:{GAME}", "--env-option", "size=3", "--env-option", "first_seed=11"]
    environ = {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_LOG_LEVEL": "warning"}
    async with serve_fake(fake) as url:
        assert await asyncio.to_thread(main, ["feed", *common, *env], environ) == Exit.OK
        assert await asyncio.to_thread(main, [
            "workers", *common, *env, "--inference", url, "--group-size", "2",
            "--max-tokens", "40", "--sampling-option", "min_p=0.05",
            "--sampling-option", 'structured_outputs={"regex": "I guess .*"}', "--burst"],
            environ) == Exit.OK
    assert await asyncio.to_thread(main, ["score", *common, "--reward-config", str(reward),
                                          "--processes", "1", "--burst"], environ) == Exit.OK
    async with TrainerClient(real_redis, run=RUN, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=3, timeout_s=20)
        await batch.ack()
    assert sorted(scored.trajectory.metadata["seed"] for scored in batch.groups) == [11, 12, 13]
    returns = set()
    for scored in batch.groups:
        group = scored.trajectory
        assert group.env == f"gem:{GAME}" and len(group.completions) == 2
        for completion, score in zip(group.completions, scored.scores, strict=True):
            replies = [m["content"] for m in completion.messages if m["role"] == "assistant"]
            rewards, ended = replayed_return(group.metadata["seed"], replies)
            assert ended and completion.info["stop"] in ("terminated", "truncated")
            assert completion.turn_rewards == rewards  # the game's own per-turn rewards
            assert completion.info["env_return"] == pytest.approx(sum(rewards))
            assert score.reward == pytest.approx(sum(rewards))  # scored on the return
            assert score.components["game"] == pytest.approx(sum(rewards))
            mask = np.asarray(completion.loss_mask)
            assert mask[0] == 1 and mask[-1] == 1  # model turns trainable...
            assert (0 in mask) == (len(replies) > 1)  # ...the game's hints between masked
            returns.add(round(sum(rewards), 6))
    assert len(returns) > 1  # the return really varies (seeds 11..13: 5/9, 5/9, 8/9)
    generations = [body for path, body in fake.requests if path == "/v1/completions"]
    assert generations and all(body["min_p"] == 0.05 and body["structured_outputs"] ==
                               {"regex": "I guess .*"} for body in generations)


def test_gem_kind_splits_rollq_options_from_gem_make_options() -> None:
    env = make_env(f"gem:{GAME}", size=5, first_seed=3, max_turns=2,
                   truncated_turn="end_with_penalty", max_completion_tokens=300)
    assert isinstance(env, EpisodeEnv) and len(env) == 5 and env.item(1).fields == {"seed": 4}
    assert env.runner.max_turns == DEFAULT_MAX_EPISODE_TURNS  # the game ends its episodes
    assert env.runner.truncated_turn == "end_with_penalty"
    assert env.runner.max_completion_tokens == 300
    assert env.make_env().env.max_turns == 2  # type: ignore[attr-defined]  # to gem.make
    assert make_env(f"gem:{GAME}", max_episode_turns=3).runner.max_turns == 3  # type: ignore[attr-defined]


def test_gem_kind_errors_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="not found"):
        make_env("gem:game:NoSuchGame-v0")
    with pytest.raises(ConfigError, match="truncated_turn"):
        make_env(f"gem:{GAME}", truncated_turn="drop")
    real_import = builtins.__import__

    def no_gem(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "gem" or name.startswith("gem."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "gem")
    monkeypatch.setattr(builtins, "__import__", no_gem)
    with pytest.raises(ConfigError, match=re.escape("pip install 'rollq[gem]'")):
        make_env(f"gem:{GAME}")


SKYRL_ROWS = [
    {"prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
     "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": "7"},
     "extra_info": {"max_turns": 2}},
    {"prompt": [{"role": "user", "content": "What is 5 times 5?"}],
     "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": "25"},
     "extra_info": {"max_turns": 2}},
]


async def test_skyrl_kind_plays_dataset_rows_with_turn_rewards(tmp_path: Path) -> None:
    pytest.importorskip("skyrl_gym", reason="the skyrl extra (skyrl-gym) is not installed")
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in SKYRL_ROWS))
    env = make_env("skyrl:gsm8k_multi_turn", source=str(source))
    assert isinstance(env, RecordEpisodeEnv) and len(env) == 2
    fake = FakeVLLM(max_model_len=2048)
    # wrong first, right once the env asks again: turn rewards [format bonus, 1.0]
    fake.responder = lambda prompt, index: "#### 7" if "final numeric" in prompt else "#### 6"
    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as pool:
        rollout = await env.rollout(env.item(0), pool, group_size=2,
                                    sampling=SamplingParams(max_tokens=16),
                                    policy_version=_version)
    for completion in rollout.completions:
        assert completion.turn_rewards == [pytest.approx(0.1), 1.0]
        assert completion.info["env_return"] == pytest.approx(1.1)
        assert completion.info["stop"] == "terminated"
    assert rollout.prompt_messages == SKYRL_ROWS[0]["prompt"]
    with pytest.raises(ConfigError, match="no env"):
        make_env("skyrl:no_such_env", source=str(source))
    with pytest.raises(ConfigError, match="source"):
        make_env("skyrl:gsm8k")
    with pytest.raises(ConfigError, match="env_config"):
        make_env("skyrl:gsm8k", source=str(source), temperature=2)


async def _version() -> int:
    return 0


class Collector:
    """An arealite ``RolloutCollector``-shaped class (only its shape is inspected here)."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth

    async def arun_episode(self, llm_client: Any, gconfig: Any, env_option: Any = None,
                           seed: int | None = None) -> Any:
        raise NotImplementedError


async def test_areal_kind_runs_a_workflow_from_a_dataset_through_real_workers(
        redis_server: RedisServer, real_redis: aioredis.Redis, tmp_path: Path) -> None:
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS))
    env = make_env("areal:tests.agents.agents:CalculatorWorkflow", source=str(source),
                   scripted_tool_turns=2)
    assert isinstance(env, GatewayEpisodeEnv) and len(env) == len(QUESTIONS)
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    [group] = await run_workers(redis_server.url, real_redis, env, fake, [0])
    assert [c.info["env_score"] for c in group.completions] == [1.0, 1.0]
    collector = make_env(f"areal:{__name__}:Collector", source=str(source), depth=2)
    assert len(collector) == len(QUESTIONS)
    with pytest.raises(ConfigError, match="bad options"):
        make_env(f"areal:{__name__}:Collector", source=str(source), width=2)
    with pytest.raises(ConfigError, match="neither"):
        make_env(f"areal:{__name__}:lowest_guesser", source=str(source))
