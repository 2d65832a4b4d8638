"""``EpisodeCapture``: one episode's calls, sent so that the stored tokens are the server's.

Both surfaces of the capture layer (the in-process ``EpisodeClient`` and the HTTP gateway)
hand an OpenAI request body to ``chat`` or ``complete`` and get an OpenAI reply body back.
On the way:

- the served model's name replaces the agent's, the worker's sampling settings fill the
  fields the agent left out (an agent's ``max_completion_tokens`` or ``max_tokens`` stands
  for both: the worker's ``max_tokens`` is not added beside it), ``n`` must be 1 (a group's
  samples are separate episodes; ``n=2`` is refused with a 400 naming ``n``);
- token ids and logprobs are forced on (``return_token_ids``, ``logprobs``) and stripped
  from the reply again unless the agent asked for them;
- **chat continuation**: when the messages are an earlier call's messages, its reply, then
  more (tool results, a user turn), the prompt the text path would produce is checked.
  ``continuation_check="before"`` (the default): it is rendered (``Upstream.render``:
  ``/tokenize`` of the messages, with ``tools``, or the same ids from a ``LocalTemplate``
  in this process, ``capture.render``) and compared with the *spliced* prompt:
  the earlier call's exact prompt and completion ids, the template's turn end the model did
  not emit, then the rendering of the new messages (``rendered[len(through reply):]``; when
  the template renders the reply by its place, as Qwen3 drops an earlier turn's ``<think>``,
  the common suffix of two renders with the reply replaced by stand-ins, ``capture.splice``;
  a token-in reply splits reasoning as vLLM does, ``capture.reasoning``). If
  they differ (the template re-renders the earlier reply: BPE re-tokenisation, stripped
  reasoning, reformatted tool-call JSON), the call is sent **token-in**: the spliced ids to
  ``/v1/completions``, its reply turned into a chat message (tool calls parsed, Hermes
  format, ``capture.toolcalls``). Otherwise the chat request goes as sent (the server's own
  tool and reasoning parsers apply). **Request fidelity**: a token-in call carries every
  field that shapes the generation (``TOKEN_IN_FIELDS``: sampling, ``stop``, ``seed``,
  ``logit_bias``, ``response_format`` and ``structured_outputs``…; the chat's
  ``max_completion_tokens`` as ``max_tokens``, vLLM's precedence). A request that holds a
  field ``/v1/completions`` cannot honour (``chat_only_field``: ``tool_choice`` ``required``
  or a named function, which vLLM implements by guided decoding of the tool's JSON; ``echo``,
  ``continue_final_message``…; any field this module does not know) is never cut down to
  fit: it goes as chat, as sent, and its tokens are the server's. When they do not extend
  the earlier call's (the template re-rendered it), the call starts a new sequence of the
  episode (``capture.record``) instead of merging; ``CaptureStats.chat_fallback`` counts
  these calls (a chat template that reads ``tool_choice`` or ``response_format``, which vLLM
  hands to templates and ``/tokenize`` does not take, is outside this check: the renders
  omit them). ``continuation_check="after"`` sends the chat request
  first and checks the prompt ids the server reports: when they extend the earlier call's
  prompt and completion the reply is kept (no extra request at all, what the gateway does
  by default); otherwise that generation is discarded (``CaptureStats.resent``) and the call
  is made token-in as above, and the episode's later continuations check before (a template
  that drifts once usually drifts again). Both count in ``CaptureStats``; every drift is
  logged (``capture_text_drifted``, with the position of the first differing token);
- **text continuation** (``/v1/completions``): a prompt that is an earlier call's prompt
  text plus its completion text plus more is always sent as ids (earlier ids + the new
  text's ids); the drift count says how often the text would have tokenised differently.

Failures reach the agent as they would from vLLM (the in-process client raises rollq's
errors, the gateway answers with the status); an ``InferenceUnavailable`` is also kept, so
the episode is retried (never scored) even when the agent caught the error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import structlog

from rollq.producers.inference.capture.reasoning import assistant_message, thinking_on
from rollq.producers.inference.capture.record import (
    CapturedCall,
    CapturedEpisode,
    CaptureStats,
    assemble_sequences,
)
from rollq.producers.inference.capture.splice import tail_after
from rollq.producers.inference.capture.upstream import Upstream
from rollq.producers.inference.errors import InferenceRequestError
from rollq.producers.inference.parse import parse_chat, parse_completions
from rollq.producers.inference.turns import close_turn
from rollq.schemas import ContractError, InferenceUnavailable

log = structlog.get_logger("rollq.capture")

PolicyVersionReader = Callable[[], Awaitable[int]]

TOKEN_IN_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "stop_token_ids", "bad_words", "allowed_token_ids", "logit_bias", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens",
    "response_format", "structured_outputs", "user", "priority", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "truncate_prompt_tokens",
    "truncation_side", "use_beam_search", "watermarking", "session_id", "kv_transfer_params",
)
"""Chat request fields a token-in call carries over to ``/v1/completions`` as they are
(vLLM 0.32's completions request takes each with the chat's meaning)."""
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")
"""The generation budget: an agent that sets either gets no default for the other."""
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs")
"""Request fields that change how the chat template renders (sent to ``/tokenize`` too)."""
TOKEN_IN_HANDLED = (
    "messages", "model", "tools", "tool_choice", "max_completion_tokens", "logprobs",
    "top_logprobs", "return_token_ids", "parallel_tool_calls", "stream", "stream_options",
    "n", "request_id", "metadata", "store", "service_tier", "cache_salt", "add_special_tokens",
    *TEMPLATE_FIELDS,
)
"""Chat request fields a token-in call honours otherwise: in the spliced prompt (messages,
tools, the template's), by mapping (``max_completion_tokens``), in the reply it builds
(``tool_choice`` ``auto``/``none``, ``logprobs``), or that do not touch the generation."""


ContinuationCheck = Literal["before", "after"]
"""When a chat continuation is checked for drift (module docstring)."""


class EpisodeClosed(ContractError):
    """A call reached an episode that was already closed (or never opened)."""


class EpisodeCapture:
    """Captures the model calls of one episode (module docstring).

    - ``upstream``: the servers (shared by every episode).
    - ``defaults``: request fields used where the agent sent none (the worker's sampling:
      ``SamplingParams.body()``).
    - ``policy_version``: read before every call; None stamps 0.
    - ``tool_parser``: how token-in chat replies find tool calls: ``"hermes"`` or None.
    - ``continuation_check``: ``before`` (render first) or ``after`` (send, then check the
      server's prompt ids; resend token-in on drift).
    """

    def __init__(self, upstream: Upstream, *, episode_id: str = "",
                 defaults: Mapping[str, Any] | None = None,
                 policy_version: PolicyVersionReader | None = None,
                 tool_parser: str | None = "hermes",
                 continuation_check: ContinuationCheck = "before") -> None:
        self.upstream = upstream
        self.continuation_check = continuation_check
        self.episode_id = episode_id
        self.defaults = dict(defaults or {})
        self.policy_version = policy_version
        self.tool_parser = tool_parser
        self.calls: list[CapturedCall] = []
        self.closed = False
        self.last_used = time.monotonic()
        self._counter = itertools.count()
        self._token_in = self._drift = self._rejected = self._unavailable = self._resent = 0
        self._fallback = 0
        self._check_first = continuation_check == "before"
        self._unavailable_error: str | None = None
        self._rejected_error: str | None = None

    # --- the two routes ------------------------------------------------------------------

    async def chat(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """An OpenAI ``/v1/chat/completions`` request body in, its reply body out."""
        return await self._counted(self._chat(request))

    async def _chat(self, request: Mapping[str, Any]) -> dict[str, Any]:
        body = await self._prepared(request)
        body["messages"] = [plain(message) for message in body.get("messages") or []]
        index, version = next(self._counter), await self._version()
        spliced: list[int] | None = None
        parent = self._chat_parent(body)
        blocker = chat_only_field(body) if parent is not None else None
        if parent is not None and (blocker is not None or not self._check_first):
            reply = await self._send(self._post_chat(body))
            served = parse_chat(reply)[0].prompt_ids
            if served[:len(parent.prompt_ids) + len(parent.completion_ids)] == [
                    *parent.prompt_ids, *parent.completion_ids]:
                return self._record_chat(index, version, body, request, reply, token_in=False)
            if blocker is not None:  # kept as the server made it: a sequence of its own
                self._note_fallback(index, blocker)
                return self._record_chat(index, version, body, request, reply,
                                         token_in=False, text_drift=True)
            self._check_first = True  # the text path re-tokenised: go token-in from now
            spliced, rendered = await self._splice_chat(parent, body, served=served)
            if spliced is None:  # no splice possible: the reply in hand is as good as any
                return self._record_chat(index, version, body, request, reply, token_in=False)
            self._resent += 1  # discarded; the call is made again, token-in
            self._note_drift(index, spliced, rendered)
        elif parent is not None:
            spliced, rendered = await self._splice_chat(parent, body)
            if spliced is not None and spliced == rendered:
                spliced = None  # the text path gives the same ids: let the server parse
            elif spliced is not None:
                self._note_drift(index, spliced, rendered)
        reply = await self._send(self._chat_token_in(body, spliced) if spliced is not None
                                 else self._post_chat(body))
        return self._record_chat(index, version, body, request, reply,
                                 token_in=spliced is not None)

    def _post_chat(self, body: dict[str, Any]) -> Awaitable[dict[str, Any]]:
        return self.upstream.post("/v1/chat/completions", {
            **body, "logprobs": True, "return_token_ids": True})

    def _record_chat(self, index: int, version: int, body: dict[str, Any],
                     request: Mapping[str, Any], reply: dict[str, Any], *,
                     token_in: bool, text_drift: bool | None = None) -> dict[str, Any]:
        [sample] = parse_chat(reply)
        message = dict(reply["choices"][0].get("message") or {})
        self._record(CapturedCall(
            index=index, route="chat", request=body, prompt_ids=sample.prompt_ids,
            completion_ids=sample.completion_ids, logprobs=sample.logprobs,
            finish_reason=sample.finish_reason, text=sample.text, message=message,
            policy_version=version, token_in=token_in,
            text_drift=token_in if text_drift is None else text_drift))
        return public_reply(reply, request, route="chat")

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """An OpenAI ``/v1/completions`` request body in, its reply body out."""
        return await self._counted(self._complete(request))

    async def _complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        body = await self._prepared(request)
        prompt = body.get("prompt")
        index, version = next(self._counter), await self._version()
        drift = False
        if isinstance(prompt, str):
            parent, head = self._text_parent(prompt)
            if parent is not None:
                rest = prompt[len(head):]
                spliced, rendered = await asyncio.gather(
                    self._ids_after(parent, rest), self.upstream.tokenize(prompt, special=True))
                drift = spliced != rendered
                if drift:
                    self._note_drift(index, spliced, rendered)
                body["prompt"] = spliced
        elif not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            raise InferenceRequestError("prompt must be one string or one list of token ids",
                                        status=400, param="prompt")
        asked = request.get("logprobs")
        reply = await self._send(self.upstream.post("/v1/completions", {
            **body, "logprobs": asked if type(asked) is int else 0, "return_token_ids": True}))
        [sample] = parse_completions(reply)
        self._record(CapturedCall(
            index=index, route="completions", request=dict(request), prompt_ids=sample.prompt_ids,
            completion_ids=sample.completion_ids, logprobs=sample.logprobs,
            finish_reason=sample.finish_reason, text=sample.text, message=None,
            policy_version=version, token_in=drift, text_drift=drift))
        return public_reply(reply, request, route="completions")

    def resume(self, calls: list[CapturedCall]) -> None:
        """Continue after ``calls`` made earlier (kept elsewhere: a session in Redis that
        another gateway process served): continuations splice onto them."""
        self.calls = list(calls)
        self._counter = itertools.count(len(self.calls))

    def close(self) -> CapturedEpisode:
        """End the episode: no call is accepted afterwards; its sequences and counters."""
        self.closed = True
        return CapturedEpisode(
            episode_id=self.episode_id, sequences=assemble_sequences(self.calls),
            stats=self.stats(), unavailable_error=self._unavailable_error,
            rejected_error=self._rejected_error)

    def stats(self) -> CaptureStats:
        return CaptureStats(calls=len(self.calls), token_in=self._token_in,
                            text_drift=self._drift, rejected=self._rejected,
                            unavailable=self._unavailable, resent=self._resent,
                            chat_fallback=self._fallback)

    # --- internals -----------------------------------------------------------------------

    async def _prepared(self, request: Mapping[str, Any]) -> dict[str, Any]:
        if self.closed:
            raise EpisodeClosed(f"episode {self.episode_id!r} is closed")
        self.last_used = time.monotonic()
        body = {key: value for key, value in request.items()
                if key not in ("stream", "stream_options")}
        budgeted = any(body.get(key) is not None for key in BUDGET_FIELDS)
        for key, value in self.defaults.items():
            if not (budgeted and key in BUDGET_FIELDS):  # the agent's budget wins
                body.setdefault(key, value)
        if body.get("n", 1) != 1:
            raise InferenceRequestError("an episode's calls take n=1 (a group's samples are "
                                        "separate episodes)", status=400, param="n")
        body.pop("n", None)
        body["model"] = await self.upstream.model()
        return body

    async def _version(self) -> int:
        return await self.policy_version() if self.policy_version is not None else 0

    async def _counted(self, call: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """A call's outcome, a refusal (ours, ``n=2``, or the server's 4xx) counted and kept:
        an agent that lets it through fails its episode as a contract error."""
        try:
            return await call
        except InferenceRequestError as exc:
            self._rejected += 1
            self._rejected_error = self._rejected_error or str(exc)
            raise

    async def _send(self, call: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        try:
            return await call
        except InferenceUnavailable as exc:
            self._unavailable += 1
            self._unavailable_error = self._unavailable_error or str(exc)
            raise

    def _record(self, call: CapturedCall) -> None:
        if self.closed:  # the episode was closed while this call was in flight
            raise EpisodeClosed(f"episode {self.episode_id!r} closed during a call")
        self.calls.append(call)
        self.last_used = time.monotonic()

    def _note_fallback(self, index: int, field: str) -> None:
        self._drift += 1
        self._fallback += 1
        log.info("capture_chat_fallback", episode=self.episode_id, call=index, field=field,
                 reason="the request holds a field /v1/completions cannot honour: sent as "
                 "chat; its prompt re-renders the earlier reply, so it starts a new sequence")

    def _note_drift(self, index: int, spliced: list[int], rendered: list[int]) -> None:
        self._drift += 1
        self._token_in += 1
        at = next((i for i, (a, b) in enumerate(zip(spliced, rendered, strict=False)) if a != b),
                  min(len(spliced), len(rendered)))
        log.info("capture_text_drifted", episode=self.episode_id, call=index, at_token=at,
                 text_drift=self._drift)

    def _chat_parent(self, body: dict[str, Any]) -> CapturedCall | None:
        """The latest, longest earlier chat call whose messages and reply begin these."""
        messages = body["messages"]
        tools = canonical(body.get("tools"))
        best: CapturedCall | None = None
        for call in self.calls:
            count = len(call.messages)
            if (call.route != "chat" or call.message is None or len(messages) <= count
                    or canonical(call.request.get("tools")) != tools):
                continue
            if ([canonical(m) for m in messages[:count]] == [canonical(m) for m in call.messages]
                    and same_reply(messages[count], call.message)
                    and (best is None or count >= len(best.messages))):
                best = call
        return best

    async def _splice_chat(self, parent: CapturedCall, body: dict[str, Any], *,
                           served: list[int] | None = None
                           ) -> tuple[list[int] | None, list[int]]:
        """The spliced token-in prompt (None when the template's prefix differs) and the
        text path's prompt (``served``: as the server already reported it, if given)."""
        messages = body["messages"]
        options = {key: body[key] for key in TEMPLATE_FIELDS if key in body}
        tools = body.get("tools")

        async def text_path() -> list[int]:
            if served is not None:
                return served
            return await self.upstream.render(messages, tools=tools, template_options=options)

        reply_at = len(parent.messages)
        rendered, through, turn_end = await asyncio.gather(
            text_path(),
            self.upstream.render(messages[:reply_at + 1], tools=tools,
                                 add_generation_prompt=False, template_options=options),
            self.upstream.turn_end())
        if rendered[:len(through)] == through:
            tail: list[int] | None = rendered[len(through):]
        else:  # the template renders the reply by its place (Qwen3: <think> kept when last)
            tail = await tail_after(self.upstream, messages, reply_at, rendered, turn_end,
                                    tools=tools, options=options)
        if tail is None:
            log.info("capture_splice_skipped", episode=self.episode_id,
                     reason="the template renders the conversation's prefix differently")
            return None, rendered
        spliced = [*parent.prompt_ids, *parent.completion_ids,
                   *close_turn(parent.completion_ids, turn_end), *tail]
        return spliced, rendered

    async def _chat_token_in(self, body: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
        request = {key: body[key] for key in TOKEN_IN_FIELDS if key in body}
        if body.get("max_completion_tokens") is not None:  # vLLM's chat takes it first
            request["max_tokens"] = body["max_completion_tokens"]
        tools_on = bool(body.get("tools")) and body.get("tool_choice") != "none"
        if tools_on:
            request.setdefault("skip_special_tokens", False)  # as vLLM's hermes parser does
        top = int(body.get("top_logprobs") or 0)
        reply = await self.upstream.post("/v1/completions", {
            **request, "model": body["model"], "prompt": prompt_ids, "logprobs": top,
            "return_token_ids": True})
        [sample] = parse_completions(reply)
        server_reasons = any(call.message is not None and not call.token_in  # its parser
                             and call.message.get("reasoning") is not None for call in self.calls)
        message = assistant_message(
            sample.text, reasoning=server_reasons and thinking_on(body),
            tools=tools_on, tool_parser=self.tool_parser)
        tops = (reply["choices"][0].get("logprobs") or {}).get("top_logprobs") or []
        entries = [{"token": f"token_id:{token}", "logprob": logprob, "bytes": None,
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": None}
                                     for t, lp in (tops[i] or {}).items()][:top]
                    if top and i < len(tops) else []}
                   for i, (token, logprob) in enumerate(zip(sample.completion_ids,
                                                            sample.logprobs, strict=True))]
        return {
            "id": f"chatcmpl-{reply.get('id', '')}", "object": "chat.completion",
            "created": reply.get("created") or int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": {"content": entries},
                         "finish_reason": "tool_calls" if message.get("tool_calls")
                         else sample.finish_reason,
                         "stop_reason": sample.stop_reason,
                         "token_ids": sample.completion_ids}],
            "usage": reply.get("usage"), "prompt_token_ids": prompt_ids,
        }

    def _text_parent(self, prompt: str) -> tuple[CapturedCall | None, str]:
        best: CapturedCall | None = None
        head = ""
        for call in self.calls:
            earlier = call.request.get("prompt")
            if call.route == "completions" and isinstance(earlier, str):
                text = earlier + call.text
                if prompt.startswith(text) and len(text) >= len(head):
                    best, head = call, text
        return best, head

    async def _ids_after(self, parent: CapturedCall, rest: str) -> list[int]:
        tail = await self.upstream.tokenize(rest) if rest else []
        return [*parent.prompt_ids, *parent.completion_ids, *tail]


