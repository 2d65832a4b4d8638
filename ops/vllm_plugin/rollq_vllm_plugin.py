"""rollq's CPU weight-transfer backend for vLLM, ``rollq_tcp``.

Serve with ``--weight-transfer-config '{"backend": "rollq_tcp"}'``.

vLLM's weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) moves weights with NCCL or CUDA IPC, which
need GPUs. This backend moves them over a plain TCP stream so the same control plane runs
on CPU servers (rollq's tests, benches and laptop demo). It is loaded into every vLLM
process through the ``vllm.general_plugins`` entry point (``pip install`` this folder into
vLLM's environment) and registers:

- the worker engine ``rollq_tcp`` in ``WeightTransferEngineFactory`` (this module);
- the trainer engine ``rollq_tcp`` in ``WeightTransferTrainerFactory``, lazily, as
  ``consumers.trainer.transfer.TcpTrainerEngine`` (rollq's trainer SDK; importable only
  where rollq is installed, which is the trainer's process).

The wire, per ``update_weights`` chunk (the trainer holds a listening socket):

1. the trainer POSTs ``/update_weights`` with ``{"address": "host:port", "ticket": hex,
   "names": [...], "dtype_names": [...], "shapes": [[...], ...]}``;
2. every worker of the server connects to ``address`` and sends ``ticket`` + ``\\n``;
3. the trainer answers an 8-byte little-endian byte count, then each tensor's raw bytes in
   ``names`` order (C-contiguous, native little-endian, the dtype named);
4. the worker checks the count against the shapes and returns: the bytes are received
   into fresh host tensors by a thread of the worker, while the server goes on serving.

Staged, then swapped: ``/start_weight_update`` and every ``/update_weights`` leave the
model alone, so the trainer ships the bytes before it pauses the server;
``/finish_weight_update`` (sent once paused) waits for every stream to end, then loads the
staged tensors with ``model.load_weights`` inside vLLM's layerwise reload, as the NCCL
engine does. Generation stops only for that copy. The cost: the server holds one host
copy of the weights during a sync.

Failure: a refused connection, a wrong count or a stream cut short fails
``/update_weights`` or ``/finish_weight_update`` before the model is touched, so the
server keeps serving its old weights whole. ``{"discard": true}`` as an update drops what
was staged (a trainer that gave up, or a new trainer freeing a server that vLLM still
holds mid-update). The worker keeps no connection between syncs.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

BACKEND = "rollq_tcp"
_log = logging.getLogger("vllm.rollq_tcp")
_COUNT = struct.Struct("<Q")


def register() -> None:
    """The ``vllm.general_plugins`` hook: runs in every vLLM process, possibly twice."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "TcpWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "consumers.trainer.transfer", "TcpTrainerEngine")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def receive_into(sock: socket.socket, buffer: memoryview) -> None:
    """Fill ``buffer`` from ``sock``; ConnectionError if the stream ends first."""
    view, filled = buffer, 0
    while filled < len(view):
        got = sock.recv_into(view[filled:], len(view) - filled)
        if got == 0:
            raise ConnectionError(f"trainer closed the stream after {filled} of "
                                  f"{len(view)} bytes")
        filled += got


def receive_tensors(address: str, ticket: str, names: list[str], dtype_names: list[str],
                    shapes: list[list[int]], timeout_s: float) -> list[tuple[str, Any]]:
    """Connect to the trainer's sender and receive one chunk's tensors (on the CPU)."""
    stream = open_stream(address, ticket, names, dtype_names, shapes, timeout_s)
    return stream()


