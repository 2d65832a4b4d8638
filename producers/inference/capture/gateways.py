"""Where an episode's OpenAI base URL comes from: an in-process hub or a remote gateway.

An ``EpisodeGateway`` opens an episode (``OpenEpisode``: its id, base URL, and the
``http_client`` to reach it with) and closes it (its ``CapturedEpisode``):

- ``LocalGateway``: a ``CaptureHub`` in the worker's process. Agents that accept an
  ``http_client`` (``openai.AsyncOpenAI(base_url=..., http_client=...)``, AReaL's workflow
  ``run(data, base_url=, http_client=, api_key=)``) reach it through ``CaptureTransport``
  (an httpx transport, no socket); the base URL itself is a ``LoopbackListener`` on
  ``127.0.0.1`` serving the same hub, so an agent that ignores ``http_client`` and builds
  its own client from the URL is captured the same way. The listener runs while an
  episode is open (from the first open to the last close).
- ``RemoteGateway``: a ``rollq gateway`` over HTTP (``POST /episodes``, ``POST
  /episodes/<id>/close``): for agents that build their own client from a base URL, or run
  in another process or container. Its calls are stamped with no policy version (the
  gateway does not read Redis): the env adapter stamps the version read at open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from rollq.producers.inference.capture.hub import CaptureHub
from rollq.producers.inference.capture.listener import LoopbackListener
from rollq.producers.inference.capture.record import CapturedEpisode
from rollq.producers.inference.capture.session import PolicyVersionReader
from rollq.schemas import ContractError, InferenceUnavailable


@dataclass(frozen=True)
class OpenEpisode:
    """An episode the gateway is capturing."""

    episode_id: str
    base_url: str
    """The OpenAI base URL of this episode (``…/episodes/<id>/v1``)."""
    http_client: httpx.AsyncClient | None
    """The client that reaches ``base_url`` (None: any HTTP client does)."""


Opening = dict[str, tuple["EpisodeGateway", OpenEpisode]]
"""Where an ``open`` records its episode, by id, as soon as it exists at the gateway (before
the open returns): a job that times out mid-open closes it all the same
(``producers.envs.episode.JobEpisodes``)."""


class EpisodeGateway(Protocol):
    async def open(self, *, defaults: dict[str, Any], policy_version: PolicyVersionReader | None,
                   opening: Opening | None = None) -> OpenEpisode: ...

    async def close(self, episode: OpenEpisode) -> CapturedEpisode: ...


class CaptureTransport(httpx.AsyncBaseTransport):
    """An httpx transport answering from a ``CaptureHub`` in this process."""

    def __init__(self, hub: CaptureHub) -> None:
        self.hub = hub

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        reply = await self.hub.dispatch(request.method, request.url.path, await request.aread())
        if reply.events is not None:
            return httpx.Response(reply.status, headers=reply.headers, content=reply.events)
        return httpx.Response(reply.status, content=reply.content(),
                              headers={"content-type": "application/json", **reply.headers})


class LocalGateway:
    """Episodes on an in-process ``CaptureHub`` (module docstring)."""

    def __init__(self, hub: CaptureHub) -> None:
        self.hub = hub
        self.transport = CaptureTransport(hub)
        self._open = 0
        self._listening: tuple[LoopbackListener, asyncio.Future[None]] | None = None

    async def open(self, *, defaults: dict[str, Any], policy_version: PolicyVersionReader | None,
                   opening: Opening | None = None) -> OpenEpisode:
        self._open += 1
        try:
            if self._listening is None:
                listener = LoopbackListener(self.hub)
                self._listening = (listener, asyncio.ensure_future(listener.start()))
            listener, started = self._listening
            await asyncio.shield(started)
        except BaseException:
            await self._release()
            raise
        capture = self.hub.open(defaults=defaults, policy_version=policy_version)
        client = httpx.AsyncClient(transport=self.transport, base_url=listener.url,
                                   timeout=None)
        opened = OpenEpisode(capture.episode_id,
                             f"{listener.url}/episodes/{capture.episode_id}/v1", client)
        if opening is not None:
            opening[opened.episode_id] = (self, opened)
        return opened

    async def close(self, episode: OpenEpisode) -> CapturedEpisode:
        try:
            if episode.http_client is not None:
                await episode.http_client.aclose()
            return self.hub.close(episode.episode_id)
        finally:
            await self._release()

    async def _release(self) -> None:
        """One episode fewer; the last one stops the listener."""
        self._open -= 1
        if self._open > 0 or self._listening is None:
            return
        listener, started = self._listening
        self._listening = None
        with contextlib.suppress(Exception):  # a failed start was raised to its opener
            await started
        await listener.aclose()


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """One default SSL context for every short-lived client of this process. Building one
    reads the CA bundle: 40-80 ms of CPU on a busy 2-core machine, paid twice an episode
    (its open and close) and once more by an agent's own client, which was ~3/4 of a
    worker's time in the tools demo before it was shared."""
    return ssl.create_default_context()


class RemoteGateway:
    """Episodes on a ``rollq gateway`` at ``url`` (module docstring)."""

    def __init__(self, url: str, *, transport: httpx.AsyncBaseTransport | None = None,
                 timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.transport = transport
        self.timeout_s = timeout_s

    async def open(self, *, defaults: dict[str, Any], policy_version: PolicyVersionReader | None,
                   opening: Opening | None = None) -> OpenEpisode:
        episode_id = uuid.uuid4().hex  # chosen here: an open cut short can still be closed
        opened = OpenEpisode(episode_id, f"{self.url}/episodes/{episode_id}/v1", None)
        if opening is not None:
            opening[episode_id] = (self, opened)
        await self._post("/episodes", {"episode_id": episode_id, "defaults": defaults})
        return opened

    async def close(self, episode: OpenEpisode) -> CapturedEpisode:
        path = f"/episodes/{episode.episode_id}/close"
        body = await self._post(path, {}, gone=(
            "no longer has the episode (it restarted, or the episode was idle past its "
            "episode_ttl_s): its calls are lost, the episode runs again"))
        return CapturedEpisode.model_validate(body)

    async def _post(self, path: str, body: dict[str, Any], *, gone: str = "") -> Any:
        """POST to the gateway; ``gone``: a 404 means the gateway lost what ``path`` names,
        which a new try can recover from (``InferenceUnavailable``), not a bad request."""
        try:
            async with httpx.AsyncClient(transport=self.transport, timeout=self.timeout_s,
                                         verify=default_ssl_context()) as client:
                response = await client.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise InferenceUnavailable(f"gateway {self.url}{path}: {type(exc).__name__}: "
                                       f"{exc}") from exc
        if response.status_code == 404 and gone:
            raise InferenceUnavailable(f"gateway {self.url} {gone}")
        if response.status_code >= 500:
            raise InferenceUnavailable(f"gateway {self.url}{path} answered "
                                       f"{response.status_code}: {response.text[:300]}")
        if not response.is_success:
            raise ContractError(f"gateway {self.url}{path} answered {response.status_code}: "
                                f"{response.text[:300]}")
        return response.json()
