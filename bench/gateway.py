"""Gateway overhead: the same agent workload through ``rollq gateway`` vs straight to vLLM.

    python -m bench.gateway [--episodes 16] [--concurrency 4] [--max-tokens 32] [--runs 3]
                            [--vllm-python .venv-vllm/bin/python] [--profile-gateway PATH]

A real CPU vLLM server (the tiny model, with ``--enable-auto-tool-choice --tool-call-parser
hermes`` and a chat template that renders tools) serves a calculator agent written with the
``openai`` client: 3 chat calls per episode with ``tools``, each reply followed by a ``tool``
message, ``max_tokens`` tokens per call (``ignore_eos``). Variants:

- ``direct``: the agent's base URL is vLLM's;
- ``gateway``: a ``rollq gateway`` process in front of it, given the model's tokenizer and
  the server's template (``--tokenizer --chat-template``: chat continuations rendered in
  the gateway, checked against ``/tokenize`` first); each episode is opened (``POST
  /episodes``), run on its own base URL, and closed (the captured sequences come back);
- ``gateway/tokenize``: the same without the tokenizer (every render a ``/tokenize``
  request, two per continuation: a gateway without ``transformers`` or ``--tokenizer``);
- ``direct+lp``: straight to vLLM, asking the logprobs and token ids the gateway forces,
  which separates what capture asks of vLLM from the gateway's own cost;
- ``rollq``: the full agent path: the same agent as an AReaL workflow env
  (``areal_workflow_env``) run by a rollq worker (arq jobs on a local ``redis-server``, one
  episode per job, ``--concurrency`` jobs at once) on the in-process gateway, rendering
  continuations with the tokenizer as ``gateway`` does (``--env-option tokenizer=``), each
  episode published to the run's stream as a group. The agent runs in the worker, as it does in
  production; its CPU is the bench process's (``agent``).

Each of ``--runs`` rounds runs every variant back to back, starting with a different one
each round. Per run: tokens/s, call latency, and CPU milliseconds per call of vLLM's API
server, its engine (which busy-polls, so it tracks wall time), the gateway and the agent
process. The closing lines are what asking vLLM for logprobs costs on its own
(``direct+lp``/``direct``: no capturing gateway can do better), the median ratio of
completion tokens/s (gateway/direct, goal >= 0.9) and the added latency per call
(p50/p99 of the gateway's call latencies minus the direct ones, medians over runs), and the
full path's ratio beside the gateway's (rollq/direct and gateway/direct)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import redis.asyncio as aioredis

from bench.common import median_of
from rollq.ops.logging import configure_logging
from rollq.producers.envs.areal import areal_workflow_env
from rollq.producers.inference import SamplingParams
from rollq.producers.inference.capture.render import LocalTemplate
from rollq.producers.publisher import Publisher
from rollq.producers.worker import build_worker, connect_queue, enqueue_rollout
from rollq.schemas.keys import stream_key

TARGET_RATIO = 0.9
RUN = "bench"
TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
TEMPLATE = """{%- if tools %}<|im_start|>system
tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    token_in: int = 0
    """Gateway calls sent as token ids (their text path would have re-tokenised a reply)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds spent during the run: ``vllm`` (its process tree), ``gateway``,
    ``agent`` (this process: the ``openai`` clients)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def episode(client: openai.AsyncOpenAI, max_tokens: int, run: Run, *,
                  capture_fields: bool = False) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is 6*7? Use the calculator."}]
    extra: dict[str, Any] = {"ignore_eos": True}
    if capture_fields:  # what the gateway asks vLLM for on the agent's behalf
        extra.update(logprobs=True, return_token_ids=True)
    for turn in range(3):
        started = time.perf_counter()
        reply = await client.chat.completions.create(
            model="rollq-tiny", messages=messages, tools=[TOOL], max_tokens=max_tokens,
            temperature=1.0, extra_body=extra)
        run.latencies.append(time.perf_counter() - started)
        run.tokens += reply.usage.completion_tokens if reply.usage else 0
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": f"call-{turn}", "content": "42"})


class BenchWorkflow:
    """The bench's agent as an AReaL workflow (the ``rollq`` variant's env)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.measured = Run()

    async def run(self, data: dict[str, Any], *, base_url: str, http_client: Any,
                  api_key: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key,
                                    http_client=http_client, max_retries=0)
        await episode(client, self.max_tokens, self.measured)
        return 0.0


