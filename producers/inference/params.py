"""Value types of the inference client: what a request asks for and what a choice returns."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollq.schemas import Completion
from rollq.schemas.models import SamplingRecord


class SamplingParams(BaseModel):
    """Sampling settings sent with every generation request (vLLM's OpenAI API names).

    None means "leave it to the server's default" and is not sent.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 1.0 samples from the policy itself (what on-policy RL wants)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass; 1.0 disables it."""
    top_k: int | None = None
    """Keep the k most likely tokens; None (or vLLM's -1) disables it."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Most tokens to generate per choice (per turn in multi-turn envs). None: up to the
    context length (vLLM clips it to ``max_model_len - prompt`` itself)."""
    stop: tuple[str, ...] = ()
    """Stop strings; the matched string is not part of the returned text or ids."""
    seed: int | None = None
    """Sampling seed of the request; the n choices still differ from each other."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Passed through verbatim into the request body (``min_p``, ``repetition_penalty``,
    ``stop_token_ids``, ``chat_template_kwargs``…); wins over the fields above."""

    def body(self) -> dict[str, Any]:
        """The request-body fields these settings contribute."""
        body: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stop:
            body["stop"] = list(self.stop)
        if self.seed is not None:
            body["seed"] = self.seed
        body.update(self.extra)
        return body

    def record(self, *, model: str, logprobs_mode: str | None) -> SamplingRecord:
        """What a request with these settings tells about its sampling (the wire's
        ``SamplingRecord``): the values the body sends (``extra`` included), None for what
        it leaves to the server."""
        body = self.body()

        def number(name: str) -> Any:
            value = body.get(name)
            return value if isinstance(value, int | float) and not isinstance(value, bool) else None

        top_k = number("top_k")
        return SamplingRecord(temperature=number("temperature"), top_p=number("top_p"),
                              top_k=int(top_k) if top_k is not None else None,
                              min_p=number("min_p"), logprobs_mode=logprobs_mode, model=model)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with ``max_tokens`` set (the multi-turn bridge's per-turn budget)."""
        return self.model_copy(update={"max_tokens": max_tokens})


@dataclass(frozen=True)
class Choice:
    """One choice of a generation response, exactly as the server returned it."""

    prompt_ids: list[int]
    """Token ids of the prompt as the server saw it (after its chat template, if any)."""
    completion_ids: list[int]
    """Generated token ids, including a final EOS/end-of-turn token when the model emitted
    one; a matched stop string is not included."""
    logprobs: list[float]
    """The sampler's log-probability of each generated token (natural log, from the
    server, never recomputed); same length as ``completion_ids``."""
    finish_reason: str
    """``stop`` (EOS or stop string), ``length`` (max_tokens or context), ``abort``."""
    text: str
    """Decoded text of the choice (chat: the message content without reasoning)."""
    reasoning: str | None = None
    """Chat only: the server's separate reasoning (``reasoning``/``reasoning_content``)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice, if one did."""
    weight_versions: tuple[WeightSpan, ...] | None = None
    """Which weights sampled which tokens, as the server labelled them (vLLM's generate API
    only: ``/inference/v1/generate`` on a server started with ``--enable-scale-out``).
    None where the server does not say (``/v1/completions``, chat)."""
    sampling: SamplingRecord | None = None
    """How the server sampled it: what the request sent, the server's logprobs mode and
    the model named (``InferenceServer`` fills it in)."""
    routed_experts: Any = None
    """The experts a MoE server routed each position of ``prompt_ids + completion_ids``
    (but the last) to, ``[positions, layers, top_k]``; None unless the server runs with
    ``--enable-return-routed-experts``."""

    def versions(self, read_version: int) -> list[int]:
        """The policy version of each generated token.

        ``read_version`` is the run's version the caller read before the request; it labels
        every token when the server gave no spans, and the tokens of spans the server
        labelled with something other than a version (``default``: no sync reached it yet).
        With spans, a request that a sync met mid-generation (pause mode ``keep``) says
        exactly which tokens the new weights sampled."""
        count = len(self.completion_ids)
        if not self.weight_versions:
            return [read_version] * count
        versions = [read_version] * count
        for span in self.weight_versions:
            label = int(span.version) if span.version.isdecimal() else read_version
            versions[span.start:span.end] = [label] * (min(span.end, count) - span.start)
        return versions

    def to_completion(self, policy_version: int, **fields: Any) -> Completion:
        """A wire ``Completion`` of this sample: every token trainable; one version (the one
        read before the request), or per-token versions where the server's spans differ."""
        versions = self.versions(policy_version)
        return Completion(
            completion_ids=self.completion_ids,
            logprobs=self.logprobs,
            loss_mask=[1] * len(self.completion_ids),
            policy_version=versions[0] if versions else policy_version,
            token_versions=versions if len(set(versions)) > 1 else None,
            finish_reason=self.finish_reason,
            text=self.text,
            reasoning=self.reasoning,
            sampling=self.sampling,
            routed_experts=self.routed_experts,
            **fields,
        )


@dataclass(frozen=True)
class WeightSpan:
    """Generated tokens ``[start, end)`` were sampled by the weights labelled ``version``
    (the label a weight sync set with ``/update_weight_version``: rollq sends the step)."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class ModelInfo:
    """What the servers say about the served model (``/v1/models``)."""

    name: str
    """Model name to send in requests (vLLM's ``--served-model-name``)."""
    max_model_len: int | None
    """Context length in tokens (prompt + completion), None if the server does not say."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: ``min(max_s, initial_s * multiplier**attempt)``,
    scaled by a uniform factor in ``[1 - jitter, 1 + jitter]``."""

    initial_s: float = 0.5
    multiplier: float = 2.0
    max_s: float = 20.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        base = min(self.max_s, self.initial_s * self.multiplier**attempt)
        return max(0.0, base * (1.0 + self.jitter * (2.0 * self.rng.random() - 1.0)))
