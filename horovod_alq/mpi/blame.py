"""After a handshake that failed alike on every rank: which ranks are at fault, and why."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..exchange.interfaces import Transport


def blame(
    transport: Transport,
    error: str | None,
    elements: Any,
    prefix: str,
    what: str,
    differ: str = "the ranks passed arrays with different element counts",
) -> str | None:
    """After a handshake that failed alike on every rank: every rank's local ``error`` and
    ``elements`` (a count, or any JSON value the ranks must agree on; two more collectives, on this
    path only), as a message naming the ranks at fault (``what`` and their errors, or ``differ``
    and every rank's ``elements``); None when no rank reported an error and ``elements`` agree."""
    raw = np.frombuffer(json.dumps([error, elements]).encode(), dtype=np.uint8)
    n = int(transport.allreduce_max(np.array([raw.size], dtype=np.int64), f"{prefix}.messages.size")[0])
    buf = np.zeros(n, dtype=np.uint8)
    buf[: raw.size] = raw
    got = transport.allgather(buf, [n] * transport.size, f"{prefix}.messages")()
    shared = [json.loads(bytes(got[r * n : (r + 1) * n]).rstrip(b"\0").decode()) for r in range(transport.size)]
    failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(shared) if m is not None]
    if failed:
        return f"{what} " + "; ".join(failed)
    if len({json.dumps(e) for _, e in shared}) > 1:
        counts = ", ".join(f"rank {r}: {e}" for r, (_, e) in enumerate(shared))
        return f"{differ} ({counts})"
    return None
