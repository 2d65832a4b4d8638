"""Weight transfer (``weight_sync="transfer"``): vLLM's native four-phase protocol, driven
from the trainer over HTTP to every server at once.

vLLM's weight-transfer API splits a sync into ``/init_weight_transfer_engine`` (once, or
again after a restart), then per sync ``/start_weight_update`` → ``/update_weights`` (one
call per chunk) → ``/finish_weight_update``. The bytes travel on a side channel the backend
owns: NCCL broadcast (``nccl``, GPUs), CUDA IPC handles (``ipc``, colocated), or a TCP
stream (``rollq_tcp``, CPU servers: ``ops/vllm_plugin``). A trainer-side engine with vLLM's
``TrainerWeightTransferEngine`` shape (``trainer_init(init_info, client=, source=)``,
``send_weights()``) drives one sync; ``ServerFanout`` is its control-plane client, one call
fanned out to every server, failures kept per server so ``WeightSyncError`` names them.

``TcpTrainerEngine`` is rollq's engine for ``rollq_tcp`` (registered in vLLM's
``WeightTransferTrainerFactory`` by the plugin; used directly here, so the trainer needs no
vllm). ``nccl`` and ``ipc`` use vLLM's own trainer engines: vllm must be importable in the
trainer's environment for those, as it must for any NCCL trainer.

Memory on the trainer: a source yields ``(name, tensor)`` pairs one at a time and chunks are
at most ``chunk_bytes`` (one tensor larger than that is a chunk of its own), so the sender
holds at most one chunk's CPU copies of GPU tensors, never a second copy of the model.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

_COUNT = struct.Struct("<Q")
BACKEND_TCP = "rollq_tcp"
DISCARD: dict[str, Any] = {"discard": True}
"""rollq_tcp's ``update_weights`` payload that drops what a server staged."""


class ServersFailed(Exception):
    """A fanned-out call failed on some servers: ``failures`` maps URL -> reason."""

    def __init__(self, step: str, failures: dict[str, str]) -> None:
        super().__init__("; ".join(f"{url}: {why}" for url, why in failures.items()))
        self.step = step
        self.failures = failures


