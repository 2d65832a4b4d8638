"""The failure taxonomy: each kind of exception maps to one action and one reason."""

from __future__ import annotations

import pytest

from rollq.producers.envs.openenv_session import EnvRewardMissing, EnvServerUnavailable
from rollq.schemas import (
    BrokerUnavailable,
    ContractError,
    DecodeError,
    InferenceUnavailable,
    RewardError,
    UnknownVersionError,
)
from rollq.schemas import failures as f


class ComponentFailed(RewardError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"component failed: {reason}")
        self.reason = reason


CASES: dict[str, tuple[BaseException, f.Kind, str]] = {
    "decode": (DecodeError("field 'lengths' is short"), f.Kind.CONTRACT, f.DECODE_ERROR),
    "version": (UnknownVersionError("v=9"), f.Kind.CONTRACT, f.UNKNOWN_VERSION),
    "contract": (ContractError("prompt too long"), f.Kind.CONTRACT, f.CONTRACT_ERROR),
    "reward": (ComponentFailed("timeout"), f.Kind.REWARD, f.REWARD_ERROR),
    "missing": (ComponentFailed("missing_field"), f.Kind.CONTRACT, f.MISSING_FIELD),
    "inference": (InferenceUnavailable("refused"), f.Kind.TRANSIENT, f.INFERENCE_UNAVAILABLE),
    "redis": (BrokerUnavailable("refused"), f.Kind.TRANSIENT, f.BROKER_UNAVAILABLE),
    "timeout": (TimeoutError(), f.Kind.TRANSIENT, f.JOB_TIMEOUT),
    "env_down": (EnvServerUnavailable("closed"), f.Kind.TRANSIENT, f.ENV_UNAVAILABLE),
    "env_no_reward": (EnvRewardMissing("done, no reward"), f.Kind.TRANSIENT,
                      f.ENV_REWARD_MISSING),
    "bug": (KeyError("x"), f.Kind.UNEXPECTED, f.UNEXPECTED_ERROR),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_classify(case: str) -> None:
    exc, kind, reason = CASES[case]
    failure = f.classify(exc)
    assert (failure.kind, failure.reason) == (kind, reason)
    assert type(exc).__name__ in failure.detail


def test_groups_are_judged_by_their_worst_member() -> None:
    transient = ExceptionGroup("episodes", [InferenceUnavailable("a"), BrokerUnavailable("b")])
    assert f.classify(transient).kind is f.Kind.TRANSIENT
    mixed = ExceptionGroup("episodes", [InferenceUnavailable("a"),
                                        ExceptionGroup("inner", [DecodeError("bad")])])
    assert f.classify(mixed).reason == f.DECODE_ERROR
    assert f.classify(ExceptionGroup("e", [ValueError("x"), ComponentFailed("error")])).kind \
        is f.Kind.UNEXPECTED


@pytest.mark.parametrize(("exc", "retry_unexpected", "attempt", "action", "reason"), [
    (InferenceUnavailable("x"), False, 1, f.Action.RETRY, f.INFERENCE_UNAVAILABLE),
    (InferenceUnavailable("x"), False, 3, f.Action.DEAD_LETTER, f.INFERENCE_UNAVAILABLE),
    (DecodeError("x"), True, 1, f.Action.DEAD_LETTER, f.DECODE_ERROR),
    (ValueError("x"), True, 1, f.Action.RETRY, f.UNEXPECTED_ERROR),
    (ValueError("x"), False, 1, f.Action.DEAD_LETTER, f.UNEXPECTED_ERROR),
    (ComponentFailed("error"), False, 2, f.Action.RETRY, f.REWARD_ERROR),
    (ComponentFailed("error"), False, 3, f.Action.DEAD_LETTER, f.REWARD_ERROR),
])
def test_decide(exc: BaseException, retry_unexpected: bool, attempt: int, action: f.Action,
                reason: str) -> None:
    verdict = f.decide(exc, attempt=attempt, max_attempts=3, retry_unexpected=retry_unexpected)
    assert (verdict.action, verdict.reason) == (action, reason)
    if action is f.Action.DEAD_LETTER and attempt == 3:
        assert verdict.detail.startswith("after 3 tries")


def test_backoff_is_bounded() -> None:
    assert f.backoff_s(1) == 1.0 and f.backoff_s(3) == 4.0 and f.backoff_s(30) == 60.0


def test_detail_is_one_bounded_line() -> None:
    detail = f.error_line(ValueError("a\nb" + "x" * 5000))
    assert "\n" not in detail and len(detail) <= 2000
