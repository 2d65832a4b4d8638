"""Weight sync: make every vLLM server serve the trainer's new weights, three ways.

``reload`` (``publish``): the trainer wrote the weights to a directory every server can
read. Per server, in order (the vLLM dev-mode API; see tests/fixtures/vllm/NOTES.md):

    POST /pause?mode=<keep|wait|abort>      stop scheduling; new requests wait, not fail
    POST /collective_rpc                    {"method": "reload_weights",
                                             "kwargs": {"weights_path": <weights_dir>}}
    POST /reset_prefix_cache                a reload does NOT clear cached KV of old weights
    POST /update_weight_version             {"new_version": "<step>"} (read by /weight_info)
    POST /resume

Servers are updated concurrently, each through its own sequence. A step that fails (HTTP
error, non-2xx, or ``"success": false``) ends that server's sequence; the server is still
asked to resume if it may have been paused, and the failure is collected. After every server
has finished, ``WeightSyncError`` lists the failed servers and why. Foreign httpx errors are
translated here and nowhere else.

``transfer`` and ``external`` (``sync``) treat the servers as one unit, in phases:

    0. ``transfer`` on ``rollq_tcp`` only: start and every chunk while the servers still
       serve; they stage the bytes and touch nothing (ops/vllm_plugin)
    1. pause every server (``pause_mode``)
    2. apply: ``rollq_tcp`` finishes (each server loads what it staged); ``nccl``/``ipc``
       run vLLM's whole protocol (``consumers.trainer.transfer``: init when needed, start,
       update in chunks loaded as they arrive, finish); ``external`` calls the trainer's
       own ``move`` (its NCCL group, a checkpoint engine), or nothing
    3. ``/reset_prefix_cache`` and ``/update_weight_version`` on every server
    4. ``on_updated()``: the caller raises the run's policy version, BEFORE any server
       resumes, so no request can start on the new weights under the old version
    5. resume every server that may have been paused, whatever happened before

A failure in 0 drops what the servers staged and raises before anything paused; a failure
in 1-3 skips the later phases up to 5. Either way ``WeightSyncError`` names each failed
server (``trainer`` when the trainer's side failed), every server is resumed and the run's
version is unchanged. The transfer engine is initialised on the first sync and again after
a failed sync, a change of the server list, or a server whose ``/weight_info`` no longer
shows the last version synced (it restarted). A server that vLLM still holds mid-update
(its trainer died) is freed by the next sync's start: staged leftovers are dropped, an
in-place update is finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from rollq.consumers.trainer.errors import WeightSyncError
from rollq.consumers.trainer.lora import LoraSync
from rollq.consumers.trainer.settings import PauseMode, WeightSyncMethod
from rollq.consumers.trainer.transfer import (
    BACKEND_TCP,
    ServerFanout,
    ServersFailed,
    TcpTrainerEngine,
    TcpTrainerInitInfo,
    vllm_trainer_engine,
)


@dataclass(frozen=True)
class SyncReport:
    """What one successful weight sync cost."""

    method: WeightSyncMethod
    seconds: float
    """From the first pause to the last resume answered."""
    paused_seconds: float
    """From the last pause answered to the first resume sent: generation stopped."""
    bytes_moved: int
    """Weight bytes the trainer sent (transfer), or of the adapter each server read (lora);
    0 for reload and external."""
    aborted_requests: int | None = None
    """Requests the servers finished as aborted while the sync ran (vLLM's
    ``vllm:request_success_total{finished_reason="abort"}``, read from each server's
    ``/metrics`` before and after): 0 with ``pause_mode='keep'``, ``wait`` and ``lora``;
    None where a server's ``/metrics`` could not be read. A client that gave up on a request
    in that window counts too."""


class _StepFailed(Exception):
    def __init__(self, step: str, reason: str, reachable: bool = True) -> None:
        super().__init__(f"{step}: {reason}")
        self.step = step
        self.reachable = reachable


class PolicyPublisher:
    """Drives the weight reload on a set of vLLM servers. Open with ``async with``."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        pause_mode: PauseMode = "keep",
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        transfer_backend: str = BACKEND_TCP,
        transfer_host: str = "127.0.0.1",
        transfer_port: int = 0,
        transfer_chunk_bytes: int = 256 * 1024 * 1024,
        workers_per_server: int = 1,
        sync_transport: httpx.BaseTransport | None = None,
        lora: LoraSync | None = None,
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.transfer_backend = transfer_backend
        self.transfer_host = transfer_host
        self.transfer_port = transfer_port
        self.transfer_chunk_bytes = transfer_chunk_bytes
        self.workers_per_server = workers_per_server
        self._transport = transport
        self._sync_transport = sync_transport
        self._http: httpx.AsyncClient | None = None
        self._engine: Any = None  # the transfer engine, with the servers it was set up for
        self._engine_urls: list[str] = []
        self._fanout: ServerFanout | None = None
        self._synced: str | None = None  # the version the last sync left on every server
        self.reinits = 0
        """How often the transfer engine was (re)initialised."""
        self.lora = lora or LoraSync(prefix="policy", keep=1, lora_dir=None)
        """The ``lora`` method's settings and work (``consumers.trainer.lora``)."""

    async def __aenter__(self) -> PolicyPublisher:
        self._http = httpx.AsyncClient(transport=self._transport, timeout=self.timeout_s)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._drop_engine()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def publish(self, step: int, weights_dir: str) -> None:
        """Load ``weights_dir`` (a directory the servers can read) on every server and tag
        it with version ``step``; raises WeightSyncError naming every server that failed."""
        results = await asyncio.gather(*(self._update(url, step, weights_dir) for url in self.urls))
        failures = {url: why for url, why in zip(self.urls, results, strict=True) if why}
        if failures:
            raise WeightSyncError(step, failures)

    async def publish_weights(self, method: WeightSyncMethod, step: int, weights: Any,
                              on_updated: Callable[[], Awaitable[object]]) -> SyncReport:
        """Serve ``weights`` as version ``step`` by ``method`` (``TrainerClient.publish_policy``
        says what ``weights`` is for each); ``on_updated`` raises the run's version once every
        server holds the new weights. TypeError for weights of the wrong kind, before
        anything pauses; WeightSyncError when a server (or the trainer's side) fails. The
        report counts the requests the servers aborted meanwhile (``aborted_requests``)."""
        before = await self._aborted()
        report = await self._publish_weights(method, step, weights, on_updated)
        after = await self._aborted()
        if before is None or after is None:
            return report
        return dataclasses.replace(report, aborted_requests=after - before)

    async def _aborted(self) -> int | None:
        """Requests every server has finished as aborted so far; None if one cannot say."""
        assert self._http is not None

        async def one(url: str) -> int | None:
            try:
                response = await self._http.get(url + "/metrics")  # type: ignore[union-attr]
            except httpx.HTTPError:
                return None
            return aborted_count(response.text) if response.is_success else None

        counts = await asyncio.gather(*(one(url) for url in self.urls))
        return None if None in counts else sum(c for c in counts if c is not None)

    async def _publish_weights(self, method: WeightSyncMethod, step: int, weights: Any,
                               on_updated: Callable[[], Awaitable[object]]) -> SyncReport:
        if self._http is None:
            raise RuntimeError("PolicyPublisher used outside `async with`")
        if method == "reload":
            if not isinstance(weights, (str, os.PathLike)):
                raise TypeError("weight_sync='reload' publishes a weights directory, got "
                                f"{type(weights).__name__}; set weight_sync='transfer' to "
                                "send a model")
            started = time.monotonic()
            await self.publish(step, os.fspath(weights))
            seconds = time.monotonic() - started
            await on_updated()
            return SyncReport("reload", seconds, seconds, 0)
        if method == "lora":
            seconds, size = await self.lora.sync(self._http, self.urls, step, weights,
                                                 on_updated)
            return SyncReport("lora", seconds, 0.0, size)
        if method == "transfer" and (weights is None or isinstance(weights, (str, os.PathLike))):
            raise TypeError("weight_sync='transfer' sends the model (or its (name, tensor) "
                            f"pairs), got {weights!r}; set weight_sync='reload' to publish "
                            "a directory")
        if method == "external" and weights is not None and not callable(weights):
            raise TypeError("weight_sync='external' takes the callable that moves the "
                            f"weights (or None), got {type(weights).__name__}")
        return await self.sync(method, step, weights, on_updated)

    async def sync(self, method: WeightSyncMethod, step: int, weights: Any,
                   on_updated: Callable[[], Awaitable[object]]) -> SyncReport:
        """``transfer`` (``weights``: an ``nn.Module`` or an iterable of ``(name, tensor)``)
        or ``external`` (``weights``: a callable that moves them, sync or async, or None),
        in the phases of the module docstring. Raises WeightSyncError."""
        started = time.monotonic()
        staged = method == "transfer" and self.transfer_backend == BACKEND_TCP
        moved = 0
        if staged:  # the bytes travel while the servers still serve
            try:
                moved = await self._transfer(step, weights, stage_only=True)
            except Exception as exc:
                failures = _failures(exc)
                await asyncio.to_thread(self._discard)
                self._drop_engine()
                self._synced = None
                raise WeightSyncError(step, failures) from None
        failures = await self._each("pause", "/pause", params={"mode": self.pause_mode})
        reached = [url for url in self.urls if not failures.get(url, "").startswith(
            "pause: cannot connect")]
        paused_at = time.monotonic()
        if not failures:
            try:
                if staged:
                    assert self._fanout is not None
                    await asyncio.to_thread(self._fanout.finish_weight_update)
                elif method == "transfer":
                    moved = await self._transfer(step, weights, stage_only=False)
                elif weights is not None:
                    result = weights() if callable(weights) else None
                    if inspect.isawaitable(result):
                        await result
            except Exception as exc:
                failures.update(_failures(exc))
                self._drop_engine()
        elif staged:
            await asyncio.to_thread(self._discard)
        if not failures:
            failures.update(await self._each("reset_prefix_cache", "/reset_prefix_cache"))
        if not failures:
            failures.update(await self._each("update_weight_version", "/update_weight_version",
                                             json={"new_version": str(step)}))
        bump_failed: Exception | None = None
        if not failures:
            self._synced = str(step)
            try:
                await on_updated()
            except Exception as exc:  # Redis gone past give-up: resume all the same
                bump_failed = exc
        resumed_at = time.monotonic()
        failures.update(await self._each("resume", "/resume", urls=reached))
        if bump_failed is not None:
            raise bump_failed
        if failures:
            self._synced = None
            raise WeightSyncError(step, failures)
        return SyncReport(method, time.monotonic() - started, resumed_at - paused_at, moved)

    async def _each(self, step: str, path: str, *, urls: list[str] | None = None,
                    params: dict[str, str] | None = None, json: Any = None) -> dict[str, str]:
        """POST to every server at once; the failures, by server."""
        targets = self.urls if urls is None else urls

        async def one(url: str) -> str | None:
            try:
                await self._post(url, step, path, params=params, json=json)
            except _StepFailed as exc:
                return str(exc)
            return None

        results = await asyncio.gather(*(one(url) for url in targets))
        return {url: why for url, why in zip(targets, results, strict=True) if why}

    async def _transfer(self, step: int, weights: Any, *, stage_only: bool) -> int:
        if weights is None:
            raise ValueError("weight_sync='transfer' needs the model (or its (name, tensor) "
                             "pairs) to send")
        if self._engine is not None and (self._engine_urls != self.urls
                                         or await self._restarted()):
            self._drop_engine()
        return await asyncio.to_thread(self._send, step, weights, stage_only)

    async def _restarted(self) -> bool:
        """Whether any server no longer reports the version the last sync set."""
        async def version(url: str) -> str | None:
            assert self._http is not None
            try:
                response = await self._http.get(url + "/weight_info")
                return str(_body(response).get("weight_version"))
            except httpx.HTTPError:
                return None

        found = await asyncio.gather(*(version(url) for url in self.urls))
        return any(v != self._synced for v in found)

    def _send(self, step: int, weights: Any, stage_only: bool) -> int:
        """One transfer, on a worker thread (the engines block); ``stage_only``: rollq_tcp's
        start and chunks, its finish comes once the servers are paused."""
        source = _pairs(weights) if self.transfer_backend == BACKEND_TCP else weights
        if self._engine is None:
            # No keep-alive: a vLLM route that fails closes its connection, and the next
            # call on it (the finish that recovers a stuck update) would be lost with it.
            self._fanout = ServerFanout(list(self.urls), httpx.Client(
                timeout=self.timeout_s, transport=self._sync_transport,
                limits=httpx.Limits(max_keepalive_connections=0)),
                workers_per_server=self.workers_per_server)
            self._engine_urls = list(self.urls)
            if self.transfer_backend == BACKEND_TCP:
                self._engine = TcpTrainerEngine.trainer_init(TcpTrainerInitInfo(
                    host=self.transfer_host, port=self.transfer_port,
                    chunk_bytes=self.transfer_chunk_bytes, timeout_s=self.timeout_s),
                    client=self._fanout, source=source)
            else:
                self._engine = vllm_trainer_engine(
                    self.transfer_backend, client=self._fanout, source=source,
                    host=self.transfer_host, port=self.transfer_port,
                    workers=self.workers_per_server * len(self.urls))
            self.reinits += 1
        self._engine.source = source
        before = getattr(self._engine, "bytes_sent", 0)
        if stage_only:
            self._engine.stage()
        else:
            try:
                self._engine.send_weights()
            except BaseException:
                self._abandon_update()
                raise
        return int(getattr(self._engine, "bytes_sent", 0)) - int(before)

    def _discard(self) -> None:
        """Drop what a failed staging left on the servers (rollq_tcp): nothing is applied."""
        if isinstance(self._engine, TcpTrainerEngine):
            self._engine.discard()

    def _abandon_update(self) -> None:
        """After a failed in-place transfer (nccl, ipc: the servers load each chunk as it
        arrives, while paused): finish the update on every server still in it, so each
        layer serves either the new weights (received) or the old ones (not received),
        instead of being left half set up. That mix is one more behaviour policy: the
        sampler's logprobs are recorded, so the importance ratio still corrects for it,
        and the run's version stays the old one (staleness is over-, never under-stated)."""
        if self._fanout is not None:
            try:
                self._fanout.finish_weight_update()
            except ServersFailed:
                pass  # servers not mid-update (or gone) refuse; that is the aim

    def _drop_engine(self) -> None:
        engine, fanout = self._engine, self._fanout
        self._engine, self._fanout, self._engine_urls = None, None, []
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # best effort: the next sync builds a new one either way
                pass
        if fanout is not None:
            fanout.http.close()
            fanout.close()

    async def _update(self, url: str, step: int, weights_dir: str) -> str | None:
        """One server's sequence; returns why it failed, or None."""
        problems: list[str] = []
        paused = True  # unless the pause provably never reached the server
        try:
            await self._post(url, "pause", "/pause", params={"mode": self.pause_mode})
            await self._post(url, "reload_weights", "/collective_rpc",
                             json={"method": "reload_weights",
                                   "kwargs": {"weights_path": weights_dir}})
            await self._post(url, "reset_prefix_cache", "/reset_prefix_cache")
            await self._post(url, "update_weight_version", "/update_weight_version",
                             json={"new_version": str(step)})
        except _StepFailed as exc:
            problems.append(str(exc))
            paused = not (exc.step == "pause" and not exc.reachable)
        if paused:
            try:
                await self._post(url, "resume", "/resume")
            except _StepFailed as exc:
                problems.append(str(exc))
        return "; ".join(problems) or None

    async def _post(self, url: str, step: str, path: str, *,
                    params: dict[str, str] | None = None, json: Any = None) -> None:
        if self._http is None:
            raise RuntimeError("PolicyPublisher used outside `async with`")
        try:
            response = await self._http.post(url + path, params=params, json=json)
        except httpx.ConnectError as exc:
            raise _StepFailed(step, f"cannot connect ({exc})", reachable=False) from exc
        except httpx.HTTPError as exc:
            raise _StepFailed(step, f"{type(exc).__name__} {exc}".strip()) from exc
        if not response.is_success:
            raise _StepFailed(step, f"HTTP {response.status_code}: {_message(response)}")
        if _body(response).get("success") is False:
            raise _StepFailed(step, f"server answered success=false: {response.text[:200]}")


def aborted_count(exposition: str) -> int | None:
    """The requests a vLLM server finished as aborted, from its Prometheus ``/metrics``
    text (summed over its engines); None when it exposes no such counter."""
    total, found = 0.0, False
    for line in exposition.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return int(total) if found else None


def _failures(exc: Exception) -> dict[str, str]:
    """Who failed, from a transfer's or a move's exception."""
    if isinstance(exc, ServersFailed):
        return {url: f"{exc.step}: {why}" for url, why in exc.failures.items()}
    return {"trainer": f"{type(exc).__name__}: {exc}"}  # a bad source, the trainer's own move


def _pairs(weights: Any) -> Any:
    """A module's parameters (a fresh pass each sync), or the caller's pairs as given."""
    if hasattr(weights, "named_parameters"):
        class Parameters:
            def __iter__(self) -> Any:
                return iter(weights.named_parameters())
        return Parameters()
    return weights


def _body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _message(response: httpx.Response) -> str:
    body = _body(response)
    error = body.get("error")
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])[:300]
    if "detail" in body:
        return str(body["detail"])[:300]
    return response.text[:300]
