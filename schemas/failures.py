"""The failure taxonomy: the one mapping from an exception to what happens to a unit of work.

Every unit of work (a rollout job, a scoring, a rescore, a trainer admission, an episode, a
group posted over an HTTP API) ends in exactly one of:

- **done**: forwarded or acked;
- **retry**: bounded, with back-off; only for failures of the outside world (inference or
  Redis unreachable, a reward worker crashed) that may succeed next time;
- **dead letter**: a named ``reason`` plus a ``detail``; counted under ``drop:<reason>``
  (which also frees the work's admission slot) and requeueable with ``rollq dead requeue``.

``classify`` sorts an exception into a ``Failure`` (its kind and reason name); ``decide``
turns that, the attempt number and the role's limits into a ``Verdict``. Roles call these
two and never match exception classes of their own, so the reason names below are the
whole vocabulary of dead letters (they are part of the wire contract: docs/reference/failures.md).
An infrastructure failure is never turned into a score: a reward component that cannot run
is a ``reward`` failure (retried, then ``reward_error``), not a reward of 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rollq.schemas.errors import (
    BrokerUnavailable,
    ContractError,
    DecodeError,
    InferenceUnavailable,
    RewardError,
    TransientError,
    UnknownVersionError,
)

# -- reason names (wire contract) ----------------------------------------------------------

DECODE_ERROR = "decode_error"
"""An entry's bytes or values break the contract (the detail names the field)."""
UNKNOWN_VERSION = "unknown_version_error"
"""An entry carries a schema version this code does not know."""
CONTRACT_ERROR = "contract_error"
"""Any other contract violation (e.g. a prompt too long for the model)."""
TRAJECTORY_MISSING = "trajectory_missing"
"""A scored entry names a traj entry that is gone or invalid."""
MAX_DELIVERIES = "max_deliveries"
"""A stream entry was delivered ``max_deliveries`` times without being finished."""
REWARD_ERROR = "reward_error"
"""A reward component could not run (raised, timed out, its process died) after retries."""
MISSING_FIELD = "reward_missing_field"
"""The group lacks a metadata field a reward component needs (e.g. the gold answer)."""
BAD_REWARD_DATA = "reward_bad_data"
"""A metadata field a reward component needs is malformed (e.g. a code task's tests)."""
INFERENCE_UNAVAILABLE = "inference_unavailable"
"""Inference failed on every try of a rollout job."""
BROKER_UNAVAILABLE = "broker_unavailable"
"""Redis failed on every try of a unit of work."""
JOB_TIMEOUT = "job_timeout"
"""A rollout job ran past its timeout on every try (or its worker was killed each time)."""
ENTRY_TOO_LARGE = "entry_too_large"
"""A group's encoded entry is above the publisher's ``max_entry_bytes`` (never retried: the
same rollout would be as large again)."""
ENV_SKIPPED = "env_skipped"
"""An env returned no group for its item (an Atropos env's ``collect_trajectories`` gave
None: it filtered the item out); the detail says why when the env said."""
ENV_UNAVAILABLE = "env_unavailable"
"""An env server (``openenv:``) failed a rollout job on every try: it could not be reached,
closed an episode's WebSocket, did not answer a message in time, or had no free session
within the wait; the detail names the server and what happened."""
ENV_REWARD_MISSING = "env_reward_missing"
"""An env ended an episode without a reward (an OpenEnv step answered ``done`` with a null
reward) on every try of a rollout job: its scoring failed, which is never a reward of 0."""
SESSION_EXPIRED = "session_expired"
"""An external agent session group (``rollq gateway --sessions``) had no call and no close
for ``session_ttl_s``: its agent went away; the detail says which sessions were closed."""
SEQUENCE_TOO_LONG = "sequence_too_long"
"""A scored group holds a sequence longer than its trainer takes (TRL's
``max_completion_length`` for the completion, its ``token_budget`` for prompt + completion):
dead-lettered by the trainer's adapter instead of truncated or dropped unseen; the detail
names the sequence, its length and the limit."""
UNEXPECTED_ERROR = "unexpected_error"
"""Anything else: a bug in rollq, an env or a component; the detail holds the exception."""


class Kind(StrEnum):
    """What sort of failure an exception is."""

    CONTRACT = "contract"
    """Retrying cannot help: dead-letter now."""
    TRANSIENT = "transient"
    """The outside world was briefly unavailable: retry with back-off."""
    REWARD = "reward"
    """A reward component could not produce a value: retry, then dead-letter."""
    UNEXPECTED = "unexpected"
    """A bug or an unknown failure: the role's policy (retry or dead-letter now)."""


