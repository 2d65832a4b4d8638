"""Turning an env observation into the token ids appended after a model turn.

The bridge never re-tokenises what the model generated: model tokens are kept verbatim and
only the env's observation is tokenised, once, by the server. Two encoders:

``ChatTemplateDelta`` (default) renders the observation through the server's chat template
against a fixed base conversation ``[user ".", assistant "."]``:

    base  = tokenize(base, add_generation_prompt=False)
    full  = tokenize(base + observation messages, add_generation_prompt=True)
    delta = full[len(base):]  # <|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n

A fixed base (rather than the real conversation) makes the delta independent of how the
template would re-render earlier turns, so the prefix really is a prefix and the cost is one
``/tokenize`` per observation. The template's end-of-turn after an assistant message
(``<|im_end|>\\n``) is learned once as ``base`` minus the same conversation rendered with
``continue_final_message``; after each model turn the missing part of it is appended
(nothing if the model emitted it all, ``\\n`` if it stopped at ``<|im_end|>``, everything if
it was cut by ``max_tokens``), so the sequence matches what the template would produce.

Templates that render the last assistant message differently from earlier ones (Qwen3
strips or adds ``<think>`` blocks by position) break the prefix check: that raises
``ConfigError``; use ``TextTemplate`` for those.

``TextTemplate`` formats the observation into literal text (``"<|im_start|>user\\n{observation}
<|im_end|>\\n<|im_start|>assistant\\n"``) and tokenises it with ``add_special_tokens=False``;
``turn_end`` is the text that closes an assistant turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rollq.producers.inference import InferencePool, MessageDict
from rollq.producers.inference.turns import close_turn  # shared with the capture layer
from rollq.schemas import ConfigError

Observation = str | list[MessageDict]
"""An env observation: text (sent as a user message) or chat messages (e.g. a tool turn)."""

BASE_CONVERSATION: list[MessageDict] = [{"role": "user", "content": "."},
                                    {"role": "assistant", "content": "."}]


def as_messages(observation: Observation) -> list[MessageDict]:
    """Chat messages of an observation; text becomes one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return list(observation)


def observation_text(observation: Observation) -> str:
    """Human-readable text of an observation."""
    if isinstance(observation, str):
        return observation
    return "\n".join(str(message.get("content", "")) for message in observation)


class ObservationEncoder(Protocol):
    """Encodes the tokens appended (loss mask 0) after a model turn."""

    async def encode(self, pool: InferencePool, observation: Observation,
                     model_ids: Sequence[int]) -> list[int]:
        """End-of-turn tokens the model did not emit, then the observation's tokens and the
        generation prompt of the next assistant turn."""
        ...


@dataclass
class ChatTemplateDelta:
    """Observation tokens as the chat-template delta against a fixed base (module docs)."""

    base: list[MessageDict] = field(default_factory=lambda: list(BASE_CONVERSATION))
    _probe: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)
    _lock: asyncio.Lock | None = field(default=None, init=False, repr=False)

    async def encode(self, pool: InferencePool, observation: Observation,
                     model_ids: Sequence[int]) -> list[int]:
        base_ids, turn_end = await self._probed(pool)
        full = await pool.tokenize(messages=[*self.base, *as_messages(observation)],
                                   add_generation_prompt=True)
        if full[:len(base_ids)] != base_ids:
            raise ConfigError("the chat template does not render a conversation's prefix the "
                              "same when a turn is added; use TextTemplate observations")
        return close_turn(model_ids, turn_end) + full[len(base_ids):]

    async def _probed(self, pool: InferencePool) -> tuple[list[int], list[int]]:
        if self._probe is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._probe is None:
                    base_ids = await pool.tokenize(messages=self.base,
                                                   add_generation_prompt=False)
                    open_ids = await pool.tokenize(messages=self.base,
                                                   add_generation_prompt=False,
                                                   continue_final_message=True)
                    prefix = base_ids[:len(open_ids)] == open_ids
                    self._probe = (base_ids, base_ids[len(open_ids):] if prefix else [])
        return self._probe


@dataclass
class TextTemplate:
    """Observation tokens from a literal text template (module docs)."""

    template: str
    """Format string with ``{observation}``."""
    turn_end: str = ""
    """Text that closes an assistant turn (e.g. ``"<|im_end|>\\n"``); "" for none."""
    _turn_end_ids: list[int] | None = field(default=None, init=False, repr=False)

    async def encode(self, pool: InferencePool, observation: Observation,
                     model_ids: Sequence[int]) -> list[int]:
        if self._turn_end_ids is None:
            self._turn_end_ids = (await pool.tokenize(prompt=self.turn_end,
                                                      add_special_tokens=False)
                                  if self.turn_end else [])
        text = self.template.format(observation=observation_text(observation))
        ids = await pool.tokenize(prompt=text, add_special_tokens=False)
        return close_turn(model_ids, self._turn_end_ids) + ids

