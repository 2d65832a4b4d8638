"""The ``tools`` task of the demo: its reward, the ``rollq gateway`` the workers' agents talk
through, and greedy evaluations of the served policy by the same agent, straight to vLLM.

Evaluation rows have the ``sums`` rows' names (``ops.local.demo_sums.learning_curves`` reads both):
``accuracy`` is the agent's reward (it called ``calc`` and then answered the right result),
``format`` the share of well-formed episodes (a ``calc`` call the tool could run, then a
number), ``failures`` how many episodes were not, by reason (``EpisodeOutcome.failure``)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from rollq.ops.local.demo_sums import SumsEvaluation
from rollq.producers.envs.tools import CalculatorAgent, EpisodeOutcome, calc_records

TOOLS_REWARD = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "tools.yaml"


class ToolsEvaluator:
    """``CalculatorAgent`` at temperature 0 on every problem, straight to one vLLM server."""

    def __init__(self, url: str, model: str, *, max_tokens: int, concurrency: int = 32) -> None:
        self.base_url = url.rstrip("/") + "/v1"
        self.agent = CalculatorAgent(max_tokens=max_tokens, temperature=0.0, model=model)
        self.concurrency = concurrency

    def evaluate(self, problems: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Mean ``accuracy`` and ``format`` over ``problems`` (``calc_records``), and the
        count of each ``failure``."""
        # A thread of its own: the demo's follower may run inside the CLI's event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            outcomes = thread.submit(asyncio.run, self._episodes(problems)).result()
        return {"accuracy": sum(o.correct for o in outcomes) / len(outcomes),
                "format": sum(o.failure is None for o in outcomes) / len(outcomes),
                "failures": dict(collections.Counter(o.failure for o in outcomes
                                                     if o.failure is not None))}

    async def _episodes(self, problems: Sequence[dict[str, Any]]) -> list[EpisodeOutcome]:
        slots = asyncio.Semaphore(self.concurrency)
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key="none",
                                      max_retries=2, timeout=300) as client:
            async def one(problem: dict[str, Any]) -> EpisodeOutcome:
                async with slots:
                    return await self.agent.episode(client, problem)

            return list(await asyncio.gather(*(one(p) for p in problems)))


@contextlib.contextmanager
def tools_evaluation(inference: str, model: str, out: Path, say: Callable[[str], None], *,
                     every: int, max_tokens: int) -> Iterator[SumsEvaluation]:
    """Evaluations of the ``tools`` task every ``every`` steps (train and held-out)."""
    evaluator = ToolsEvaluator(inference, model, max_tokens=max_tokens)
    problems = {split: calc_records(split) for split in ("train", "heldout")}
    yield SumsEvaluation(evaluator, problems, every, out / "evals.jsonl", say)


def gateway_argv(inference: str, port: int) -> list[str]:
    """``rollq gateway`` in front of ``inference`` on a loopback ``port``. Continuations are
    checked after they are sent: the warm-started model's calls re-render as it wrote them,
    so no ``/tokenize`` round trip is paid unless a reply drifts."""
    return [sys.executable, "-m", "rollq", "gateway", "--host", "127.0.0.1", "--port",
            str(port), "--inference", inference, "--continuation-check", "after",
            "--log-format", "json", "--log-level", "warning"]


def wait_healthy(url: str, check: Callable[[], None], timeout_s: float = 60.0) -> None:
    """Wait until ``url``/health answers 200; ``check`` raises when the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f}s")
