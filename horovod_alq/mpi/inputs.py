"""The inputs of a :class:`~horovod_alq.mpi.QuantizedAllreduce` call, checked: the arrays, their
scales (``scales=``, preconditioned quantization) and keys (``key=``, error feedback)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import precondition

OPS = ("average", "sum")


def checked(xs: list, listed: bool, op: str | None, scales: Any, key: Any, feedback: bool):
    """(arrays, scales or None, keys or None) of a call; ValueError naming the bad input."""
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    arrays = [_float_array(v, f"x[{i}]" if listed else "x") for i, v in enumerate(xs)]
    return arrays, _scales(scales, arrays, listed), _keys(key, len(arrays), listed, feedback)


def scales_digest(ws: list[np.ndarray] | None) -> int:
    """The handshake's digest of a call's scales (0: none)."""
    return 0 if ws is None else precondition.combine(map(precondition.digest, ws, range(len(ws))))


def _scales(scales: Any, arrays: list[np.ndarray], listed: bool) -> list[np.ndarray] | None:
    """The checked ``scales=`` of a call (one float32 array per array), or None; ValueError naming the array."""
    if scales is None:
        return None
    if not isinstance(scales, (list, tuple)) or len(scales) != len(arrays):
        raise ValueError(f"scales must hold one array per array of x ({len(arrays)}), got {type(scales).__name__}")
    return [
        precondition.check_scale(f"x[{i}]" if listed else "x", w, a.shape)
        for i, (w, a) in enumerate(zip(scales, arrays))
    ]


def _keys(key: Any, count: int, listed: bool, feedback: bool) -> list | None:
    """Error feedback: each array's key (``key``: a name for one array; for a list, one per array,
    or one name, then ``(name, index)``); None without feedback, where ``key`` is not needed."""
    if not feedback:
        return None
    if key is None:
        raise ValueError(
            "error_feedback=True keeps each array's error under a key: pass key= (a name for an array; for "
            "a list, one per array or one name) naming what the array is, the same at every call for it"
        )
    if not listed:
        return [key]
    if isinstance(key, (list, tuple)):
        if len(key) != count:
            raise ValueError(f"key= names {len(key)} arrays, the list holds {count}")
        return list(key)
    return [(key, i) for i in range(count)]


def _float_array(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be a floating-point array (float16/32/64), got dtype {arr.dtype}")
    return arr
