"""Chat-turn token arithmetic shared by the multi-turn bridge and the capture layer.

Both append tokens after a model turn without re-tokenising it. What the chat template
writes after an assistant message's content (ChatML: ``<|im_end|>\\n``) is learned once,
by rendering a fixed conversation with and without ``continue_final_message``
(``probe_turn_end``); after each model turn only the part of it the model did not emit
itself is added (``close_turn``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

BASE_CONVERSATION: list[dict[str, Any]] = [{"role": "user", "content": "."},
                                           {"role": "assistant", "content": "."}]
"""The fixed conversation the template's turn end is learned on."""

Render = Callable[..., Awaitable[list[int]]]
"""``/tokenize`` of chat messages: ``render(messages, add_generation_prompt=,
continue_final_message=)`` returns the template's token ids."""


def close_turn(model_ids: Sequence[int], turn_end: Sequence[int]) -> list[int]:
    """The end-of-turn tokens still missing after ``model_ids``: the suffix of ``turn_end``
    not already emitted by the model (``turn_end[k:]`` for the longest ``k`` with
    ``model_ids`` ending in ``turn_end[:k]``)."""
    for emitted in range(len(turn_end), 0, -1):
        if list(model_ids[-emitted:]) == list(turn_end[:emitted]):
            return list(turn_end[emitted:])
    return list(turn_end)


async def probe_turn_end(render: Render) -> tuple[list[int], list[int]]:
    """``(base_ids, turn_end)``: the fixed conversation's ids, and the tokens the template
    writes after an assistant message's content ([] when rendering with
    ``continue_final_message`` is not a prefix of the full rendering)."""
    base_ids = await render(BASE_CONVERSATION, add_generation_prompt=False)
    open_ids = await render(BASE_CONVERSATION, add_generation_prompt=False,
                            continue_final_message=True)
    prefix = base_ids[:len(open_ids)] == open_ids
    return base_ids, base_ids[len(open_ids):] if prefix else []
