"""``rollq tail``: follow a stream live without joining any pipeline consumer group."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from rollq.consumers.bus import join_trajectories
from rollq.schemas import ContractError, Fields, ScoredGroup, decode, decode_dead, trajectory_ref


def _snippet(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def format_entry(stream: str, entry_id: str, fields: Fields, width: int = 80) -> str:
    """One entry as a few readable lines (any kind: traj, scored, dead, or undecodable)."""
    kind = fields.get(b"kind", b"?").decode(errors="replace")
    if kind == "dead":
        try:
            letter = decode_dead(fields)
        except ContractError as exc:
            return f"{entry_id} dead (undecodable: {exc})"
        return (f"{entry_id} dead reason={letter.reason} from={letter.source_stream} "
                f"{letter.source_id} deliveries={letter.deliveries}\n"
                f"  {_snippet(letter.detail, width)}")
    try:
        message = decode(fields)
    except ContractError as exc:
        return f"{entry_id} {kind} (undecodable: {exc})"
    group = message.trajectory if isinstance(message, ScoredGroup) else message
    tokens = [len(c.completion_ids) for c in group.completions]
    head = (f"{entry_id} {message.kind} group={group.group_id} env={group.env} "
            f"v={group.policy_version} n={len(tokens)} prompt={len(group.prompt_ids)}tok "
            f"completions={min(tokens)}..{max(tokens)}tok")
    lines = [head, f"  prompt: {_snippet(group.prompt_text, width)}"]
    for i, completion in enumerate(group.completions):
        line = f"  [{i}] {_snippet(completion.text, width)}"
        if isinstance(message, ScoredGroup):
            score = message.scores[i]
            parts = " ".join(f"{k}={v:.2f}" if v is not None else f"{k}=-"
                             for k, v in score.components.items())
            line += f"\n      reward={score.reward:.3f} adv={score.advantage:+.3f} {parts}"
        lines.append(line)
    return "\n".join(lines)


def printer(write: Callable[[str], None], width: int = 80,
            redis: aioredis.Redis | None = None) -> Callable[[str, str, Fields], object]:
    """An entry handler for ``consumers.bus.follow``; with ``redis``, a scored entry is shown
    with the trajectory its traj entry holds (reference form, see ``schemas.codec``)."""
    async def handle(stream: str, entry_id: str, fields: Fields) -> None:
        if redis is not None and trajectory_ref(fields) is not None:
            [joined] = await join_trajectories(redis, [(stream, fields)])
            if isinstance(joined, str):
                write(f"{entry_id} scored group={fields.get(b'group_id', b'?').decode()} "
                      f"(trajectory not shown: {joined})")
                return
            fields = joined
        write(format_entry(stream, entry_id, fields, width))

    return handle
