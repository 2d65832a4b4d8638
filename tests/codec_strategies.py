"""Hypothesis strategies of the codec tests (`test_codec.py` and `test_codec_malformed.py`):
completions and trajectory groups of any shape the contract allows."""

from __future__ import annotations

from hypothesis import strategies as st

from rollq.schemas import Completion, TrajectoryGroup

token_ids = st.integers(min_value=0, max_value=2**31 - 1)
logprobs32 = st.floats(width=32, allow_nan=False, allow_infinity=False).map(lambda x: -abs(x))
texts = st.text(max_size=40)


@st.composite
def completions(draw: st.DrawFn) -> Completion:
    n = draw(st.integers(1, 40))
    versioned = draw(st.booleans())
    return Completion(
        completion_ids=draw(st.lists(token_ids, min_size=n, max_size=n)),
        logprobs=draw(st.lists(logprobs32, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        token_versions=draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
        if versioned
        else None,
        policy_version=draw(st.integers(0, 99)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        text=draw(texts),
        reasoning=draw(st.none() | texts),
        messages=draw(st.none() | st.just([{"role": "assistant", "content": "hi"}])),
        turn_rewards=draw(st.lists(st.floats(-10, 10), max_size=3)),
        info=draw(st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1),
                                  max_size=3)),
    )


@st.composite
def groups(draw: st.DrawFn) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=draw(st.text(min_size=1, max_size=20)),
        run="run",
        env=draw(st.text(min_size=1, max_size=10)),
        policy_version=draw(st.integers(0, 10**6)),
        prompt_ids=draw(st.lists(token_ids, max_size=30)),
        prompt_text=draw(texts),
        completions=tuple(draw(st.lists(completions(), min_size=1, max_size=5))),
        metadata=draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)),
        created_at=draw(st.floats(0, 2e9)),
    )
