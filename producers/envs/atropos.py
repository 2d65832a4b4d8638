"""Atropos envs as rollq envs: ``rollq workers --env atropos:package.module:EnvClass``.

ROLL's execution bridge, for atroposlib 0.4.0's ``BaseEnv``: rollq keeps the control
(admission, retries, dead letters, one group per arq job), the env keeps its logic.

- **Loading**: ``atropos_env("package.module:EnvClass", **options)`` imports the class (a
  ``BaseEnv`` subclass); its ``config_init()`` gives the config, ``options`` override its
  fields (``tokenizer_name=…``, ``max_token_length=…``: any field of the env's config
  class); ``group_size`` is the worker's ``--group-size``; wandb is off. Adapter options:
  ``env_name`` (the env's name on the wire; default the class's ``name``), ``items`` (how many
  items the feeder counts per epoch; default 10^9, the env's source is a stream).
- **Items**: atroposlib envs draw items from a stateful ``get_next_item()``, so the env is a
  ``DrawingEnv``: the runner records the drawn item per job (``producers.drawn``) and a
  re-run rolls the same item. Items travel as JSON; tuples, sets and frozensets are kept
  by tags (``schemas.tagged``). Items an env hands back in its backlog (the second value of
  ``collect_trajectories``) are drawn before new ones, by this worker process (a backlog
  dies with its process, as in atroposlib).
- **One job**: the env is built and ``setup()`` once per worker process (on the first
  draw); per job, ``collect_trajectories(item)`` (atroposlib's default gathers
  ``collect_trajectory`` ``group_size`` times), then ``postprocess_histories``. The
  ``ScoredDataGroup`` becomes one rollq group (``producers.envs.atropos_groups``: shared
  prompt = the prefix masked in every sequence). None is dead-lettered ``env_skipped``;
  a list of several groups is a contract error (a job is one group).
- **Inference**: the env's ``ServerManager`` gets ``RollqServer``s: atroposlib's server
  interface (``chat_completion``, ``completion``, ``tokens_and_logprobs_completion`` (what
  ``managed_server`` uses), ``get_logprobs``) answered in-process from the worker's vLLM
  pool through the capture layer (``producers.inference.capture.generate``: the server's
  own token ids and logprobs), whatever servers the env's ``config_init`` names. The
  worker's sampling settings fill the fields a call leaves out. Every call reads the
  policy version first; the group is stamped with the oldest.
- **Token exactness**: the server's outputs of the job are kept; a sequence is
  ``info["token_exact"]`` when every trained stretch is made of them, id for id. Envs that
  build tokens with ``managed_server`` (or from ``tokens_and_logprobs_completion``) are
  exact; envs that re-tokenise chat text (``tokenize_for_trainer``) are exact only where
  the tokenizer happens to agree. When the env sends no ``inference_logprobs``, the
  server's logprobs fill exact stretches.
- **Failures**: a call that failed for want of inference fails the job with
  ``InferenceUnavailable`` (retried) even when the env caught the error (atroposlib's own
  retry wrapper, tenacity, is unwrapped); anything else the env raises goes to the
  worker's failure taxonomy.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rollq.producers.envs.atropos_groups import atropos_sequences
from rollq.producers.envs.base import Item, PolicyVersion, Rollout
from rollq.producers.envs.episode import UpstreamCache
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.inference.capture import Upstream
from rollq.producers.inference.capture.generate import generate, passthrough
from rollq.producers.inference.capture.session import public_reply
from rollq.producers.inference.parse import parse_chat, parse_completions
from rollq.schemas import ConfigError, ContractError, InferenceUnavailable
from rollq.schemas.failures import ENV_SKIPPED
from rollq.schemas.tagged import decode_tagged, encode_tagged

DEFAULT_ITEMS = 10**9


class EnvSkipped(ContractError):
    """The env returned no group for its item."""

    reason = ENV_SKIPPED


# --- inference ---------------------------------------------------------------------------

@dataclass
class JobCalls:
    """What one job's model calls did (shared by the tasks the env starts for the job)."""

    policy_version: PolicyVersion
    defaults: dict[str, Any]
    versions: list[int] = field(default_factory=list)
    outputs: dict[tuple[int, ...], list[float]] = field(default_factory=dict)
    """Every completion the server returned: its token ids -> its logprobs."""
    unavailable: str | None = None

    def record(self, ids: list[int], logprobs: list[float]) -> None:
        if ids:
            self.outputs[tuple(ids)] = logprobs


