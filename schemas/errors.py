"""rollq's one exception tree.

Each branch maps to one delivery action; code that catches an error decides what to do with
the stream entry by the branch alone:

- ``ContractError`` (and ``DecodeError``, ``UnknownVersionError``): the entry can never be
  processed. Dead-letter it with the reason and ack it: retrying cannot help.
- ``TransientError`` (``BrokerUnavailable``, ``InferenceUnavailable``): the outside world is
  briefly unavailable. Leave the entry unacked; redelivery or a retry will take it again.
- ``RewardError``: a reward component could not produce a value (it raised, timed out, its
  pool process died). Never a score of 0: the component's policy either skips it for that
  sample (``skip_component``: no value, flagged) or makes the group's reward unknown, which
  is retried and then dead-lettered as ``reward_error`` (``schemas.failures``).
- ``ConfigError``: a setting is wrong. Raised at start-up, before any entry is read; the CLI
  exits non-zero with the message.

Foreign exceptions (redis, httpx, pydantic) are translated into these where they enter;
``translated_errors`` is the one translation of redis-py's connection failures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.exceptions as redis_errors


class RollqError(Exception):
    """Root of every error rollq raises on purpose."""


class ContractError(RollqError):
    """An entry or message breaks the wire contract: dead-letter it and ack."""


class DecodeError(ContractError):
    """Bytes on a stream could not be decoded into a rollq message."""


class UnknownVersionError(DecodeError):
    """The entry carries a schema version this code does not know; never guess."""


class TransientError(RollqError):
    """A dependency is briefly unavailable: leave the entry unacked and retry later."""


class BrokerUnavailable(TransientError):
    """Redis could not be reached or answered with a connection-level error."""


@asynccontextmanager
async def translated_errors(action: str) -> AsyncIterator[None]:
    """Turn redis-py connection failures into ``BrokerUnavailable`` ("redis unavailable
    while <action>: ...")."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise BrokerUnavailable(f"redis unavailable while {action}: {exc}") from exc


class InferenceUnavailable(TransientError):
    """No inference server could serve the request (down, timing out, or 5xx)."""


class RewardError(RollqError):
    """A reward component could not produce a value; never turned into a score of 0."""


class ConfigError(RollqError, ValueError):
    """A setting is invalid; raised at start-up with a message that names the field."""
