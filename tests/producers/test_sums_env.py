"""The ``sums`` task: its shipped data, its env, and its shipped reward config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollq.consumers.scorer import RewardConfig
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.scorer.traces import extract_reasoning
from rollq.producers.data.make_sums import make_sums, write_sums
from rollq.producers.envs import DatasetEnv
from rollq.producers.envs.registry import make_env
from rollq.producers.envs.sums import CHANCE, sums_env, sums_path, sums_records
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError
from tests.producers.fake_vllm import FakeVLLM, fake_transport

SUMS_REWARD = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "sums.yaml"


def test_the_shipped_file_is_what_the_generator_writes(tmp_path: Path) -> None:
    write_sums(tmp_path / "sums.jsonl")
    assert (tmp_path / "sums.jsonl").read_bytes() == Path(sums_path()).read_bytes()


def test_every_single_digit_pair_once_80_train_20_heldout_disjoint() -> None:
    train, heldout = sums_records("train"), sums_records("heldout")
    pairs = [(r["a"], r["b"]) for r in train + heldout]
    assert len(train) == 80 and len(heldout) == 20
    assert sorted(pairs) == [(a, b) for a in range(10) for b in range(10)]
    assert len(sums_records("all")) == 100
    assert {r["problem"] for r in train}.isdisjoint({r["problem"] for r in heldout})


def test_the_split_is_fixed_by_the_seed() -> None:
    def held(seed: int) -> set[str]:
        return {str(r["problem"]) for r in make_sums(seed) if r["split"] == "heldout"}

    assert held(0) == held(0)
    assert held(0) != held(1)


def test_records_carry_the_target_format_and_the_gold_sum() -> None:
    env = sums_env()
    for index in range(len(env)):
        item = env.item(index)
        a, b = item.fields["a"], item.fields["b"]
        assert item.fields["problem"] == f"What is {a} + {b}?"
        assert item.fields["solution"] == f"<think>{a} + {b}</think> \\boxed{{{a + b}}}"
        metadata = env.format.metadata(item.fields, index)
        assert metadata["gold"] == str(a + b)
        assert metadata["answer"] == f"\\boxed{{{a + b}}}"
    assert CHANCE == pytest.approx(1 / 19)  # sums range over 0..18


def test_registry_builds_each_split_and_rejects_a_bad_one() -> None:
    assert len(make_env("sums")) == 80
    heldout = make_env("sums", split="heldout", system_prompt="Add.")
    assert isinstance(heldout, DatasetEnv) and len(heldout) == 20
    assert heldout.prompt(heldout.item(0))[0] == {"role": "system", "content": "Add."}
    with pytest.raises(ConfigError, match="split"):
        make_env("sums", split="test")


async def version() -> int:
    return 3


async def test_a_rollout_is_one_chat_request_with_the_gold_in_metadata() -> None:
    fake = FakeVLLM()
    env = sums_env()
    async with InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        rollout = await env.rollout(env.item(7), pool, group_size=8,
                                    sampling=SamplingParams(max_tokens=20),
                                    policy_version=version)
    assert fake.counts["/v1/chat/completions"] == 1
    assert len(rollout.completions) == 8
    a, b = env.item(7).fields["a"], env.item(7).fields["b"]
    assert rollout.prompt_messages == [{"role": "user", "content": f"What is {a} + {b}?"}]
    assert rollout.metadata["answer"] == f"\\boxed{{{a + b}}}"
    assert {c.policy_version for c in rollout.completions} == {3}


def _scores(text: str, answer: str = "\\boxed{7}") -> dict[str, float | None]:
    config = RewardConfig.from_yaml(SUMS_REWARD)
    sample = Sample(text=text, completion_ids=np.zeros(12, np.int32),
                    trace=extract_reasoning(text), metadata={"answer": answer})
    return {entry.name: entry.build().score(sample, [sample]) for entry in config.components}


@pytest.mark.parametrize(("text", "accuracy", "format"), [
    ("<think>3 + 4</think> \\boxed{7}", 1.0, 1.0),
    ("<think>3 + 4</think> \\boxed{8}", 0.0, 1.0),  # right format, wrong answer
    ("<think>3 + 4</think> \\boxed{7}\n", 1.0, 1.0),
    ("<think>3 + 4 \\boxed{7}", 0.0, 0.0),  # unclosed think block: no answer region
    ("3 + 4 = \\boxed{7}", 0.0, 0.0),  # no think block
    ("<think>3 + 4</think> 7", 0.0, 0.0),  # no box
    ("<think>3 + 4</think> \\boxed{7} \\boxed{7}", 1.0, 0.0),  # two boxes
    ("<think>\\boxed{7}</think> \\boxed{7}", 1.0, 0.0),  # a box inside the reasoning
    ("<think>a</think><think>b</think> \\boxed{7}", 1.0, 0.0),  # two think blocks
    ("Sure. <think>3 + 4</think> \\boxed{7}", 1.0, 0.0),  # text before the think block
])
def test_the_shipped_reward_scores_format_and_accuracy_apart(
        text: str, accuracy: float, format: float) -> None:
    assert _scores(text) == {"accuracy": accuracy, "format": format}


def test_the_shipped_reward_gives_every_gold_solution_full_marks() -> None:
    for record in sums_records("all"):
        answer = f"\\boxed{{{int(record['a']) + int(record['b'])}}}"
        assert _scores(str(record["solution"]), answer) == {"accuracy": 1.0, "format": 1.0}


def test_the_shipped_reward_config_keeps_zero_variance_groups() -> None:
    config = RewardConfig.from_yaml(SUMS_REWARD)
    assert config.advantages.zero_variance == "keep"
    assert {e.name: e.weight for e in config.components} == {"accuracy": 1.0, "format": 0.2}