_JOB: contextvars.ContextVar[JobCalls | None] = contextvars.ContextVar("rollq_atropos_job",
                                                                      default=None)
_SERVER_CLASS: type | None = None


def server_class() -> type:
    """``RollqServer``: atroposlib's ``APIServer`` on rollq's inference pool (module
    docstring); ``upstream`` is bound per worker pool."""
    global _SERVER_CLASS
    if _SERVER_CLASS is not None:
        return _SERVER_CLASS
    from atroposlib.envs.server_handling.server_baseline import (  # type: ignore[import-untyped]  # no py.typed
        APIServer,
    )
    from openai.types.chat.chat_completion import ChatCompletion
    from openai.types.completion import Completion as OpenAICompletion

    class RollqServer(APIServer):
        upstream: Upstream | None = None

        async def check_server_status_task(self, chat_completion: bool = True) -> None:
            self.server_healthy = True  # the pool checks health itself

        async def _with_upstream(self, call: Any) -> Any:
            job = _JOB.get()
            if self.upstream is None:
                raise InferenceUnavailable("the env called the model outside a rollout job")
            if job is not None:
                job.versions.append(await job.policy_version())
            try:
                return await call(self.upstream, job)
            except InferenceUnavailable as exc:
                if job is not None and job.unavailable is None:
                    job.unavailable = str(exc)
                raise

        async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
            async def call(upstream: Upstream, job: JobCalls | None) -> Any:
                body = _body(kwargs, job)
                reply = await passthrough(upstream, "/v1/chat/completions", {
                    **body, "logprobs": True, "return_token_ids": True})
                if job is not None:
                    for sample in parse_chat(reply):
                        job.record(sample.completion_ids, sample.logprobs)
                return ChatCompletion.model_validate(public_reply(reply, body, route="chat"))

            return await self._with_upstream(call)

        async def _completion_wrapper(self, **kwargs: Any) -> Any:
            async def call(upstream: Upstream, job: JobCalls | None) -> Any:
                body = _body(kwargs, job)
                asked = body.get("logprobs")
                reply = await passthrough(upstream, "/v1/completions", {
                    **body, "logprobs": asked if type(asked) is int else 0,
                    "return_token_ids": True})
                if job is not None:
                    for sample in parse_completions(reply):
                        job.record(sample.completion_ids, sample.logprobs)
                return OpenAICompletion.model_validate(
                    public_reply(reply, body, route="completions"))

            return await self._with_upstream(call)

        async def _tokens_and_logprobs_completion_wrapper(
                self, **kwargs: Any) -> tuple[list[int], list[list[int]], list[list[float]],
                                              list[str]]:
            async def call(upstream: Upstream, job: JobCalls | None) -> Any:
                body = _body(kwargs, job)
                answer = await generate(upstream, {**_prompt_of(body), "logprobs": 0})
                logprobs = [[next(iter(row[0].values())) for row in rows]
                            for rows in answer["logprobs"]]
                if job is not None:
                    for ids, values in zip(answer["token_ids"], logprobs, strict=True):
                        job.record(ids, values)
                return (answer["prompt_token_ids"], answer["token_ids"], logprobs,
                        answer["finish_reasons"])

            result: tuple[list[int], list[list[int]], list[list[float]], list[str]] = (
                await self._with_upstream(call))
            return result

        async def _get_logprobs_wrapper(self, **kwargs: Any) -> dict[str, Any]:
            top = max(1, int(kwargs.pop("top_k", kwargs.pop("top_logprobs", 1))))

            async def call(upstream: Upstream, job: JobCalls | None) -> Any:
                body = {**_prompt_of(dict(kwargs)), "prompt_logprobs": top, "n": 1,
                        "temperature": 0.0, "top_p": 1.0, "max_tokens": 1}
                answer = await generate(upstream, body)
                entries = answer.get("prompt_logprobs") or []
                return {"prompt_tokens": answer["prompt_token_ids"],
                        "prompt_topk_token_ids": [[int(k) for k in (e or {})] for e in entries],
                        "prompt_topk_logprobs": [list((e or {}).values()) for e in entries]}

            result: dict[str, Any] = await self._with_upstream(call)
            return result

    _SERVER_CLASS = RollqServer
    return RollqServer