async def run_rollq(vllm_url: str, redis_url: str, args: argparse.Namespace,
                    number: int, template: LocalTemplate | None) -> Run:
    """The ``rollq`` variant (module docstring): ``--episodes`` jobs through a burst
    worker; ``number`` names the env, so every run's jobs are new to arq; ``template``
    renders continuations in the worker, as the ``gateway`` variant's ``--tokenizer``."""
    workflow = BenchWorkflow(args.max_tokens)
    name = f"bench-{number}"
    env = areal_workflow_env(name, workflow, [{"n": i} for i in range(args.episodes)],
                             template=template)
    redis = aioredis.from_url(redis_url)
    traj = stream_key(RUN, 0, "traj")
    before = int(await redis.xlen(traj))
    queue = await connect_queue(redis_url)
    try:
        await Publisher(redis, RUN).register()
        for position in range(args.episodes):
            await enqueue_rollout(queue, RUN, name, position)
    finally:
        await queue.aclose()
    worker = build_worker(
        redis_url=redis_url, run=RUN, env_factory=lambda: env, inference_urls=[vllm_url],
        model="rollq-tiny", sampling=SamplingParams(max_tokens=args.max_tokens), group_size=1,
        concurrency=args.concurrency, job_timeout_s=600, max_tries=1, request_timeout_s=600,
        burst=True)
    started = time.perf_counter()
    try:
        await worker.main()
    finally:
        await worker.close()
    workflow.measured.seconds = time.perf_counter() - started
    published = int(await redis.xlen(traj)) - before
    await redis.aclose()
    if published != args.episodes:  # every episode must have become a group
        raise SystemExit(f"rollq run {number}: {published} of {args.episodes} episodes "
                         "published (see the worker's log lines above)")
    return workflow.measured


async def run_workload(vllm_url: str, gateway_url: str | None, args: argparse.Namespace,
                       *, capture_fields: bool = False) -> Run:
    run = Run()
    slots = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one() -> None:
            async with slots:
                if gateway_url is None:
                    base = f"{vllm_url}/v1"
                else:
                    opened = (await http.post(f"{gateway_url}/episodes")).json()
                    base = f"{gateway_url}{opened['base_path']}"
                client = openai.AsyncOpenAI(base_url=base, api_key="x", http_client=http,
                                            max_retries=0)
                await episode(client, args.max_tokens, run, capture_fields=capture_fields)
                if gateway_url is not None:
                    closed = await http.post(f"{gateway_url}/episodes/{opened['episode_id']}/close")
                    assert closed.status_code == 200 and closed.json()["sequences"]
                    run.token_in += int(closed.json()["stats"]["token_in"])

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(args.episodes)))
        run.seconds = time.perf_counter() - started
    return run


def process_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by process ``root`` (``own``) and its
    descendants (``children``), from Linux's ``/proc`` (zeros elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks

    def under(pid: int) -> bool:
        pid = parents.get(pid, 0)
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    return {"own": used.get(root, 0.0),
            "children": sum(seconds for pid, seconds in used.items() if under(pid))}


