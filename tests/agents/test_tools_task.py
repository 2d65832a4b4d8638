"""The ``tools`` task (``producers.envs.tools``): the calc tool, the agent's verdict, the
env on the in-process gateway (fake vLLM), and its warm start's two turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rollq.producers.envs.registry import make_env
from rollq.producers.envs.tools import (
    TOOLS_CHAT_TEMPLATE,
    CalculatorAgent,
    calc_records,
    calculate,
    final_answer,
    tools_env,
)
from rollq.producers.inference import SamplingParams
from rollq.schemas import ConfigError
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import pool_of
from tests.producers.fake_vllm import fake_transport

SAMPLING = SamplingParams(max_tokens=128)
RECORD = calc_records("train")[0]  # What is 0 + 0?


def call_text(expression: str, name: str = "calc") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {
        "expression": expression}}) + "\n</tool_call>"


async def zero() -> int:
    return 0


def test_calc_evaluates_integer_arithmetic_and_refuses_anything_else() -> None:
    assert calculate("3 + 4") == "7"
    assert calculate(" 2*3-10 ") == "-4"
    for bad in ("3 +", "__import__('os')", "2 ** 3", "1.5 + 1", "7 / 2", "", "x + 1"):
        assert calculate(bad) == "error"


def test_the_questions_have_one_digit_answers_the_tool_gives() -> None:
    """``calc.jsonl``: every answer is one digit (chance is 1/10) and is what ``calc``
    returns for the record's expression; the shipped file is what ``make_calc`` writes."""
    from rollq.producers.data.make_calc import make_calc

    records = calc_records("all")
    assert records == make_calc()
    assert len(records) == 152 and len(calc_records("heldout")) == 30
    assert {r["expression"].split()[1] for r in records} == {"+", "-", "*"}
    for record in records:
        assert 0 <= record["answer"] <= 9
        assert calculate(record["expression"]) == str(record["answer"])
        assert record["problem"] == f"What is {record['expression']}?"
    with pytest.raises(ConfigError, match="split"):
        calc_records("test")  # type: ignore[arg-type]


def test_the_final_answer_is_a_bare_integer() -> None:
    assert final_answer(" 12\n") == 12
    assert final_answer("-3") == -3
    for other in ("The answer is 12", "12.0", "", None, "1 2"):
        assert final_answer(other) is None


async def episodes(replies: list[str], group_size: int = 1) -> Any:
    """One group of the ``tools`` env on the in-process gateway, the fake model replying
    ``replies`` in order."""
    fake = AgentFakeVLLM()
    fake.script = lambda prompt, number: replies[number % len(replies)]
    env = tools_env()
    async with pool_of(fake) as pool:
        return await env.rollout(env.item(0), pool, group_size=group_size, sampling=SAMPLING,
                                 policy_version=zero)


@pytest.mark.parametrize(("replies", "reward", "calls", "failure"), [
    ([call_text(RECORD["expression"]), "0"], 1.0, 2, None),  # called, then right
    ([call_text("0 + 0"), "5"], 0.0, 2, None),  # well formed, the wrong answer
    (["0"], 0.0, 1, "no call"),  # answered without the tool
    # another tool: no calc call (this parser drops calls to tools the request did not offer)
    ([call_text("0 + 0", name="search"), "0"], 0.0, 1, "no call"),
    ([call_text("0 +"), "0"], 0.0, 2, "tool error"),  # an expression the tool refuses
    ([call_text("0 + 0"), call_text("0 + 0")], 0.0, 2, "called again"),
    ([call_text("0 + 0"), "The answer is 0"], 0.0, 2, "no number"),
])
async def test_the_reward_is_a_calc_call_then_the_right_number(
        replies: list[str], reward: float, calls: int, failure: str | None) -> None:
    rollout = await episodes(replies)
    (completion,) = rollout.completions
    assert completion.info["env_score"] == reward
    assert completion.info["capture"]["calls"] == calls
    if calls == 2:  # one sequence: the call, the tool's turn masked, the answer
        assert completion.info["sequences"] == 1
        assert 0 in completion.loss_mask.tolist()
    # The same agent straight to the server (the demo's greedy evaluation): why it failed.
    fake = AgentFakeVLLM()
    fake.script = lambda prompt, number: replies[number % len(replies)]
    async with (httpx.AsyncClient(transport=fake_transport(fake)) as http,
                openai.AsyncOpenAI(base_url=f"{fake.base_url}/v1", api_key="none",
                                   http_client=http) as client):
        outcome = await CalculatorAgent().episode(client, RECORD)
    assert (outcome.correct, outcome.failure) == (reward == 1.0, failure)


