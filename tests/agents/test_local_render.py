"""Chat renders made in the capture layer's process (``capture.render``), against the fake
vLLM: checked against ``/tokenize`` before being trusted, dropped on any difference, and
the same captured episode as with the server's renders. That the local template renders
as real vLLM does is checked in ``test_vllm_agents`` (the real server)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollq.producers.envs.areal import areal_workflow_env
from rollq.producers.envs.base import EpisodeResult, Item
from rollq.producers.envs.episode import GatewayEpisodeEnv, build_rollout
from rollq.producers.envs.registry import make_env
from rollq.producers.inference.capture import (
    CapturedEpisode,
    EpisodeCapture,
    EpisodeClient,
    Upstream,
)
from rollq.producers.inference.capture.render import (
    PROBE_MESSAGES,
    LocalTemplate,
    vllm_conversation,
)
from rollq.producers.inference.errors import InferenceRequestError
from rollq.schemas import ConfigError
from tests.agents.agents import QUESTIONS, CalculatorWorkflow, calculator_episode
from tests.agents.fake_agent_vllm import AgentFakeVLLM, render
from tests.agents.helpers import (
    assert_exactly_served,
    pool_of,
    served,
    tool_script,
    trainable_runs,
)
from tests.agents.pipeline import run_workers
from tests.redis_server import RedisServer

CONVERSATION = [{"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": "Let me see."},
                {"role": "tool", "tool_call_id": "call-0", "content": "42"}]


class FakeTemplate(LocalTemplate):
    """Renders as the fake server does (``fake_agent_vllm.render``); ``differ`` adds a token
    to the renders it selects, ``fail`` raises as a template error would."""

    def __init__(self, *, differ: Any = None, fail: bool = False) -> None:
        super().__init__(tokenizer=None)
        self.differ = differ or (lambda messages: False)
        self.fail = fail
        self.calls = 0

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_options: Mapping[str, Any] | None = None) -> list[int] | None:
        self.calls += 1
        if self.fail:
            raise ValueError("the template raised")
        ids = render([dict(m) for m in messages], tools=[dict(t) for t in tools or []],
                     add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message)
        return [*ids, 7] if self.differ(messages) else ids


async def test_local_renders_are_checked_then_answer_alone() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        upstream = Upstream(pool, template=FakeTemplate(), verify=2)
        for _ in range(5):
            assert await upstream.render(CONVERSATION) == render(CONVERSATION)
    # the probe: 2 tool settings x 2 generation prompts; then the first 2 renders checked
    assert fake.counts["/tokenize"] == 4 + 2
    assert (upstream.local_renders, upstream.server_renders, upstream.render_mismatches) == (
        5, 6, 0)
    assert upstream.template is not None


async def test_a_template_that_differs_is_dropped_and_the_servers_ids_kept() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        on_probe = Upstream(pool, template=FakeTemplate(differ=lambda m: True))
        assert await on_probe.render(CONVERSATION) == render(CONVERSATION)
        assert on_probe.template is None and on_probe.render_mismatches == 1

        # passes the probe, differs on a conversation met later: dropped there
        later = Upstream(pool, template=FakeTemplate(differ=lambda m: len(m) == 1), verify=8)
        assert await later.render(CONVERSATION) == render(CONVERSATION)
        assert later.template is not None
        assert await later.render(CONVERSATION[:1]) == render(CONVERSATION[:1])
        assert later.template is None and later.render_mismatches == 1
        served = later.server_renders
        assert await later.render(CONVERSATION[:1]) == render(CONVERSATION[:1])
        assert later.server_renders == served + 1 and later.local_renders == 1


async def test_a_template_error_is_left_to_the_server() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        template = FakeTemplate()
        upstream = Upstream(pool, template=template, verify=0)
        await upstream.render(CONVERSATION)  # probe passes
        template.fail = True
        assert await upstream.render(CONVERSATION) == render(CONVERSATION)
        assert upstream.template is template and upstream.render_mismatches == 0
        fake.fail_next("400")  # the server's template refuses it too: the agent sees that
        with pytest.raises(InferenceRequestError, match="injected 400"):
            await upstream.render(CONVERSATION)


@pytest.mark.parametrize("compact", [True, False])
async def test_an_episode_captures_the_same_with_local_renders(compact: bool) -> None:
    """The calculator agent (drifting or not) gives the same sequences and counters whether
    its continuations are rendered locally or by ``/tokenize``; local: no /tokenize after
    the checks."""
    captured: list[CapturedEpisode] = []
    tokenize: list[int] = []
    for template in (None, FakeTemplate()):
        fake = AgentFakeVLLM()
        fake.script = tool_script(compact=compact)
        async with pool_of(fake) as pool:
            upstream = Upstream(pool, template=template, verify=0)
            capture = EpisodeCapture(upstream, episode_id="e")
            assert await calculator_episode(EpisodeClient(capture), QUESTIONS[0]) == 1.0
            captured.append(capture.close())
            tokenize.append(fake.counts["/tokenize"])
            rollout = build_rollout([(captured[-1], EpisodeResult())], Item(0, {}))
            assert_exactly_served(rollout.completions, list(rollout.prompt_ids), fake.replies)
    by_server, by_template = captured
    # the same tokens, logprobs, masks and calls (tool-call ids are random: not compared)
    assert [s.model_dump(exclude={"messages"}) for s in by_template.sequences] == [
        s.model_dump(exclude={"messages"}) for s in by_server.sequences]
    assert by_template.stats == by_server.stats
    assert by_server.stats.text_drift == (2 if compact else 0)
    # server: turn-end probe (2) + 2 renders per continuation; local: only its probe (4)
    assert tokenize == [2 + 4, 4]


def test_without_transformers_there_is_no_local_template(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    assert LocalTemplate.load("any-tokenizer") is None


def test_messages_are_given_to_the_template_as_vllm_gives_them() -> None:
    conversation = vllm_conversation(PROBE_MESSAGES)
    assert conversation is not None
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}
    assert "tool_calls" not in conversation[4]  # an empty list is dropped
    assert conversation[5]["content"] == "Thanks.\nAnd 6*8?"
    assert conversation[3] == {"role": "tool", "content": "42", "tool_call_id": "call-0"}
    assert vllm_conversation([{"role": "assistant", "content": None, "reasoning": "r"}]) == [
        {"role": "assistant", "content": "", "reasoning": "r", "reasoning_content": "r"}]
    # left to the server: other roles, non-text parts, arguments that are not an object
    assert vllm_conversation([{"role": "developer", "content": "x"}]) is None
    assert vllm_conversation([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]) is None
    assert vllm_conversation([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]) is None
    assert vllm_conversation([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]) is None
    template = LocalTemplate(tokenizer=None)
    assert template.render(CONVERSATION, template_options={"chat_template": "x"}) is None


async def test_the_in_process_gateway_renders_with_the_envs_template(
        redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    """``areal_workflow_env(..., template=)`` (``--env-option tokenizer=``): the worker's
    in-process gateway renders continuations itself; the capture is the server's tokens."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    template = FakeTemplate()
    env = areal_workflow_env("calc-local-render", CalculatorWorkflow(),
                             [{"question": q} for q in QUESTIONS], template=template)
    [group] = await run_workers(redis_server.url, real_redis, env, fake, [0])
    assert template.calls > 4  # the probe's four renders, then the episodes' own
    assert all(c.info["capture"]["token_in"] == 2 for c in group.completions)
    runs = sorted(run for c in group.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in fake.replies)


def test_the_areal_kind_takes_a_tokenizer_for_its_in_process_gateway(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the train extra is not installed")
    from rollq.ops.local.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", seed=0)
    source = tmp_path / "rows.jsonl"
    source.write_text('{"question": "What is 6*7?"}\n')
    template = str(Path(__file__).with_name("tool_template.jinja"))
    spec = "areal:tests.agents.agents:CalculatorWorkflow"
    env = make_env(spec, source=str(source), tokenizer=str(model), chat_template=template)
    assert isinstance(env, GatewayEpisodeEnv) and env.template is not None
    with pytest.raises(ConfigError, match="needs 'tokenizer'"):
        make_env(spec, source=str(source), chat_template=template)
    with pytest.raises(ConfigError, match="rollq gateway"):
        make_env(spec, source=str(source), tokenizer=str(model), gateway="http://gw:1")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        make_env(spec, source=str(source), tokenizer=str(tmp_path / "nowhere"))
