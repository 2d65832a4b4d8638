"""Tagged JSON: Python values that plain JSON would change, kept exactly across the wire.

JSON has no tuples, sets or bytes, and only string keys: a value sent as plain JSON comes
back as lists and string-keyed dicts, and code that compares with a tuple (a reasoning-gym
task's scorer, an Atropos env's item) then silently disagrees. ``encode_tagged`` writes
such values as objects tagged under ``"__rollq__"`` (``{"__rollq__": "tuple", "items":
[...]}``; ``set``, ``frozenset``, ``bytes`` as base64, ``dict`` for non-string keys or a
dict that holds the tag key itself) and numpy scalars as plain numbers; ``decode_tagged``
rebuilds them. Everything else is plain JSON, readable as it is.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from rollq.schemas.errors import ContractError

TAG = "__rollq__"
"""The key that marks a tagged object."""


def encode_tagged(value: Any, *, what: str = "a value") -> Any:
    """``value`` as JSON-ready values, tagged where plain JSON would change it (module
    docstring). Raises ``ContractError`` (naming ``what``) for values JSON cannot hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [encode_tagged(v, what=what) for v in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode_tagged(v, what=what) for v in value]}
    if isinstance(value, set | frozenset):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        return {TAG: kind, "items": [encode_tagged(v, what=what) for v in value]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "base64": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode_tagged(v, what=what) for k, v in value.items()}
        return {TAG: "dict", "items": [[encode_tagged(k, what=what), encode_tagged(v, what=what)]
                                       for k, v in value.items()]}
    raise ContractError(f"{what} holds a {type(value).__name__}, which rollq cannot record "
                        "(JSON values, tuples, sets and bytes can be)")


def decode_tagged(value: Any) -> Any:
    """The value ``encode_tagged`` encoded."""
    if isinstance(value, list):
        return [decode_tagged(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode_tagged(v) for k, v in value.items()}
    if kind == "bytes":
        return base64.b64decode(value["base64"])
    items = [decode_tagged(v) for v in value["items"]]
    if kind == "tuple":
        return tuple(items)
    if kind == "frozenset":
        return frozenset(items)
    if kind == "set":
        return set(items)
    return {_hashable(k): v for k, v in items}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
