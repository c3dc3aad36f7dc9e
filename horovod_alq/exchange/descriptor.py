"""What an exchange is: one frozen :class:`Exchange` per way payloads travel, registered once in
:mod:`.registry`, from which every front-end, the handshake and the tests read what they need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..core.quantizer import Quantizer
from .plan import BufferPlan


@dataclass(frozen=True)
class Exchange:
    """One exchange (docs/design/design.md, "Exchange").

    ``steps(job, i)``: the protocol of buffer ``i`` as a generator of collectives (:mod:`.job`);
    ``stages``: how many collectives it yields per buffer; ``wire_id``: its number in the
    handshake, stable across releases. ``plan(lo, hi, size, rank, first, second, segments=None,
    g=None)``: its arithmetic (:class:`.plan.BufferPlan`: parts, payload sizes, bytes on the wire),
    None for exchanges of streamed rounds only. ``empty_first(ops, size)``: its first collective
    with nothing to contribute (fused rounds complete other ranks' early buffers with it).
    ``span(job)``: the ``(start, length)`` of a one-buffer job's stream whose sum this rank ends
    with (reduce-scatters); None: the whole buffer (an allreduce). Flags: ``requantizes`` (sums are
    quantized again with the second quantizer), ``own_first_statistics`` (it quantizes other values
    than the rank's own, node sums, and collects the first quantizer's statistics itself),
    ``node_aware`` (its stages follow the node layout), ``graph`` (TensorFlow runs it in its graph),
    ``shard_of`` (a reduce-scatter: the allreduce exchange whose first stages it is; FSDP2 runs it
    when that one is asked for).
    """

    name: str
    wire_id: int
    stages: int
    steps: Callable
    plan: Callable[..., BufferPlan] | None = None
    empty_first: Callable | None = None
    span: Callable[[Any], tuple[int, int]] | None = None
    requantizes: bool = False
    own_first_statistics: bool = False
    node_aware: bool = False
    graph: bool = False
    shard_of: str | None = None

    @property
    def allreduce(self) -> bool:
        """Whether every rank ends with the whole sum (the allreduce front-ends serve it)."""
        return self.span is None

    def bytes(
        self,
        n: int,
        rank: int,
        size: int,
        first: Quantizer,
        second: Quantizer | None = None,
        local_size=None,
        status: bool = True,
    ) -> tuple[int, int]:
        """``(sent, received)`` payload bytes of one ``n``-element buffer on ``rank`` of ``size`` in
        nodes of ``local_size`` (None: one node), from :attr:`plan` (``status``: the node-aware
        exchanges' status bytes between nodes, which TensorFlow's graph does not send)."""
        if self.plan is None:
            raise ValueError(f"exchange {self.name!r} has no plan (streamed rounds only)")
        g = {"g": local_size or size, "status": status} if self.node_aware else {}
        p = self.plan(0, n, size, rank, first, second if second is not None else first, **g)
        return p.sent, p.received
