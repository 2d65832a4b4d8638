"""The Atropos API's state, all of it in Redis: any number of API processes serve one run.

Keys (run-wide ones under the run's hash tag, ``schemas.keys.run_key``):

    rollq:{<run>}:atropos           hash: registration (the trainer's, JSON), started, step,
                                    outstanding (the batch last handed out, JSON list of
                                    [stream, entry id]), handout (its id), delivery
                                    ("<handout> sent|not_sent"), redeliver, prepared
                                    (batches formed ahead), latest ("<stream> <id>")
    rollq:{<run>}:atropos:envs      list: registered envs (JSON), index = env_id
    rollq:{<run>}:atropos:buffer:<env_id>
                                    list: posted groups of a size other than their env's,
                                    verbatim JSON, until some of them sum to that size
    rollq:{<run>}:atropos:lock      the lock that serialises batch assembly across processes
    rollq:{<run>:<p>}:atropos:pieces
                                    hash: entry id -> the group's ``/batch`` JSON, deflated
                                    once (``ops.atropos.pieces``); HDEL when the group is
                                    acked or dropped
    rollq:{<run>:<p>}:atropos:posted:<digest>
                                    the entry id of a posted group, for ``dedup_window_s``:
                                    an identical re-post (same env, tokens and scores) in
                                    that window is answered without a second XADD

Delivery:

- A posted group is one XADD before the HTTP answer: to the partition's ``scored`` stream
  (``rewards="env"``, inline form, the env's scores) or ``traj`` stream
  (``rewards="bridge"``: rollq's scorers score it). With ``rewards="env"`` the same Lua
  script stores the group's ``/batch`` piece beside it; other groups (bridge-scored, or
  from rollq's own envs) get theirs built once when this API first reads them. A buffered
  group is an RPUSH; the groups that complete a size are XADDed and taken off the buffer
  in one MULTI/EXEC.
- ``/batch`` reads the scored streams in consumer group ``atropos`` as consumer ``queue``:
  the queue is that consumer's pending list (XPENDING) minus the batch last handed out. A
  handed-out batch stays pending until the next ``/batch`` (or ``/ack-batch``) acks it
  (counted ``consumed``). The next ``/batch`` acks it only if its answer was sent in full
  (the API that sent it recorded ``delivery`` = sent: last byte written, client still
  connected); an answer cut off (the client left, the API was killed, Redis was down when
  the verdict was due) makes the next ``/batch`` hand the same batch out again, as a
  ``/register`` in between (a restarted trainer) does, less any group acked meanwhile. So
  a crash of the trainer, of an API process or of Redis (AOF), or a trainer that never
  read its answer, loses no group (it may see a batch twice), and no acked group is
  handed out again.

Who owns what: this module the registration, the batches handed out and acked, the
env status and reset; ``ops.atropos.posting`` the writing of posted groups;
``ops.atropos.queue`` the reading of the queue; ``ops.atropos.kept_pieces`` where the
``/batch`` pieces live; ``ops.atropos.lock`` the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import Delivery, StreamReader, translated_errors
from rollq.ops.atropos.batching import env_status, select_batch
from rollq.ops.atropos.kept_pieces import PieceCache, Ref, piece_key
from rollq.ops.atropos.lock import ApiLock
from rollq.ops.atropos.models import ScoredData
from rollq.ops.atropos.pieces import inflate
from rollq.ops.atropos.posting import Poster
from rollq.ops.atropos.queue import Queue, QueuedGroup
from rollq.ops.settings import RewardSource
from rollq.producers.publisher import Publisher
from rollq.schemas.keys import CONSUMED_COUNTER, DROP_PREFIX, counters_key, run_key

log = structlog.get_logger("rollq.atropos")


def _refs(raw: Any) -> list[Ref]:
    """Entry refs from their JSON form (a list of [stream, entry id])."""
    values = orjson.loads(raw) if isinstance(raw, str | bytes) else (raw or [])
    return [(str(stream), str(entry)) for stream, entry in values]


def _handed(state: dict[str, Any]) -> set[Ref]:
    """Groups out of the queue: the batch handed out and the batches formed ahead."""
    handed = set(_refs(state.get("outstanding")))
    for batch in orjson.loads(state.get("prepared", "[]")):
        handed.update(_refs(batch))
    return handed


SENT, NOT_SENT = "sent", "not_sent"
"""Verdicts on a hand-out's answer (the state's ``delivery`` field: ``<handout> <verdict>``)."""

# Set a hand-out's verdict only while it is still the batch out (KEYS: state hash;
# ARGV: hand-out id, verdict).
_RECORD_DELIVERY = """
if redis.call('HGET', KEYS[1], 'handout') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'delivery', ARGV[1] .. ' ' .. ARGV[2])
return 1
"""


@dataclass(frozen=True)
class Handout:
    """A batch as ``/batch`` hands it out: its groups' pieces, and the id under which
    the API records whether the answer reached the client (``record_delivery``)."""

    pieces: list[bytes]
    handout: str


class NotRegistered(Exception):
    """``/batch`` before any trainer called ``/register``."""


class UnknownEnv(LookupError):
    """An ``env_id`` that no env registered."""


class AtroposStore:
    """One run's Atropos API state; ``async with AtroposStore(...)``."""

    def __init__(self, redis: aioredis.Redis, run: str, *, rewards: RewardSource = "env",
                 consumer_group: str = "atropos", partitions: int = 1,
                 lock_timeout_s: float = 30.0, cache_groups: int = 4096,
                 gzip_level: int = 1, dedup_window_s: int = 600,
                 piece_cache_bytes: int = 512 << 20, delivery_wait_s: float = 5.0,
                 events: Counter[str] | None = None) -> None:
        self.redis = redis
        self.run = run
        self.rewards = rewards
        self.consumer_group = consumer_group
        self.partitions = partitions
        self.lock_timeout_s = lock_timeout_s
        self.cache_groups = cache_groups
        self.gzip_level = gzip_level
        self.dedup_window_s = dedup_window_s
        self.delivery_wait_s = delivery_wait_s
        self.events: Counter[str] = Counter() if events is None else events
        """Counts of this process (``batch_redelivered``), for ``/metrics``."""
        self._state = run_key(run, "atropos")
        self._record_delivery = redis.register_script(_RECORD_DELIVERY)
        self._sending: tuple[str, asyncio.Event] | None = None
        """The hand-out this process is sending, set once its verdict is recorded: a
        ``/batch`` that follows on its heels waits for it without polling Redis."""
        self._envs = run_key(run, "atropos:envs")
        self._lock = ApiLock(redis, run_key(run, "atropos:lock"), lock_timeout_s)
        pieces_kept = PieceCache(piece_cache_bytes)
        self._queue = Queue(redis, run, consumer_group=consumer_group,
                            cache_groups=cache_groups, gzip_level=gzip_level,
                            pieces_kept=pieces_kept)
        self._poster = Poster(redis, run, rewards=rewards, partitions=partitions,
                              gzip_level=gzip_level, dedup_window_s=dedup_window_s,
                              pieces_kept=pieces_kept, on_posted=self._queue.posted)

    async def __aenter__(self) -> AtroposStore:
        self.partitions = await Publisher(self.redis, self.run, self.partitions).register()
        self._poster.partitions = self.partitions
        await self._queue.start(self.partitions)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._queue.close()

    @property
    def reader(self) -> StreamReader:
        return self._queue.reader

    # -- registration ------------------------------------------------------------------------

    async def state(self) -> dict[str, Any]:
        async with translated_errors("reading the Atropos API state"):
            raw = await self.redis.hgetall(self._state)
        state: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        if "registration" in state:
            state["registration"] = orjson.loads(state["registration"])
        return state

    async def envs(self) -> list[dict[str, Any]]:
        async with translated_errors("reading registered envs"):
            raw = await self.redis.lrange(self._envs, 0, -1)
        return [orjson.loads(item) for item in raw]

    async def register_trainer(self, registration: dict[str, Any]) -> int:
        """Record the first trainer's registration (later ones keep it, as atroposlib);
        a registration while a batch is out makes the next ``/batch`` hand it out again."""
        async with translated_errors("registering a trainer"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hsetnx(self._state, "registration", orjson.dumps(registration).decode())
            pipe.hsetnx(self._state, "step", str(registration["starting_step"]))
            pipe.hexists(self._state, "outstanding")
            _, _, outstanding = await pipe.execute()
            if outstanding:
                await self.redis.hset(self._state, "redeliver", "1")
        return uuid.uuid4().int

    async def register_env(self, env: dict[str, Any]) -> dict[str, Any] | None:
        """Append an env (under the lock: ids and names follow registration order); None
        while no trainer has started (called ``/batch``)."""
        async with self._lock.held():
            state = await self.state()
            if state.get("started") != "1":
                return None
            envs = await self.envs()
            same = sum(1 for e in envs if e["desired_name"] == env["desired_name"])
            record = {**env, "real_name": f"{env['desired_name']}_{same}",
                      "registered_id": len(envs), "last_update": time.time(),
                      "connected": True}
            async with translated_errors("registering an env"):
                await self.redis.rpush(self._envs, orjson.dumps(record))
        registration = state.get("registration", {})
        return {**record, "checkpoint_dir": registration.get("checkpoint_dir", ""),
                "starting_step": int(state.get("step", 0)),
                "checkpoint_interval": registration.get("save_checkpoint_interval", -1),
                "num_steps": registration.get("num_steps", -1)}

    async def disconnect_env(self, env_id: int) -> None:
        async with self._lock.held():
            envs = await self.envs()
            if not 0 <= env_id < len(envs):
                raise UnknownEnv("list index out of range")
            envs[env_id]["connected"] = False
            async with translated_errors("disconnecting an env"):
                await self.redis.lset(self._envs, env_id, orjson.dumps(envs[env_id]).decode())

    # -- posting -------------------------------------------------------------------------------

    async def post(self, data: ScoredData, occurrence: int = 0) -> dict[str, Any]:
        """Store one posted group (or buffer it); the answer atroposlib gives.
        ``occurrence``: how many groups identical to it came before it in its request."""
        return await self._poster.post(data, await self.envs(), occurrence)

    def check(self, data: ScoredData) -> None:
        """Raise ``InvalidGroup`` for a group that could not be stored."""
        self._poster.check(data)

    # -- the queue -----------------------------------------------------------------------------

    async def queue(self, exclude: set[Ref] | None = None) -> list[tuple[Ref, QueuedGroup]]:
        """The groups waiting for a batch, oldest first."""
        return await self._queue.waiting(exclude)

    async def queue_size(self) -> int:
        handed = _handed(await self.state())
        await self._queue.ingest()
        return len([r for r in await self._queue.pending() if r not in handed])

    # -- batches ---------------------------------------------------------------------------

    async def next_batch(self) -> Handout | None:
        """The next batch (``Handout``: each group's piece, ``ops.atropos.pieces``), or
        None when none can be formed.

        As atroposlib, a call that finds no batch formed ahead forms every batch the queue
        allows, counts them all as steps, and hands out the last one formed first. The
        batch handed out before is acked first, if its answer was sent in full
        (``record_delivery``); else it is handed out again (``batch_redelivered``), as it
        is after a ``/register``. Raises ``NotRegistered`` before the first ``/register``.
        """
        async with self._lock.held():
            state = await self.state()
            if "registration" not in state:
                raise NotRegistered
            if state.get("started") != "1":
                await self.redis.hset(self._state, "started", "1")
            prepared = [_refs(batch) for batch in orjson.loads(state.get("prepared", "[]"))]
            outstanding = _refs(state.get("outstanding"))
            if outstanding:
                still = set(await self._queue.pending())
                kept = [r for r in outstanding if r in still]
                if kept:
                    reason = "trainer_registered" if state.get("redeliver") == "1" \
                        else await self._undelivered(state.get("handout"),
                                                     state.get("delivery"))
                    if reason is not None:
                        log.info("batch_redelivered", run=self.run, groups=len(kept),
                                 reason=reason)
                        self.events["batch_redelivered"] += 1
                        return await self._hand_out(kept, prepared, formed=0)
                await self._ack(kept)
            formed = 0
            if not prepared:
                queue = await self.queue()
                envs = await self.envs()
                batch_size = state["registration"]["batch_size"]
                while (chosen := select_batch([h.queued for _, h in queue], batch_size,
                                              envs)) is not None:
                    prepared.append([queue[i][0] for i in chosen])
                    taken = set(chosen)
                    queue = [q for i, q in enumerate(queue) if i not in taken]
                formed = len(prepared)
            if not prepared:
                return None
            refs = prepared.pop()
            handout = await self._hand_out(refs, prepared, formed=formed)
            log.info("batch_handed_out", run=self.run, groups=len(refs), formed=formed)
            return handout

    async def _hand_out(self, refs: list[Ref], prepared: list[list[Ref]], *,
                        formed: int) -> Handout:
        """Record ``refs`` as the batch out (under a new hand-out id, no delivery verdict
        yet) and the batches still formed ahead; return its pieces."""
        held = await self._queue.fetch(refs)
        handout = uuid.uuid4().hex
        async with translated_errors("handing out a batch"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self._state, mapping={"outstanding": orjson.dumps(refs),
                                            "prepared": orjson.dumps(prepared),
                                            "handout": handout})
            pipe.hdel(self._state, "redeliver", "delivery")
            if formed:
                pipe.hincrby(self._state, "step", formed)
            await pipe.execute()
        pieces = await self._queue.pieces(held, load=True)
        self._sending = (handout, asyncio.Event())
        return Handout([pieces[r] for r in refs if r in pieces], handout)

    async def _undelivered(self, handout: str | None, delivery: str | None) -> str | None:
        """Why the batch out under ``handout`` must be handed out again, or None when its
        answer was sent in full. With no verdict yet, waits up to ``delivery_wait_s`` for
        one: the answer may still be finishing (the trainer can read the last bytes
        before this API records them sent), or the API that sent it died."""
        if handout is None:
            return None  # handed out before hand-outs had ids: acked as then
        deadline = time.monotonic() + self.delivery_wait_s
        while True:
            if delivery == f"{handout} {SENT}":
                return None
            if delivery == f"{handout} {NOT_SENT}":
                return "answer_not_sent"
            if time.monotonic() >= deadline:
                return "answer_unconfirmed"
            if self._sending is not None and self._sending[0] == handout:
                with contextlib.suppress(TimeoutError):  # sent by this process: no polling
                    await asyncio.wait_for(self._sending[1].wait(),
                                           max(0.0, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.01)
            async with translated_errors("reading a delivery"):
                raw = await self.redis.hget(self._state, "delivery")
            delivery = raw.decode() if isinstance(raw, bytes) else raw

    async def record_delivery(self, handout: str, sent: bool) -> None:
        """Record whether the answer of hand-out ``handout`` was sent in full (its last
        byte written, the client still connected): the next ``/batch`` acks the batch
        only then. Ignored when another batch was handed out since."""
        verdict = SENT if sent else NOT_SENT
        async with translated_errors("recording a delivery"):
            recorded = await self._record_delivery(keys=[self._state], args=[handout, verdict])
        if self._sending is not None and self._sending[0] == handout:
            self._sending[1].set()
        if not sent and recorded:
            log.warning("batch_not_delivered", run=self.run, handout=handout,
                        detail="the client left before the whole answer was sent: the "
                        "next /batch hands the same batch out again")

    async def ack_outstanding(self) -> int:
        """Ack the batch last handed out (``/ack-batch``); returns the groups acked now."""
        async with self._lock.held():
            state = await self.state()
            return await self._ack(_refs(state.get("outstanding")))

    async def _ack(self, refs: Sequence[Ref]) -> int:
        acked = await self.reader.ack_counted([Delivery(s, e, {}) for s, e in refs],
                                              CONSUMED_COUNTER) if refs else 0
        async with translated_errors("acking a batch"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hdel(self._state, "outstanding", "redeliver", "handout", "delivery")
            for stream, entry in refs:
                pipe.hdel(piece_key(stream), entry)
            await pipe.execute()
        self._queue.forget(refs)
        if refs:
            log.info("batch_acked", run=self.run, groups=len(refs), consumed=acked)
        return acked

    # -- status ----------------------------------------------------------------------------

    async def env_status(self, env_id: int) -> dict[str, Any]:
        async with self._lock.held():
            envs = await self.envs()
            if not 0 <= env_id < len(envs):
                raise UnknownEnv(f"env_id {env_id} is not registered ({len(envs)} envs are)")
            state = await self.state()
            queue = await self.queue(_handed(state))
            batch_size = state.get("registration", {}).get("batch_size", 0)
            status, group_size = env_status([h.queued for _, h in queue], env_id, envs,
                                            batch_size, int(state.get("step", 0)))
            if group_size != envs[env_id]["group_size"]:
                envs[env_id]["group_size"] = group_size
                async with translated_errors("updating an env"):
                    await self.redis.lset(self._envs, env_id, orjson.dumps(envs[env_id]).decode())
            return status

    async def latest(self) -> bytes | None:
        state = await self.state()
        stream, _, entry = state.get("latest", "").partition(" ")
        if not entry:
            return None
        held = await self._queue.fetch([(stream, entry)])
        pieces = await self._queue.pieces(held, load=True)
        return inflate(pieces[(stream, entry)]) if pieces else None

    async def reset(self) -> int:
        """atroposlib's ``/reset_data``: forget registrations and drop every queued and
        buffered group (counted ``drop:reset``). Returns the groups dropped."""
        async with self._lock.held():
            state = await self.state()
            queue = await self.queue()
            envs = await self.envs()
            dropped = await self.reader.drop([Delivery(s, e, {}) for (s, e), _ in queue],
                                             "reset") if queue else 0
            buffered = 0
            async with translated_errors("resetting"):
                pipe = self.redis.pipeline(transaction=True)
                for env_id in range(len(envs)):
                    pipe.llen(self._poster.buffer_key(env_id))
                    pipe.delete(self._poster.buffer_key(env_id))
                pipe.delete(self._state, self._envs,
                            *(piece_key(stream) for stream in self.reader.streams))
                if "registration" in state:  # atroposlib's reset forgets all but this
                    pipe.hset(self._state, "max_token_len",
                              str(state["registration"]["max_token_len"]))
                replies = await pipe.execute()
                buffered = sum(replies[0:2 * len(envs):2])
                if buffered:
                    await self.redis.hincrby(counters_key(self.run, 0), DROP_PREFIX + "reset",
                                             buffered)
            self._queue.clear()
            log.info("atropos_reset", run=self.run, dropped=dropped, buffered=buffered)
            return dropped + buffered