def chat_only_field(body: Mapping[str, Any]) -> str | None:
    """The first field of a chat request that a token-in call cannot honour; None when
    ``/v1/completions`` can carry them all (module docstring)."""
    if body.get("tool_choice") not in (None, "auto", "none"):
        return "tool_choice"  # required / named: guided decoding of the tool call's JSON
    if body.get("parallel_tool_calls") is False:
        return "parallel_tool_calls"
    for key, value in body.items():
        if value is not None and key not in TOKEN_IN_FIELDS and key not in TOKEN_IN_HANDLED:
            return key
    return None


def plain(message: Any) -> dict[str, Any]:
    """A chat message as a plain dict (agents append reply objects as they are)."""
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return {key: value for key, value in dump(exclude_none=True).items()
                if key in ("role", "content", "name", "tool_calls", "tool_call_id",
                           "reasoning", "reasoning_content")}
    raise InferenceRequestError(f"a message is a {type(message).__name__}, not an object",
                                status=400, param="messages")


def canonical(value: Any) -> str:
    """A comparable form of a message or a tools list: empty fields dropped, keys sorted."""
    if isinstance(value, Mapping):
        value = {key: item for key, item in value.items() if item not in (None, [], "")}
    return json.dumps(value, sort_keys=True, default=str)


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    found = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {} if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        found.append((str(function.get("name")), arguments))
    return found


def same_reply(sent: Mapping[str, Any], reply: Mapping[str, Any]) -> bool:
    """Whether the agent sent back the assistant message the model produced."""
    return (sent.get("role") == "assistant"
            and (sent.get("content") or "") == (reply.get("content") or "")
            and _calls_of(sent) == _calls_of(reply))


def public_reply(reply: dict[str, Any], request: Mapping[str, Any], *,
                 route: str) -> dict[str, Any]:
    """The reply without the token ids and logprobs rollq forced, unless the agent asked."""
    wants_ids = bool(request.get("return_token_ids"))
    wants_logprobs = (bool(request.get("logprobs")) if route == "chat"
                      else request.get("logprobs") is not None)
    if wants_ids and wants_logprobs:
        return reply
    reply = dict(reply)
    choices = []
    for choice in reply.get("choices") or []:
        choice = dict(choice)
        if not wants_logprobs:
            choice["logprobs"] = None
        if not wants_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        choices.append(choice)
    reply["choices"] = choices
    if not wants_ids:
        reply.pop("prompt_token_ids", None)
    return reply
