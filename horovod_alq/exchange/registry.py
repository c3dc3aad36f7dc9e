"""The exchanges, registered once, and the rule that picks one.

Every list of exchanges is derived from :data:`REGISTRY`: the settings' choices, the handshake's
names, TensorFlow's refusals (:attr:`.descriptor.Exchange.graph`), FSDP2's choice
(:func:`shard_exchange`), the conformance test's byte counts (:meth:`.descriptor.Exchange.bytes`).
A new exchange is one module that defines an :class:`~.descriptor.Exchange` and one
:func:`register` call (the built-in ones are registered below).
"""

from __future__ import annotations

from ..core import protocol
from . import allgather, hierarchical, hierarchical_two_phase, node_reduce_scatter, reduce_scatter, topology, two_phase
from .descriptor import Exchange
from .interfaces import Transport

#: Exchanges by name, in registration order.
REGISTRY: dict[str, Exchange] = {}
#: ``exchange="auto"`` uses the two-phase exchange from this many ranks (or nodes) on
#: (docs/results/network_wall_clock.md#exchanges).
TWO_PHASE_FROM = 4


def register(exchange: Exchange) -> Exchange:
    """Add ``exchange``; ValueError if its name or wire id is taken, or it is malformed."""
    taken = {e.wire_id: e.name for e in REGISTRY.values()}
    if exchange.name in REGISTRY or exchange.name == "auto":
        raise ValueError(f"an exchange named {exchange.name!r} is already registered")
    if exchange.wire_id in taken or not 0 <= exchange.wire_id < 1 << 20:
        raise ValueError(f"wire id {exchange.wire_id} of {exchange.name!r} is taken or out of range ({taken})")
    if exchange.stages < 1 or (exchange.allreduce and (exchange.plan is None or exchange.empty_first is None)):
        raise ValueError(f"exchange {exchange.name!r}: an allreduce needs stages >= 1, a plan and empty_first")
    REGISTRY[exchange.name] = exchange
    protocol.EXCHANGE_NAMES[exchange.wire_id] = exchange.name
    return exchange


def unregister(name: str) -> None:
    """Remove the exchange ``name`` (tests that register one of their own)."""
    protocol.EXCHANGE_NAMES.pop(REGISTRY.pop(name).wire_id, None)


for _module in (allgather, two_phase, reduce_scatter, hierarchical, node_reduce_scatter, hierarchical_two_phase):
    register(_module.EXCHANGE)


def get(name: str) -> Exchange:
    """The exchange ``name``; ValueError naming the registered ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"no exchange {name!r}; registered: {', '.join(REGISTRY)}") from None


def allreduce_names() -> tuple[str, ...]:
    """The exchanges that leave every rank the whole sum (what ``exchange=`` may name)."""
    return tuple(e.name for e in REGISTRY.values() if e.allreduce)


def choices() -> tuple[str, ...]:
    return (*allreduce_names(), "auto")


def max_stages() -> int:
    """The most collectives of one buffer (a front-end that pairs collectives by call order can pass
    one transport this many times to :meth:`.engine.Engine.open_stream`)."""
    return max(e.stages for e in REGISTRY.values())


def check_exchange(exchange: str) -> str:
    if exchange not in choices():
        raise ValueError(f"exchange must be one of {', '.join(map(repr, choices()))}, got {exchange!r}")
    return exchange


def choose_exchange(exchange: str, size: int, local_size: int | None = None) -> str:
    """The exchange in use for ``size`` ranks in nodes of ``local_size`` (None: one node). ``auto``:
    across several nodes of several ranks, a hierarchical exchange (exact inside the node), whose
    stage between nodes follows the flat rule applied to the nodes: the node sums allgathered below
    :data:`TWO_PHASE_FROM` nodes, a two-phase exchange of them from there on; otherwise two-phase
    from :data:`TWO_PHASE_FROM` ranks on, else allgather."""
    if exchange != "auto":
        return exchange
    if local_size is not None and 1 < local_size < size:
        return hierarchical_two_phase.NAME if size // local_size >= TWO_PHASE_FROM else hierarchical.NAME
    return two_phase.NAME if size >= TWO_PHASE_FROM else allgather.NAME


def exchange_for(exchange: str, transport: Transport) -> str:
    """:func:`choose_exchange` for ``transport``'s ranks and nodes."""
    return choose_exchange(exchange, transport.size, topology.local_size(transport))


def requantizes(exchange: str) -> bool:
    """Whether ``exchange`` quantizes sums a second time (with the second quantizer)."""
    return get(exchange).requantizes


def shard_choices() -> tuple[str, ...]:
    """What ``exchange=`` may say where the result is a shard (FSDP2): "auto" and the allreduce
    exchanges that some reduce-scatter is the first stages of."""
    return ("auto", *(e.shard_of for e in REGISTRY.values() if e.shard_of))


def shard_exchange(exchange: str, size: int, local_size: int) -> str:
    """The reduce-scatter for ``exchange`` (one of :func:`shard_choices`) over ``size`` ranks in
    nodes of ``local_size``: the one whose ``shard_of`` it names; "auto": a node-aware one when
    the ranks span several nodes of several ranks, else the flat one."""
    shards = [e for e in REGISTRY.values() if not e.allreduce]
    if exchange == "auto":
        spans = 1 < local_size < size
        return next(e.name for e in shards if e.node_aware == spans)
    for e in shards:
        if e.shard_of == exchange:
            return e.name
    raise ValueError(f"exchange={exchange!r} has no reduce-scatter; use one of {', '.join(shard_choices())}")


def graph_names() -> tuple[str, ...]:
    """The exchanges TensorFlow runs in its graph."""
    return tuple(e.name for e in REGISTRY.values() if e.graph)
