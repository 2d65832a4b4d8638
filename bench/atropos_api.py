"""rollq's Atropos API against atroposlib's own server, same client, same run.

Each server runs as its own process (``rollq atropos-api`` on a throwaway redis-server;
atroposlib's ``atroposlib.api.server:app`` under uvicorn, as its ``run-api`` does). A
trainer registers with a batch of ``--batch-groups`` groups; ``--clients`` concurrent env
clients post ``--groups`` groups of 16 × 2048 tokens (labels, scores and inference
logprobs, gzip-compressed JSON as atroposlib's env sends them); then the trainer polls
``/batch`` until every group came out (asking for gzip, as ``requests`` does). Reported per
server, medians of ``--runs`` runs:

- ingest groups/s (the posting phase);
- ``/batch`` p50/p99: from the request to the last byte of the answer in the trainer's
  hands (the server's work and the transfer), and ``answered``: until the headers;
- egress groups/s: groups handed out per second of ``/batch`` calls so measured;
- the trainer's own decode of each answer (gunzip and JSON parse, ``orjson``), timed
  apart: the same work whichever server answered (a 64-group batch is ~64 MB of JSON, ~1 s
  of one core), so it is reported, not charged to either server; ``egress incl. decode``
  is the poll loop's rate with it.

    .venv/bin/python -m bench.atropos_api [--runs 3] [--groups 128] [--clients 8]

Needs atroposlib (``pip install rollq[atropos]``) and redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from bench.common import BenchRedis, free_port, median_of, print_table

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 16
TOKENS = 2048
PROMPT = 256


def make_bodies(count: int, seed: int = 0) -> list[bytes]:
    """Gzip-compressed JSON groups as atroposlib's env posts them, all distinct (rollq's API
    answers an identical re-post without storing it again): 8 token payloads, each body
    with its own scores."""
    rng = np.random.default_rng(seed)
    templates = []
    for _ in range(min(count, 8)):  # 8 token payloads reused: the set-up stays quick
        prompt = rng.integers(0, 150_000, PROMPT).tolist()
        tokens, masks, logprobs = [], [], []
        for _ in range(GROUP_SIZE):
            done = rng.integers(0, 150_000, TOKENS - PROMPT).tolist()
            tokens.append(prompt + done)
            masks.append([-100] * PROMPT + done)
            lp = (-rng.random(TOKENS - PROMPT, dtype=np.float32)).astype(np.float64).tolist()
            logprobs.append([1.0] * PROMPT + lp)
        templates.append({"tokens": tokens, "masks": masks, "inference_logprobs": logprobs,
                          "env_id": None, "advantages": None, "ref_logprobs": None,
                          "overrides": None, "group_overrides": None, "messages": None,
                          "distill_token_ids": None, "distill_logprobs": None})
    bodies = []
    for g in range(count):
        scores = [float(i % 2) + g / 1024 for i in range(GROUP_SIZE)]
        group = {**templates[g % len(templates)], "scores": scores}
        bodies.append(gzip.compress(json.dumps(group).encode(), compresslevel=1))
    return bodies


class Server:
    def __init__(self, kind: str, redis_url: str, run: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "rollq":
            command = [sys.executable, "-m", "rollq", "atropos-api", "--redis-url",
                       redis_url, "--run", run, "--port", str(self.port), "--log-level",
                       "warning", "--log-format", "json"]
        else:
            command = [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app",
                       "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    def wait(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/info", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"server on {self.url} did not start")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=30)


async def measure(url: str, bodies: list[bytes], clients: int, batch_groups: int,
                  accept: str = "gzip") -> dict[str, float]:
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await client.post("/register", json={
            "wandb_group": "", "wandb_project": "", "batch_size": batch_groups * GROUP_SIZE,
            "max_token_len": TOKENS, "checkpoint_dir": "", "save_checkpoint_interval": 0,
            "starting_step": 0, "num_steps": 1000})
        await client.get("/batch")  # the trainer has started
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        pending = list(bodies)

        async def post() -> None:
            while pending:
                body = pending.pop()
                response = await client.post("/scored_data", content=body, headers=headers)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(post() for _ in range(clients)))
        ingest_s = time.perf_counter() - started
        served, latencies, answered, decoding = 0, [], [], []
        started = time.perf_counter()
        while served < len(bodies):
            t0 = time.perf_counter()
            async with client.stream("GET", "/batch",
                                     headers={"Accept-Encoding": accept}) as response:
                answered.append(time.perf_counter() - t0)  # the server's work is done
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
                gzipped = response.headers.get("content-encoding") == "gzip"
            t1 = time.perf_counter()
            latencies.append(t1 - t0)  # the answer is in the trainer's hands
            content = zlib.decompress(raw, wbits=31) if gzipped else raw
            batch = orjson.loads(content)["batch"]  # the same fast parse for both
            decoding.append(time.perf_counter() - t1)
            if batch is None:
                raise RuntimeError(f"/batch answered null with {served} of {len(bodies)} out")
            served += len(batch)
        loop_s = time.perf_counter() - started
    return {"ingest": len(bodies) / ingest_s, "egress": len(bodies) / sum(latencies),
            "egress_decoded": len(bodies) / loop_s,
            "p50_ms": float(np.percentile(latencies, 50)) * 1000,
            "p99_ms": float(np.percentile(latencies, 99)) * 1000,
            "answer_p50_ms": float(np.percentile(answered, 50)) * 1000,
            "decode_p50_ms": float(np.percentile(decoding, 50)) * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--batch-groups", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--accept-encoding", default="gzip",
                        help="what the trainer asks /batch for: gzip (as requests) or identity")
    args = parser.parse_args(argv)
    if args.groups % args.batch_groups:
        parser.error("--groups must be a multiple of --batch-groups")
    bodies = make_bodies(args.groups)
    results: dict[str, list[dict[str, float]]] = {"rollq": [], "atroposlib": []}
    with BenchRedis() as redis:
        for run in range(args.runs):
            order = ["rollq", "atroposlib"] if run % 2 == 0 else ["atroposlib", "rollq"]
            for kind in order:
                server = Server(kind, redis.url, f"bench-{run}")
                try:
                    server.wait()
                    results[kind].append(asyncio.run(
                        measure(server.url, bodies, args.clients, args.batch_groups,
                                args.accept_encoding)))
                finally:
                    server.stop()
                print(f"run {run + 1} {kind}: {results[kind][-1]}", flush=True)
    medians: dict[str, dict[str, Any]] = {
        kind: {key: median_of(r[key] for r in runs) for key in runs[0]}
        for kind, runs in results.items()}
    print()
    print_table(["server", "ingest groups/s", "egress groups/s", "/batch p50 ms",
                 "/batch p99 ms", "answered p50 ms", "decode p50 ms",
                 "egress incl. decode"],
                [[kind, m["ingest"], m["egress"], m["p50_ms"], m["p99_ms"],
                  m["answer_p50_ms"], m["decode_p50_ms"], m["egress_decoded"]]
                 for kind, m in medians.items()],
                title=f"{args.groups} groups of {GROUP_SIZE}x{TOKENS} tokens, {args.clients} "
                f"clients, {args.batch_groups}-group batches, medians of {args.runs} runs")
    ratio = medians["rollq"]["egress"] / medians["atroposlib"]["egress"]
    print(f"egress ratio {ratio:.1f} (rollq/atroposlib)")


if __name__ == "__main__":
    main()
