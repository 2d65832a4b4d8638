"""Qwen3's own tokenizer and chat template on the real CPU vLLM: the multi-turn traps of a real
template, each run by an unmodified ``openai`` agent through every capture path (a worker's
episode env, ``rollq gateway`` over uvicorn, an external session) and straight to vLLM.

The model is random (``rollq tiny-model --tokenizer qwen3``): it neither thinks nor calls
tools on its own, so every turn is forced by vLLM's structured outputs (a regex over the
whole reply: ``<think>`` blocks, Hermes ``<tool_call>`` JSON, truncated calls) or by
``tool_choice`` ``required`` / named; a ``logit_bias`` makes it write ``<think>`` and
``<tool_call>`` as the single added tokens a real Qwen3 writes. The forced texts are fixed,
so the agent must see the same replies (content, reasoning, tool calls, finish reason)
through rollq as straight from vLLM, whatever token ids each prompt led to.

Per trap and path: the trained tokens are exactly the sampled ones, id for id with vLLM's
logprobs (a recording proxy in front of vLLM); no template token (``<|im_start|>``, the
empty think block of thinking-off, ``<tool_response>`` turns) is ever trainable. Each trap
also measures what a re-rendering system would train instead: the final history rendered
by the tokenizer's ``apply_chat_template``, compared with the captured sequence (the table
in docs/guides/agents.md).
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from rollq.ops.gateway.app import create_app
from rollq.ops.local.stack import VllmProcess
from rollq.ops.settings import GatewaySettings
from rollq.producers.envs.base import EpisodeResult, Item
from rollq.producers.envs.episode import ClientEpisodeEnv, GatewayEpisodeEnv
from rollq.producers.inference import SamplingParams
from rollq.producers.inference.capture import RemoteGateway
from rollq.schemas import TrajectoryGroup, decode_trajectory
from rollq.schemas.keys import stream_key
from tests.agents.agents import calculate
from tests.agents.helpers import kept_replies, served, trainable_runs
from tests.agents.pipeline import run_workers
from tests.agents.test_vllm_agents import served_gateway
from tests.integration.interpreters import vllm_python
from tests.integration.recording import RecordingTransport
from tests.redis_server import RedisServer, free_port
from tests.serving import serve_asgi

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

SERVED = "qwen3-tiny"
GENERATION = ("/v1/chat/completions", "/v1/completions")
IM_START, TOOL_RESPONSE, THINK, THINK_END, TOOL_CALL = 151644, 151665, 151667, 151668, 151657
SINGLE_TAGS = {str(token): 10.0 for token in (THINK, THINK_END, TOOL_CALL, TOOL_CALL + 1)}
"""``logit_bias``: where the regex allows ``<think>`` the model writes the added token."""
NO_THINKING = {"enable_thinking": False}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "enum": ["6*7", "2+3", "4*5"]}}, "required": ["expression"]}}}
"""An enum keeps a guided call (``tool_choice`` required or named) short on random weights."""
TABLE: dict[str, dict[str, int]] = {}
"""Per trap, what the episode path trained and what a re-render would have (printed: the
table in docs/guides/agents.md)."""


def call_regex(*expressions: str) -> str:
    calls = [r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "'
             + expression.replace("*", r"\*").replace("+", r"\+") + r'"\}\}\n</tool_call>'
             for expression in expressions]
    return r"\n".join(calls)


def forced(regex: str, turn: int, **fields: Any) -> dict[str, Any]:
    return {"seed": 100 + turn, "max_tokens": 64,
            "extra_body": {"structured_outputs": {"regex": regex}, **fields}}


def thinking(turn: int) -> dict[str, Any]:
    return forced(rf"<think>\nstep {turn}\n</think>\n\nok {turn}", turn)


class TrapAgent:
    """One agent per trap, written for the ``openai`` client; ``seen`` keeps every reply as
    the agent saw it (content, reasoning, tool calls, finish reason) and ``history`` the
    last messages it held (the re-render compares against them)."""

    def __init__(self, trap: str, model: str = SERVED) -> None:
        self.trap, self.model = trap, model
        self.seen: list[tuple[Any, ...]] = []
        self.history: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.template_options: dict[str, Any] = {}

    async def ask(self, client: Any, messages: list[dict[str, Any]],
                  fields: dict[str, Any]) -> dict[str, Any]:
        if self.tools:
            fields = {"tools": self.tools, **fields}
        if self.model == SERVED and "extra_body" in fields:  # a forced turn of Qwen3
            fields = {"logit_bias": SINGLE_TAGS, **fields}
        reply = await client.chat.completions.create(model=self.model, messages=messages,
                                                     **fields)
        choice = reply.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls") or []]
        self.seen.append((message.get("content"), message.get("reasoning"), calls,
                          choice.finish_reason))
        return message

    def answer_calls(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
        messages.append(message)
        for call in message.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"] or "{}")
            expression = arguments.get("expression", "") if isinstance(arguments, dict) else ""
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": calculate(str(expression))})

    async def run(self, client: Any) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
        off = {"chat_template_kwargs": NO_THINKING}
        if self.trap == "thinking-on":  # three turns, a user turn between them
            for turn in range(3):
                messages.append(await self.ask(client, messages, thinking(turn)))
                messages.append({"role": "user", "content": f"And then {turn}?"})
            messages.pop()
        elif self.trap == "thinking-off":
            self.template_options = NO_THINKING
            for turn in range(2):
                messages.append(await self.ask(client, messages, forced(f"ok {turn}", turn,
                                                                        **off)))
                messages.append({"role": "user", "content": "Again?"})
            messages.pop()
        elif self.trap == "tool-calls":  # one call, then two in a turn, then the answer
            self.tools, self.template_options = [CALCULATOR], NO_THINKING
            for turn, regex in enumerate([call_regex("6*7"), call_regex("2+3", "4*5"),
                                          "the answer is 42"]):
                self.answer_calls(messages, await self.ask(client, messages,
                                                           forced(regex, turn, **off)))
        elif self.trap == "tool-choice":  # required, named, required: guided by vLLM
            self.tools = [CALCULATOR]
            named = {"type": "function", "function": {"name": "calculator"}}
            for turn, choice in enumerate(["required", named, "required"]):
                self.answer_calls(messages, await self.ask(client, messages, {
                    "seed": 100 + turn, "max_tokens": 48, "tool_choice": choice}))
        elif self.trap == "edited-history":  # rewrites a tool result, then drops turns
            self.tools, self.template_options = [CALCULATOR], NO_THINKING
            self.answer_calls(messages, await self.ask(client, messages, forced(
                call_regex("6*7"), 0, **off)))
            messages.append(await self.ask(client, messages, forced("it is 42", 1, **off)))
            messages = [*messages[:2], {**messages[2], "content": "41"}]  # rewritten, cut
            messages.append(await self.ask(client, messages, forced("it is 41", 2, **off)))
            messages = [messages[0], {"role": "user", "content": "Just 42?"}]  # a turn dropped
            messages.append(await self.ask(client, messages, forced("yes", 3, **off)))
        elif self.trap == "chatml-turns":  # SmolLM2: plain turns, one edited, one cut short
            for turn, text in enumerate(["Six times seven is 42.", "Yes, 42."]):
                messages.append(await self.ask(client, messages, forced(text, turn)))
                messages.append({"role": "user", "content": "Are you sure?"})
            messages.append(await self.ask(client, messages, {
                **forced("I am sure, it is 42.", 2), "max_tokens": 3}))
            messages = [{"role": "user", "content": "What is 6 times 7?"}, *messages[1:]]
            messages.append({"role": "user", "content": "Go on."})
            messages.append(await self.ask(client, messages, forced("42.", 3)))
        elif self.trap == "length-in-call":  # max_tokens stops inside the <tool_call>
            self.tools, self.template_options = [CALCULATOR], NO_THINKING
            message = await self.ask(client, messages, {
                **forced(call_regex("6*7"), 0, **off), "max_tokens": 9})
            messages += [message, {"role": "user", "content": "Finish the call."}]
            self.answer_calls(messages, await self.ask(client, messages, forced(
                call_regex("6*7"), 1, **off)))
        else:
            raise AssertionError(self.trap)
        self.history = messages
        return 1.0


TRAPS = ["thinking-on", "thinking-off", "tool-calls", "tool-choice", "edited-history",
         "length-in-call"]
PATHS = ["episode", "gateway", "session"]


class TrapEnv:
    """The trap agent as an ``AgentEnv`` (the worker's episode path)."""

    def __init__(self, trap: str, model: str) -> None:
        self.name, self.trap, self.model = f"trap-{trap}", trap, model
        self.agents: list[TrapAgent] = []

    def __len__(self) -> int:
        return 1

    def item(self, index: int) -> Item:
        return Item(index=index, fields={})

    async def run_episode(self, client: Any, item: Item, *,
                          sampling: SamplingParams) -> EpisodeResult:
        self.agents.append(TrapAgent(self.trap, self.model))
        return EpisodeResult(reward=await self.agents[-1].run(client))

    async def run(self, data: dict[str, Any], *, base_url: str,
                  http_client: httpx.AsyncClient | None = None, **extra: Any) -> float:
        """The same agent as a workflow (the gateway path)."""
        self.agents.append(TrapAgent(self.trap, self.model))
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none",
                                      max_retries=0) as client:
            return await self.agents[-1].run(client)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """The tiny random model under Qwen3's tokenizer and template, with vLLM's ``hermes``
    tool parser and ``qwen3`` reasoning parser; structured outputs apply from the first
    token (``enable_in_reasoning``: the regexes force the ``<think>`` block itself), and JSON
    is compact (``disable_any_whitespace``: a random model's guided tool call otherwise fills
    its budget with whitespace)."""
    from rollq.ops.local.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("qwen3") / SERVED, tokenizer="qwen3")
    python = vllm_python()
    server = VllmProcess(
        python, model, tmp_path_factory.mktemp("vllm-qwen3") / "server.log",
        served_name=SERVED, max_model_len=2048,
        compile_cache=Path(python).resolve().parent.parent / "inductor-cache",
        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--reasoning-parser", "qwen3", "--structured-outputs-config",
                    json.dumps({"backend": "xgrammar", "enable_in_reasoning": True,
                                "disable_any_whitespace": True})]).start(timeout_s=400)
    yield server
    server.stop()