def _body(kwargs: Mapping[str, Any], job: JobCalls | None) -> dict[str, Any]:
    """An OpenAI request body of atroposlib's call arguments: ``extra_body`` merged in, the
    job's sampling defaults under it."""
    body = {key: value for key, value in kwargs.items()
            if key not in ("extra_body", "split", "skip_reasoning") and value is not None}
    body.update(kwargs.get("extra_body") or {})
    for key, value in (job.defaults if job is not None else {}).items():
        body.setdefault(key, value)
    return body


def _prompt_of(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/generate`` body of a token call's arguments (``input_ids`` or ``prompt``)."""
    body = dict(body)
    for alias in ("max_new_tokens", "max_completion_tokens"):
        if alias in body:
            body["max_tokens"] = body.pop(alias)
    body.pop("model", None)
    if "input_ids" in body:
        body.pop("prompt", None)
        body["prompt"] = {"prompt_token_ids": list(body.pop("input_ids"))}
    return body


# --- token exactness ---------------------------------------------------------------------

def served_logprobs(tokens: NDArray[np.int64], trainable: NDArray[np.bool_],
                    outputs: Mapping[tuple[int, ...], list[float]]) -> NDArray[np.float32] | None:
    """Logprobs of every trained token when each trained stretch is a concatenation of
    server outputs (then the sequence is token-exact); else None."""
    by_first: dict[int, list[tuple[int, ...]]] = {}
    for ids in outputs:
        by_first.setdefault(ids[0], []).append(ids)
    values = np.zeros(len(tokens), np.float32)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trainable.astype(np.int8), [0]])))
    for begin, end in zip(edges[::2], edges[1::2], strict=True):
        stretch = tuple(int(t) for t in tokens[begin:end])
        path = _cover(stretch, by_first)
        if path is None:
            return None
        at = int(begin)
        for ids in path:
            values[at:at + len(ids)] = outputs[ids]
            at += len(ids)
    return values


def _cover(stretch: tuple[int, ...],
           by_first: dict[int, list[tuple[int, ...]]]) -> list[tuple[int, ...]] | None:
    """Outputs whose concatenation is ``stretch`` (breadth-first over positions)."""
    reached: dict[int, list[tuple[int, ...]]] = {0: []}
    frontier = [0]
    while frontier:
        position = frontier.pop()
        if position == len(stretch):
            return reached[position]
        for ids in by_first.get(stretch[position], ()):
            end = position + len(ids)
            if end not in reached and stretch[position:end] == ids:
                reached[end] = [*reached[position], ids]
                frontier.append(end)
    return None


# --- the env -----------------------------------------------------------------------------

@dataclass
class AtroposEnv:
    """An atroposlib ``BaseEnv`` subclass run by rollq workers (module docstring)."""

    env_class: type
    config: Any
    """The env's config (its ``env_config_cls``), options applied."""
    name: str
    items: int = DEFAULT_ITEMS
    _env: Any = field(default=None, init=False, repr=False)
    _lock: asyncio.Lock | None = field(default=None, init=False, repr=False)
    _backlog: list[Any] = field(default_factory=list, init=False, repr=False)
    _upstreams: UpstreamCache = field(default_factory=UpstreamCache, init=False, repr=False)

    def __len__(self) -> int:
        return self.items

    def item(self, index: int) -> Item:
        return Item(index=index, fields={})  # the runner replaces it with the drawn item

    async def instance(self) -> Any:
        """The env, built and set up once."""
        if self._env is not None:
            return self._env
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._env is None:
                from atroposlib.envs.server_handling.server_baseline import APIServerConfig

                wrapped = type(self.env_class.__name__, (self.env_class,),
                               {"server_cls": server_class()})
                server = APIServerConfig(model_name="rollq", base_url=None,
                                         tokenizer_name=self.config.tokenizer_name,
                                         health_check=False, server_type="vllm",
                                         num_max_requests_at_once=10**6,
                                         num_requests_for_eval=10**6)
                env = wrapped(self.config, [server], slurm=False, testing=False)
                await env.setup()
                self._env = env
        return self._env

    async def draw(self) -> dict[str, Any]:
        env = await self.instance()
        value = self._backlog.pop(0) if self._backlog else await env.get_next_item()
        return {"item": encode_tagged(value, what="an Atropos item")}

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        env = await self.instance()
        upstream = self._upstreams(pool)
        for server in env.server.servers:
            server.upstream = upstream
        env.config.group_size = group_size
        value = decode_tagged(item.fields["item"])
        job = JobCalls(policy_version=policy_version, defaults=sampling.body())
        token = _JOB.set(job)
        try:
            scored, backlog = await env.collect_trajectories(value)
            if scored is not None and (not isinstance(scored, list) or any(scored)):
                scored = await env.postprocess_histories(scored)
        except Exception as exc:
            if job.unavailable is not None:
                raise InferenceUnavailable(f"a model call failed: {job.unavailable}") from exc
            raise _unwrapped(exc) from exc
        finally:
            _JOB.reset(token)
        if job.unavailable is not None:  # the env caught it: the group is incomplete
            raise InferenceUnavailable(f"a model call failed: {job.unavailable}")
        self._backlog.extend(backlog or ())
        group = _one_group(scored)
        version = min(job.versions) if job.versions else await policy_version()
        outputs = job.outputs
        sequences = atropos_sequences(
            group, policy_version=version,
            fallback=lambda i, tokens, trainable: served_logprobs(tokens, trainable, outputs),
            info=lambda i: {"token_exact": served_logprobs(
                np.asarray(group["tokens"][i], np.int64),
                np.asarray(group["masks"][i], np.int64) != -100, outputs) is not None})
        messages = group.get("messages")
        return Rollout(
            prompt_ids=sequences.prompt_ids.tolist(), completions=list(sequences.completions),
            prompt_messages=_prompt_messages(messages[0]) if messages else None,
            metadata={"atropos": sequences.atropos, "item": item.fields["item"],
                      "model_calls": len(job.versions)})