def open_stream(address: str, ticket: str, names: list[str], dtype_names: list[str],
                shapes: list[list[int]], timeout_s: float
                ) -> Callable[[], list[tuple[str, Any]]]:
    """Connect, present the ticket and check the byte count; the returned call receives the
    tensors (it closes the connection), so a thread can take the body."""
    import torch

    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"names, dtype_names and shapes differ in length: {len(names)}, "
                         f"{len(dtype_names)}, {len(shapes)}")
    tensors = [torch.empty(shape, dtype=_dtype(dtype)) for dtype, shape in
               zip(dtype_names, shapes, strict=True)]
    expected = sum(t.numel() * t.element_size() for t in tensors)
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(ticket.encode() + b"\n")
        header = bytearray(_COUNT.size)
        receive_into(sock, memoryview(header))
        (count,) = _COUNT.unpack(header)
        if count != expected:
            raise ValueError(f"trainer sends {count} bytes, the shapes and dtypes of this "
                             f"chunk need {expected}")
    except BaseException:
        sock.close()
        raise

    def body() -> list[tuple[str, Any]]:
        with sock:
            for tensor in tensors:
                if tensor.numel():
                    receive_into(sock, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__
        return list(zip(names, tensors, strict=True))

    return body


def _fill(stream: Future[list[tuple[str, Any]]], body: Callable[[], list[tuple[str, Any]]]
          ) -> None:
    try:
        stream.set_result(body())
    except BaseException as exc:
        stream.set_exception(exc)


def _engine_classes() -> tuple[type, type, type]:
    """Built on first use: vllm is importable only inside vLLM's processes."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class TcpInitInfo(WeightTransferInitInfo):
        timeout_s: float = 120.0
        """Connect and per-read timeout of a chunk's stream (seconds)."""

    @dataclass
    class TcpUpdateInfo(WeightTransferUpdateInfo):
        address: str = ""
        ticket: str = ""
        discard: bool = False
        """Drop what this update staged so far (the trainer abandoned it)."""
        names: list[str] = field(default_factory=list)
        dtype_names: list[str] = field(default_factory=list)
        shapes: list[list[int]] = field(default_factory=list)

    class Engine(WeightTransferEngine[TcpInitInfo, TcpUpdateInfo]):
        init_info_cls = TcpInitInfo
        update_info_cls = TcpUpdateInfo
        timeout_s = 120.0
        _streams: list[Future[list[tuple[str, Any]]]]

        def init_transfer_engine(self, init_info: TcpInitInfo) -> None:
            self.timeout_s = init_info.timeout_s
            self._streams = []

        def start_weight_update(self) -> None:
            self._streams = []  # a sync abandoned half-way leaves nothing behind

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: TcpUpdateInfo) -> None:
            if update_info.discard:
                self._streams = []
                return
            body = open_stream(update_info.address, update_info.ticket, update_info.names,
                               update_info.dtype_names, update_info.shapes, self.timeout_s)
            stream: Future[list[tuple[str, Any]]] = Future()
            threading.Thread(target=_fill, args=(stream, body), daemon=True,
                             name="rollq-tcp-receive").start()
            self._streams.append(stream)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            streams, self._streams = self._streams, []
            if not streams:
                return  # nothing staged (or discarded): the model stays as it is
            staged = [pair for stream in streams
                      for pair in stream.result(timeout=self.timeout_s)]
            device = self.device
            # one tensor at a time onto the device: never a second copy of the model there
            weights = (staged if device.type == "cpu" else
                       ((name, tensor.to(device)) for name, tensor in staged))
            started = time.perf_counter()
            initialize_layerwise_reload(self.model)
            self.model.load_weights(weights)
            loaded = time.perf_counter()
            finalize_layerwise_reload(self.model, self.model_config)
            # what a sync's paused time is made of on this server (the bench reads it)
            _log.info("rollq_tcp finish: %d tensors loaded in %.3f s, finalized in %.3f s",
                      len(staged), loaded - started, time.perf_counter() - loaded)

        def shutdown(self) -> None:
            self._streams = []

    Engine.__name__ = Engine.__qualname__ = "TcpWeightTransferEngine"
    return TcpInitInfo, TcpUpdateInfo, Engine


def __getattr__(name: str) -> Any:
    if name in ("TcpInitInfo", "TcpUpdateInfo", "TcpWeightTransferEngine"):
        init_info, update_info, engine = _engine_classes()
        globals().update(TcpInitInfo=init_info, TcpUpdateInfo=update_info,
                         TcpWeightTransferEngine=engine)
        return globals()[name]
    raise AttributeError(name)