async def direct_replies(url: str, trap: str, model: str) -> TrapAgent:
    agent = TrapAgent(trap, model)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none",
                                  max_retries=0) as client:
        await agent.run(client)
    return agent


async def through(path: str, trap: str, server: VllmProcess, redis_server: RedisServer,
                  redis: aioredis.Redis) -> tuple[TrajectoryGroup, RecordingTransport,
                                                  list[TrapAgent]]:
    recorder = RecordingTransport()
    env = TrapEnv(trap, server.served_name)
    if path == "episode":
        [group] = await run_workers(redis_server.url, redis, ClientEpisodeEnv(env), None, [0],
                                    inference_url=server.url, transport=recorder,
                                    group_size=1)
    elif path == "gateway":
        async with served_gateway(server.url, recorder) as url:
            [group] = await run_workers(
                redis_server.url, redis, GatewayEpisodeEnv(env.name, env, [{}],
                                                           gateway=RemoteGateway(url)),
                None, [0], inference_url=server.url, group_size=1)
    else:
        port = free_port()
        app = create_app(GatewaySettings(inference=[server.url], port=port, run="qwen3",
                                         sessions=True), transport=recorder, redis=redis)
        async with serve_asgi(app, port, start_timeout_s=30) as url, \
                httpx.AsyncClient(base_url=url) as http:
            [session] = (await http.post("/sessions", json={"env": trap, "group_size": 1})
                         ).json()["sessions"]
            async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x",
                                          max_retries=0) as client:
                env.agents.append(TrapAgent(trap, server.served_name))
                reward = await env.agents[-1].run(client)
            closed = await http.post(f"/sessions/{session['session_id']}/close",
                                     json={"reward": reward})
            assert closed.status_code == 200, closed.text
        [group] = [decode_trajectory(fields) for _, fields in
                   await redis.xrange(stream_key("qwen3", 0, "traj"))]
    return group, recorder, env.agents