def _prompt_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages before the first assistant message (the shared prompt, for humans)."""
    head = []
    for message in conversation:
        if message.get("role") == "assistant":
            break
        head.append(dict(message))
    return head or None


def _one_group(scored: Any) -> dict[str, Any]:
    groups = scored if isinstance(scored, list) else [scored]
    groups = [g for g in groups if g is not None]
    if not groups:
        raise EnvSkipped("collect_trajectories returned no group for the item")
    if len(groups) > 1:
        raise ContractError(f"collect_trajectories returned {len(groups)} groups: a rollq job "
                            "is one group (run such an env in serve mode against "
                            "rollq atropos-api)")
    group = groups[0]
    if not isinstance(group, Mapping) or "tokens" not in group or "masks" not in group:
        raise ContractError(f"collect_trajectories returned a {type(group).__name__}, not a "
                            "ScoredDataGroup")
    return dict(group)


def _unwrapped(exc: BaseException) -> BaseException:
    """atroposlib wraps its server calls in tenacity retries: the error inside."""
    attempt = getattr(exc, "last_attempt", None)
    inner = attempt.exception() if attempt is not None else None
    return inner if isinstance(inner, BaseException) else exc


def atropos_env(spec: str, *, env_name: str | None = None, items: int = DEFAULT_ITEMS,
                **options: Any) -> AtroposEnv:
    """The env of ``spec`` (``package.module:EnvClass``) with its config fields in
    ``options`` (module docstring). Raises ``ConfigError`` when atroposlib is missing, the
    class cannot be loaded, or an option is not a field of its config."""
    try:
        from atroposlib.envs.base import BaseEnv  # type: ignore[import-untyped]  # no py.typed
    except ImportError as exc:
        raise ConfigError("atropos envs need atroposlib: pip install 'rollq[atropos]'") from exc
    module_name, _, attribute = spec.partition(":")
    try:
        env_class: Any = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot load Atropos env {spec!r}: {exc}") from exc
    if not (isinstance(env_class, type) and issubclass(env_class, BaseEnv)):
        raise ConfigError(f"{spec!r} is not a BaseEnv subclass")
    loaded: Any = env_class
    config, _servers = loaded.config_init()
    unknown = sorted(set(options) - set(type(config).model_fields))
    if unknown:
        raise ConfigError(f"{spec!r}: {unknown} are not fields of {type(config).__name__} "
                          f"(nor the adapter's options env_name, items)")
    try:
        config = type(config).model_validate({**config.model_dump(), **options,
                                              "use_wandb": False})
    except ValueError as exc:
        raise ConfigError(f"bad options for Atropos env {spec!r}: {exc}") from exc
    return AtroposEnv(env_class=env_class, config=config,
                      name=env_name or loaded.name or env_class.__name__, items=items)
