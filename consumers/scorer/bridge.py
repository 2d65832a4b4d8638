"""The universal reward bridge: run the configured components over a group, combine their
values into one reward per completion, and turn the rewards into advantages.

Placement: cheap components run inline on the event loop; CPU-heavy ones (math-verify)
run in a `WorkerPool`, several samples a call, with a timeout per sample, so the loop never
blocks on sympy; I/O components (a process reward model) are awaited with the same timeout.

A reward failure is never a score. A component call that raises, times out or loses its
pool process is tried again `retries` times (short back-off); if it still fails, the
sample's value is unknown, and the entry's `on_error` says what that means:

- `dead_letter` (default): the group cannot be scored now; `score_groups` returns a
  `ScoringError` naming the component for it (`score_batch`/`score_group` raise it). The
  scorer retries the group, then dead-letters it as `reward_error`.
- `skip_component`: the value is None for that sample (it adds nothing to the total) and
  a `ComponentFlag` records why; components that read correctness see `correct=None`.

What a component returns is its business: a wrong answer, or a candidate's code that the
component itself times out, is a value of 0, not a failure. A group lacking a metadata
field a component requires fails with `MissingFieldError` before any component runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from numpy.typing import NDArray

from rollq.consumers.scorer.advantages import (
    broadcast_advantages,
    compute_advantages,
    compute_process_advantages,
    is_zero_variance,
)
from rollq.consumers.scorer.components import RewardComponent, Score
from rollq.consumers.scorer.config import ComponentEntry, RewardConfig
from rollq.consumers.scorer.errors import MissingFieldError, ScoringError
from rollq.consumers.scorer.pool import WorkerPool
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.scorer.traces import extract_reasoning

_RETRY_BACKOFF_S = 0.05
"""Pause before a failed component call's first retry (seconds); doubled per retry."""
POOL_CALL_SAMPLES = 8
"""Samples a pooled component scores per pool call. Each call costs a pipe round trip and
a wake-up of both processes, about 0.2 ms of CPU on each side: as much as a math-verify
check of a completion. ``bench.scorer`` (r1, 16 completions a group, 2 workers): 89
groups/s a call per sample, 115 with 4 samples a call, 133 with 8."""


@dataclass(frozen=True)
class ComponentFlag:
    """A component call that failed after its retries and was skipped (`skip_component`).

    - `component`: the entry's name; `sample`: the completion's index in its group.
    - `reason`: `timeout`, `error`, `non_finite`, `bad_token_rewards`, or the reason a
      `ScoringError` carried (e.g. `prm_error`, `worker_died`).
    - `policy`: what was applied (`skip_component`: the value is None); `detail`: the
      error text.
    """

    component: str
    sample: int
    reason: str
    policy: str
    detail: str


@dataclass(frozen=True)
class GroupScore:
    """The scores of one group.

    - `rewards`: the combined reward per completion.
    - `components`: raw value per completion, by component name (None = skipped: the
      component returned None, or failed under `skip_component`).
    - `weights`: weight by component name.
    - `timings`: wall seconds spent per component (over the whole `score_batch` call).
    - `flags`: failed calls skipped by policy; `flag_counts()` tallies them.
    - `token_rewards`: per completion, Σ weight · per-token rewards of the components
      that produce them (float32, one per token); None when none does.
    - `advantages`: per-completion advantages (float32), or None when dropped.
    - `token_advantages`: per-token advantages (float32) per completion, or None when
      dropped.
    - `drop_reason`: why the group is dropped (`zero_variance`), else None.
    """

    rewards: list[float]
    components: dict[str, list[float | None]]
    weights: dict[str, float]
    timings: dict[str, float]
    flags: tuple[ComponentFlag, ...]
    token_rewards: list[NDArray[np.float32]] | None
    advantages: NDArray[np.float32] | None
    token_advantages: list[NDArray[np.float32]] | None
    drop_reason: str | None

    def flag_counts(self) -> dict[str, int]:
        """Count of flags by `"<component>:<reason>"`."""
        return dict(Counter(f"{flag.component}:{flag.reason}" for flag in self.flags))


