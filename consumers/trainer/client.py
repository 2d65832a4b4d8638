"""``TrainerClient``: pull scored groups in batches, ack after the step, resume exactly once.

Delivery (DESIGN.md §3): the client reads every partition's ``scored`` stream in consumer
group ``trainer``. On its first ``next_batch`` it takes back its own pending entries (same
consumer name after a restart), then reclaims entries other trainers left idle longer than
``reclaim_idle_ms``, then reads new ones. Entries stay pending until ``batch.ack()``.

What happens to an entry before it reaches a batch (nothing an entry holds can stop the
client): ``consumers.trainer.intake``.

Prefetch (``prefetch=True``, the default): once ``next_batch`` returns a batch, the next
one (same sizes) is read, checked, decoded and laid out while the caller trains; its
groups stay queued, pending and unacked until it is handed out, staleness is judged at
hand-out, and what the preparation meets is what the next call would have met. The rules
are in ``consumers.trainer.prefetch``. Resume (checkpoint/resume neither skips nor repeats a
group): ``consumers.trainer.resume``. A run no role has worked on: ``.unstarted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import httpx
import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import Delivery, StreamReader
from rollq.consumers.trainer.batch import Batch, BatchData, EntryRef, build_batch
from rollq.consumers.trainer.errors import ResumeError
from rollq.consumers.trainer.holdings import HeldGroup, Holdings
from rollq.consumers.trainer.intake import admit, drop_stale, reject
from rollq.consumers.trainer.layout import pad_groups
from rollq.consumers.trainer.ledger import Ledger, TrainedEntry, check_consumer_name
from rollq.consumers.trainer.lora import LoraSync
from rollq.consumers.trainer.prefetch import PREFETCH_POLL_S, Prefetch, Prefetcher, PreparedBatch
from rollq.consumers.trainer.resume import STATE_FORMAT, groups_to_replay
from rollq.consumers.trainer.settings import TrainerClientSettings
from rollq.consumers.trainer.sizing import BatchSize
from rollq.consumers.trainer.staleness import is_stale
from rollq.consumers.trainer.stats import TrainerStats
from rollq.consumers.trainer.unstarted import RunCheck
from rollq.consumers.trainer.waiting import WaitReporter, stall_reason
from rollq.consumers.trainer.weights import PolicyPublisher, SyncReport
from rollq.schemas import BrokerUnavailable
from rollq.schemas.keys import CONSUMED_COUNTER, check_run_name, stream_keys
from rollq.schemas.outage import OutageRider

log = structlog.get_logger("rollq.trainer")

TRAINER_GROUP = "trainer"
"""Consumer group of trainers on the scored streams."""


class TrainerClient:
    """Async trainer SDK client for one run; ``async with TrainerClient(...) as client``.

    ``redis`` is owned by the caller (not closed here). ``consumer`` names this trainer in
    the consumer group: keep it stable across restarts so pending entries come back to it,
    and give each data-parallel reader its own. ``transport`` replaces the HTTP transport
    of weight sync (tests pass an ``httpx.MockTransport``).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        run: str,
        consumer: str,
        settings: TrainerClientSettings | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.redis = redis
        self.run = check_run_name(run)
        self.consumer = check_consumer_name(consumer)
        self.settings = settings or TrainerClientSettings()
        self.partitions = 0
        self._ledger = Ledger(redis, run, consumer, self.settings.log_max_len,
                              dedup_window_s=self.settings.dedup_window_s)
        s = self.settings
        self._publisher = PolicyPublisher(s.inference_urls, pause_mode=s.pause_mode,
                                          timeout_s=s.http_timeout_s, transport=transport,
                                          transfer_backend=s.transfer_backend,
                                          transfer_host=s.transfer_host,
                                          transfer_port=s.transfer_port,
                                          transfer_chunk_bytes=s.transfer_chunk_bytes,
                                          workers_per_server=s.transfer_workers_per_server,
                                          lora=LoraSync(prefix=s.lora_name,
                                                        keep=max(1, s.max_staleness or 1),
                                                        lora_dir=s.lora_dir))
        self._reader: StreamReader | None = None
        self._books = Holdings()
        self._version: int | None = None  # own published (or resumed) version
        self._log_head = "0-0"
        self._started = False
        self._recovering = False  # a Redis outage interrupted next_batch
        self._last_reclaim = 0.0
        self._empty_reads = 0
        self._rider = OutageRider(give_up_s=s.redis_give_up_s, what="trainer", log=log)
        self.stats = TrainerStats()
        """What this client did (batches, steps, staleness): the trainer's metrics."""
        self.last_sync: SyncReport | None = None
        """What the last successful ``publish_policy`` cost (seconds, paused, bytes)."""
        self._prefetcher = Prefetcher(
            lambda size, prefetch: self._next_batch(size, None, prefetch=prefetch),
            run=self.run, name=f"rollq-prefetch-{self.consumer}")
        self._lock = asyncio.Lock()  # one next_batch (or load_state) at a time
        self._waits = WaitReporter(redis, self.run, self.settings.wait_log_s)
        self._run_check = RunCheck(redis, self.run, new_run=self.settings.new_run)

    async def __aenter__(self) -> TrainerClient:
        self.partitions, created = await self._ledger.register(self.settings.partitions)
        log.info("trainer_started", run=self.run, consumer=self.consumer,
                 partitions=self.partitions, new_run=created)
        await self._run_check.at_start()  # a typo in --run: said at once (unstarted.py)
        await self._waits.check_admission(self.settings.batch_groups)
        self._reader = StreamReader(
            self.redis, stream_keys(self.run, self.partitions, "scored"), TRAINER_GROUP,
            self.consumer, self.settings.reader_settings(), join_trajectories=True)
        await self._reader.ensure_groups()
        self._log_head = await self._ledger.log_head()
        await self._publisher.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, traceback: TracebackType | None) -> None:
        """Cancel the prefetch and close the HTTP client. Unacked entries (and the prefetched
        batch's) stay pending for the next start."""
        try:
            await self._prefetcher.cancel()
        finally:
            await self._publisher.__aexit__(exc_type, exc, traceback)

    @property
    def reader(self) -> StreamReader:
        if self._reader is None:
            raise RuntimeError("TrainerClient used outside `async with`")
        return self._reader

    # -- batches ---------------------------------------------------------------------------

    async def next_batch(
        self,
        groups: int | None = None,
        *,
        sequences: int | None = None,
        max_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Batch:
        """The next batch of whole groups, waiting until it is full.

        Size it by ``groups`` (exactly that many), ``sequences`` (whole groups while the
        total stays <= the limit) or ``max_tokens`` (whole groups while prompt+completion
        tokens stay <= the budget); limits combine, and a batch always holds at least one
        group even if that group alone exceeds them. Without any, ``batch_groups`` groups.
        ``timeout_s`` bounds the wait and returns what is there (possibly empty); None waits
        for a full batch, 0 takes only what is available now.

        A Redis outage is ridden out (``redis_give_up_s``, timed from each outage's
        start): the call waits it out, logs its start and end, takes back what Redis holds
        for this consumer that the client does not (a read whose reply was lost) without
        counting another delivery of what it does hold, and goes on; past the give-up
        time it raises ``BrokerUnavailable``.

        With ``prefetch`` on, the batch after this one is prepared while the caller trains,
        and the next call with the same sizes returns it at once (module docstring).
        """
        batch, size = await self._next_batch_sized(groups, sequences, max_tokens, timeout_s)
        self._prefetch_after(size)
        return batch

    async def _next_batch_sized(self, groups: int | None, sequences: int | None,
                                max_tokens: int | None,
                                timeout_s: float | None) -> tuple[Batch, BatchSize]:
        """``next_batch`` without starting the prefetch: the batch, and its sizes."""
        size = BatchSize.of(groups, sequences, max_tokens, self.settings.batch_groups)
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        async with self._lock, self._waits.waiting(size.groups, lambda: len(self._books.queue)):
            ready: PreparedBatch | None = None
            while True:
                try:
                    if ready is None:
                        ready, reread = await self._prefetcher.take(size, deadline)
                        if reread:
                            self._recovering = self._started
                    batch, version = await self._hand_out(size, deadline, ready)
                except BrokerUnavailable as exc:
                    await self._rider.failed(exc)
                    # then take back what Redis holds for this consumer and the client does
                    # not (a read whose reply was lost), without counting a delivery of the rest
                    self._recovering = self._started
                    continue
                break
            self._rider.recovered()
            # the caller's wait: the lock, the prefetch, any outage, the assembly
            self.stats.handed_out(batch.entries, version, time.monotonic() - started)
            return batch, size

    def _prefetch_after(self, size: BatchSize) -> None:
        """Start preparing the batch after the one just handed out (``prefetch`` on), unless
        a call is under way (it prefetches after itself) or a prefetch already is."""
        if (self.settings.prefetch and self._prefetcher.current is None
                and not self._lock.locked()):
            self._prefetcher.start(size)

    async def _hand_out(self, size: BatchSize, deadline: float | None,
                        ready: PreparedBatch | None) -> tuple[Batch, int]:
        """The batch to return and the version it was judged at: ``ready`` (prefetched)
        unless a group of it is stale now, else one assembled by this call."""
        if ready is not None:
            version = await self.current_version()
            stale = version != ready.version and any(
                not h.replay and is_stale(h.group.policy_version, version,
                                          self.settings.max_staleness) for h in ready.held)
            if not stale and self._books.leads_with(ready.held):
                self._books.take(len(ready.held))
                return ready.batch, version
            log.info("batch_prefetch_discarded", run=self.run,
                     reason="stale" if stale else "queue_changed", policy_version=version)
        prepared = await self._next_batch(size, deadline)
        self._books.take(len(prepared.held))
        return prepared.batch, prepared.version

    async def _next_batch(self, size: BatchSize, deadline: float | None, *,
                          prefetch: Prefetch | None = None) -> PreparedBatch:
        """Assemble a batch from the first groups of the queue, reading until it is full or
        ``deadline``; its groups stay queued. As ``prefetch``'s task, it leaves the outage
        rider to the next call, polls until a call waits for it, and then reads until that
        call's deadline."""
        if not self._started:
            await self._start()
        elif self._recovering:
            await self._admit(await self.reader.recover_own_pending(self._books.held,
                                                                    count=100_000))
            self._recovering = False
        if prefetch is None:
            # Redis answers again: the outage ends now, not when the batch is full (which
            # may be long after), or the next outage would count from this one's start.
            self._rider.recovered()
        version = await self.current_version()
        while True:
            await self._drop_stale(version)
            count, full = size.fit([(h.group.num_sequences, h.group.sequence_tokens)
                                    for h in self._books.queue])
            if prefetch is not None:
                deadline = prefetch.deadline
            remaining = _left(deadline)
            if full or (remaining is not None and remaining <= 0):
                chosen = self._books.peek(count)
                batch = await self._build(chosen)
                if batch is not None:
                    return PreparedBatch(batch, tuple(chosen), version)
                continue  # a group could not be laid out (dead-lettered): fill its place
            # Read no more than the batch still needs (by group count; other limits cannot
            # tell how many groups will fit): decoding far more than one call returns is
            # what made every few calls slow.
            wanted = self.settings.read_count
            if size.groups is not None:
                wanted = min(wanted, size.groups - count)
            await self._fill(remaining, wanted, None if prefetch is None else prefetch.idle)

    async def _build(self, chosen: list[HeldGroup]) -> Batch | None:
        """The batch of ``chosen`` (the first queued groups); None when some of them cannot
        be laid out: those are dead-lettered, the others stay queued."""
        try:
            return build_batch([h.group for h in chosen], [EntryRef(*h.ref) for h in chosen],
                               self, self.settings.pad_token_id)
        except Exception as exc:
            failed = self._unbuildable(chosen)
            if not failed:
                raise  # the batch as a whole failed (e.g. memory), not one group of it
            log.warning("batch_build_failed", run=self.run, groups=len(chosen),
                        failed=len(failed), detail=str(exc)[:200])
        self._books.remove(failed)  # a replay was acked before: no longer listed either
        for held, exc in failed.items():
            await self._reject(held.delivery, exc, refetch=True)
        return None

    def _unbuildable(self, chosen: list[HeldGroup]) -> dict[HeldGroup, Exception]:
        """The groups of a batch that fail to lay out on their own, with their errors."""
        failed: dict[HeldGroup, Exception] = {}
        for held in chosen:
            try:
                pad_groups([held.group], self.settings.pad_token_id)
            except Exception as exc:
                failed[held] = exc
        return failed

    async def ack(self, batch: BatchData) -> int:
        """Acknowledge a batch after its optimizer step (``batch.ack()`` calls this).

        Returns how many entries were counted ``consumed`` by this call. A Redis outage is
        ridden out like ``next_batch``'s; retrying after a failure half-way is safe: the
        seen-set write repeats the same value, a log entry written twice replays once
        (``load_state`` dedups), and ``ack_counted`` counts only entries it acks first.
        """
        # Why retrying the whole of _ack is safe wherever the outage cut it (before the
        # record, between record and ack, or after the XACK with its reply lost): the
        # record is one MULTI (all or nothing) whose seen-set write sets the same value
        # again and whose log entry, if written twice, lists the same groups, which
        # ``load_state`` replays once; the entries stay held (``Holdings``) until a try succeeds;
        # and the ack script counts ``consumed`` only for the entries its own XACK took out
        # of the pending list, so a retry after an XACK that went through counts 0 and the
        # counter stays exact. A restart that lost the last writes (AOF everysec, kill -9)
        # is the same case as one that never received them: the retry writes them again.
        return await self._rider.call(lambda: self._ack(batch))

    async def _ack(self, batch: BatchData) -> int:
        held, books = self._handed(batch), self._books
        fresh = [h for h in held if not h.replay]
        head = await self._ledger.record(
            [TrainedEntry(h.group.group_id, *h.ref) for h in fresh])
        if head is not None:
            self._log_head = head
        counted = await self.reader.ack_counted([h.delivery for h in held], CONSUMED_COUNTER)
        for h in held:
            books.release(h)
            books.remember(h)
        self.stats.acked(batch.entries, [h.group for h in held], counted)
        log.info("batch_acked", run=self.run, groups=len(held), consumed=counted)
        return counted

    async def drop(self, batch: BatchData, reason: str = "stale") -> int:
        """Settle a handed-out batch its trainer did not train (e.g. TRL's staleness
        filter): ack it, counted ``drop:<reason>``, not recorded as trained."""
        held = self._handed(batch)
        dropped = await self._rider.call(lambda: self.reader.drop([h.delivery for h in held],
                                                                  reason))
        for h in held:
            self._books.release(h)
        return dropped

    async def dead_letter(self, batch: BatchData, exc: Exception) -> None:
        """Dead-letter a handed-out batch its trainer cannot take, with the reason
        ``schemas.failures`` gives ``exc`` (a ``ContractError`` carrying ``reason``)."""
        for h in self._handed(batch):
            await self._rider.call(lambda d=h.delivery: self._reject(d, exc, refetch=True))
            self._books.release(h)

    def _handed(self, batch: BatchData) -> list[HeldGroup]:
        return [self._books.held[r] for e in batch.entries
                if (r := (e.stream, e.entry_id)) in self._books.held]

    async def stall_reason(self) -> str:
        """Why no group may be arriving, in one line (``consumers.trainer.waiting``)."""
        return await stall_reason(self.redis, self.run, self.partitions,
                                  await self.current_version(), self._rider,
                                  self.settings.redis_give_up_s)

    async def current_version(self) -> int:
        """The version staleness is measured against: this client's own published (or
        resumed) version, else the run's ``policy_version``."""
        if self._version is not None:
            return self._version
        return await self._ledger.policy_version()

    # -- checkpoint / resume ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-serialisable resume state; save it with the checkpoint, after ``ack``."""
        return {
            "format": STATE_FORMAT,
            "run": self.run,
            "consumer": self.consumer,
            "log_id": self._log_head,
            "replay": [[stream, entry_id, group_id]
                       for (stream, entry_id), group_id in self._books.replays.items()],
            "policy_version": self._version,
        }

    async def load_state(self, state: dict[str, Any]) -> int:
        """Resume from a checkpoint's ``state()``; call before the first ``next_batch``.

        Queues, ahead of everything else, the groups trained after that checkpoint (their
        training was lost). Returns how many groups will be replayed. Raises ResumeError
        when the state is for another run, malformed, or its groups can no longer be found.
        """
        async with self._lock:
            return await self._load_state(state)

    async def _load_state(self, state: dict[str, Any]) -> int:
        if self._started or self._books.held or self._prefetcher.current is not None:
            raise ResumeError("load_state must be called before the first next_batch")
        held, version = await groups_to_replay(self._ledger, self.run, state)
        for group in held:
            self._books.hold(group)
        self._version = version
        log.info("trainer_resumed", run=self.run, replay=len(held),
                 log_id=str(state["log_id"]))
        return len(held)

    # -- weights ---------------------------------------------------------------------------

    async def publish_policy(self, step: int, weights: Any) -> int:
        """Serve the trainer's weights as policy version ``step`` on every vLLM server.

        What ``weights`` is depends on ``settings.weight_sync`` (``consumers.trainer.weights``):

        - ``reload``: a directory the servers can read (HF layout); each reloads it.
        - ``transfer``: the model (``nn.Module``) or an iterable of ``(name, tensor)`` pairs
          (iterated once per sync), sent through vLLM's weight-transfer API.
        - ``external``: a callable (sync or async) that moves the weights itself while the
          servers are paused, or None when nothing needs moving.
        - ``lora``: a PEFT adapter directory the servers can read, or a ``LoraAdapter``
          (``consumers.trainer.lora``); every server loads it as ``<lora_name>-v<step>``
          while it serves, nothing pauses; older versions are unloaded.

        Then the run's ``policy_version`` is raised to ``step`` (never lowered) so the feeder
        admits new work; for transfer and external before any server resumes. If any server
        fails, raises WeightSyncError naming it, after resuming every server, and leaves the
        version as it was. Returns the version in force.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._publisher.urls and self._run_check.unconfirmed and not await \
                self._run_check.may_publish(step, len(self._publisher.urls)):
            return await self._rider.call(self._ledger.policy_version)  # nothing sent
        method = self.settings.weight_sync
        raised: list[int] = []

        async def raise_version() -> None:
            raised.append(await self._rider.call(
                lambda: self._ledger.raise_policy_version(step)))

        report = await self._publisher.publish_weights(method, step, weights, raise_version)
        self.stats.synced(report)
        self.last_sync = report
        self._version = step
        log.info("policy_published", run=self.run, step=step, in_force=raised[0],
                 servers=len(self._publisher.urls), method=method,
                 seconds=round(report.seconds, 3), paused_s=round(report.paused_seconds, 3),
                 bytes=report.bytes_moved)
        return raised[0]

    def set_inference_urls(self, urls: Sequence[str]) -> None:
        """Change the servers the next ``publish_policy`` updates (a server added or
        removed); with ``transfer`` the next sync sets the transfer up again for all."""
        self._publisher.urls = [url.rstrip("/") for url in urls]

    # -- internals -------------------------------------------------------------------------

    async def _start(self) -> None:
        await self._admit(await self.reader.read_own_pending(count=100_000))
        self._started = True  # only now: an outage before this point starts over
        self._last_reclaim = time.monotonic()
        await self._admit(await self.reader.reclaim())

    async def _fill(self, remaining_s: float | None, count: int,
                    idle: asyncio.Event | None = None) -> None:
        """One read: abandoned entries when due, else up to ``count`` new ones (blocking,
        bounded). ``idle``: a prefetch no call waits for yet, which must stay cancellable
        at once (an abandoned blocking read could still deliver entries, to a client that
        no longer expects them): it reads without blocking and pauses until ``idle`` is set
        or ``PREFETCH_POLL_S`` at most."""
        s = self.settings
        if time.monotonic() - self._last_reclaim >= s.reclaim_every_s:
            self._last_reclaim = time.monotonic()
            reclaimed = await self.reader.reclaim()
            if reclaimed:
                await self._admit(reclaimed)
                return
        block_ms = s.block_ms if remaining_s is None else min(s.block_ms, int(remaining_s * 1000))
        if idle is not None:
            block_ms = 0
        started = time.monotonic()
        deliveries = await self.reader.read(count=count, block_ms=block_ms)
        if deliveries:
            self._empty_reads = 0
            await self._admit(deliveries)
            return
        self._empty_reads += 1
        waited = time.monotonic() - started
        if block_ms == 0 or waited < block_ms / 2000:  # no BLOCK (or fakeredis): back off
            pause = min(1.0, 0.005 * 2 ** min(self._empty_reads, 8))  # 2**1024 overflows
            if remaining_s is not None:
                pause = min(pause, max(0.0, remaining_s - waited))
            if idle is None:
                await asyncio.sleep(pause)
                return
            with contextlib.suppress(TimeoutError):  # a call waits now: read as it would
                await asyncio.wait_for(idle.wait(), min(pause, PREFETCH_POLL_S))

    async def _admit(self, deliveries: list[Delivery]) -> None:
        await admit(deliveries, self.reader, self._ledger, self._books, self.settings, self.run)

    async def _drop_stale(self, version: int) -> None:
        await drop_stale(version, self.reader, self._books, self.settings, self.run)

    async def _reject(self, delivery: Delivery, exc: Exception, *, refetch: bool = False) -> None:
        await reject(delivery, exc, self.reader, self.settings, refetch=refetch)


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (never below 0); None without one."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
