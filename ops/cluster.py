"""The data-plane client for a Redis Cluster: redis-py's ``RedisCluster`` plus what rollq
needs of it and redis-py 5 lacks.

- **Single-slot transactions.** redis-py 5's cluster pipelines refuse ``transaction=True``.
  Here a transaction runs as MULTI … EXEC on one connection to the master that owns its
  slot; one whose keys hash to several slots is refused (``RedisClusterException``): every
  multi-key operation of rollq keeps to one partition's hash tag (``schemas.keys``).
- **Pipelines** group their commands by master and send each master's share on one
  connection, all masters at once; a command answered MOVED/ASK/TRYAGAIN (nothing was
  done) is sent again alone after the topology is refreshed.
- **WAIT durability** (``wait_replicas`` > 0): every write (a single command, a pipeline's
  share of one master, a transaction) is followed on its connection by ``WAIT
  wait_replicas wait_timeout_ms``; fewer replicas than asked is ``NotReplicated``, a
  ``ConnectionError``: the roles retry the write (every rollq write is idempotent or
  deduplicated downstream) until a replica acknowledges it or they give up. A failover then
  cannot lose an acknowledged write, since the replica that is promoted holds it. A write
  sent on a stale slot map to a master that a failover made a replica is redirected (MOVED)
  and that node's refusal of WAIT is not an error of its own.
- **Errors of a failover** (CLUSTERDOWN, TRYAGAIN, an uncovered slot, a topology that cannot
  be read, redirections that do not settle) become ``redis.exceptions.ConnectionError``, so
  every role rides them out like any other Redis outage (``schemas.outage``); a cross-slot
  command stays a ``RedisClusterException`` (a bug, not an outage). After a connection
  error the client re-reads the topology before its next command.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import redis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, PipelineCommand, RedisCluster

from rollq.schemas.errors import refusals_named

WRITE_COMMANDS = frozenset({
    "XADD", "XACK", "XTRIM", "XDEL", "XGROUP", "HSET", "HSETNX", "HINCRBY", "HDEL", "SET",
    "DEL", "UNLINK", "SADD", "SREM", "EXPIRE", "PEXPIRE", "INCR", "INCRBY", "DECR", "DECRBY",
    "EVAL", "EVALSHA", "ZADD", "ZREM", "RPUSH", "LPUSH",
})
"""Commands after which ``wait_replicas`` waits for replicas (those rollq writes with)."""

_REDIRECTS = (redis_errors.MovedError, redis_errors.TryAgainError)  # AskError: Moved's base
_TRANSIENT = (redis_errors.ClusterDownError, redis_errors.TryAgainError,
              redis_errors.ClusterError, redis_errors.SlotNotCoveredError)


REDIS_PY_INTERNALS: dict[str, tuple[str, ...]] = {
    "RedisCluster": ("_initialize", "_determine_slot", "nodes_manager"),
    "NodesManager": ("startup_nodes", "nodes_cache", "connection_kwargs"),
    "ClusterNode": ("_free", "acquire_connection", "parse_response", "response_callbacks"),
    "ClusterPipeline": ("_command_stack", "_client"),
}
"""The redis-py internals this module relies on (checked against redis-py 5.3), named once.
None is public API: ``missing_redis_py_internals()`` lists those an installed redis-py
lacks, a test fails on it and ``ClusterClient`` refuses to start with it, so an upgrade
that moves one fails loudly instead of misbehaving during a failover."""


def missing_redis_py_internals() -> list[str]:
    """``Class.attribute`` of each of ``REDIS_PY_INTERNALS`` the installed redis-py lacks
    (probed on objects built without connecting)."""
    client = RedisCluster(host="127.0.0.1", port=6379)
    probes: dict[str, Any] = {
        "RedisCluster": client, "NodesManager": client.nodes_manager,
        "ClusterNode": ClusterNode("127.0.0.1", 6379),
        "ClusterPipeline": ClusterPipeline(client),  # type: ignore[abstract]
    }
    return [f"{owner}.{name}" for owner, names in REDIS_PY_INTERNALS.items()
            for name in names if not hasattr(probes[owner], name)]


_MISSING_INTERNALS = cache(missing_redis_py_internals)


class NotReplicated(redis_errors.ConnectionError):
    """A write was done on the master but fewer replicas than ``wait_replicas`` hold it."""


@contextmanager
def _outage_errors() -> Iterator[None]:
    try:
        yield
    except _TRANSIENT as exc:
        raise redis_errors.ConnectionError(
            f"redis cluster unavailable: {type(exc).__name__}: {exc}") from exc


class ClusterClient(RedisCluster):
    """``RedisCluster`` with single-slot transactions, per-master pipelines, optional WAIT
    durability and failover errors as connection errors (see the module docstring)."""

    wait_replicas: int = 0
    """Replicas that must acknowledge each write (0: asynchronous replication)."""
    wait_timeout_ms: int = 1000
    """How long a write waits for them (milliseconds) before it counts as failed."""

    async def initialize(self) -> ClusterClient:
        missing = _MISSING_INTERNALS()
        if missing:  # before any command: refused by name, never a misbehaving failover
            raise RuntimeError(
                f"redis-py {redis.__version__} lacks what rollq's cluster client relies on: "
                f"{', '.join(missing)} (see ops/cluster.py REDIS_PY_INTERNALS); install the "
                "redis version pyproject.toml names")
        if self._initialize:
            self._restore_startup_nodes()
        try:
            await super().initialize()
        except (redis_errors.RedisClusterException, redis_errors.ClusterError,
                RuntimeError) as exc:
            # RuntimeError: redis-py iterates its start-up nodes while a failing command
            # elsewhere removes one ("dictionary changed size during iteration")
            raise redis_errors.ConnectionError(
                f"redis cluster unavailable: cannot read its topology: {exc}") from exc
        self._known_nodes().update(self.nodes_manager.nodes_cache)
        return self

    def _known_nodes(self) -> set[str]:
        known: set[str] | None = getattr(self, "_known", None)
        if known is None:
            known = self._known = set(self.nodes_manager.startup_nodes)
        return known

    def _restore_startup_nodes(self) -> None:
        """Ask every node ever seen for the topology again. redis-py drops a node from its
        start-up list on each connection error, healthy nodes included when a failover
        breaks connections in flight, and with the list empty it could never reconnect."""
        manager = self.nodes_manager
        for name in self._known_nodes() - set(manager.startup_nodes):
            host, _, port = name.rpartition(":")
            manager.startup_nodes[name] = ClusterNode(host, int(port),
                                                      **manager.connection_kwargs)

    async def aclose(self) -> None:
        """Close every connection. Unlike redis-py's, also when a topology refresh is due:
        a command that raced the refresh may have opened connections since."""
        await super().aclose()
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        user = self.nodes_manager.connection_kwargs.get("username")
        with refusals_named(user, args), _outage_errors():
            if (self.wait_replicas and "target_nodes" not in kwargs
                    and str(args[0]).upper() in WRITE_COMMANDS):
                command = PipelineCommand(0, *args, **kwargs)
                await self.run_commands([command], transaction=False)
                if isinstance(command.result, BaseException):
                    raise command.result
                return command.result
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> SlotPipeline:
        """A pipeline (``transaction=True``: one MULTI/EXEC, which must keep to one slot)."""
        if shard_hint:
            raise redis_errors.RedisClusterException("shard_hint is not supported")
        # redis-py makes its own ClusterPipeline the same way (connection_pool is unused)
        return SlotPipeline(self, transaction=bool(transaction))  # type: ignore[abstract]

    async def run_commands(self, commands: list[PipelineCommand], *, transaction: bool) -> None:
        """Run ``commands`` (a transaction: in one slot), each master's share on one of its
        connections; sets each command's ``result`` (a value or the error it got)."""
        for attempt in range(3):
            await self.initialize()
            slots: set[int] = set()
            by_node: dict[str, tuple[ClusterNode, list[PipelineCommand]]] = {}
            for command in commands:
                slot = await self._determine_slot(*command.args)
                slots.add(slot)
                node = self.nodes_manager.get_node_from_slot(slot)
                by_node.setdefault(node.name, (node, []))[1].append(command)
            if transaction and len(slots) > 1:
                raise redis_errors.RedisClusterException(
                    "a transaction on a Redis Cluster must keep to one hash slot; got keys of "
                    f"{len(slots)} slots: {[c.args[:2] for c in commands]}")
            await asyncio.gather(*(self._run_on_node(node, share, transaction=transaction)
                                   for node, share in by_node.values()))
            redirected = [c for c in commands if isinstance(c.result, _REDIRECTS)]
            if not redirected:
                return
            await self.aclose()  # re-read the topology: a slot moved (a failover)
            await asyncio.sleep(0.05 * 2**attempt)
            commands = commands if transaction else redirected
        raise redis_errors.ConnectionError(
            f"redis cluster unavailable: redirections did not settle: {redirected[0].result}")

    async def _run_on_node(self, node: ClusterNode, commands: list[PipelineCommand], *,
                           transaction: bool) -> None:
        wait = self.wait_replicas > 0 and any(
            str(c.args[0]).upper() in WRITE_COMMANDS for c in commands)
        packed: list[tuple[Any, ...]] = [c.args for c in commands]
        if transaction:
            packed = [("MULTI",), *packed, ("EXEC",)]
        if wait:
            packed.append(("WAIT", self.wait_replicas, self.wait_timeout_ms))
        connection = node.acquire_connection()
        try:
            await connection.send_packed_command(connection.pack_commands(packed), False)
            if transaction:
                await self._read_transaction(node, connection, commands)
            else:
                for command in commands:
                    try:
                        command.result = await node.parse_response(
                            connection, command.args[0], **command.kwargs)
                    except redis_errors.ResponseError as exc:
                        command.result = exc
            if wait:
                await self._read_wait(node, connection, commands)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
            await connection.disconnect(nowait=True)  # replies may be left unread on it
            await self.aclose()  # re-read the topology before the next command
            raise
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        finally:
            node._free.append(connection)  # ClusterNode's own pool

    async def _read_wait(self, node: ClusterNode, connection: Any,
                         commands: list[PipelineCommand]) -> None:
        """Read WAIT's reply: fewer replicas than asked makes each command's result
        ``NotReplicated``. A node that a failover made a replica refuses WAIT itself: its
        writes were redirected (MOVED, sent again to the new master by ``run_commands``),
        and one that was done before it became a replica may be lost, so it is
        ``NotReplicated`` too (the retry finds the new master through MOVED)."""
        try:
            replicas = int(await connection.read_response())
            why = f"within {self.wait_timeout_ms} ms (got {replicas})"
        except redis_errors.NoPermissionError:
            raise  # the ACL refuses the user WAIT: a configuration error (refusals_named)
        except redis_errors.ResponseError as exc:
            replicas, why = -1, f"(it refused WAIT: {exc}; a failover made it a replica)"
        if replicas >= self.wait_replicas:
            return
        error = NotReplicated(
            f"write not acknowledged by {self.wait_replicas} replica(s) of {node.name} {why}")
        for command in commands:
            if not isinstance(command.result, _REDIRECTS):
                command.result = error

    @staticmethod
    async def _read_transaction(node: ClusterNode, connection: Any,
                                commands: list[PipelineCommand]) -> None:
        await connection.read_response()  # MULTI's OK
        queued: list[redis_errors.ResponseError] = []
        for _ in commands:
            try:
                await connection.read_response()  # QUEUED
            except redis_errors.ResponseError as exc:
                queued.append(exc)
        try:
            replies = await connection.read_response()
        except redis_errors.ResponseError as exc:  # EXECABORT: nothing was done
            error = queued[0] if queued else exc
            for command in commands:
                command.result = error
            return
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, redis_errors.ResponseError):
                command.result = reply
                continue
            callback = node.response_callbacks.get(command.args[0])
            options = {k: v for k, v in command.kwargs.items() if k != "keys"}
            command.result = callback(reply, **options) if callback else reply


class SlotPipeline(ClusterPipeline):
    """The cluster client's pipeline: see ``ClusterClient.run_commands``."""

    __slots__ = ("_transaction",)

    def __init__(self, client: ClusterClient, *, transaction: bool) -> None:
        super().__init__(client)
        self._transaction = transaction

    async def execute(self, raise_on_error: bool = True,
                      allow_redirections: bool = True) -> list[Any]:
        stack, self._command_stack = self._command_stack, []
        if not stack:
            return []
        client = self._client
        assert isinstance(client, ClusterClient)
        with _outage_errors():
            await client.run_commands(stack, transaction=self._transaction)
        if raise_on_error:
            for command in stack:
                if isinstance(command.result, BaseException):
                    raise command.result
        return [command.result for command in stack]
