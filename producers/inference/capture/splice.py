"""Where a chat continuation's new messages start, when the template renders the earlier
reply by its place.

A continuation is spliced onto the earlier call's exact tokens, then the template's turn
end, then the template's tokens for the new messages (``capture.session``). Usually those
are what follows the rendering of the conversation up to the reply. Some templates render an
assistant turn differently once it is no longer the last (Qwen3 writes the ``<think>`` block
of the last turn only; its thinking-off generation prompt's empty block is dropped from
earlier turns), so that rendering is no prefix of the whole. ``tail_after`` then renders the
whole conversation twice with the reply replaced by two different one-token stand-ins: what
follows the stand-in (the renders' common suffix) is the turn end, then the new messages.
"""

from __future__ import annotations

from typing import Any

from rollq.producers.inference.capture.upstream import Upstream
from rollq.producers.inference.errors import InferenceRequestError

STAND_INS = ("0", "1")
"""Two contents that are one token each and differ: the renders part right after them."""


async def tail_after(upstream: Upstream, messages: list[dict[str, Any]], reply_at: int,
                     rendered: list[int], turn_end: list[int], *, tools: Any,
                     options: dict[str, Any]) -> list[int] | None:
    """The template's tokens for ``messages[reply_at + 1:]`` (with the generation prompt)
    after the turn end of the reply at ``reply_at`` (module docstring); ``rendered`` is the
    whole conversation's rendering. None when the renders do not part that way (a template
    that renders the new messages by the reply's content, or refuses a stand-in)."""
    renders = []
    for stand_in in STAND_INS:
        changed = [*messages[:reply_at], {"role": "assistant", "content": stand_in},
                   *messages[reply_at + 1:]]
        try:
            renders.append(await upstream.render(changed, tools=tools, template_options=options))
        except InferenceRequestError:
            return None
    first, second = renders
    common = 0
    while (common < min(len(first), len(second))
           and first[len(first) - 1 - common] == second[len(second) - 1 - common]):
        common += 1
    suffix = first[len(first) - common:]
    if (not turn_end or suffix[:len(turn_end)] != turn_end
            or rendered[len(rendered) - common:] != suffix):
        return None
    return suffix[len(turn_end):]
