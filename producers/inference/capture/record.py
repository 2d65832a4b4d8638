"""What capture keeps of an episode: its calls, and the sequences they assemble into.

Assembly (``assemble_sequences``), in call order: a call whose prompt ids start with an
existing sequence's tokens (its first prompt, then every token appended since) extends that
sequence — the tokens in between (tool results, user turns, the template's turn end) are
appended masked with logprob 0, then the call's completion with loss mask 1 and the
server's logprobs. A call that extends no sequence (the agent rewrote or summarised its
context, or a sub-agent started its own conversation) opens a new sequence. Where several
sequences fit, the longest wins. The test is on token ids only, so it holds whichever route
(chat, completions, token-in) produced the calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class CapturedCall:
    """One model call of an episode, with the server's own tokens."""

    index: int
    """Position of the call in the episode (the order the calls were made)."""
    route: Literal["chat", "completions"]
    """The API the agent called (a token-in chat call is still ``chat``)."""
    request: dict[str, Any]
    """The agent's request as received (messages or prompt, tools, sampling fields)."""
    prompt_ids: list[int]
    """The prompt ids the server generated from (the spliced ids on a token-in call)."""
    completion_ids: list[int]
    logprobs: list[float]
    """The sampler's logprob of each completion token, from the server."""
    finish_reason: str
    text: str
    """The completion text (chat: the message content, tool calls excluded)."""
    message: dict[str, Any] | None
    """Chat: the assistant message handed back to the agent."""
    policy_version: int
    """The policy version read just before the call was sent."""
    token_in: bool = False
    """The prompt was sent as token ids because the text path would have re-tokenised
    an earlier completion differently."""
    text_drift: bool = False
    """The text path (the agent's messages or prompt text) would not have reproduced the
    earlier calls' ids exactly."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.request.get("messages") or [])


class CapturedSequence(BaseModel):
    """One token sequence of an episode: a prompt, then model and env tokens in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_ids: list[int]
    """The first call's prompt ids, from the server."""
    completion_ids: list[int]
    """Every token after the prompt: model tokens and, between calls, env tokens."""
    logprobs: list[float]
    """Server logprobs of model tokens; 0.0 for env tokens."""
    loss_mask: list[int]
    """1 for model tokens (trainable), 0 for env tokens."""
    versions: list[int]
    """Per-token policy version (the version read before the call that holds the token)."""
    calls: list[int]
    """Indices of the episode's calls merged into this sequence, in order."""
    finish_reason: str = ""
    """The last call's finish reason."""
    text: str = ""
    """The model's texts, one per call, joined by newlines (for humans)."""
    messages: list[dict[str, Any]] | None = None
    """Chat sequences: the last call's messages plus its reply (for humans)."""


class CaptureStats(BaseModel):
    """Counters of one episode's capture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    calls: int = 0
    """Model calls recorded."""
    token_in: int = 0
    """Calls sent as token ids because the text path would have differed."""
    text_drift: int = 0
    """Calls whose text path (messages or prompt text) would not have reproduced the
    earlier calls' token ids: how often plain text/chat replay would have re-tokenised."""
    rejected: int = 0
    """Calls the server refused with a 4xx (the agent saw the error)."""
    unavailable: int = 0
    """Calls that failed because inference was unavailable (the agent saw the error)."""
    resent: int = 0
    """Generations discarded and resent token-in: with ``continuation_check="after"``, the
    server's prompt for a chat continuation did not extend the earlier call's tokens."""
    chat_fallback: int = 0
    """Chat continuations whose template re-rendered the earlier reply but that could not go
    token-in (a field ``/v1/completions`` cannot honour, e.g. a named ``tool_choice``): sent
    as chat and kept as the server made them, each starting a new sequence."""


class CapturedEpisode(BaseModel):
    """An episode's capture: its sequences and counters (``POST /episodes/<id>/close``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    episode_id: str
    sequences: list[CapturedSequence] = Field(default_factory=list)
    stats: CaptureStats = Field(default_factory=CaptureStats)
    unavailable_error: str | None = None
    """Set when a call failed for want of inference: the episode is incomplete through no
    fault of the agent, so the job must be retried, never scored."""
    rejected_error: str | None = None
    """The first refusal of a call (a 4xx from the server, or the capture's own: ``n`` not
    1): when the agent lets the error end its episode, the job is a contract error (the
    same request would be refused again), not retried."""


@dataclass
class _Builder:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    last: CapturedCall | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def extended_by(self, prompt: list[int]) -> bool:
        n = len(self.prompt_ids)
        return (len(prompt) >= self.length and prompt[:n] == self.prompt_ids
                and prompt[n:self.length] == self.ids)

    def append(self, call: CapturedCall) -> None:
        env = call.prompt_ids[self.length:]
        self.ids += env + call.completion_ids
        self.logprobs += [0.0] * len(env) + call.logprobs
        self.mask += [0] * len(env) + [1] * len(call.completion_ids)
        self.versions += [call.policy_version] * (len(env) + len(call.completion_ids))
        self.calls.append(call.index)
        self.texts.append(call.text)
        self.last = call

    def build(self) -> CapturedSequence:
        last = self.last
        messages = None
        if last is not None and last.route == "chat":
            messages = [*last.messages, *([last.message] if last.message else [])]
        return CapturedSequence(
            prompt_ids=self.prompt_ids, completion_ids=self.ids, logprobs=self.logprobs,
            loss_mask=self.mask, versions=self.versions, calls=self.calls,
            finish_reason=last.finish_reason if last else "", text="\n".join(self.texts),
            messages=messages)


def assemble_sequences(calls: list[CapturedCall]) -> list[CapturedSequence]:
    """The sequences of an episode's calls (module docstring); calls with no completion
    token add nothing."""
    builders: list[_Builder] = []
    for call in sorted(calls, key=lambda c: c.index):
        if not call.completion_ids:
            continue
        fits = [b for b in builders if b.extended_by(call.prompt_ids)]
        if fits:
            target = max(fits, key=lambda b: b.length)
        else:
            target = _Builder(prompt_ids=list(call.prompt_ids))
            builders.append(target)
        target.append(call)
    return [builder.build() for builder in builders]
