"""Greedy evaluation of the policy a vLLM server serves now, on a dataset env's problems.

``Evaluator.evaluate(problems)`` sends every problem in one ``/v1/completions`` request
(token-id prompts, temperature 0, one completion each) and scores the answers with the
reward config's own components, in this thread: the mean raw value of each component
(``accuracy``, ``format``...) over the problems. Prompts are tokenised once by the server's
``/tokenize`` (its chat template), exactly as the rollout workers' chat requests are.

Used by ``rollq demo --task sums`` (train and held-out accuracy every N steps) and by
``bench/learning.py``. Synchronous on purpose: the demo's follower is synchronous, and
math-verify's own timeouts work only in the main thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from rollq.consumers.scorer import RewardConfig
from rollq.consumers.scorer.components import RewardComponent
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.scorer.traces import extract_reasoning
from rollq.producers.envs import DatasetEnv
from rollq.schemas import InferenceUnavailable


@dataclass(frozen=True)
class Problem:
    """One problem: its prompt token ids and the group metadata its env would publish."""

    prompt_ids: list[int]
    metadata: dict[str, Any]


class Evaluator:
    """Greedy answers from one server, scored by ``config``'s components. Use ``with``."""

    def __init__(self, url: str, model: str, config: RewardConfig, *, max_tokens: int,
                 timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.config = config
        self.max_tokens = max_tokens
        self.components: list[tuple[str, RewardComponent[Any]]] = [
            (entry.name, entry.build()) for entry in config.components]
        self.correctness = config.correctness_name()
        self._http = httpx.Client(timeout=timeout_s)
        # The accuracy component's normalisation settings make latex2sympy warn on every
        # call ("equations=True ... is deprecated"): one line per answer, nothing to act on.
        logging.getLogger("latex2sympy2_extended.math_normalization").setLevel(logging.ERROR)

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = self._http.post(self.url + path, json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise InferenceUnavailable(f"evaluation request {path} failed: {exc}") from exc
        return response.json()

    def problems(self, env: DatasetEnv) -> list[Problem]:
        """Every item of ``env`` as a ``Problem`` (chat prompts through ``/tokenize``)."""
        found = []
        for index in range(len(env)):
            item = env.item(index)
            prompt = env.prompt(item)
            body: dict[str, Any] = ({"model": self.model, "prompt": prompt}
                                    if isinstance(prompt, str) else
                                    {"model": self.model, "messages": prompt,
                                     "add_generation_prompt": True})
            tokens = self._post("/tokenize", body)["tokens"]
            found.append(Problem([int(t) for t in tokens],
                                 env.format.metadata(item.fields, item.index)))
        return found

    def evaluate(self, problems: Sequence[Problem]) -> dict[str, float]:
        """Mean raw value of each component over ``problems`` (greedy answers)."""
        body = {"model": self.model, "prompt": [p.prompt_ids for p in problems],
                "max_tokens": self.max_tokens, "temperature": 0.0, "n": 1,
                "return_token_ids": True}
        choices = sorted(self._post("/v1/completions", body)["choices"],
                         key=lambda choice: int(choice["index"]))
        totals: dict[str, list[float]] = {name: [] for name, _ in self.components}
        for problem, choice in zip(problems, choices, strict=True):
            for name, value in self.score(str(choice["text"]), choice.get("token_ids") or [],
                                          problem.metadata).items():
                if value is not None:
                    totals[name].append(value)
        return {name: float(np.mean(values)) if values else float("nan")
                for name, values in totals.items()}

    def score(self, text: str, token_ids: Sequence[int],
              metadata: dict[str, Any]) -> dict[str, float | None]:
        """Each component's value for one completion (the correctness component first)."""
        tags = self.config.trace
        sample = Sample(text=text, completion_ids=np.asarray(token_ids, dtype=np.int32),
                        trace=extract_reasoning(text, open_tag=tags.open_tag,
                                                close_tag=tags.close_tag),
                        metadata=metadata)
        ordered = sorted(self.components, key=lambda pair: pair[0] != self.correctness)
        values: dict[str, float | None] = {}
        for name, component in ordered:
            if component.needs_correctness and self.correctness is not None:
                correct = values.get(self.correctness)
                sample = dataclasses.replace(sample, correct=None if correct is None
                                             else correct > 0)
            values[name] = component.score(sample, [sample])
        return values
