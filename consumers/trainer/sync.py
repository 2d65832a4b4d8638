"""``SyncTrainerClient``: the trainer SDK for plain (non-async) training loops.

It runs a private event loop in a daemon thread and forwards each call to a
``TrainerClient`` on that loop, so it works from scripts and from notebooks that already
run a loop. Every method blocks until the async call finishes and re-raises its errors.
Since the loop has a thread of its own, the prefetch of the next batch (``prefetch``)
really runs while the caller's training step does, as long as the step releases the GIL
(CUDA kernels, ``time.sleep``, most of torch).

    with SyncTrainerClient("redis://127.0.0.1:6379/0", run="gsm8k", consumer="rank0") as tc:
        tc.load_state(checkpoint["rollq"])          # when resuming
        for step in range(start, steps):
            batch = tc.next_batch(groups=8)
            train_step(batch.to_torch("cuda"))
            batch.ack()
            if step % 100 == 0:
                save(model, rollq=tc.state())
                tc.publish_policy(step, weights_dir)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import redis.asyncio as aioredis

from rollq.consumers.trainer.batch import BatchData, SyncBatch
from rollq.consumers.trainer.client import TrainerClient
from rollq.consumers.trainer.settings import TrainerClientSettings

T = TypeVar("T")
CANCEL_WAIT_S = 10.0
"""Longest wait for an interrupted call to finish cancelling on the client's loop."""


async def _cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome is moot now
        await task


class SyncTrainerClient:
    """Blocking facade over ``TrainerClient``; use as a context manager or call ``close``.

    ``redis`` is a ``redis://`` or ``rediss://`` URL (a client is made and closed here,
    with the TLS files of ``settings``, else of the ``ROLLQ_REDIS_CA_FILE``,
    ``ROLLQ_REDIS_CERT_FILE``, ``ROLLQ_REDIS_KEY_FILE`` and ``ROLLQ_REDIS_TLS_VERIFY``
    variables, as the roles read them) or an asyncio client
    owned by the caller that has not been used on another event loop: asyncio clients are
    bound to the loop they first ran on, and this facade runs its own. Nothing starts until
    ``__enter__`` (or ``open``).
    """

    def __init__(
        self,
        redis: aioredis.Redis | str,
        *,
        run: str,
        consumer: str,
        settings: TrainerClientSettings | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._owns_redis = isinstance(redis, str)
        if isinstance(redis, str):  # the SDK's edge: TLS from the settings, else ROLLQ_REDIS_*
            tls = (settings or TrainerClientSettings()).redis_tls(os.environ)
            self._redis: aioredis.Redis = aioredis.Redis.from_url(redis, **tls.options(redis))
        else:
            self._redis = redis
        self.client = TrainerClient(self._redis, run=run, consumer=consumer,
                                    settings=settings, transport=transport)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def open(self) -> SyncTrainerClient:
        """Start the background loop and open the client."""
        if self._loop is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="rollq-trainer", daemon=True)
        self._thread.start()
        try:
            self._call(self.client.__aenter__())
        except BaseException:
            self._stop_loop()
            raise
        return self

    def close(self) -> None:
        """Close the client (unacked entries stay pending) and stop the loop; idempotent."""
        if self._loop is None:
            return
        try:
            self._call(self.client.__aexit__(None, None, None))
            if self._owns_redis:
                self._call(self._redis.aclose())
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncTrainerClient:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def next_batch(self, groups: int | None = None, *, sequences: int | None = None,
                   max_tokens: int | None = None, timeout_s: float | None = None) -> SyncBatch:
        """Blocking ``TrainerClient.next_batch``; the batch's ``ack()`` blocks too."""
        batch, size = self._call(self.client._next_batch_sized(groups, sequences, max_tokens,
                                                               timeout_s))
        handed = SyncBatch(**batch.data(), acker=self)
        # Only now, the batch in the caller's hands, is the next one prepared: its CPU work
        # (parsing, decoding, layout) holds the GIL, and started at once it would keep this
        # thread from returning for up to a GIL switch interval (5 ms).
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.client._prefetch_after, size)
        return handed

    def ack(self, batch: BatchData) -> int:
        """Blocking ``TrainerClient.ack``."""
        return self._call(self.client.ack(batch))

    def drop(self, batch: BatchData, reason: str = "stale") -> int:
        """Blocking ``TrainerClient.drop``."""
        return self._call(self.client.drop(batch, reason))

    def dead_letter(self, batch: BatchData, exc: Exception) -> None:
        """Blocking ``TrainerClient.dead_letter``."""
        self._call(self.client.dead_letter(batch, exc))

    def stall_reason(self) -> str:
        """Blocking ``TrainerClient.stall_reason``."""
        return self._call(self.client.stall_reason())

    def state(self) -> dict[str, Any]:
        """``TrainerClient.state``, taken on the client's loop (the prefetch of the next
        batch may be changing the client's books there)."""
        if self._loop is None:  # not open: nothing runs that could change them
            return self.client.state()
        return self._call(self._state())

    async def _state(self) -> dict[str, Any]:
        return self.client.state()

    def load_state(self, state: dict[str, Any]) -> int:
        """Blocking ``TrainerClient.load_state``."""
        return self._call(self.client.load_state(state))

    def publish_policy(self, step: int, weights: Any) -> int:
        """Blocking ``TrainerClient.publish_policy`` (``weights`` as ``weight_sync`` says)."""
        return self._call(self.client.publish_policy(step, weights))

    def set_inference_urls(self, urls: Sequence[str]) -> None:
        """``TrainerClient.set_inference_urls``."""
        self.client.set_inference_urls(urls)

    def current_version(self) -> int:
        """Blocking ``TrainerClient.current_version``."""
        return self._call(self.client.current_version())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop and wait for it. Interrupted while waiting
        (Ctrl-C's ``KeyboardInterrupt``, or whatever a signal handler raises), the call is
        cancelled and awaited on the loop before the interruption goes on: left running,
        it would read on while ``close`` shuts its connection (a false Redis outage in the
        log) and die with the loop ("Task was destroyed but it is pending!")."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("SyncTrainerClient used before open() / `with`")
        loop = self._loop
        started: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()

        async def tracked() -> T:
            task = asyncio.current_task()
            assert task is not None
            started.set_result(task)
            return await coro

        future = asyncio.run_coroutine_threadsafe(tracked(), loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                if started.done():
                    asyncio.run_coroutine_threadsafe(_cancelled(started.result()),
                                                     loop).result(timeout=CANCEL_WAIT_S)
                else:  # not started yet: it never will
                    future.cancel()
            raise

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        loop.close()