def check_exact(group: TrajectoryGroup, recorder: RecordingTransport) -> list[dict[str, Any]]:
    """Trained ids and logprobs are exactly vLLM's sampled ones; returns the replies kept."""
    replies = [reply for path, _, reply in recorder.exchanges if path in GENERATION]
    kept = [reply for reply in replies
            if reply in kept_replies(list(group.completions), list(group.prompt_ids), [reply])]
    resent = sum(c.info["capture"]["resent"] for c in group.completions)
    assert len(replies) - len(kept) == resent
    runs = sorted(run for c in group.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in kept)
    for completion in group.completions:
        ids, mask = completion.completion_ids.tolist(), completion.loss_mask.tolist()
        own = completion.info["prompt_tokens"]
        assert mask[:own] == [0] * own
        for token in (IM_START, TOOL_RESPONSE):  # template and tool tokens: never trained
            assert all(not m for t, m in zip(ids, mask, strict=True) if t == token)
    return kept


def rerender_figures(model_dir: Path, agent: TrapAgent, group: TrajectoryGroup
                     ) -> dict[str, int]:
    """The last sequence as captured against the final history re-rendered by the template
    (what a system that re-tokenises the conversation trains on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    last = group.completions[-1]
    captured = [*group.prompt_ids, *last.completion_ids.tolist()]
    mask = [0] * len(group.prompt_ids) + last.loss_mask.tolist()
    conversation = [{**message, "content": message.get("content") or "",
                     **({"reasoning_content": message["reasoning"]}
                        if message.get("reasoning") is not None else {})}
                    for message in agent.history]  # as vLLM hands them to the template
    rerendered = tokenizer.apply_chat_template(
        conversation, tools=agent.tools, tokenize=True, return_dict=False,
        **agent.template_options)
    matcher = difflib.SequenceMatcher(a=captured, b=list(rerendered), autojunk=False)
    lost = sum(sum(mask[i1:i2]) for tag, i1, i2, _, _ in matcher.get_opcodes()
               if tag in ("replace", "delete"))
    unsampled = sum(j2 - j1 for tag, _, _, j1, j2 in matcher.get_opcodes()
                    if tag in ("replace", "insert"))
    return {"sequences": len(group.completions), "captured": len(captured),
            "trained": sum(mask), "think_trained": sum(
                m for t, m in zip(captured, mask, strict=True) if t == THINK),
            "rerendered": len(rerendered),
            "think_rerendered": list(rerendered).count(THINK),
            "sampled_lost": lost, "unsampled_in_rerender": unsampled}


async def run_trap(server: VllmProcess, trap: str, redis_server: RedisServer,
                   redis: aioredis.Redis) -> dict[str, Any]:
    """The trap straight to vLLM, then through every path: the same replies, exact
    tokens (``check_exact``); per path the group, the replies kept and the episode's stats;
    the re-render figures of the episode path in ``TABLE``."""
    started = time.monotonic()
    direct = await direct_replies(server.url, trap, server.served_name)
    runs: dict[str, Any] = {"direct": direct}
    for path in PATHS:
        await redis.flushall()
        group, recorder, agents = await through(path, trap, server, redis_server, redis)
        [agent] = agents
        assert agent.seen == direct.seen, (path, agent.seen, direct.seen)
        kept = check_exact(group, recorder)
        stats = group.completions[0].info["capture"]  # the episode's, on each sequence
        assert stats["calls"] == len(agent.seen)
        runs[path] = (group, kept, stats, recorder)
        if path == "episode":
            TABLE[trap] = rerender_figures(server.model_dir, agent, group)
    print(f"{trap}: {time.monotonic() - started:.1f} s, {TABLE.get(trap)}")
    return runs


@pytest.mark.parametrize("trap", TRAPS)
async def test_qwen3_template_traps_are_token_exact_on_every_path(
        qwen3_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
        trap: str) -> None:
    runs = await run_trap(qwen3_server, trap, redis_server, real_redis)
    direct = runs["direct"]
    for path in PATHS:
        group, kept, stats, recorder = runs[path]
        sequences = len(group.completions)
        if trap in ("thinking-on", "thinking-off", "tool-calls", "length-in-call"):
            assert sequences == 1  # every turn spliced onto what was sampled
            assert stats["token_in"] >= 1  # the template re-rendered the history differently
        if trap == "thinking-on":  # each turn's <think> trained as sampled
            [completion] = group.completions
            think = [t for t, m in zip(completion.completion_ids.tolist(),
                                       completion.loss_mask.tolist(), strict=True)
                     if m and t == THINK]
            assert len(think) == 3
        if trap == "thinking-off":  # the empty think block is the prompt's, never trained
            for reply in kept:
                ids, _ = served(reply)
                assert THINK not in ids and THINK_END not in ids
        if trap == "edited-history":
            assert sequences == 3  # the rewrite and the cut each open a new sequence
        if trap == "tool-choice":  # each continuation went as chat, as sent: its own sequence
            assert stats["chat_fallback"] == sequences - 1
            asked = [(body.get("tool_choice"), reply["choices"][0])
                     for route, body, reply in recorder.exchanges if route in GENERATION]
            assert [choice for choice, _ in asked] == [
                "required", {"type": "function", "function": {"name": "calculator"}},
                "required"]  # honoured: every call went to vLLM's guided chat route
            for _, choice in asked:  # a guided call, unless the budget cut it short
                assert choice["message"].get("tool_calls") or choice["finish_reason"] == "length"
        if trap == "length-in-call":
            assert direct.seen[0][3] == "length" and direct.seen[0][2] == []
