"""Annotated numpy array types for the wire models.

Token arrays never travel as JSON lists: in memory they are 1-D numpy arrays of a fixed
dtype (int32 token ids and versions, float32 logprobs/rewards, uint8 masks), and on the wire
their little-endian bytes. The validators accept any 1-D sequence of numbers and convert it
once; an array that already has the right dtype is taken without a copy and frozen.

``check_values`` is the one value check of an array (finite, within bounds), shared by the
models' validators and the codec. It costs one or two vectorised reductions (a few µs for
32K tokens), never a Python loop over elements, so the codec runs it on every group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
from pydantic import PlainSerializer, PlainValidator

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
UInt8Array = npt.NDArray[np.uint8]


def _as_array(dtype: type[np.generic]) -> Any:
    def validate(value: Any) -> np.ndarray[Any, Any]:
        if (type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1
                and not value.flags.writeable):
            return value  # already what the model holds: frozen, typed, 1-D
        try:
            array = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"expected a 1-D sequence of {np.dtype(dtype).name}: {exc}") from exc
        if array.ndim != 1:
            raise ValueError(f"expected a 1-D array, got shape {array.shape}")
        if array.flags.writeable:
            if array is value or array.base is not None:
                array = array.copy()  # never freeze the caller's own buffer
            array.flags.writeable = False
        return array

    return PlainValidator(validate)


MAX_VERSION = 2**31 - 1
"""Largest policy version: versions travel as int32 (per token) and must fit one."""


_FEW = 32  # below this many values a Python pass beats numpy's per-call overhead


def check_values(name: str, array: np.ndarray[Any, Any], *, low: float | None = None,
                 high: float | None = None) -> None:
    """Raise ValueError naming ``name`` unless every value of ``array`` is finite (floats)
    and within ``[low, high]`` (each bound optional).

    NaN propagates through ``min``/``max``, so a float array needs only those two reductions;
    a stride-0 view (``broadcast``) holds one value, so only that one is read.
    """
    size = array.size
    if not size:
        return
    floating = array.dtype.kind == "f"
    if size < _FEW or array.strides == (0,):
        values = array.tolist() if size < _FEW else [array.item(0)]
        # a float64 sum of float32 values is finite exactly when every value is
        if floating and not math.isfinite(sum(values)):
            raise ValueError(f"{name} holds a non-finite value")
        lowest, highest = min(values), max(values)
    else:
        lowest = array.min() if floating or low is not None else 0
        highest = array.max() if floating or high is not None else 0
        if floating and not (math.isfinite(lowest) and math.isfinite(highest)):
            raise ValueError(f"{name} holds a non-finite value")
    if low is not None and lowest < low:
        raise ValueError(f"{name} holds {lowest}, below the lowest allowed value {low}")
    if high is not None and highest > high:
        raise ValueError(f"{name} holds {highest}, above the highest allowed value {high}")


def broadcast(values: npt.ArrayLike, lengths: Sequence[int]) -> list[Float32Array]:
    """``values[i]`` repeated ``lengths[i]`` times, for each ``i``: float32 read-only views
    with stride 0, so a broadcast value costs no per-token memory and ``is_broadcast`` can
    recognise it without reading the tokens."""
    packed = np.ascontiguousarray(values, dtype="<f4").tobytes()  # immutable: views are read-only
    if len(packed) != 4 * len(lengths):
        raise ValueError(f"{len(packed) // 4} values for {len(lengths)} lengths")
    if min(lengths, default=0) < 0:
        raise ValueError(f"negative length in {list(lengths)}")
    # One [len(values), max(lengths)] grid of stride (4, 0); each row cut to its length.
    grid = np.ndarray((len(lengths), max(lengths, default=0)), np.float32, buffer=packed,
                      strides=(4, 0))
    return [row[:length] for row, length in zip(grid, lengths, strict=True)]


def is_broadcast(array: Float32Array, value: float) -> bool:
    """Whether every element of ``array`` equals ``value``: O(1) for ``broadcast`` views."""
    if len(array) == 0:
        return True
    if array.strides == (0,):  # every element is the first one
        return bool(array[0] == value)
    return not (array != value).any()


def _to_list(array: np.ndarray[Any, Any]) -> list[Any]:
    return array.tolist()  # type: ignore[no-any-return]  # only for model_dump(); the codec writes bytes


TokenIds = Annotated[Int32Array, _as_array(np.int32), PlainSerializer(_to_list)]
"""int32 token ids (or per-token policy versions)."""
Floats = Annotated[Float32Array, _as_array(np.float32), PlainSerializer(_to_list)]
"""float32 values, one per token or per sequence."""
Mask = Annotated[UInt8Array, _as_array(np.uint8), PlainSerializer(_to_list)]
"""uint8 0/1 mask, one per token."""


ROUTED_DTYPES = ("uint8", "uint16", "int32")
"""Dtypes routed-expert ids travel in: the narrowest that holds every expert id (vLLM
writes uint8 up to 256 experts, uint16 above), or int32."""


def _as_routed(value: Any) -> np.ndarray[Any, Any]:
    """A frozen ``[positions, layers, top_k]`` array of expert ids in a ``ROUTED_DTYPES``
    dtype (little-endian), as given: the dtype is part of what travels."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.dtype.name not in ROUTED_DTYPES:
        raise ValueError(f"routed experts must be {', '.join(ROUTED_DTYPES)}, got "
                         f"{array.dtype.name}")
    if array.ndim != 3:
        raise ValueError(f"routed experts must be [positions, layers, top_k], got shape "
                         f"{array.shape}")
    array = array.astype(array.dtype.newbyteorder("<"), copy=False)
    if array.size and array.min() < 0:
        raise ValueError("routed experts hold a negative expert id")
    if array.flags.writeable:
        if array is value or array.base is not None:
            array = array.copy()
        array.flags.writeable = False
    return array


RoutedExperts = Annotated[npt.NDArray[Any], PlainValidator(_as_routed),
                          PlainSerializer(_to_list)]
"""Expert ids ``[positions, layers, top_k]`` (uint8, uint16 or int32) a MoE server routed
each position of a sequence to."""
