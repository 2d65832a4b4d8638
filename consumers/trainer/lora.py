"""``weight_sync='lora'``: the trainer trains a LoRA adapter; every vLLM server loads each
version at run time under its own name, and nothing pauses.

Per sync of version ``step`` (the servers run with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):

    1. the adapter is a PEFT directory every server can read: the one given, or the
       ``LoraAdapter`` tensors written to ``lora_dir/<name>/`` (``adapter_config.json`` +
       ``adapter_model.safetensors``)
    2. POST /v1/load_lora_adapter {"lora_name": "<lora_name>-v<step>", "lora_path": ...}
       on every server at once; generation goes on meanwhile
    3. ``on_updated()``: the run's version becomes ``step`` only once every server holds
       the adapter, so a worker that reads version ``step`` finds ``<lora_name>-v<step>``
       everywhere (``producers.inference.pool``: each request names the adapter of the
       version it read, so its version is exact by construction)
    4. adapters of versions older than the window (``keep`` versions back) are unloaded
       from every server (``GET /v1/models`` lists what each holds: adapters a crashed
       trainer left are found too), and their directories under ``lora_dir`` removed

A server that refuses 2 fails the sync: the adapter is unloaded again from the servers
that took it, ``WeightSyncError`` names each server that refused and why, and the run's
version is unchanged. A failed unload in 4 does not undo a sync that served: it is logged
(``lora_unload_failed``), and the next sync tries again.

Version 0 is the base model: a sync of step 0 loads nothing (the workers name the base
model at version 0). An adapter initialised as PEFT does (``B = 0``) is the base model; a
trainer that starts from a trained adapter publishes it as step 1 or later.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from rollq.consumers.trainer.errors import WeightSyncError
from rollq.schemas.keys import adapter_name, adapter_version

log = structlog.get_logger("rollq.trainer")


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as tensors, for ``publish_policy`` with ``weight_sync='lora'``: what
    PEFT's ``get_peft_model_state_dict(model)`` returns and its ``LoraConfig`` as a dict
    (``peft_config["default"].to_dict()``), or the same written by hand (``r``,
    ``lora_alpha``, ``target_modules``; tensor names as PEFT saves them,
    ``base_model.model.<module>.lora_A.weight``)."""

    config: Mapping[str, Any]
    tensors: Mapping[str, Any] = field(repr=False)


def write_adapter(adapter: LoraAdapter, directory: Path) -> int:
    """Write ``adapter`` as a PEFT directory; returns the bytes of its tensors file."""
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError("writing a LoraAdapter needs torch and safetensors (pip install "
                          "'rollq[train]'), or publish a PEFT directory") from exc

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: (value.detach() if isinstance(value, torch.Tensor)
                      else torch.as_tensor(value)).to("cpu").contiguous()
               for name, value in adapter.tensors.items()}
    config = {"peft_type": "LORA", "bias": "none", "lora_dropout": 0.0, **adapter.config}
    config["target_modules"] = sorted(config.get("target_modules") or [])
    staging = directory / "adapter_model.safetensors.tmp"
    save_file(tensors, str(staging))
    staging.replace(directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(config, default=str))
    return (directory / "adapter_model.safetensors").stat().st_size


def adapter_bytes(directory: Path) -> int:
    """The bytes of an adapter directory's tensor files (what each server reads)."""
    return sum(p.stat().st_size for p in directory.glob("adapter_model*"))


class LoraSync:
    """The ``lora`` method of ``PolicyPublisher`` (module docstring)."""

    def __init__(self, *, prefix: str, keep: int, lora_dir: str | None) -> None:
        self.prefix = prefix
        self.keep = keep
        self.lora_dir = Path(lora_dir) if lora_dir else None

    async def sync(self, http: httpx.AsyncClient, urls: Sequence[str], step: int,
                   weights: Any, on_updated: Callable[[], Awaitable[object]]
                   ) -> tuple[float, int]:
        """Load version ``step`` everywhere, raise the run's version, unload the old ones;
        returns (seconds, adapter bytes). Raises WeightSyncError (version unchanged)."""
        started = time.monotonic()
        if step == 0:  # version 0 is the base model: nothing to load
            await on_updated()
            return time.monotonic() - started, 0
        path, size = await asyncio.to_thread(self._directory, step, weights)
        name = adapter_name(self.prefix, step)
        # in place: a sync retried after a server's timeout finds its name taken
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        results = await asyncio.gather(*(_post(http, url, "load_lora_adapter", body)
                                         for url in urls))
        failures = {url: why for url, why in zip(urls, results, strict=True) if why}
        if failures:
            loaded = [url for url in urls if url not in failures]
            await asyncio.gather(*(_post(http, url, "unload_lora_adapter", {"lora_name": name})
                                   for url in loaded))
            raise WeightSyncError(step, failures)
        await on_updated()
        seconds = time.monotonic() - started
        await self._unload_old(http, urls, step)
        return seconds, size

    def _directory(self, step: int, weights: Any) -> tuple[Path, int]:
        if isinstance(weights, str | os.PathLike):
            path = Path(weights).resolve()
            if not (path / "adapter_config.json").is_file():
                raise TypeError(f"weight_sync='lora' publishes a PEFT adapter directory; "
                                f"{path} has no adapter_config.json")
            return path, adapter_bytes(path)
        if isinstance(weights, LoraAdapter):
            if self.lora_dir is None:
                raise TypeError("weight_sync='lora' with a LoraAdapter needs lora_dir: a "
                                "directory every server can read, to write it into")
            path = (self.lora_dir / adapter_name(self.prefix, step)).resolve()
            return path, write_adapter(weights, path)
        raise TypeError("weight_sync='lora' publishes a PEFT adapter directory or a "
                        f"LoraAdapter, got {type(weights).__name__}")

    async def _unload_old(self, http: httpx.AsyncClient, urls: Sequence[str],
                          step: int) -> None:
        """Unload (and delete, when written here) every adapter of ours older than the
        window, on every server."""
        oldest = step - self.keep

        async def one(url: str) -> list[str]:
            try:
                response = await http.get(url + "/v1/models")
                data = response.json().get("data") or []
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                log.warning("lora_unload_failed", server=url, error=f"/v1/models: {exc}")
                return []
            old = [str(entry.get("id")) for entry in data if isinstance(entry, dict)
                   and (version := adapter_version(self.prefix, str(entry.get("id"))))
                   is not None and version < oldest]
            for name in old:
                why = await _post(http, url, "unload_lora_adapter", {"lora_name": name})
                if why:
                    log.warning("lora_unload_failed", server=url, adapter=name, error=why)
            return old

        unloaded = {name for names in await asyncio.gather(*(one(url) for url in urls))
                    for name in names}
        if self.lora_dir is not None:
            for name in unloaded:
                shutil.rmtree(self.lora_dir / name, ignore_errors=True)


async def _post(http: httpx.AsyncClient, url: str, route: str,
                body: dict[str, Any]) -> str | None:
    """POST a LoRA route; why it failed, or None."""
    try:
        response = await http.post(f"{url}/v1/{route}", json=body)
    except httpx.HTTPError as exc:
        return f"{route}: {type(exc).__name__} {exc}".strip()
    if response.is_success:
        return None
    if response.status_code == 404 and "Not Found" in response.text[:100]:
        return (f"{route}: HTTP 404 (serve with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
    return f"{route}: HTTP {response.status_code}: {response.text[:300]}"
