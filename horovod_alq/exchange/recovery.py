"""What a round does when its ranks did not lay it out alike (the handshake lets such rounds run):

* ranks that put two tensors of one shape in swapped slots (the handshake cannot see it; each
  tensor's control vector can): :func:`recover` exchanges those tensors again, each on its own;
* ranks that ordered the round's tensors differently: :func:`gather_unordered` gathers every rank's
  whole stream and layout, and :meth:`Unordered.read` takes each tensor from where each rank put it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import allgather
from .job import Job
from .payloads import check_payloads


def recover(rnd, entry, slots: tuple[int, ...], ops, transport):
    """The sum over ranks of ``entry``, a tensor that the ranks put in different ``slots`` of one
    shape (the fused sum at its slot mixed it with another tensor). Every rank quantizes again its
    values at *every* slot of that shape and allgathers them, named by slot: every rank finds the
    swap in the tensor's control vector, whenever it decompresses it, and issues the same
    collectives, all before waiting for any (ranks decompress in their own orders). Then rank
    ``r``'s values are taken from the slot it gave this tensor. ``rnd``: the
    :class:`.fused.FusedRound` (its ``recovery`` holds the slots' waits or results; its ``ctx``,
    the codec, seeds and counters of the round)."""
    ctx = rnd.ctx
    q, state = ctx.quantizer, ctx.state
    live = rnd.live()
    key = (entry.numel, entry.shape_code)
    index = {e.slot: k for k, e in enumerate(live)}
    for k, e in enumerate(live):
        if (e.numel, e.shape_code) == key and k not in rnd.recovery:
            x = ops.stream([e.flat if e.scale is None else e.flat * e.scale], [0], e.numel)
            payload = ops.encode(x, q, ctx.recovery_seed(k))
            sizes = [int(payload.shape[0])] * transport.size
            rnd.recovery[k] = transport.allgather(payload, sizes, ctx.name("recover")(str(k)))
            state.bytes_sent += (transport.size - 1) * sizes[0]
            state.bytes_received += (transport.size - 1) * sizes[0]
            state.payload_bytes += sizes[0]
    out = ops.zeros(entry.numel)
    part = ops.zeros(entry.numel)
    for r, slot in enumerate(slots):
        k = index[slot]
        got = rnd.recovery[k]
        if callable(got):
            got = rnd.recovery[k] = got()
        offsets = check_payloads(ops, got, [entry.numel] * transport.size, q, f"re-exchanged slot {k}")
        ops.decode_sum(part, got, [offsets[r]], q)
        out += part
    state.recovered += 1
    return out


@dataclass
class Unordered:
    """A round whose ranks ordered its tensors differently: every rank's decoded stream and where
    each slot starts in it."""

    streams: list
    starts: list[dict[int, int]]  # per rank: slot -> start in its stream

    def read(self, slots: tuple[int, ...], numel: int):
        """The sum over ranks of the tensor that rank ``r`` put in ``slots[r]``."""
        out = None
        for r, slot in enumerate(slots):
            start = self.starts[r][slot]
            part = self.streams[r][start : start + numel]
            out = part * 1.0 if out is None else out + part
        return out


def gather_unordered(job: Job, live: list) -> Unordered:
    """Ranks hold the same tensors in different orders: gather every rank's stream and layout."""
    t = job.transport
    # every rank's (slot, start) pairs, then (-1, its stream's length): lengths differ with the order
    rows = [[e.slot, s] for e, s in zip(live, job.layout.starts)] + [[-1, job.layout.length]]
    mine = np.array(rows, dtype=np.int64).ravel()
    raw = job.ops.from_numpy(mine.view(np.uint8))
    tables = job.ops.to_numpy(t.allgather(raw, [raw.shape[0]] * t.size, job.name("layouts"))())
    tables = tables.view(np.int64).reshape(t.size, -1, 2)
    streams = allgather.gather_streams(job, [int(table[-1, 1]) for table in tables])
    return Unordered(streams, [dict(map(tuple, table[:-1].tolist())) for table in tables])
