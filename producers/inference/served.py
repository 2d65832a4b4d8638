"""The workers' start-up check: does every inference server serve the model?

A worker started with a ``--model`` its servers do not serve fails every job with a 404
(a ``contract_error`` dead letter), and each failure frees an admission slot for the next
job: the dataset burns in seconds. So before the pool takes a job, ``check_served`` asks
each server's ``/v1/models`` and raises ``ConfigError`` (exit 78) naming what each serves.

Policy for servers that do not answer (documented in docs/failures.md):

- **none answers**: vLLM takes minutes to load a model, and the roles of a deployment start
  in any order, so the check *waits*: one WARNING names the servers and why, one more every
  ``remind_s``, until one answers (SIGINT/SIGTERM stop the wait);
- **some answer**: the ones that answer are checked; the others get one WARNING and are
  left to the pool's health checks (a wrong port among them ends in
  ``inference_unavailable`` dead letters, which the run's circuit breaker stops);
- **a server answers, but not as an OpenAI-compatible server** (``/v1/models`` 404 or no
  model list): ``ConfigError``, since waiting cannot fix a wrong URL.

Without ``--model``, the pool uses what the servers serve, so they must all serve the same
first model: a pool of servers serving different models is a ``ConfigError`` too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import structlog

from rollq.producers.inference.errors import InferenceRequestError, InferenceResponseError
from rollq.producers.inference.server import InferenceServer
from rollq.schemas import ConfigError, InferenceUnavailable

log = structlog.get_logger("rollq.inference")

Served = dict[str, list[str]]
"""Model ids by server URL, for the servers that answered."""


async def served_models(urls: Sequence[str], *, timeout_s: float = 5.0,
                        transport: httpx.AsyncBaseTransport | None = None,
                        ) -> tuple[Served, dict[str, str]]:
    """Ask every server's ``/v1/models`` at once: ``(served, unreachable)``, the model ids
    of the servers that answered and, for the others, why not. ``ConfigError`` for a server
    that answers but is no OpenAI-compatible inference server."""
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
        answers = await asyncio.gather(*(_ask(InferenceServer(url.rstrip("/"), client))
                                         for url in urls))
    served = {url: ids for url, ids in zip(urls, answers, strict=True) if isinstance(ids, list)}
    unreachable = {url: why for url, why in zip(urls, answers, strict=True)
                   if isinstance(why, str)}
    return served, unreachable


async def _ask(server: InferenceServer) -> list[str] | str:
    try:
        entries = await server.models()
    except InferenceUnavailable as exc:
        return str(exc)
    except (InferenceRequestError, InferenceResponseError) as exc:
        raise ConfigError(f"{server.base_url} is not an OpenAI-compatible inference server "
                          f"(GET /v1/models: {exc}); check --inference") from None
    return [str(entry.get("id")) for entry in entries if isinstance(entry, dict)]


def mismatch(served: Served, model: str | None) -> str | None:
    """Why the answering servers cannot serve ``model`` (None: they can). Without a
    model, they must agree on the first model they list (the one the pool would use)."""
    listing = "; ".join(f"{url} serves {', '.join(ids) or 'nothing'}"
                        for url, ids in served.items())
    if model is not None:
        if all(model in ids for ids in served.values()):
            return None
        return (f"--model {model!r} is not served by every --inference server: {listing}; "
                "pass --model with the name the servers serve, or fix --inference")
    if len({ids[0] if ids else "" for ids in served.values()}) <= 1:
        return None
    return (f"the --inference servers serve different models: {listing}; point --inference "
            "at servers of one model, or pass --model")


async def check_served(urls: Sequence[str], model: str | None, *, poll_s: float = 2.0,
                       remind_s: float = 60.0, timeout_s: float = 5.0,
                       transport: httpx.AsyncBaseTransport | None = None) -> Served:
    """Wait until some server answers, then ``ConfigError`` unless every answering server
    serves ``model`` (see the module docstring); returns what they serve."""
    started = reminded = time.monotonic()
    warned = False
    while True:
        served, unreachable = await served_models(urls, timeout_s=timeout_s,
                                                  transport=transport)
        if served:
            break
        now = time.monotonic()
        if not warned or now - reminded >= remind_s:
            log.warning("inference_unreachable", servers=unreachable,
                        waited_s=round(now - started, 1),
                        action="waiting for a server to answer GET /v1/models before "
                        "taking jobs")
            warned, reminded = True, now
        await asyncio.sleep(poll_s)
    why = mismatch(served, model)
    if why is not None:
        raise ConfigError(why)
    if unreachable:
        log.warning("inference_unchecked", servers=unreachable,
                    action="not answering at start-up: left to the pool's health checks")
    log.info("inference_checked", model=model, served=_summary(served))
    return served


def _summary(served: Served) -> dict[str, Any]:
    return {url: ids[:5] for url, ids in served.items()}
