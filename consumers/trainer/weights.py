"""Weight sync: make every vLLM server serve the trainer's new weights.

Per server, in order (the vLLM dev-mode API; see tests/fixtures/vllm/NOTES.md):

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import httpx

from consumers.trainer.errors import WeightSyncError
from consumers.trainer.settings import PauseMode


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
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> PolicyPublisher:
        self._http = httpx.AsyncClient(transport=self._transport, timeout=self.timeout_s)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
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