class Action(StrEnum):
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class Failure:
    """An exception sorted by ``classify``: its kind, reason name and a one-line detail."""

    kind: Kind
    reason: str
    detail: str


@dataclass(frozen=True)
class Verdict:
    """What to do with the unit of work: retry it, or dead-letter it with ``reason``."""

    action: Action
    reason: str
    detail: str

    @property
    def retry(self) -> bool:
        return self.action is Action.RETRY


def error_line(exc: BaseException) -> str:
    """``Type: message``, one line, bounded (it goes into a dead letter and a log line)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 2000 else text[:1997] + "..."


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def classify(exc: BaseException) -> Failure:
    """Sort an exception (an ``ExceptionGroup`` by its worst member) into a ``Failure``.

    Order of severity for groups: contract, unexpected, reward, transient — a group that
    holds one contract error cannot succeed on retry, one that holds only transient
    errors can.
    """
    failures = [_classify_one(leaf) for leaf in _leaves(exc)]
    for kind in (Kind.CONTRACT, Kind.UNEXPECTED, Kind.REWARD, Kind.TRANSIENT):
        for failure in failures:
            if failure.kind is kind:
                return failure
    raise AssertionError("unreachable: every leaf has a kind")


def _classify_one(exc: BaseException) -> Failure:
    detail = error_line(exc)
    if isinstance(exc, UnknownVersionError):
        return Failure(Kind.CONTRACT, UNKNOWN_VERSION, detail)
    if isinstance(exc, DecodeError):
        return Failure(Kind.CONTRACT, DECODE_ERROR, detail)
    if isinstance(exc, ContractError):
        return Failure(Kind.CONTRACT, getattr(exc, "reason", None) or CONTRACT_ERROR, detail)
    if isinstance(exc, RewardError):
        reason = getattr(exc, "reason", "")
        if reason == "missing_field":  # the data lacks the field: no retry can add it
            return Failure(Kind.CONTRACT, MISSING_FIELD, detail)
        if reason == "bad_tests":  # the env's own data is malformed: no retry can fix it
            return Failure(Kind.CONTRACT, BAD_REWARD_DATA, detail)
        return Failure(Kind.REWARD, REWARD_ERROR, detail)
    if isinstance(exc, InferenceUnavailable):
        return Failure(Kind.TRANSIENT, INFERENCE_UNAVAILABLE, detail)
    if isinstance(exc, BrokerUnavailable):
        return Failure(Kind.TRANSIENT, BROKER_UNAVAILABLE, detail)
    if isinstance(exc, TransientError):
        return Failure(Kind.TRANSIENT, getattr(exc, "reason", None) or "transient_error", detail)
    if isinstance(exc, TimeoutError):
        return Failure(Kind.TRANSIENT, JOB_TIMEOUT, detail)
    return Failure(Kind.UNEXPECTED, UNEXPECTED_ERROR, detail)


def decide(exc: BaseException, *, attempt: int, max_attempts: int,
           retry_unexpected: bool) -> Verdict:
    """The verdict for a unit of work that raised ``exc`` on try ``attempt`` (1-based) of
    at most ``max_attempts``.

    Contract failures are dead-lettered at once; transient and reward failures are
    retried while tries remain, then dead-lettered with their own reason (the detail says
    after how many tries); unexpected ones are retried only where the role says so
    (``retry_unexpected``: rollout jobs, whose envs may be flaky) and otherwise
    dead-lettered at once (a scorer bug would fail the same way every time).
    """
    failure = classify(exc)
    retryable = failure.kind in (Kind.TRANSIENT, Kind.REWARD) or (
        failure.kind is Kind.UNEXPECTED and retry_unexpected)
    if retryable and attempt < max_attempts:
        return Verdict(Action.RETRY, failure.reason, failure.detail)
    detail = failure.detail
    if retryable:
        detail = f"after {attempt} tries: {detail}"
    return Verdict(Action.DEAD_LETTER, failure.reason, detail)


def backoff_s(attempt: int, *, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """Exponential back-off before try ``attempt + 1``: base · 2^(attempt − 1), capped."""
    return float(min(cap_s, base_s * 2.0 ** max(0, attempt - 1)))
