"""Where a group's ``/batch`` piece is kept, and how one is made.

A piece (``ops.atropos.pieces``: the group's Atropos JSON, deflated once) lives in Redis,
in one hash a partition (``piece_key``: entry id -> piece) that every API process reads,
and in this process's ``PieceCache``, so a batch of groups posted here is joined without
reading them back. ``build_piece`` makes one from a rollq group. Both the posting side
(``ops.atropos.posting``) and the queue (``ops.atropos.queue``) use these.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

from rollq.ops.atropos.convert import to_atropos
from rollq.ops.atropos.pieces import compress
from rollq.schemas import ScoredGroup
from rollq.schemas.keys import partner_key

Ref = tuple[str, str]
"""A queued group: (its stream, its entry id)."""


def piece_key(stream: str) -> str:
    """The hash of the pieces of ``stream``'s groups (in that partition's hash slot)."""
    return partner_key(stream, "atropos:pieces")


def entry_text(entry: Any) -> str:
    """An entry id as text, whether Redis answered bytes or str."""
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def build_piece(group: ScoredGroup, gzip_level: int) -> bytes:
    """The group's ``/batch`` piece: its Atropos JSON, deflated at ``gzip_level``."""
    return compress(orjson.dumps(to_atropos(group), option=orjson.OPT_SERIALIZE_NUMPY),
                    gzip_level)


class PieceCache:
    """This process's copies of recent pieces (the ones it posted or read), oldest
    dropped beyond ``budget`` bytes: a batch of groups posted here is joined without
    reading them back from Redis (Redis keeps the copy every process can read)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self._pieces: OrderedDict[Ref, bytes] = OrderedDict()

    def get(self, ref: Ref) -> bytes | None:
        return self._pieces.get(ref)

    def put(self, ref: Ref, piece: bytes) -> None:
        self.pop(ref)
        self._pieces[ref] = piece
        self.size += len(piece)
        while self.size > self.budget and self._pieces:
            self.size -= len(self._pieces.popitem(last=False)[1])

    def pop(self, ref: Ref) -> None:
        piece = self._pieces.pop(ref, None)
        if piece is not None:
            self.size -= len(piece)

    def clear(self) -> None:
        self._pieces.clear()
        self.size = 0
