"""Weight sync: reload (save + every server reads the directory) against transfer (vLLM's
weight-transfer API, rollq's CPU backend ``rollq_tcp``), on a real CPU vLLM server.

    python -m bench.weight_sync [--repeats 3] [--shapes tiny,100m]

For each model shape (``ops.local.tiny_model.SHAPES``: the tiny test model, and a random
Qwen2-shaped ~105M-parameter model made locally) a vLLM server starts with
``--weight-transfer-config '{"backend": "rollq_tcp"}'`` and a trainer (the SDK, one client
per method) syncs fresh weights ``--repeats`` times by each method, interleaved so drift
hits both alike:

- reload: ``save_pretrained`` (safetensors) then ``publish_policy(step, dir)``: pause,
  ``reload_weights``, reset the prefix cache, version, resume. Its time includes the save,
  which a reload cannot do without; its paused time is the server's part only. The server
  reads the files the trainer just wrote from this machine's page cache (warm): the best
  case for reload, which on separate hosts reads them from shared storage.
- reload cold: the same, but the saved files are fsynced and dropped from the page cache
  (``posix_fadvise(DONTNEED)``) before the server reads them, as a server on another host
  than the trainer would meet them.
- transfer: ``publish_policy(step, model)``: pause, start, chunks over TCP, finish, reset,
  version, resume. Paused time: from the last pause answered to the first resume sent.
- lora: a rank-8 LoRA adapter on every linear layer of the same model (PEFT),
  ``publish_policy(step, LoraAdapter)`` with ``weight_sync='lora'``: the adapter written
  (safetensors) and loaded by the server at run time under its versioned name; nothing
  pauses. Its bytes are the adapter's, transfer's the model's. The server runs with
  ``--enable-lora`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) for every method.

After the last sync of each method the server's logprobs for a fixed prompt must equal the
trainer model's (the adapted model's, served under the adapter's name, for lora: a sync
that moved nothing would be fast too). Prints, per shape, a line for reload (warm) and one
for reload cold against the same transfer runs, and the lora line:

    weight sync: params P, reload R s (paused Rp s), transfer T s (paused Tp s), ratio R/T,
    paused ratio Tp/Rp
    weight sync: params P, lora L s (B MB a sync, paused 0 s), transfer T s (M MB), ratio T/L

with medians of the repeats; ``--json PATH`` writes every run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import torch
from transformers import AutoModelForCausalLM

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.consumers.trainer.lora import LoraAdapter
from rollq.ops.local.stack import RedisProcess, VllmProcess
from rollq.ops.local.tiny_model import write_tiny_model

PROMPT = "the quick brown fox 1 2 3"


def served_logprobs(url: str, prompt: str | list[int], served: str) -> list[float]:
    """The server's logprob of each prompt token after the first (greedy, ``echo``); the
    prompt as text or as token ids."""
    response = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": served, "prompt": prompt, "max_tokens": 1, "echo": True,
        "logprobs": 0, "temperature": 0})
    response.raise_for_status()
    # echo: the prompt's tokens (the first has none), then the one generated
    return [float(v) for v in response.json()["choices"][0]["logprobs"]["token_logprobs"][1:-1]]


def forward_logprobs(url: str, model: Any, prompt: str, name: str) -> list[float]:
    """The same logprobs from a torch forward of ``model`` over the server's tokens."""
    tokens = httpx.post(f"{url}/tokenize", timeout=60,
                        json={"model": name, "prompt": prompt}).json()["tokens"]
    return own_logprobs(model, tokens)