def cpu_by_role(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of vLLM's API server (``vllm-api``: HTTP, templates, detokenising),
    its engine (``vllm-engine``: the model; it busy-polls a core for a while after each
    request, so it tracks wall time) and each gateway."""
    vllm = process_cpu(pids["vllm"])
    return {"vllm-api": vllm["own"], "vllm-engine": vllm["children"],
            **{role: sum(process_cpu(pid).values()) for role, pid in pids.items()
               if role != "vllm"}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_gateway(vllm_url: str, port: int, log: Path, *, render: list[str],
                  profile: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    launch = (["-m", "cProfile", "-o", profile, "-m", "rollq"] if profile else
              ["-c", "from ops.cli import main; raise SystemExit(main())"])
    command = [sys.executable, *launch,
               "gateway", "--host", "127.0.0.1", "--port", str(port), "--inference", vllm_url,
               "--model", "rollq-tiny", "--log-format", "json", "--log-level", "warning",
               *render]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"gateway did not start:\n{log.read_text()[-2000:]}")


VARIANTS = ("direct", "direct+lp", "gateway", "gateway/tokenize", "rollq")
"""``gateway``: rendering chat continuations itself (``--tokenizer``); ``gateway/tokenize``:
the same gateway without the tokenizer, every render a ``/tokenize`` request to vLLM;
``rollq``: the full path (module docstring)."""


async def measure(vllm_url: str, redis_url: str, gateways: dict[str, str],
                  args: argparse.Namespace, pids: dict[str, int],
                  template: LocalTemplate | None) -> dict[str, list[Run]]:
    print(f"{args.episodes} episodes x 3 calls x {args.max_tokens} tokens, concurrency "
          f"{args.concurrency}, {args.runs} runs; {os.cpu_count()} CPUs", flush=True)
    await run_workload(vllm_url, None, args)  # warm-up, untimed
    for url in gateways.values():
        await run_workload(vllm_url, url, args)
    rollq_runs = iter(range(1_000_000))
    await run_rollq(vllm_url, redis_url, args, next(rollq_runs), template)
    results: dict[str, list[Run]] = {name: [] for name in VARIANTS}
    names = list(results)
    for number in range(args.runs):
        # each run starts with another variant, so no variant always follows the same one
        start = number % len(names)
        for name in names[start:] + names[:start]:
            before = cpu_by_role(pids)
            agent = time.process_time()
            if name == "rollq":
                run = await run_rollq(vllm_url, redis_url, args, next(rollq_runs), template)
            else:
                run = await run_workload(vllm_url, gateways.get(name), args,
                                         capture_fields=name == "direct+lp")
            run.cpu = {role: seconds - before[role]
                       for role, seconds in cpu_by_role(pids).items()
                       if role in ("vllm-api", "vllm-engine", name)
                       or (role == "redis" and name == "rollq")}
            run.cpu["agent"] = time.process_time() - agent
            results[name].append(run)
            drift = (f" token-in {run.token_in}/{len(run.latencies)}"
                     if name in gateways else "")
            calls = len(run.latencies)
            cpu = " ".join(f"{role} {seconds / calls * 1000:.1f}"
                           for role, seconds in run.cpu.items())
            print(f"run {number + 1}/{args.runs} {name:16s}: {run.seconds:6.2f} s "
                  f"{run.tokens_per_s:6.1f} tokens/s "
                  f"p50 {percentile(run.latencies, 0.5) * 1000:5.1f} ms "
                  f"p99 {percentile(run.latencies, 0.99) * 1000:5.1f} ms{drift}; "
                  f"CPU ms/call: {cpu}", flush=True)
    for name, url in gateways.items():
        async with httpx.AsyncClient() as http:
            renders = (await http.get(f"{url}/health")).json()["renders"]
        print(f"{name} chat renders: {renders['local']} local, {renders['server']} by "
              f"/tokenize, {renders['mismatches']} local renders differing", flush=True)
    await time_tokenize(vllm_url)
    return results


async def time_tokenize(vllm_url: str) -> None:
    """One ``/tokenize`` of a 3-message chat with tools, alone on the server: what each of
    the gateway's chat-continuation checks costs before any generation (it renders the
    conversation through the server's template, twice per continuation, concurrently)."""
    body = {"model": "rollq-tiny", "tools": [TOOL], "add_generation_prompt": True,
            "messages": [{"role": "user", "content": "What is 6*7? Use the calculator."},
                         {"role": "assistant", "content": "x" * 100},
                         {"role": "tool", "tool_call_id": "call-0", "content": "42"}]}
    seconds = []
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(20):
            started = time.perf_counter()
            (await http.post(f"{vllm_url}/tokenize", json=body)).raise_for_status()
            seconds.append(time.perf_counter() - started)
    print(f"vLLM /tokenize (chat with tools, idle server): p50 "
          f"{statistics.median(seconds) * 1000:.1f} ms", flush=True)


def run_bench(args: argparse.Namespace) -> dict[str, list[Run]]:
    from rollq.ops.local.stack import RedisProcess, VllmProcess, free_port
    from rollq.ops.local.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="rollq-bench-gateway-") as tmp:
        directory = Path(tmp)
        model = write_tiny_model(directory / "rollq-tiny", seed=0)
        (directory / "template.jinja").write_text(TEMPLATE)
        cache = Path(args.vllm_python).absolute().parent.parent / "inductor-cache"
        vllm = VllmProcess(args.vllm_python, model, directory / "vllm.log", max_model_len=1024,
                           compile_cache=cache, extra_args=[
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--chat-template", str(directory / "template.jinja")])
        print("== starting the CPU vLLM server with the tiny model ...", flush=True)
        vllm.start()
        assert vllm.process is not None
        redis = RedisProcess(directory / "redis").start()
        assert redis.process is not None
        started: list[subprocess.Popen[bytes]] = []
        try:
            gateways: dict[str, str] = {}
            pids = {"vllm": vllm.process.pid, "redis": redis.process.pid}
            for name in ("gateway", "gateway/tokenize"):
                render = [] if name.endswith("/tokenize") else [
                    "--tokenizer", str(model), "--chat-template",
                    str(directory / "template.jinja")]
                process, gateways[name] = start_gateway(
                    vllm.url, free_port(), directory / f"{name.replace('/', '-')}.log",
                    render=render, profile=args.profile_gateway if name == "gateway" else None)
                started.append(process)
                pids[name] = process.pid
            template = LocalTemplate.load(str(model), str(directory / "template.jinja"))
            return asyncio.run(measure(vllm.url, redis.url, gateways, args, pids, template))
        finally:
            for process in started:
                # SIGINT: uvicorn re-raises the signal after shutting down, and cProfile
                # writes its stats on KeyboardInterrupt (not on SIGTERM's default death)
                process.send_signal(signal.SIGINT if args.profile_gateway else signal.SIGTERM)
                process.wait(timeout=30)
            vllm.stop()
            redis.stop()


def report(results: dict[str, list[Run]]) -> None:
    pairs = list(zip(results["direct"], results["gateway"], strict=True))
    ratios = [g.tokens_per_s / d.tokens_per_s for d, g in pairs]
    added = {q: median_of(percentile(g.latencies, q) - percentile(d.latencies, q)
                          for d, g in pairs) for q in (0.5, 0.99)}
    ratio = median_of(ratios)
    print(f"per-run gateway/direct: {' '.join(f'{r:.2f}' for r in ratios)}; "
          f"median direct {statistics.median(r.tokens_per_s for r in results['direct']):.1f} "
          f"tokens/s")
    print(f"added latency per call: p50 {added[0.5] * 1000:.1f} ms, "
          f"p99 {added[0.99] * 1000:.1f} ms")
    ceiling = median_of(lp.tokens_per_s / d.tokens_per_s for d, lp in zip(
        results["direct"], results["direct+lp"], strict=True))
    print(f"direct asking logprobs and token ids / direct: {ceiling:.2f} (what vLLM's own "
          "logprobs cost: the ceiling of the ratio below for any gateway that captures them)")
    captured = median_of(g.tokens_per_s / d.tokens_per_s for d, g in zip(
        results["direct+lp"], results["gateway"], strict=True))
    print(f"gateway / direct asking the same logprobs and token ids: {captured:.2f} "
          "(what the gateway itself costs, beyond what capture asks of vLLM)")
    tokenize = median_of(g.tokens_per_s / d.tokens_per_s for d, g in zip(
        results["direct"], results["gateway/tokenize"], strict=True))
    print(f"gateway/tokenize / direct (no --tokenizer: every render a /tokenize request): "
          f"{tokenize:.2f}")
    for name, runs in results.items():
        cpu = {role: median_of(run.cpu[role] / len(run.latencies) for run in runs)
               for role in runs[0].cpu}
        print(f"CPU ms per call, {name:16s} (medians): "
              + ", ".join(f"{role} {seconds * 1000:.1f}" for role, seconds in cpu.items()))
    full = median_of(r.tokens_per_s / d.tokens_per_s for d, r in zip(
        results["direct"], results["rollq"], strict=True))
    verdict = "OK" if ratio >= TARGET_RATIO else "BELOW TARGET"
    print(f"ratio {ratio:.2f} (gateway/direct tokens/s, goal >= {TARGET_RATIO}) {verdict}")
    print(f"ratio {full:.2f} (rollq/direct tokens/s: the full agent path, workers, "
          f"in-process gateway and publishing) beside gateway/direct {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16, help="episodes per run (16)")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes at once (4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per call (32)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each (3)")
    parser.add_argument("--vllm-python", default=os.environ.get("ROLLQ_TEST_VLLM_PYTHON")
                        or ".venv-vllm/bin/python",
                        help="python of a venv with vLLM [ROLLQ_TEST_VLLM_PYTHON, else "
                        ".venv-vllm/bin/python, what .ci/setup.sh makes]")
    parser.add_argument("--profile-gateway", metavar="PATH",
                        help="run the gateway under cProfile and write its stats to PATH "
                        "(read with python -m pstats; slows the gateway: not for figures)")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).exists():
        parser.error(f"no vLLM interpreter at {args.vllm_python}: give --vllm-python or set "
                     "ROLLQ_TEST_VLLM_PYTHON")
    configure_logging("json", "warning")  # the rollq variant's worker: no line per group
    report(run_bench(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
