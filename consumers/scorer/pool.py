"""A pool of worker processes for CPU-heavy rewards, each of which can be killed alone.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running call: a sympy
simplification that hangs would hold its worker for good. Here each worker owns one pipe;
the event loop waits on the pipe's readability (never blocking), and a call that outlives
its timeout (or is cancelled) gets its worker killed and replaced, while the other workers
carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, TypeVar, cast

from rollq.consumers.scorer.errors import ScoringError

ResultT = TypeVar("ResultT")
StartMethod = Literal["spawn", "forkserver", "fork"]
_READY = "ready"


class _DeprecationNoise(logging.Filter):
    # math-verify logs this on every call with equations=True, which open-r1's config uses.
    def filter(self, record: logging.LogRecord) -> bool:
        return "is deprecated" not in record.getMessage()


def _serve(connection: Connection, preload: Sequence[str]) -> None:
    """Worker main: import `preload`, say ready, then run `(function, args)` tasks."""
    # The parent owns shutdown; a terminal's Ctrl-C must not kill workers mid-call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("latex2sympy2_extended.math_normalization").addFilter(_DeprecationNoise())
    for module in preload:
        importlib.import_module(module)
    # A closed pipe means the parent gave up on this worker: exit quietly.
    with contextlib.suppress(OSError, EOFError):
        connection.send(_READY)
        while (task := connection.recv()) is not None:
            connection.send_bytes(_run_task(task))


def _run_task(task: tuple[Callable[..., Any], tuple[Any, ...]]) -> bytes:
    """The pickled reply: `(True, result)` or `(False, reason, message)`."""
    function, args = task
    try:
        return bytes(ForkingPickler.dumps((True, function(*args))))
    except Exception as exc:
        return bytes(ForkingPickler.dumps(_failure(exc)))


def _failure(exc: Exception) -> tuple[bool, str, str]:
    # Exceptions travel as text: not every exception class survives unpickling.
    reason = getattr(exc, "reason", "error")
    return False, reason if isinstance(reason, str) else "error", f"{type(exc).__name__}: {exc}"


def _each(function: Callable[..., Any], items: Sequence[Any],
          args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """`run_each`'s task: per item, `(True, function(item, *args))` or `_failure`."""
    replies: list[tuple[Any, ...]] = []
    for item in items:
        try:
            replies.append((True, function(item, *args)))
        except Exception as exc:
            replies.append(_failure(exc))
    return replies


def _context(method: StartMethod) -> SpawnContext | ForkServerContext | ForkContext:
    if method == "fork":
        return multiprocessing.get_context("fork")
    if method == "forkserver":
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    connection: Connection


async def _wait_readable(connection: Connection) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    descriptor = connection.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(descriptor, wake)
    try:
        await ready
    finally:
        loop.remove_reader(descriptor)


class WorkerPool:
    """`workers` processes started with `start_method`, each importing `preload` first.

    Use as an async context manager; `run(function, *args, timeout_s=…)` calls
    `function(*args)` in a free worker (both must be picklable), raising TimeoutError past
    `timeout_s` seconds (the worker is then replaced) and `ScoringError` when the function
    raised (reason taken from the exception's `reason` attribute, else "error") or the
    worker died ("worker_died"). `run_each` makes several such calls in one.
    """

    def __init__(self, workers: int, *, start_method: StartMethod = "spawn",
                 preload: Sequence[str] = (), startup_timeout_s: float = 60.0) -> None:
        self._count = workers
        self._context = _context(start_method)
        self._preload = tuple(preload)
        self._startup_timeout_s = startup_timeout_s
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        self._revivals: set[asyncio.Task[None]] = set()
        self._replaced = 0
        self._revival_failure: BaseException | None = None

    async def __aenter__(self) -> WorkerPool:
        self._idle = asyncio.Queue()
        starting = [self._start() for _ in range(self._count)]
        try:
            await asyncio.gather(*starting)
        except BaseException:
            self._stop_all()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        revivals = list(self._revivals)
        for task in revivals:
            task.cancel()
        await asyncio.gather(*revivals, return_exceptions=True)
        self._stop_all()

    @property
    def replaced(self) -> int:
        """How many workers were killed and replaced so far (timeouts, cancels, deaths)."""
        return self._replaced

    async def run(
        self, function: Callable[..., ResultT], *args: Any, timeout_s: float
    ) -> ResultT:
        if self._idle is None:
            raise RuntimeError("WorkerPool is not open (use it as an async context manager)")
        if self._revival_failure is not None:
            raise ScoringError("pool_broken", "a reward worker could not be restarted: "
                              f"{self._revival_failure!r}")
        payload = bytes(ForkingPickler.dumps((function, args)))
        worker = await self._idle.get()
        healthy = False
        try:
            worker.connection.send_bytes(payload)
            await asyncio.wait_for(_wait_readable(worker.connection), timeout_s)
            reply = worker.connection.recv()
            healthy = True
        except TimeoutError:
            raise
        except (EOFError, OSError) as exc:
            raise ScoringError("worker_died", f"reward worker died: {exc!r}") from exc
        finally:
            if healthy:
                self._idle.put_nowait(worker)
            else:
                self._retire(worker)
                self._replaced += 1
                task = asyncio.get_running_loop().create_task(self._start())
                self._revivals.add(task)
                task.add_done_callback(self._revived)
        if reply[0]:
            return cast(ResultT, reply[1])
        raise ScoringError(reply[1], reply[2])

    async def run_each(self, function: Callable[..., ResultT], items: Sequence[Any], *args: Any,
                       timeout_s: float) -> list[ResultT | ScoringError]:
        """`function(item, *args)` for each of `items`, all in ONE call to a free worker:
        one pipe round trip and one wake-up of each side for all of them. Per item, its
        result, or the `ScoringError` it raised (as `run` raises it). The call as a whole
        fails as `run` fails: TimeoutError past `timeout_s` seconds for all the items
        together (the worker is then replaced), `ScoringError` when the worker died."""
        replies = await self.run(_each, function, items, args, timeout_s=timeout_s)
        return [cast(ResultT, reply[1]) if reply[0] else ScoringError(reply[1], reply[2])
                for reply in replies]

    async def _start(self) -> None:
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_end, self._preload),
                                        daemon=True, name="rollq-reward-worker")
        process.start()
        child_end.close()
        worker = _Worker(process, parent_end)
        self._workers.add(worker)
        try:
            await asyncio.wait_for(_wait_readable(parent_end), self._startup_timeout_s)
            if parent_end.recv() != _READY:
                raise RuntimeError("reward worker sent something other than ready")
        except EOFError:
            self._retire(worker)
            raise RuntimeError(f"a reward worker exited while starting (importing "
                               f"{list(self._preload)}; see its stderr)") from None
        except BaseException:
            self._retire(worker)
            raise
        assert self._idle is not None
        self._idle.put_nowait(worker)

    def _revived(self, task: asyncio.Task[None]) -> None:
        self._revivals.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Surfaced by the next `run`, so the failure cannot vanish.
            self._revival_failure = task.exception()

    def _retire(self, worker: _Worker) -> None:
        if worker not in self._workers:  # already retired (a failed start, then shutdown)
            return
        self._workers.discard(worker)
        worker.process.kill()
        # SIGKILL makes the join immediate; it only reaps the zombie.
        worker.process.join(5.0)
        worker.connection.close()
        with contextlib.suppress(ValueError):
            worker.process.close()

    def _stop_all(self) -> None:
        for worker in list(self._workers):
            with contextlib.suppress(OSError):
                worker.connection.send(None)
            worker.process.join(1.0)
            self._retire(worker)
