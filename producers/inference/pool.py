"""A pool of vLLM servers: balancing, health checks, retries, and waiting out pauses.

Balancing is least-outstanding-requests across healthy, unpaused servers; ties go round
robin. A background task probes ``/health`` and ``/is_paused`` every ``health_interval_s``;
a server that fails is skipped until a probe finds it healthy again. An error in that task
other than an unreachable server is a bug: it is logged, re-raised by the next request and
by ``__aexit__``, never swallowed.

Retries (``max_retries``, exponential backoff with jitter) cover connection errors,
timeouts, 5xx and "no healthy server". A 4xx raises ``InferenceRequestError`` at once.

Pauses (vLLM's ``/pause`` during a weight update), as observed on vLLM 0.32:

- a request *submitted* while paused is held by the server and completes after
  ``/resume`` (every pause mode);
- a request *in flight* on ``/pause?mode=abort`` returns 200 with ``finish_reason:
  "abort"`` and partial tokens; with ``mode=keep`` it is frozen and then finishes (its
  tokens span two policies); with ``mode=wait`` the pause waits for it.

So the pool routes new requests away from servers known to be paused; when every healthy
server is paused it polls ``/is_paused`` (one poll shared by all waiters) with backoff for
up to ``pause_timeout_s`` before sending, then raises ``PauseTimeout``. An aborted
response is not a failure: the server is marked paused and the whole request is sent
again once a server is ready, up to ``max_aborts`` times (the retry budget is untouched).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
import structlog

from rollq.producers.inference.errors import (
    GenerationAborted,
    InferenceRequestError,
    PauseTimeout,
    ServerUnreachable,
)
from rollq.producers.inference.params import (
    Backoff,
    Choice,
    ModelInfo,
    SamplingParams,
    WeightSpan,
)
from rollq.producers.inference.server import InferenceServer, MessageDict
from rollq.schemas import ConfigError, InferenceUnavailable
from rollq.schemas.keys import adapter_name

log = structlog.get_logger("rollq.inference")

T = TypeVar("T")
_UNTIMED = frozenset({"models", "tokenize", "/tokenize", "/v1/models"})
"""Calls that generate nothing: not in the per-server latency and token counts."""


class InferencePool:
    """Async client of one or more vLLM servers serving the same model.

    Use as ``async with InferencePool([...]) as pool``; the httpx client and the health
    task live between ``__aenter__`` and ``__aexit__``. Safe to share between coroutines.

    - ``model``: name sent in requests; None discovers it once from ``/v1/models``.
    - ``timeout_s``: read timeout of one request (a generation may take minutes);
      ``connect_timeout_s`` for connecting.
    - ``max_retries``: retries after the first attempt on transient failures; then
      ``InferenceUnavailable``. ``backoff`` spaces them.
    - ``health_interval_s``: seconds between probes; None disables probing (servers are
      then never marked unhealthy).
    - ``pause_timeout_s``: longest wait for a paused server before ``PauseTimeout``;
      ``pause_poll`` spaces the ``/is_paused`` polls; ``max_aborts``: resends of one
      request after aborted generations.
    - ``logprobs_mode``: the servers' ``--logprobs-mode``, recorded with each sample
      (``Choice.sampling``); ``auto`` asks each server's ``/server_info`` (vLLM in dev
      mode) once; None: not known.
    - ``lora_name`` with ``policy_version`` (reads the run's version): the trainer syncs a
      LoRA adapter (``weight_sync='lora'``); each generation names the adapter of the
      version it read, ``<lora_name>-v<version>`` (the base model at version 0), and its
      tokens carry that version.
    - ``transport``: an httpx transport (``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff: Backoff | None = None,
        health_interval_s: float | None = 5.0,
        pause_timeout_s: float = 600.0,
        pause_poll: Backoff | None = None,
        max_aborts: int = 8,
        max_connections: int | None = None,
        api_key: str | None = None,
        logprobs_mode: str | None = None,
        lora_name: str | None = None,
        policy_version: Callable[[], Awaitable[int]] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_urls:
            raise ConfigError("InferencePool needs at least one server URL")
        if max_retries < 0 or max_aborts < 0:
            raise ConfigError("max_retries and max_aborts must be >= 0")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self.model = model
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff = backoff or Backoff()
        self.health_interval_s = health_interval_s
        self.pause_timeout_s = pause_timeout_s
        self.pause_poll = pause_poll or Backoff(initial_s=0.1, multiplier=1.5, max_s=2.0,
                                                jitter=0.2)
        self.max_aborts = max_aborts
        self.max_connections = max_connections
        self.api_key = api_key
        self.logprobs_mode = logprobs_mode
        self.lora_name = lora_name
        self.policy_version = policy_version
        self.transport = transport
        self.servers: list[InferenceServer] = []
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._pause_poll: asyncio.Task[None] | None = None
        self._model_info: ModelInfo | None = None
        self._model_task: asyncio.Task[ModelInfo] | None = None
        self._turn = itertools.count()

    async def __aenter__(self) -> Self:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._client = httpx.AsyncClient(
            transport=self.transport,
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=self.max_connections,
                                max_keepalive_connections=None),
        )
        self.servers = [InferenceServer(url, self._client) for url in self.base_urls]
        for server in self.servers:
            server.declared_logprobs_mode = self.logprobs_mode
        if self.health_interval_s is not None:
            self._health_task = asyncio.create_task(self._watch_health(self.health_interval_s),
                                                    name="rollq-inference-health")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        task, self._health_task = self._health_task, None
        failure: BaseException | None = None
        if task is not None:
            if task.done() and not task.cancelled():
                failure = task.exception()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for background in (self._pause_poll, self._model_task):
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if failure is not None and exc is None:
            raise failure

    # --- the API -------------------------------------------------------------------------

    async def complete(self, prompt: str | Sequence[int], n: int = 1,
                       params: SamplingParams | None = None) -> list[Choice]:
        """Generate ``n`` choices for one prompt (text, or token ids used verbatim) through
        ``/v1/completions``; returns prompt ids, completion ids, sampler logprobs, finish
        reason and text per choice."""
        model, version = await self._generation_model()
        sampling = params or SamplingParams()
        return _labelled(await self._call(
            "complete", lambda s: s.complete(prompt, n, sampling, model=model)), version)

    async def chat(self, messages: Sequence[MessageDict], n: int = 1,
                   params: SamplingParams | None = None) -> list[Choice]:
        """Generate ``n`` replies to a conversation through ``/v1/chat/completions`` (the
        server's chat template and reasoning parser apply)."""
        model, version = await self._generation_model()
        sampling = params or SamplingParams()
        return _labelled(await self._call(
            "chat", lambda s: s.chat(messages, n, sampling, model=model)), version)

    async def tokenize(self, *, messages: Sequence[MessageDict] | None = None,
                       prompt: str | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of chat ``messages`` through the server's chat template (with the
        assistant generation prompt by default), or of plain ``prompt`` text."""
        model = await self._model_name()
        return await self._call("tokenize", lambda s: s.tokenize(
            model=model, messages=messages, prompt=prompt,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens))

    async def model_info(self) -> ModelInfo:
        """Name and context length of the served model (``/v1/models``, asked once).

        Callers that ask at the same time share one discovery (one sequence of attempts),
        and share its failure too: while the servers are down, every waiting job fails at
        once and retries on its own schedule, instead of queueing behind a lock for a
        full retry cycle each (which made a pool of 4 jobs retry one at a time)."""
        if self._model_info is not None:
            return self._model_info
        self._live_servers()  # outside 'async with': RuntimeError
        task = self._model_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._model_task = asyncio.create_task(self._discover_model(),
                                                          name="rollq-inference-model")
        return await asyncio.shield(task)  # a cancelled caller leaves it to the others

    async def _discover_model(self) -> ModelInfo:
        # It serves every waiting job: the log context of the one that started it is not
        # its own (the task runs in a copy of that context, so this clears only the copy).
        structlog.contextvars.clear_contextvars()
        entries = await self._call("models", lambda s: s.models())
        self._model_info = _select_model(entries, self.model)
        return self._model_info

    async def health(self) -> dict[str, bool]:
        """Probe every server now; returns ``{base_url: healthy}`` and updates the pool."""
        await asyncio.gather(*(self._probe(server) for server in self._live_servers()))
        return {server.base_url: server.healthy for server in self.servers}

    # --- retries and routing -------------------------------------------------------------

    async def _generation_model(self) -> tuple[str, int | None]:
        """The model a generation names, and the policy version that name fixes: with
        ``lora_name``, the adapter of the run's current version (the base model at version
        0), so every token's version is exact by construction; else the model, no version."""
        if self.lora_name is None or self.policy_version is None:
            return await self._model_name(), None
        version = await self.policy_version()
        if version == 0:
            return await self._model_name(), 0
        return adapter_name(self.lora_name, version), version

    async def _model_name(self) -> str:
        if self.model is not None:
            return self.model
        return (await self.model_info()).name

    async def _call(self, operation: str,
                    attempt: Callable[[InferenceServer], Awaitable[T]]) -> T:
        failures = aborts = 0
        failed: InferenceServer | None = None
        while True:
            self._raise_background_failure()
            error: InferenceUnavailable
            server = await self._acquire(avoid=failed)
            if server is None:
                error = self._none_healthy()
            else:
                server.outstanding += 1
                started = time.monotonic()
                try:
                    reply = await attempt(server)
                    if operation not in _UNTIMED:
                        server.record(time.monotonic() - started, reply)
                    return reply
                except GenerationAborted:
                    aborts += 1
                    log.info("inference_aborted", server=server.base_url, operation=operation,
                             aborts=aborts)
                    if aborts > self.max_aborts:
                        raise
                    server.paused = server.pause_supported
                    continue
                except InferenceRequestError:
                    raise
                except InferenceUnavailable as exc:
                    error = exc
                    server.failures += 1
                    if isinstance(exc, ServerUnreachable) and self._health_task is not None:
                        self._mark(server, healthy=False, reason=str(exc))
                finally:
                    server.outstanding -= 1
            failed = server
            failures += 1
            if failures > self.max_retries:
                raise InferenceUnavailable(
                    f"{operation} failed after {failures} attempts: {error}") from error
            delay = self.backoff.delay(failures - 1)
            log.warning("inference_retried", operation=operation, attempt=failures,
                        server=server.base_url if server else None, delay_s=round(delay, 3),
                        error=str(error))
            await asyncio.sleep(delay)

    async def _acquire(self, avoid: InferenceServer | None) -> InferenceServer | None:
        """The server to send to next; None when none is healthy. Waits out pauses."""
        deadline: float | None = None
        polls = 0
        while True:
            healthy = [server for server in self._live_servers() if server.healthy]
            if not healthy:
                return None
            ready = [server for server in healthy if not server.paused]
            if ready:
                return self._least_loaded(ready, avoid)
            now = asyncio.get_running_loop().time()
            if deadline is None:
                deadline = now + self.pause_timeout_s
                log.info("inference_pause_waited", servers=[s.base_url for s in healthy])
            if now >= deadline:
                raise PauseTimeout(f"every healthy server paused for over {self.pause_timeout_s}s")
            await asyncio.sleep(min(self.pause_poll.delay(polls), deadline - now))
            polls += 1
            await self._refresh_paused()

    def _least_loaded(self, ready: list[InferenceServer],
                      avoid: InferenceServer | None) -> InferenceServer:
        if avoid in ready and len(ready) > 1:
            ready = [server for server in ready if server is not avoid]
        start = next(self._turn) % len(ready)
        rotated = ready[start:] + ready[:start]
        return min(rotated, key=lambda server: server.outstanding)

    async def _refresh_paused(self) -> None:
        # One /is_paused poll shared by every waiter, so a thousand waiting episodes
        # cost the servers one request per interval.
        if self._pause_poll is None or self._pause_poll.done():
            self._pause_poll = asyncio.create_task(self._poll_paused())
        await asyncio.shield(self._pause_poll)

    async def _poll_paused(self) -> None:
        paused = [s for s in self._live_servers() if s.healthy and s.paused]
        results = await asyncio.gather(*(s.is_paused() for s in paused), return_exceptions=True)
        for server, result in zip(paused, results, strict=True):
            if isinstance(result, bool):
                if not result:
                    log.info("inference_server_resumed", server=server.base_url)
                server.paused = result
            elif isinstance(result, InferenceUnavailable | InferenceRequestError):
                log.warning("inference_pause_poll_failed", server=server.base_url,
                            error=str(result))
            else:
                raise result

    # --- health ---------------------------------------------------------------------------

    async def _watch_health(self, interval_s: float) -> None:
        try:
            while True:
                await asyncio.gather(*(self._probe(server) for server in self.servers))
                await asyncio.sleep(interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("inference_health_task_failed")
            raise

    async def _probe(self, server: InferenceServer) -> None:
        failure = await server.health_failure()
        if failure is None:
            try:
                server.paused = await server.is_paused()
            except (InferenceUnavailable, InferenceRequestError) as exc:
                failure = f"/is_paused failed: {exc}"
        self._mark(server, healthy=failure is None, reason=failure or "probe succeeded")

    def _mark(self, server: InferenceServer, *, healthy: bool, reason: str) -> None:
        if server.healthy != healthy:
            event = "inference_server_recovered" if healthy else "inference_server_unhealthy"
            log.warning(event, server=server.base_url, reason=reason)
        server.healthy = healthy
        server.unhealthy_reason = None if healthy else reason

    def _none_healthy(self) -> InferenceUnavailable:
        causes = "; ".join(f"{server.base_url}: {server.unhealthy_reason or 'unhealthy'}"
                           for server in self.servers)
        return InferenceUnavailable(f"no healthy inference server ({causes})")

    def _live_servers(self) -> list[InferenceServer]:
        if self._client is None:
            raise RuntimeError("InferencePool used outside 'async with'")
        return self.servers

    def _raise_background_failure(self) -> None:
        task = self._health_task
        if task is not None and task.done() and not task.cancelled():
            failure = task.exception()
            if failure is not None:
                raise failure


def _labelled(samples: list[Choice], version: int | None) -> list[Choice]:
    """Samples whose every token the weights of ``version`` sampled (a named adapter)."""
    if version is None:
        return samples
    return [dataclasses.replace(sample, weight_versions=(
        WeightSpan(str(version), 0, len(sample.completion_ids)),)) for sample in samples]


def _select_model(entries: list[dict[str, Any]], wanted: str | None) -> ModelInfo:
    names = [str(entry.get("id")) for entry in entries]
    if wanted is None:
        entry = entries[0]
    elif wanted in names:
        entry = entries[names.index(wanted)]
    else:
        raise ConfigError(f"model {wanted!r} is not served; the servers offer {names}")
    length = entry.get("max_model_len")
    return ModelInfo(name=str(entry["id"]), max_model_len=int(length) if length else None)
