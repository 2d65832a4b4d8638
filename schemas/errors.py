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
  exits non-zero with the message. ``AccessRefused`` is one: Redis refused the user a
  command or a key (ACL ``NOPERM``) or refused its credentials (``WRONGPASS``, ``NOAUTH``),
  which no waiting fixes, so it is never ridden out as an outage.

Foreign exceptions (redis, httpx, pydantic) are translated into these where they enter;
``translated_errors`` is the one translation of redis-py's connection failures, and
``access_refused`` the one wording of a refusal.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

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
    except REFUSALS as exc:  # before ConnectionError: AuthenticationError is one
        raise access_refused(exc) from exc
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        failure = tls_failure(exc)
        if failure is not None:  # a certificate to fix: no waiting makes it verify
            raise tls_refused(failure) from exc
        raise BrokerUnavailable(f"redis unavailable while {action}: {exc}") from exc


class InferenceUnavailable(TransientError):
    """No inference server could serve the request (down, timing out, or 5xx)."""


class RewardError(RollqError):
    """A reward component could not produce a value; never turned into a score of 0."""


class ConfigError(RollqError, ValueError):
    """A setting is invalid; raised at start-up with a message that names the field."""


class AccessRefused(ConfigError):
    """Redis refused this user a command or a key (ACL ``NOPERM``), or its credentials
    (``WRONGPASS``, ``NOAUTH``): a setting to fix, never an outage to wait out (exit 78)."""


REFUSALS = (redis_errors.NoPermissionError, redis_errors.AuthenticationError,
            redis_errors.AuthorizationError)
"""redis-py's errors for a refusal (``AuthenticationError`` subclasses its
``ConnectionError``: catch these first wherever connection errors mean an outage)."""

KEY_PREFIXES = ("rollq:", "arq:")
"""Prefixes of the keys rollq's roles touch (their own, and arq's job queue)."""


def access_refused(exc: BaseException, *, user: str | None = None,
                   command: Sequence[Any] = ()) -> AccessRefused:
    """The ``AccessRefused`` for a refusal ``exc``, naming the user, the command and the key
    pattern it lacks (as far as they are known: ``command`` is the refused command's
    arguments, name first).

    Redis's own NOPERM text names neither the user nor the key, and an operator needs both
    to write the ACL rule that is missing."""
    who = repr(user) if user else "this Redis user"
    words = [_text(part) for part in command]
    name = words[0].upper() if words else "a command"
    keys = [word for word in words[1:] if word.startswith(KEY_PREFIXES)] or words[1:2]
    detail = str(exc) or type(exc).__name__
    if not isinstance(exc, redis_errors.NoPermissionError):
        return AccessRefused(f"Redis refused the credentials of {who} ({detail}): check the "
                             "URL's user and password (and that the ACL user is on)")
    refused_command = re.search(r"run the '([^']+)' command", detail)
    if refused_command:  # Redis names the command it refused (in a script or a MULTI too)
        name = refused_command.group(1).upper()
        lacks = f"the command {name} (ACL rule +{name.lower()} or its category)"
    elif keys:
        lacks = ("the key pattern " if len(keys) == 1 else "one of the key patterns ") + (
            " ".join(f"~{key}" for key in keys) + f" for {name}")
    else:
        lacks = f"a key that {name} names"
    return AccessRefused(
        f"Redis refused {who} {lacks}: {detail}; grant it with ACL SETUSER (rollq's keys "
        "are ~rollq:* and, for feed and workers, arq's ~arq:*; docs/operations.md, "
        "\"TLS and ACL\")")


@contextmanager
def refusals_named(user: str | None, command: Sequence[Any]) -> Iterator[None]:
    """Raise a refusal of ``command`` as ``access_refused`` naming ``user`` and it (the
    one place a client knows both: its ``execute_command``)."""
    try:
        yield
    except REFUSALS as exc:
        raise access_refused(exc, user=user, command=command) from exc


def _text(part: Any) -> str:
    return part.decode(errors="replace") if isinstance(part, bytes) else str(part)


def tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error in ``exc``'s chain that a setting must fix (the server's certificate
    does not verify, or the server refused the client's), else None. redis-py raises its
    ConnectionError inside the handler of the ``ssl`` error, so both links are followed."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return current
        if isinstance(current, ssl.SSLError) and any(
                word in str(current).upper() for word in ("CERTIFICATE", "UNKNOWN_CA")):
            return current
        current = current.__cause__ or current.__context__
    return None


def tls_refused(failure: ssl.SSLError) -> ConfigError:
    """The ``ConfigError`` for a TLS ``failure``: what failed and which settings to check."""
    reason = getattr(failure, "verify_message", None) or failure.reason or str(failure)
    return ConfigError(
        f"TLS to Redis failed ({reason}): check that redis_ca_file (ROLLQ_REDIS_CA_FILE) is "
        "the CA that signed the server's certificate and that the certificate names the "
        "URL's host; a server that asks for client certificates needs redis_cert_file and "
        "redis_key_file (ROLLQ_REDIS_CERT_FILE, ROLLQ_REDIS_KEY_FILE); docs/operations/tls.md")
