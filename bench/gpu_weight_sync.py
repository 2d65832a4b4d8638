"""GPU weight sync: the trainer's side of a sync of a Qwen2-0.5B-shaped model on one GPU.

vLLM cannot run on the GPU machine this was written for, so the receiver is a second
process holding its own copy of the model on the same GPU, loading what it receives by
name, as a vLLM worker's ``load_weights`` would. Each method is timed trainer-side from
the first byte to the receiver's confirmation that every parameter landed (median of
``--repeats``), and checked: the receiver's parameters must equal the trainer's bit for bit.

- ``rollq_tcp``: rollq's CPU backend (``consumers.trainer.transfer.TcpTrainerEngine`` and
  the plugin's ``receive_tensors``), here carrying GPU tensors: GPU -> host chunk ->
  loopback TCP -> host -> GPU. The floor a GPU-less transport sets.
- ``ipc``: CUDA IPC, what vLLM's ``ipc`` backend does for a colocated trainer: each chunk
  is packed into one GPU buffer whose handle the receiver opens and copies from.
- ``nccl``: a broadcast from the trainer's rank to the receiver's over NCCL, what vLLM's
  ``nccl`` backend does, in packed chunks. NCCL refuses two ranks on one GPU; with one
  GPU the line says so instead of a figure.

    python -m bench.gpu_weight_sync [--repeats 3] [--chunk-mb 256] [--tiny]

Prints one line per method: ``weight sync gpu: METHOD params P, S s (G GB/s), match``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.gpu_trainer import build_model
from rollq.consumers.trainer.transfer import TcpTrainerEngine, TcpTrainerInitInfo
from rollq.ops.vllm_plugin.rollq_vllm_plugin import receive_tensors


def _params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _packed_chunks(params: dict[str, torch.Tensor], chunk_bytes: int
                   ) -> list[list[tuple[str, torch.Tensor]]]:
    chunks: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in params.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append((name, tensor))
        size += nbytes
    return chunks


def receiver(connection: Any, tiny: bool, method: str, nccl_init: str | None) -> None:
    """The stand-in for a vLLM worker: its own model, loading what arrives by name."""
    device = torch.device("cuda", 0)
    torch.manual_seed(1)  # other random weights than the trainer's
    params = {name: p.detach() for name, p in build_model(tiny, device).named_parameters()}
    group = None
    if method == "nccl":
        import torch.distributed as dist

        try:
            dist.init_process_group("nccl", init_method=nccl_init, rank=1, world_size=2,
                                    device_id=device)
            group = dist.group.WORLD
        except Exception as exc:
            connection.send(("error", f"{type(exc).__name__}: {str(exc)[:200]}"))
            return
    connection.send(("ready", None))
    while True:
        message = connection.recv()
        kind = message[0]
        if kind == "stop":
            break
        if kind == "tcp":
            _, update = message
            for name, tensor in receive_tensors(update["address"], update["ticket"],
                                                update["names"], update["dtype_names"],
                                                update["shapes"], 120.0):
                params[name].copy_(tensor, non_blocking=True)
            torch.cuda.synchronize()
            connection.send(("done", None))
        elif kind == "ipc":
            _, buffer, layout = message  # buffer: a CUDA tensor shared through its IPC handle
            for name, offset, count in layout:
                params[name].view(-1).copy_(buffer[offset:offset + count])
            torch.cuda.synchronize()
            del buffer
            connection.send(("done", None))
        elif kind == "nccl":
            _, layout, total = message
            import torch.distributed as dist

            buffer = torch.empty(total, dtype=torch.bfloat16, device=device)
            dist.broadcast(buffer, src=0, group=group)
            for name, offset, count in layout:
                params[name].view(-1).copy_(buffer[offset:offset + count])
            torch.cuda.synchronize()
            connection.send(("done", None))
        elif kind == "checksum":
            connection.send(("checksum", _checksum(params)))


def _checksum(params: dict[str, torch.Tensor]) -> list[float]:
    return [float(p.float().sum()) for p in params.values()]


class LocalClient:
    """The control plane of a sync with one receiver process (vLLM's four calls)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.connection.send(("tcp", update_info))
        kind, detail = self.connection.recv()
        if kind != "done":
            raise RuntimeError(f"receiver: {detail}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def sync_tcp(params: dict[str, torch.Tensor], connection: Any, chunk_bytes: int) -> None:
    engine = TcpTrainerEngine.trainer_init(
        TcpTrainerInitInfo(chunk_bytes=chunk_bytes), client=LocalClient(connection),
        source=list(params.items()))
    try:
        engine.send_weights()
    finally:
        engine.shutdown()


def sync_packed(method: str, params: dict[str, torch.Tensor], connection: Any,
                chunk_bytes: int) -> None:
    for chunk in _packed_chunks(params, chunk_bytes):
        layout, offset = [], 0
        for name, tensor in chunk:
            layout.append((name, offset, tensor.numel()))
            offset += tensor.numel()
        buffer = torch.cat([t.reshape(-1) for _, t in chunk])  # one packed GPU buffer
        if method == "ipc":
            connection.send(("ipc", buffer, layout))
        else:
            import torch.distributed as dist

            connection.send(("nccl", layout, offset))
            dist.broadcast(buffer, src=0)
        kind, detail = connection.recv()
        if kind != "done":
            raise RuntimeError(f"receiver: {detail}")
        del buffer


def measure(method: str, args: argparse.Namespace, params: dict[str, torch.Tensor]
            ) -> dict[str, Any]:
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    init = f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}" if method == "nccl" else None
    process = context.Process(target=receiver, args=(theirs, args.tiny, method, init))
    process.start()
    result: dict[str, Any] = {"method": method}
    try:
        if method == "nccl":
            import torch.distributed as dist

            try:
                dist.init_process_group("nccl", init_method=init, rank=0, world_size=2,
                                        device_id=torch.device("cuda", 0))
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if ours.poll(120):
            kind, detail = ours.recv()
            if kind == "error":
                result["error"] = detail
        else:
            result["error"] = "receiver did not start in 120 s"
        if "error" in result:
            return result
        chunk_bytes = args.chunk_mb * 1024 * 1024
        seconds = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            started = time.perf_counter()
            if method == "rollq_tcp":
                sync_tcp(params, ours, chunk_bytes)
            else:
                sync_packed(method, params, ours, chunk_bytes)
            seconds.append(time.perf_counter() - started)
        ours.send(("checksum",))
        _, theirs_sum = ours.recv()
        result["seconds"] = statistics.median(seconds[1:])
        result["runs"] = seconds[1:]
        result["match"] = theirs_sum == _checksum(params)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if process.is_alive():
            ours.send(("stop",))
            process.join(timeout=30)
        if process.is_alive():
            process.kill()
        if method == "nccl":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=256)
    parser.add_argument("--methods", default="rollq_tcp,ipc,nccl")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (wiring check)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_weight_sync: needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_model(args.tiny, torch.device("cuda", 0))
    params = {name: p.detach() for name, p in model.named_parameters()}
    count = sum(p.numel() for p in params.values())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    results = []
    for method in args.methods.split(","):
        result = measure(method, args, params)
        results.append(result)
        if "error" in result:
            line = f"weight sync gpu: {method} params {count / 1e9:.2f}B, " \
                   f"not measured: {result['error']}"
        else:
            line = (f"weight sync gpu: {method} params {count / 1e9:.2f}B, "
                    f"{result['seconds']:.3f} s ({nbytes / result['seconds'] / 1e9:.1f} GB/s), "
                    f"{'match' if result['match'] else 'MISMATCH'}")
        print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_weight_sync.json"), "w") as handle:
            json.dump({"params": count, "bytes": nbytes, "results": results}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