@dataclass
class _Outcome:
    scores: list[list[Score]]  # [group][sample]
    flags: list[list[ComponentFlag]]  # [group]
    failures: list[ScoringError | None]  # [group]: the first failure under dead_letter
    seconds: float = 0.0


class RewardBridge:
    """Scores groups with the components of a `RewardConfig`.

    Use as an async context manager: it owns the process pool and the components' I/O
    clients. `transport` is handed to components that open HTTP clients (for tests).
    """

    def __init__(self, config: RewardConfig, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._transport = transport
        self._components: list[tuple[ComponentEntry, RewardComponent[Any]]] = [
            (entry, entry.build()) for entry in config.components]
        self._pool: WorkerPool | None = None
        self._opened: list[RewardComponent[Any]] = []

    def _placement(self, entry: ComponentEntry, component: RewardComponent[Any]) -> str:
        return entry.run_in or component.placement

    async def __aenter__(self) -> RewardBridge:
        pooled = [c for e, c in self._components if self._placement(e, c) == "process"]
        try:
            if pooled:
                preload = sorted({module for c in pooled
                                  for module in (type(c).__module__, *c.preload_modules)})
                pool = WorkerPool(self.config.pool.workers,
                                  start_method=self.config.pool.start_method, preload=preload)
                await pool.__aenter__()
                self._pool = pool
            for _, component in self._components:
                await component.open(transport=self._transport)
                self._opened.append(component)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        while self._opened:
            await self._opened.pop().close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.__aexit__(None, None, None)

    def make_sample(
        self, text: str, completion_ids: Sequence[int] | NDArray[np.int32], *,
        reasoning: str | None = None, finish_reason: str = "stop",
        metadata: Mapping[str, Any] | None = None, prompt: str = "",
        completion_metadata: Mapping[str, Any] | None = None,
    ) -> Sample:
        """A `Sample` whose trace is extracted with the configured tags; its metadata are
        plain dicts (they cross the pool boundary by pickle)."""
        tags = self.config.trace
        trace = extract_reasoning(text, reasoning=reasoning, open_tag=tags.open_tag,
                                  close_tag=tags.close_tag)
        return Sample(text=text, completion_ids=np.asarray(completion_ids, dtype=np.int32),
                      trace=trace, finish_reason=finish_reason, metadata=_plain(metadata),
                      prompt=prompt, completion_metadata=_plain(completion_metadata))

    async def score_group(self, samples: Sequence[Sample]) -> GroupScore:
        """Score one group (see `score_batch`)."""
        return (await self.score_batch([samples]))[0]

    async def score_batch(self, groups: Sequence[Sequence[Sample]]) -> list[GroupScore]:
        """Score several groups at once; components with `scope: batch` see all of them.

        Raises the first group's failure (see `score_groups`).
        """
        results = await self.score_groups(groups)
        for result in results:
            if isinstance(result, ScoringError):
                raise result
        return [result for result in results if not isinstance(result, ScoringError)]

    async def score_groups(
        self, groups: Sequence[Sequence[Sample]]
    ) -> list[GroupScore | ScoringError]:
        """Score several groups together, each failing on its own: per group, its scores,
        or `MissingFieldError` (it lacks a metadata field a component needs; it is then
        left out of the batch population), or `ScoringError` (a `dead_letter` component
        failed on one of its samples after the retries; the error names the component)."""
        results: list[GroupScore | ScoringError | None] = [
            self._missing_field(group) for group in groups]
        live = [index for index, result in enumerate(results) if result is None]
        scored = await self._score_live([list(groups[index]) for index in live])
        for index, result in zip(live, scored, strict=True):
            results[index] = result
        return [result for result in results if result is not None]

    async def _score_live(self, groups: list[list[Sample]]) -> list[GroupScore | ScoringError]:
        if not groups:
            return []
        correctness = self.config.correctness_name()
        first = [(e, c) for e, c in self._components if not c.needs_correctness]
        second = [(e, c) for e, c in self._components if c.needs_correctness]
        outcomes = await self._run_all(first, groups)
        if second and correctness is not None:
            groups = [[dataclasses.replace(sample, correct=_is_correct(score))
                       for sample, score in zip(group, scores, strict=True)]
                      for group, scores in zip(groups, outcomes[correctness].scores, strict=True)]
        outcomes |= await self._run_all(second, groups)
        outcomes = {entry.name: outcomes[entry.name] for entry, _ in self._components}
        results: list[GroupScore | ScoringError] = []
        for index, group in enumerate(groups):
            failure = next((o.failures[index] for o in outcomes.values()
                            if o.failures[index] is not None), None)
            results.append(failure if failure is not None
                           else self._assemble(index, group, outcomes))
        return results

    async def _run_all(self, components: Sequence[tuple[ComponentEntry, RewardComponent[Any]]],
                       groups: Sequence[Sequence[Sample]]) -> dict[str, _Outcome]:
        """Run components concurrently; when all are inline (they never yield), one after
        the other, as a task per component would only add scheduling."""
        if all(self._placement(e, c) == "inline" for e, c in components):
            return {e.name: await self._run(e, c, groups) for e, c in components}
        return dict(zip([e.name for e, _ in components], await asyncio.gather(
            *(self._run(e, c, groups) for e, c in components)), strict=True))

    def _missing_field(self, group: Sequence[Sample]) -> MissingFieldError | None:
        for entry, component in self._components:
            for field in component.required_fields():
                for sample in group:
                    if field not in sample.completion_metadata and field not in sample.metadata:
                        return MissingFieldError(field, component=entry.name)
        return None

    async def _run(self, entry: ComponentEntry, component: RewardComponent[Any],
                   groups: Sequence[Sequence[Sample]]) -> _Outcome:
        outcome = _Outcome(scores=[], flags=[[] for _ in groups], failures=[None] * len(groups))
        batch = [sample for group in groups for sample in group]
        placement = self._placement(entry, component)
        started = time.perf_counter()
        if placement == "process":  # every group's calls at once: the workers never wait
            outcome.scores = list(await asyncio.gather(*(
                self._pooled(entry, component, outcome, group_index, group,
                             batch if component.population == "batch" else group)
                for group_index, group in enumerate(groups))))
            outcome.seconds = time.perf_counter() - started
            return outcome
        for group_index, group in enumerate(groups):
            population = batch if component.population == "batch" else group
            if placement == "inline":
                scores = []
                for index, sample in enumerate(group):
                    try:  # the usual case first: no task, no await
                        score = _checked(component.evaluate(sample, population),
                                         len(sample.completion_ids))
                    except Exception as exc:
                        score = await self._retry(entry, component, placement, outcome,
                                                  group_index, index, sample, population, exc)
                    scores.append(score)
            else:
                scores = list(await asyncio.gather(*(
                    self._call(entry, component, placement, outcome, group_index, index,
                               sample, population)
                    for index, sample in enumerate(group))))
            outcome.scores.append(scores)
        outcome.seconds = time.perf_counter() - started
        return outcome

    async def _pooled(self, entry: ComponentEntry, component: RewardComponent[Any],
                      outcome: _Outcome, group_index: int, group: Sequence[Sample],
                      population: Sequence[Sample]) -> list[Score]:
        """A pooled component's scores of one group, `POOL_CALL_SAMPLES` samples a pool
        call (`WorkerPool.run_each`). A call of several samples that fails as a whole
        (its timeout, `timeout_s` per sample, runs out; its worker dies) is no sample's
        fault yet and costs none of them a try: each is called again alone, as without
        chunks, so a sample that hangs or kills its worker is found alone and the others
        score. A sample that raised, or returned a bad score, goes on to its retries."""
        assert self._pool is not None
        pool = self._pool
        shipped = [_shippable(s) for s in population] if component.uses_group else ()

        async def chunk(first: int) -> list[Score]:
            indices = range(first, min(first + POOL_CALL_SAMPLES, len(group)))
            if len(indices) == 1:  # its own call: a failure of the call is the sample's
                return [await self._call(entry, component, "process", outcome, group_index,
                                         first, group[first], population)]
            try:
                results = await pool.run_each(
                    component.evaluate, [_shippable(group[i]) for i in indices], shipped,
                    timeout_s=entry.timeout_s * len(indices))
            except Exception:  # the call as a whole: each sample again, alone
                return list(await asyncio.gather(*(
                    self._call(entry, component, "process", outcome, group_index, i,
                               group[i], population) for i in indices)))
            scores: list[Score] = []
            for i, result in zip(indices, results, strict=True):
                try:
                    if isinstance(result, ScoringError):
                        raise result
                    scores.append(_checked(result, len(group[i].completion_ids)))
                except Exception as exc:
                    scores.append(await self._retry(entry, component, "process", outcome,
                                                    group_index, i, group[i], population, exc))
            return scores

        chunks = await asyncio.gather(*(chunk(first)
                                        for first in range(0, len(group), POOL_CALL_SAMPLES)))
        return [score for scores in chunks for score in scores]

    async def _call(self, entry: ComponentEntry, component: RewardComponent[Any],
                    placement: str, outcome: _Outcome, group_index: int, index: int,
                    sample: Sample, population: Sequence[Sample]) -> Score:
        try:
            return await self._once(entry, component, placement, sample, population)
        except Exception as exc:
            return await self._retry(entry, component, placement, outcome, group_index,
                                     index, sample, population, exc)

    async def _once(self, entry: ComponentEntry, component: RewardComponent[Any],
                    placement: str, sample: Sample, population: Sequence[Sample]) -> Score:
        if placement == "process":
            assert self._pool is not None
            shipped = [_shippable(s) for s in population] if component.uses_group else ()
            score = await self._pool.run(component.evaluate, _shippable(sample), shipped,
                                         timeout_s=entry.timeout_s)
        elif placement == "inline":
            score = component.evaluate(sample, population)
        else:
            score = await asyncio.wait_for(component.evaluate_async(sample, population),
                                           entry.timeout_s)
        return _checked(score, len(sample.completion_ids))

    async def _retry(self, entry: ComponentEntry, component: RewardComponent[Any],
                     placement: str, outcome: _Outcome, group_index: int, index: int,
                     sample: Sample, population: Sequence[Sample], exc: Exception) -> Score:
        """Try a failed call again up to `entry.retries` times; then apply `on_error`."""
        for attempt in range(1, entry.retries + 1):
            await asyncio.sleep(_RETRY_BACKOFF_S * 2 ** (attempt - 1))
            try:
                return await self._once(entry, component, placement, sample, population)
            except Exception as again:
                exc = again
        return self._fail(entry, outcome, group_index, index, exc)

    def _fail(self, entry: ComponentEntry, outcome: _Outcome, group_index: int, index: int,
              exc: Exception) -> Score:
        if isinstance(exc, TimeoutError):
            reason, detail = "timeout", f"no result within {entry.timeout_s} s"
        elif isinstance(exc, ScoringError):
            reason, detail = exc.reason, str(exc)
        else:
            reason, detail = "error", f"{type(exc).__name__}: {exc}"
        if entry.on_error == "dead_letter":
            if outcome.failures[group_index] is None:
                outcome.failures[group_index] = ScoringError(
                    reason, f"component {entry.name!r} failed on sample {index} "
                    f"({reason}, {entry.retries + 1} tries): {detail}", component=entry.name)
        else:
            outcome.flags[group_index].append(
                ComponentFlag(entry.name, index, reason, entry.on_error, detail))
        return Score(None)

    def _assemble(self, index: int, group: Sequence[Sample],
                  outcomes: Mapping[str, _Outcome]) -> GroupScore:
        weights = {entry.name: entry.weight for entry, _ in self._components}
        values = {name: [score.value for score in outcome.scores[index]]
                  for name, outcome in outcomes.items()}
        rewards = [self._combine({name: column[position] for name, column in values.items()},
                                 weights) for position in range(len(group))]
        lengths = [len(sample.completion_ids) for sample in group]
        token_rewards = _token_rewards(
            [(weights[name], outcome.scores[index]) for name, outcome in outcomes.items()],
            lengths)
        settings = self.config.advantages
        flags = tuple(flag for outcome in outcomes.values() for flag in outcome.flags[index])
        score = GroupScore(
            rewards=rewards, components=values, weights=weights,
            timings={name: outcome.seconds for name, outcome in outcomes.items()},
            flags=flags, token_rewards=token_rewards, advantages=None, token_advantages=None,
            drop_reason="zero_variance")
        if is_zero_variance(rewards, settings.variance_tolerance):
            if settings.zero_variance == "drop":
                return score
            advantages = np.zeros(len(group), dtype=np.float32)
        else:
            advantages = compute_advantages(rewards, settings.method, settings.eps,
                                            settings.ddof)
        if settings.process_component is None:
            token_advantages = broadcast_advantages(advantages, lengths)
        else:
            steps = outcomes[settings.process_component].scores[index]
            empty_ends, empty_scores = np.zeros(0, np.int64), np.zeros(0, np.float32)
            token_advantages = compute_process_advantages(
                [s.step_ends if s.step_ends is not None else empty_ends for s in steps],
                [s.step_scores if s.step_scores is not None else empty_scores for s in steps],
                lengths, settings.eps, settings.ddof)
        return dataclasses.replace(score, advantages=advantages,
                                   token_advantages=token_advantages, drop_reason=None)

    def _combine(self, values: Mapping[str, float | None], weights: Mapping[str, float]) -> float:
        if self.config.combine == "roll_universal":
            name = self.config.correctness_name()
            correctness = values.get(name) if name is not None else None
            if correctness is not None and correctness > 0:
                return weights[str(name)] * correctness
            return -1.0 + sum(weights[key] * value for key, value in values.items()
                              if key != name and value is not None)
        return sum((weights[key] * value for key, value in values.items() if value is not None),
                   start=0.0)


def _plain(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """`mapping` as a plain dict (picklable; no copy when it already is one)."""
    if mapping is None:
        return {}
    return mapping if type(mapping) is dict else dict(mapping)


def _shippable(sample: Sample) -> Sample:
    """`sample` with plain-dict metadata, so that it pickles (a `MappingProxyType` does
    not); the same object when it already has them."""
    if type(sample.metadata) is dict and type(sample.completion_metadata) is dict:
        return sample
    return dataclasses.replace(sample, metadata=_plain(sample.metadata),
                               completion_metadata=_plain(sample.completion_metadata))


def _is_correct(score: Score) -> bool | None:
    return None if score.value is None else score.value > 0


def _checked(score: Score, length: int) -> Score:
    if score.value is not None and not math.isfinite(score.value):
        raise ScoringError("non_finite", f"component returned {score.value!r}")
    if score.token_rewards is not None and len(score.token_rewards) != length:
        raise ScoringError("bad_token_rewards", f"{len(score.token_rewards)} token rewards "
                          f"for {length} tokens")
    if score.value is not None and type(score.value) is not float:  # int, numpy scalar
        return dataclasses.replace(score, value=float(score.value))
    return score


def _token_rewards(columns: Sequence[tuple[float, Sequence[Score]]],
                   lengths: Sequence[int]) -> list[NDArray[np.float32]] | None:
    if not any(score.token_rewards is not None for _, scores in columns for score in scores):
        return None
    totals = [np.zeros(length, dtype=np.float32) for length in lengths]
    for weight, scores in columns:
        for total, score in zip(totals, scores, strict=True):
            if score.token_rewards is not None:
                total += np.float32(weight) * score.token_rewards
    return totals