async def test_episodes_through_a_rollq_gateway_build_no_ssl_context_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every short-lived client of an episode (the gateway's open and close, the agent's
    own) shares one SSL context: building one per client was most of a worker's CPU."""
    import ssl

    from tests.agents.test_gateway import served_gateway

    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context",
                        lambda *a, **k: built.append(1) or real(*a, **k))
    fake = AgentFakeVLLM()
    fake.script = lambda prompt, number: "0" if "<|im_start|>tool" in prompt else call_text(
        RECORD["expression"])
    async with served_gateway(fake) as url, pool_of(fake) as pool:
        env = tools_env(gateway=url)
        for _ in range(2):
            rollout = await env.rollout(env.item(0), pool, group_size=2,
                                        sampling=SAMPLING, policy_version=zero)
            assert [c.info["env_score"] for c in rollout.completions] == [1.0, 1.0]
    assert len(built) <= 1  # 12 clients (2 groups × 2 episodes × 3): at most the first builds


def test_the_env_is_built_by_name_with_its_options() -> None:
    env = make_env("tools", gateway="http://127.0.0.1:1", max_tokens=64, split="heldout")
    assert env.name == "tools" and len(env) == 30
    assert make_env("tools").item(3).fields["problem"] == calc_records("train")[3]["problem"]


def test_warm_start_turns_cut_the_templates_own_renders(tiny_model_dir: Path) -> None:
    from rollq.ops.local.warm_start import Encoder
    from rollq.ops.local.warm_start_tools import ToolTurns, call_text

    turns = ToolTurns(Encoder(tiny_model_dir, TOOLS_CHAT_TEMPLATE))
    first, call, second = turns.turns(RECORD)
    decode = turns.encoder.tokenizer.decode
    assert decode(call) == call_text("0 + 0") + "<|im_end|>"
    assert decode(second[len(first) + len(call):]) == (
        "\n<|im_start|>tool\n0<|im_end|>\n<|im_start|>assistant\n")
    prompt, completion, weights = turns.episode(RECORD, 7)
    assert prompt == first and completion[:len(call)] == call
    assert decode(completion[len(second) - len(first):]) == "7<|im_end|>"
    between = len(second) - len(first) - len(call)
    digits = len(completion) - len(call) - between - 1
    assert weights == [1] * len(call) + [-1] * between + [0] * digits + [1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from rollq.ops.local.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "rollq-tiny", seed=0)


def test_the_tools_tokenizer_writes_a_call_in_few_tokens_and_keeps_its_tags(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """``write_tiny_model(tools=True)``: ``<tool_call>`` and ``</tool_call>`` are single,
    non-special tokens (vLLM's hermes parser reads the detokenised text, which skips special
    ones) and the JSON between them is merged as a real tokenizer merges it; the default
    tokenizer is not changed by the option."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from rollq.ops.local.tiny_model import TOOL_TOKENS, write_tiny_model

    tools = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path / "tools", tools=True))
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = call_text("3 + 4")
    ids = tools(call, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 24 < len(plain(call, add_special_tokens=False)["input_ids"])
    assert [tools.convert_ids_to_tokens(i) for i in (ids[0], ids[-1])] == TOOL_TOKENS
    assert tools.decode(ids, skip_special_tokens=True) == call
    assert not set(TOOL_TOKENS) & set(plain.get_vocab())


def test_a_demo_warm_up_goes_to_either_trainer() -> None:
    from rollq.ops.local.demo import DemoOptions, trainer_argv

    def argv(**given: object) -> list[str]:
        options = DemoOptions.for_task("tools", out=Path("demo-out"), **given)
        return trainer_argv(options, Path("model"), "http://vllm", Path("trainer"),
                            Path("m.jsonl"))

    assert "--warmup-steps" not in argv(warmup_steps=0)
    for ranks in (1, 2):  # the tools recipe warms up over 10 steps
        warmed = argv(trainer_ranks=ranks)
        assert warmed[warmed.index("--warmup-steps") + 1] == "10"


def test_the_demo_evaluation_names_why_episodes_were_out_of_format(tmp_path: Path) -> None:
    from rollq.ops.local.demo_sums import SumsEvaluation

    class Evaluator:
        def evaluate(self, problems: list[dict[str, Any]]) -> dict[str, Any]:
            return {"accuracy": 0.5, "format": 0.75, "failures": {"no call": 2, "no number": 1}}

    said: list[str] = []
    evaluation = SumsEvaluation(Evaluator(), {"train": [], "heldout": []}, 10,
                                tmp_path / "evals.jsonl", said.append)
    evaluation.run(20)
    assert said == ["eval at step   20: train accuracy 0.500  held-out 0.500  format 0.750 "
                    "(no call 2, no number 1)"]
    (row,) = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert row["heldout_failures"] == {"no call": 2, "no number": 1}