class ServerFanout:
    """vLLM's ``VLLMWeightSyncClient`` protocol over HTTP to several servers at once.

    Each call is posted to every server concurrently and returns when all answered; any
    failure raises ``ServersFailed`` naming each failed server. ``workers_per_server`` sets
    each server's NCCL ``rank_offset`` (1 + i x workers) in an init payload that has one:
    vLLM's NCCL engine builds one payload for a single server.
    """

    def __init__(self, urls: list[str], http: httpx.Client, *, workers_per_server: int = 1
                 ) -> None:
        self.urls = urls
        self.http = http
        self.workers_per_server = workers_per_server
        self.discard_update: dict[str, Any] | None = None
        """An ``update_weights`` payload that makes a server drop a half-staged update
        (rollq_tcp's ``{"discard": true}``), sent before the finish that frees a stuck one:
        a staged backend must not apply a dead sync's leftovers."""
        self.bytes_sent = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)),
                                        thread_name_prefix="rollq-sync")

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def post_all(self, step: str, path: str, body: Any = None, *,
                 per_server: list[Any] | None = None, urls: list[str] | None = None) -> None:
        targets = self.urls if urls is None else urls
        bodies = per_server if per_server is not None else [body] * len(targets)
        futures = [self._pool.submit(self._post, url, path, one)
                   for url, one in zip(targets, bodies, strict=True)]
        failures = {url: why for url, f in zip(targets, futures, strict=True)
                    if (why := f.result()) is not None}
        if failures:
            raise ServersFailed(step, failures)

    def _post(self, url: str, path: str, body: Any) -> str | None:
        try:
            response = self.http.post(url + path, json=body)
        except httpx.ConnectError as exc:
            return f"cannot connect ({exc})"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__} {exc}".strip()
        if not response.is_success:
            hint = (" (start the server with --weight-transfer-config "
                    "'{\"backend\": ...}' and VLLM_SERVER_DEV_MODE=1)"
                    if response.status_code == 404 or "weight_transfer_config" in response.text
                    else "")
            return f"HTTP {response.status_code}: {response.text[:300]}{hint}"
        return None

    # -- VLLMWeightSyncClient ----------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if "rank_offset" in init_info:
            bodies = [{"init_info": {**init_info, "rank_offset": 1 + i * self.workers_per_server}}
                      for i in range(len(self.urls))]
            self.post_all("init_weight_transfer_engine", "/init_weight_transfer_engine",
                          per_server=bodies)
        else:
            self.post_all("init_weight_transfer_engine", "/init_weight_transfer_engine",
                          {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post_all("shutdown_weight_transfer_engine", "/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        """Start on every server. A server still mid-update (a trainer died between two
        chunks) refuses; it is finished (its layers keep what they hold) and started again,
        and the sync that follows overwrites every weight."""
        try:
            self.post_all("start_weight_update", "/start_weight_update")
        except ServersFailed as exc:
            stuck = list(exc.failures)
            try:
                if self.discard_update is not None:
                    self.post_all("update_weights", "/update_weights",
                                  {"update_info": self.discard_update}, urls=stuck)
                self.post_all("finish_weight_update", "/finish_weight_update", urls=stuck)
            except ServersFailed:
                pass  # not mid-update after all: the second start gives the verdict
            self.post_all("start_weight_update", "/start_weight_update", urls=stuck)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.post_all("update_weights", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.post_all("finish_weight_update", "/finish_weight_update", body)


# -- the CPU backend: rollq_tcp ----------------------------------------------------------------


@dataclass
class TcpTrainerInitInfo:
    """Trainer-side init info of ``rollq_tcp`` (vLLM's ``TrainerInitInfo`` shape)."""

    backend: ClassVar[str] = BACKEND_TCP
    host: str = "127.0.0.1"
    """Address the trainer listens on; every vLLM worker must reach it."""
    port: int = 0
    """Port the trainer listens on (0: any free port)."""
    chunk_bytes: int = 256 * 1024 * 1024
    """Most bytes per ``/update_weights`` call (a larger tensor is a chunk of its own)."""
    timeout_s: float = 120.0
    """Worker-side connect/read timeout, and how long the trainer waits for connections."""
    rank: int = field(default=0, kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def chunks(pairs: Iterable[tuple[str, Any]], chunk_bytes: int
           ) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``chunk_bytes`` (a tensor larger
    than that alone), moving each tensor to contiguous CPU memory as it is taken."""
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in pairs:
        if hasattr(tensor, "full_tensor"):  # a shard: its bytes are not the parameter's
            raise TypeError(f"{name} is a sharded (FSDP) tensor: gather the full state dict "
                            "to the sending rank first (as examples/torchrun_trainer.py does)")
        host = tensor.detach().to("cpu").contiguous()
        nbytes = host.numel() * host.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, host))
        size += nbytes
    if chunk:
        yield chunk


def _raw(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TcpTrainerEngine:
    """The trainer side of ``rollq_tcp``: serves each chunk's bytes to every worker that
    connects with the chunk's ticket while ``/update_weights`` runs on every server.

    The servers stage what they receive and apply it at ``/finish_weight_update``
    (ops/vllm_plugin): ``stage()`` (start and every chunk) can run while they serve, and
    only the finish needs them paused. ``send_weights()`` is both, vLLM's one-call form."""

    init_info_cls = TcpTrainerInitInfo

    def __init__(self, *, client: Any, source: Iterable[tuple[str, Any]] | None,
                 init_info: TcpTrainerInitInfo) -> None:
        self.client = client
        self.source = source
        self.info = init_info
        self.is_sender = init_info.is_sender
        self.bytes_sent = 0
        self._listener: socket.socket | None = None

    @classmethod
    def trainer_init(cls, init_info: TcpTrainerInitInfo, *, client: Any,
                     source: Iterable[tuple[str, Any]] | None = None) -> TcpTrainerEngine:
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            engine._listener = socket.create_server((init_info.host, init_info.port),
                                                    backlog=64)
            try:
                if hasattr(client, "discard_update"):
                    client.discard_update = DISCARD
                client.init_weight_transfer_engine({"timeout_s": init_info.timeout_s})
            except BaseException:
                engine.shutdown()  # a server that refused: no listening socket left behind
                raise
        return engine

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("not the sender, or shut down")
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def send_weights(self, weight_version: str | None = None) -> None:
        """One sync: start, every chunk, finish (``weight_version`` tags it)."""
        self.stage()
        if self.is_sender:
            self.client.finish_weight_update(weight_version)

    def stage(self) -> None:
        """Start and send every chunk: the servers hold the weights, not yet applied."""
        if self.source is None:
            raise ValueError("rollq_tcp needs a source of (name, tensor) pairs")
        if not self.is_sender:
            return  # only rank 0 sends: it holds the whole model (gathered, under FSDP)
        self.client.start_weight_update()
        for chunk in chunks(self.source, self.info.chunk_bytes):
            self._send_chunk(chunk)

    def discard(self) -> None:
        """Make every server drop what it staged (and end the update, applying nothing)."""
        for call in (lambda: self.client.update_weights(DISCARD),
                     self.client.finish_weight_update):
            try:
                call()
            except Exception:  # a server not mid-update (or gone): nothing to drop there
                pass

    def _send_chunk(self, chunk: list[tuple[str, Any]]) -> None:
        ticket = secrets.token_hex(16)
        update = {"address": self.address, "ticket": ticket,
                  "names": [name for name, _ in chunk],
                  "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                  "shapes": [list(t.shape) for _, t in chunk]}
        views = [_raw(t) for _, t in chunk if t.numel()]
        header = _COUNT.pack(sum(len(v) for v in views))
        done: Future[None] = Future()
        waker, wake = socket.socketpair()  # the call's end wakes the accept loop at once
        done.add_done_callback(lambda _: wake.send(b"."))
        caller = threading.Thread(target=_complete, args=(done, self.client.update_weights,
                                                          update), daemon=True)
        senders: list[threading.Thread] = []
        errors: list[str] = []
        assert self._listener is not None
        with selectors.DefaultSelector() as selector, waker, wake:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(waker, selectors.EVENT_READ)
            caller.start()
            while not done.done():
                for key, _ in selector.select(timeout=1.0):
                    if key.fileobj is not self._listener:
                        continue
                    connection, _ = self._listener.accept()
                    sender = threading.Thread(target=self._serve, daemon=True,
                                              args=(connection, ticket, header, views, errors))
                    sender.start()
                    senders.append(sender)
        for sender in senders:
            sender.join()
        done.result()  # ServersFailed names the servers whose workers failed
        if errors:  # a stranger connected: the workers themselves all succeeded
            raise ServersFailed("update_weights", {"trainer": "; ".join(errors)})

    def _serve(self, connection: socket.socket, ticket: str, header: bytes,
               views: list[memoryview], errors: list[str]) -> None:
        with connection:
            connection.settimeout(self.info.timeout_s)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                line = connection.makefile("rb").readline(100).strip()
                if line != ticket.encode():
                    errors.append("a connection without this chunk's ticket was refused")
                    return
                connection.sendall(header)
                for view in views:
                    connection.sendall(view)
                    self.bytes_sent += len(view)
            except OSError as exc:  # the worker's update_weights fails and says so
                errors.append(f"stream to a worker cut: {exc}")

    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _complete(future: Future[None], call: Callable[[Any], None], argument: Any) -> None:
    try:
        call(argument)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)


# -- vLLM's own backends (nccl, ipc) ------------------------------------------------------------


def vllm_trainer_engine(backend: str, *, client: ServerFanout, source: Any, host: str,
                        port: int, workers: int) -> Any:
    """vLLM's trainer engine for ``nccl`` or ``ipc`` (vllm must be installed here)."""
    try:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError as exc:
        raise RuntimeError(f"transfer backend {backend!r} drives vLLM's own trainer engine: "
                           "install vllm in the trainer's environment (or use rollq_tcp)"
                           ) from exc
    if hasattr(source, "named_parameters"):
        source = ModuleSource(source)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if port == 0:
            with socket.create_server((host, 0)) as probe:
                port = probe.getsockname()[1]
        info: Any = NCCLTrainerInitInfo(master_address=host, master_port=port,
                                        world_size=1 + workers, rank=0)
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0)
    else:
        raise RuntimeError(f"unknown transfer backend {backend!r}: rollq_tcp, nccl or ipc")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