def own_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """``model``'s logprob of each token after the first (a torch forward)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()
    chosen = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return [float(v) for v in chosen]


def largest_gap(url: str, model: Any, prompts: tuple[str, ...] | list[str] = (PROMPT,), *,
                name: str = "rollq-tiny", served: str | None = None) -> float:
    """Largest difference between the served logprobs and ``model``'s over ``prompts``.

    ``name`` is the served base model (it tokenizes); ``served`` the name generating, when
    another (a LoRA adapter's)."""
    return max(abs(a - b) for prompt in prompts for a, b in zip(
        served_logprobs(url, prompt, served or name),
        forward_logprobs(url, model, prompt, name), strict=True))


def drop_from_page_cache(directory: Path) -> None:
    """fsync the files, then ask the kernel to drop their pages (clean pages go at once)."""
    for path in directory.iterdir():
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def nudge(model: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)


def lora_model(model_dir: Path) -> Any:
    """The model with a random rank-8 adapter on every linear layer (PEFT: the lora extra)."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                           init_lora_weights=False)).eval()


def adapter(model: Any) -> LoraAdapter:
    from peft import get_peft_model_state_dict

    return LoraAdapter(model.peft_config["default"].to_dict(), get_peft_model_state_dict(model))


def on_base(adapted: Any, base: Any) -> Any:
    """``adapted``'s adapter on ``base``'s weights."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(base), adapted.peft_config["default"])
    set_peft_model_state_dict(model, get_peft_model_state_dict(adapted))
    return model.eval()


def nudge_adapter(model: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)


async def measure(shape: str, repeats: int, vllm_python: str, directory: Path,
                  redis_url: str) -> dict[str, Any]:
    model_dir = write_tiny_model(directory / shape, shape=shape)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    adapted = lora_model(model_dir)
    server = VllmProcess(vllm_python, model_dir, directory / f"vllm-{shape}.log",
                         weight_transfer="rollq_tcp", max_model_len=256,
                         extra_args=["--enable-lora", "--max-lora-rank", "8"],
                         environment={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
                         ).start(timeout_s=600)
    runs: dict[str, list[tuple[float, float, int]]] = {"reload": [], "reload_cold": [],
                                                        "transfer": [], "lora": []}
    redis = aioredis.Redis.from_url(redis_url)
    try:
        base = {"inference_urls": (server.url,), "transfer_backend": "rollq_tcp",
                "http_timeout_s": 600.0, "new_run": True}
        reload = TrainerClient(redis, run=f"reload-{shape}", consumer="bench",
                               settings=TrainerClientSettings(weight_sync="reload", **base))
        transfer = TrainerClient(redis, run=f"transfer-{shape}", consumer="bench",
                                 settings=TrainerClientSettings(weight_sync="transfer", **base))
        lora = TrainerClient(redis, run=f"lora-{shape}", consumer="bench",
                             settings=TrainerClientSettings(
                                 weight_sync="lora", lora_dir=str(directory / "adapters"),
                                 **base))
        weights = directory / f"weights-{shape}"
        gaps = {}
        async with reload, transfer, lora:
            version = 0
            for repeat in range(repeats + 1):  # the first of each is a warm-up
                for method in ("reload", "reload_cold", "transfer", "lora"):
                    version += 1
                    started = time.monotonic()
                    if method == "lora":
                        nudge_adapter(adapted, version)
                        started = time.monotonic()
                        await lora.publish_policy(version, adapter(adapted))
                        report = lora.last_sync
                    elif method == "transfer":
                        nudge(model, version)
                        started = time.monotonic()
                        await transfer.publish_policy(version, model)
                        report = transfer.last_sync
                    else:
                        nudge(model, version)
                        started = time.monotonic()
                        model.save_pretrained(weights, safe_serialization=True)
                        if method == "reload_cold":
                            drop_from_page_cache(weights)
                        await reload.publish_policy(version, weights)
                        report = reload.last_sync
                    assert report is not None
                    if repeat:
                        runs[method].append((time.monotonic() - started,
                                             report.paused_seconds, report.bytes_moved))
            # the server applies the adapter to the base that reload and transfer last put
            # there (``model``, nudged since), not to the one ``adapted`` was made from
            gaps["lora"] = largest_gap(server.url, on_base(adapted, model),
                                       served=f"policy-v{version}")
            gaps["transfer"] = largest_gap(server.url, model)
            nudge(model, 9999)
            model.save_pretrained(weights, safe_serialization=True)
            await reload.publish_policy(version + 1, weights)
            gaps["reload"] = largest_gap(server.url, model)
    finally:
        await redis.aclose()
        server.stop()
    return {"shape": shape, "params": params, "runs": runs, "logprob_gap": gaps,
            "server_finish": finish_split(server.log_path.read_text(errors="replace"))}


_FINISH = re.compile(r"rollq_tcp finish: \d+ tensors loaded in ([\d.]+) s, finalized in "
                     r"([\d.]+) s")


def finish_split(log: str) -> list[tuple[float, float]]:
    """Each transfer's apply on the server, as the plugin logs it: (load_weights seconds,
    finalize seconds: vLLM's per-layer processing, on the CPU the re-packing of every
    linear layer's weights for oneDNN)."""
    return [(float(load), float(final)) for load, final in _FINISH.findall(log)]


def lines(result: dict[str, Any]) -> list[str]:
    def median(method: str, index: int) -> float:
        return statistics.median(run[index] for run in result["runs"][method])

    transfer, paused = median("transfer", 0), median("transfer", 1)
    found = []
    for method, label in (("reload", "reload"), ("reload_cold", "reload cold")):
        reload = median(method, 0)
        found.append(f"weight sync: params {result['params'] / 1e6:.1f}M, {label} {reload:.3f} s "
                     f"(paused {median(method, 1):.3f} s), transfer {transfer:.3f} s "
                     f"(paused {paused:.3f} s), ratio {reload / transfer:.2f}, paused ratio "
                     f"{paused / median(method, 1):.2f}")
    if result["runs"].get("lora"):
        lora = median("lora", 0)
        found.append(f"weight sync: params {result['params'] / 1e6:.1f}M, lora {lora:.3f} s "
                     f"({median('lora', 2) / 1e6:.2f} MB a sync, paused "
                     f"{median('lora', 1):.3f} s), transfer {transfer:.3f} s "
                     f"({median('transfer', 2) / 1e6:.1f} MB), ratio {transfer / lora:.2f}")
    split = result.get("server_finish") or []
    if split:
        found.append(f"  transfer apply on the server (median of {len(split)}): load_weights "
                     f"{statistics.median(a for a, _ in split):.3f} s, finalize "
                     f"{statistics.median(b for _, b in split):.3f} s")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="tiny,100m")
    parser.add_argument("--vllm-python",
                        default=os.environ.get("ROLLQ_TEST_VLLM_PYTHON", ".venv-vllm/bin/python"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).exists():
        print(f"weight_sync: no vLLM python at {args.vllm_python} (bash .ci/setup.sh makes "
              "one)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the server's worker needs the other core
    results = []
    with tempfile.TemporaryDirectory(prefix="rollq-weight-sync-") as tmp:
        directory = Path(tmp)
        redis_server = RedisProcess(directory / "redis").start()
        try:
            for shape in args.shapes.split(","):
                result = asyncio.run(measure(shape, args.repeats, os.path.abspath(
                    args.vllm_python), directory, redis_server.url))
                results.append(result)
                gaps = result["logprob_gap"]
                if max(gaps.values()) > 1e-3:
                    print(f"weight sync: {shape}: the server does not serve the trainer's "
                          f"weights after a sync (logprob gap {gaps})", file=sys.stderr)
                    return 1
                print("\n".join(lines(result)), flush=True)
        finally:
            redis_server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
