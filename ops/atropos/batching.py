"""atroposlib 0.4.0's batch rules as pure functions over queued groups' sizes and envs.

Ported from ``atroposlib/api/utils.py`` and ``server.py`` (a test runs both on random
queues and compares): a batch is exactly ``batch_size`` sequences of whole groups, taken
in queue order from complete *packs* (groups of one size whose count times that size is
the largest group size in the queue); with per-env minimum allocations each such env's
minimum is filled first. Groups whose size differs from their env's registered size are
buffered per env until some of them sum to it (``groups_summing_to``). The functions
return queue indices, never the groups, so the groups themselves can stay in Redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_ENV_WEIGHT = 0.01
"""An env's weight in ``/status-env`` never drops below this (no starvation)."""


@dataclass(frozen=True)
class Queued:
    """A group waiting for a batch: its sequence count and the env that posted it."""

    size: int
    env_id: int | None


def groups_summing_to(sizes: Sequence[int], target: int) -> list[int]:
    """Indices (ascending) of buffered groups whose sizes sum to ``target``: FIFO first,
    else any subset (dynamic programming, preferring earlier groups); [] when none."""
    if not sizes:
        return []
    total = 0
    chosen: list[int] = []
    for i, size in enumerate(sizes):
        if total + size <= target:
            chosen.append(i)
            total += size
            if total == target:
                return chosen
    n = len(sizes)
    reachable = [[False] * (target + 1) for _ in range(n + 1)]
    reachable[0][0] = True
    for i in range(1, n + 1):
        for j in range(target + 1):
            reachable[i][j] = reachable[i - 1][j] or (
                j >= sizes[i - 1] and reachable[i - 1][j - sizes[i - 1]])
    if not reachable[n][target]:
        return []
    chosen = []
    j = target
    for i in range(n, 0, -1):
        if j >= sizes[i - 1] and reachable[i - 1][j - sizes[i - 1]]:
            chosen.append(i - 1)
            j -= sizes[i - 1]
    return sorted(chosen)


def _exact(queue: Sequence[Queued], batch_size: int) -> list[int] | None:
    if not queue or sum(q.size for q in queue) < batch_size:
        return None
    largest = max(q.size for q in queue)
    waiting: dict[int, list[int]] = {}
    packed: list[int] = []
    for i, item in enumerate(queue):
        bucket = waiting.setdefault(item.size, [])
        bucket.append(i)
        if len(bucket) * item.size == largest:
            packed.extend(bucket)
            bucket.clear()
    if sum(queue[i].size for i in packed) < batch_size:
        return None
    chosen: list[int] = []
    running = 0
    for i in packed:
        chosen.append(i)
        running += queue[i].size
        if running == batch_size:
            return chosen
        if running > batch_size:
            return None
    return None


def select_batch(queue: Sequence[Queued], batch_size: int,
                 envs: Sequence[dict[str, Any]]) -> list[int] | None:
    """Queue indices of the next batch, in batch order, or None when none can be formed.

    ``envs`` are the registered envs (``connected``, ``min_batch_allocation``,
    ``registered_id``); with no minimum allocation this is atroposlib's
    ``grab_exact_from_heterogeneous_queue``, else ``grab_batch_with_minimum_allocations``.
    """
    minimums = {e["registered_id"]: e["min_batch_allocation"] for e in envs
                if e.get("connected", False) and e.get("min_batch_allocation") is not None}
    if not any(e.get("min_batch_allocation") is not None for e in envs) or not minimums:
        return _exact(queue, batch_size)
    if not queue:
        return None
    largest = max(q.size for q in queue)
    by_env: dict[int, dict[int, list[int]]] = {}
    packable: dict[int, list[int]] = {}
    for i, item in enumerate(queue):
        if item.env_id is None:
            continue
        sizes = by_env.setdefault(item.env_id, {})
        packable.setdefault(item.env_id, [])
        bucket = sizes.setdefault(item.size, [])
        bucket.append(i)
        if len(bucket) * item.size == largest:
            packable[item.env_id].extend(bucket)
            sizes[item.size] = []
    needed: dict[int, int] = {}
    for env_id, fraction in minimums.items():
        sequences = int(batch_size * fraction)
        if sequences > 0:
            if env_id not in by_env or not packable.get(env_id):
                return None
            needed[env_id] = sequences
    total_needed = sum(needed.values())
    if total_needed > batch_size:
        scale = batch_size / total_needed
        for env_id in needed:
            smallest = min(queue[i].size for i in packable[env_id])
            needed[env_id] = max(smallest, int(needed[env_id] * scale))
    chosen: list[int] = []
    taken = dict.fromkeys(packable, 0)
    total = 0
    for env_id, sequences in needed.items():
        for i in packable.get(env_id, ()):
            if taken[env_id] >= sequences:
                break
            if total + queue[i].size <= batch_size:
                chosen.append(i)
                taken[env_id] += queue[i].size
                total += queue[i].size
    if total < batch_size:
        in_packs = {i for indices in packable.values() for i in indices}
        for i in range(len(queue)):
            if i in chosen or i not in in_packs:
                continue
            if total + queue[i].size <= batch_size:
                chosen.append(i)
                total += queue[i].size
            if total == batch_size:
                break
    return chosen if total == batch_size else None


def env_status(queue: Sequence[Queued], env_id: int, envs: list[dict[str, Any]],
               batch_size: int, step: int) -> tuple[dict[str, Any], int]:
    """atroposlib's ``/status-env`` answer for ``env_id``, and the env's group size as
    that call updates it (the largest of its registered size and its queued groups')."""
    env = envs[env_id]
    total = sum(e["max_context_len"] * max(0.0, e["weight"]) for e in envs if e["connected"])
    weight = max(MIN_ENV_WEIGHT, env["max_context_len"] * env["weight"] / total) if total \
        else MIN_ENV_WEIGHT
    min_total = sum(e["min_batch_allocation"] for e in envs
                    if e.get("connected", False) and e.get("min_batch_allocation") is not None)
    unallocated = 1.0 - min(min_total, 1.0)
    group_size = env["group_size"]
    largest = 1
    own_sequences = 0
    for item in queue:
        largest = max(largest, item.size)
        if item.env_id == env_id:
            group_size = max(group_size, item.size)
            own_sequences += item.size
    minimum_sequences: dict[int | None, int] = {
        e["registered_id"]: int(batch_size * e["min_batch_allocation"]) for e in envs
        if e.get("connected", False) and e.get("min_batch_allocation") is not None}
    others: dict[int | None, int] = {}
    for item in queue:
        if item.env_id != env_id:
            others[item.env_id] = others.get(item.env_id, 0) + item.size
    available = 0
    if largest > 1:
        for other, sequences in others.items():
            packed = math.ceil(sequences / largest) * largest
            available += max(0, packed - minimum_sequences.get(other, 0))
    return {
        "current_step": step,
        "queue_size": (own_sequences + available) // group_size,
        "unallocated_fraction": unallocated,
        "self_queue_size": own_sequences // group_size,
        "max_group_size": largest,
        "env_weight": weight,
    }, group_size
