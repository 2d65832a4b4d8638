"""Single-turn dataset envs: loading, gold metadata, one request per group."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from rollq.producers.data.make_sample import make_problems
from rollq.producers.envs import (
    GSM8K,
    MATH,
    DatasetEnv,
    PromptStyle,
    gsm8k_env,
    last_boxed,
    load_records,
    math_env,
    parse_gsm8k_answer,
)
from rollq.producers.envs.registry import sample_path
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError, ContractError
from tests.producers.fake_vllm import FakeVLLM, encode_text, fake_transport, render_chat

MATH_ROWS = [{"problem": "What is $1/2 + 1/2$?",
              "solution": "We add: $\\frac12+\\frac12 = \\boxed{1}$."},
             {"problem": "Simplify $\\frac{2}{4}$.",
              "solution": "Divide: $\\boxed{\\frac{1}{2}}$"}]


async def version() -> int:
    return 7


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_gold_parsers() -> None:
    assert parse_gsm8k_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert parse_gsm8k_answer("#### $5") == "5"
    assert parse_gsm8k_answer("no marker") is None
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None


def test_shipped_sample_is_deterministic_small_and_gsm8k_shaped() -> None:
    path = Path(sample_path())
    assert path.stat().st_size < 100_000
    rows = load_records(path)
    assert len(rows) == 200 and rows == make_problems(200, seed=0)
    for row in rows:
        gold = parse_gsm8k_answer(row["answer"])
        assert gold is not None and gold.lstrip("-").isdigit()


def test_gsm8k_metadata_carries_gold_number_and_solution(tmp_path: Path) -> None:
    rows = [{"question": "1+2?", "answer": "1 + 2 = <<1+2=3>>3\n#### 3"}]
    env = gsm8k_env(write_jsonl(tmp_path / "g.jsonl", rows))
    assert len(env) == 1 and env.item(0).fields == rows[0]
    assert GSM8K.metadata(rows[0], 0) == {"answer": "3", "gold": "3",
                                          "solution": rows[0]["answer"], "index": 0}


def test_math_metadata_carries_the_boxed_gold() -> None:
    metadata = MATH.metadata(MATH_ROWS[1], 1)
    assert metadata["gold"] == "\\frac{1}{2}"
    assert metadata["answer"] == "\\boxed{\\frac{1}{2}}"
    assert metadata["solution"] == MATH_ROWS[1]["solution"]


def test_unparseable_gold_is_a_contract_error() -> None:
    with pytest.raises(ContractError):
        GSM8K.metadata({"question": "q", "answer": "no marker"}, 3)


def test_json_array_files_load_too(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(MATH_ROWS))
    assert load_records(path) == MATH_ROWS


def test_missing_fields_and_empty_data_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lack fields"):
        DatasetEnv("x", [{"q": 1}], GSM8K)
    with pytest.raises(ConfigError, match="no records"):
        DatasetEnv("x", [], GSM8K)


async def test_chat_rollout_is_one_request_with_n_choices(tmp_path: Path) -> None:
    fake = FakeVLLM()
    env = math_env(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS),
                   style=PromptStyle(system_prompt="Think step by step."))
    async with InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        rollout = await env.rollout(env.item(0), pool, group_size=4,
                                    sampling=SamplingParams(max_tokens=8),
                                    policy_version=version)
    assert fake.counts["/v1/chat/completions"] == 1
    assert fake.requests[-1][1]["n"] == 4
    messages = [{"role": "system", "content": "Think step by step."},
                {"role": "user", "content": MATH_ROWS[0]["problem"]}]
    assert rollout.prompt_messages == messages
    assert rollout.prompt_ids == render_chat(messages, add_generation_prompt=True)
    assert len(rollout.completions) == 4
    assert all(c.policy_version == 7 and c.loss_mask.all() for c in rollout.completions)
    assert rollout.metadata["answer"] == "\\boxed{1}"


async def test_completion_mode_uses_the_template() -> None:
    fake = FakeVLLM()
    rows = load_records(sample_path())[:3]
    env = DatasetEnv("gsm8k", rows, GSM8K,
                     PromptStyle(mode="completion", template="Q: {question}\nA:"))
    async with InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        rollout = await env.rollout(env.item(2), pool, group_size=2,
                                    sampling=SamplingParams(), policy_version=version)
    prompt = f"Q: {rows[2]['question']}\nA:"
    assert fake.requests[-1][1]["prompt"] == prompt
    assert rollout.prompt_ids == encode_text(prompt) and rollout.prompt_text == prompt
    assert rollout.metadata["gold"] == parse_gsm8k_answer(rows[2]["answer"])


def test_parquet_loading(tmp_path: Path) -> None:
    if importlib.util.find_spec("pyarrow") is None:
        (tmp_path / "x.parquet").touch()
        with pytest.raises(ConfigError, match="pyarrow"):
            load_records(tmp_path / "x.parquet")
        pytest.skip("pyarrow is not installed: only its clear error is tested")
    import pyarrow as pa  # type: ignore[import-not-found,unused-ignore]  # optional
    import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]  # optional

    pq.write_table(pa.Table.from_pylist(MATH_ROWS), tmp_path / "m.parquet")
    assert load_records(tmp_path / "m.parquet") == MATH_ROWS


def test_hugging_face_datasets_loading(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ConfigError, match="datasets"):
            load_records("json", data_files=str(path))
        pytest.skip("datasets is not installed: only its clear error is tested")
    assert load_records("json", data_files=str(path)) == MATH_ROWS


@pytest.mark.parametrize("source", ["missing.jsonl", "missing.parquet", "no/such/dataset"])
def test_missing_dataset_is_a_config_error(tmp_path: Path, source: str) -> None:
    with pytest.raises(ConfigError, match=r"does not exist|cannot load dataset"):
        load_records(tmp_path / source if "." in source else source)
