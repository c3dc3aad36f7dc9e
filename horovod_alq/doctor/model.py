"""The project's scale model: a latency-bandwidth (alpha-beta) model of one data-parallel step for
each exchange (the formulas, calibration and projection are described on docs/results/scale_model.md;
scripts/study/scale.py calibrates it on measured steps and projects it, ``python -m
horovod_alq.doctor`` predicts with it from the links and codec it measures).

With the ranks in nodes of G consecutive ranks (N = M G ranks), a gradient of P coordinates and
q = b/8 + 4/d bytes per quantized coordinate, every exchange is a :class:`Cost` (bytes between and
inside nodes, messages, coordinates encoded and decoded), and one step is

    T = T_compute + L + W - phi min(L, W)
    L = share [kappa (enc t_enc + dec t_dec) + intra / B_intra + (inter / G) / B_host + msgs_intra alpha_intra]
    W = inter / (eta R) + msgs alpha
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BUCKET = 8192
GBIT = 1e9 / 8  # bytes/s in a Gbit/s


# ----------------------------------------------------------------------------- costs of collectives
@dataclass(frozen=True)
class Cost:
    """What one rank's step does besides computing: ``inter`` bytes out of its node's link (per node),
    ``intra`` bytes to ranks of its node (per rank), sequential messages between nodes (``msgs``) and
    inside the node (``msgs_intra``), coordinates encoded (``enc``) and coordinate-payloads decoded and
    summed (``dec``)."""

    inter: float = 0.0
    intra: float = 0.0
    msgs: float = 0.0
    msgs_intra: float = 0.0
    enc: float = 0.0
    dec: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, k: float) -> Cost:
        return Cost(*(k * a for a in astuple(self)))


def astuple(c: Cost) -> tuple[float, ...]:
    return (c.inter, c.intra, c.msgs, c.msgs_intra, c.enc, c.dec)


def qbytes(bits: int, bucket: int = BUCKET) -> float:
    """Bytes per quantized coordinate: b/8 of codes plus a float32 norm per bucket."""
    return bits / 8 + 4 / bucket


def ring_allreduce(s: float, n: int, g: int) -> Cost:
    """Flat ring allreduce of ``s`` bytes over n ranks in node order: every ring link carries
    2(n-1)/n s; one link leaves each node, (g-1)/g of a node's ranks send on a link inside it;
    2(n-1) sequential steps, each with a hop between nodes when there are several."""
    per_link, m = 2 * (n - 1) / n * s, n // g
    steps = 2 * (n - 1)
    return Cost(per_link if m > 1 else 0, (g - 1) / g * per_link, steps if m > 1 else 0, 0 if m > 1 else steps)


def hierarchical_allreduce(s: float, n: int, g: int) -> Cost:
    """Horovod's hierarchical allreduce (and what Open MPI's allreduce sent at 2 x 2): ring
    reduce-scatter inside the node ((g-1)/g s per rank, g-1 steps), g parallel ring allreduces of s/g
    across the m nodes (2(m-1)/m s per node, 2(m-1) steps), ring allgather inside the node (as the
    reduce-scatter)."""
    m = n // g
    return Cost(2 * (m - 1) / m * s, 2 * (g - 1) / g * s, 2 * (m - 1), 2 * (g - 1))


def alltoall(block: float, n: int, g: int) -> Cost:
    """Every rank sends ``block`` bytes to each other rank, pairwise: g(n-g) blocks leave a node,
    (g-1) blocks per rank stay in it; n-g messages between nodes, g-1 inside."""
    return Cost(g * (n - g) * block, (g - 1) * block, n - g, g - 1)


def allgather(block: float, n: int, g: int, algorithm: str = "ring") -> Cost:
    """Every rank's ``block`` to every rank. ``ring`` (NCCL, gloo): each link carries n-1 blocks, one
    leaves each node, n-1 steps; ``pairwise`` (what Open MPI's allgatherv sent at 2 x 2): as
    :func:`alltoall`."""
    if algorithm == "pairwise":
        return alltoall(block, n, g)
    m = n // g
    per_link = (n - 1) * block
    return Cost(per_link if m > 1 else 0, (g - 1) / g * per_link, n - 1 if m > 1 else 0, 0 if m > 1 else n - 1)


def small_allreduce(n: int, g: int) -> Cost:
    """A latency-only allreduce (control vector, handshake): recursive doubling, log2 g steps inside
    the node and log2 m between nodes."""
    return Cost(msgs=math.ceil(math.log2(n // g)), msgs_intra=math.ceil(math.log2(g)))


# ----------------------------------------------------------------------------- the exchanges
def ring16(p: float, n: int, g: int) -> Cost:
    """Ring allreduce of 16-bit gradients (fp16 or bf16, same bytes): :func:`ring_allreduce` of 2p."""
    return ring_allreduce(2 * p, n, g)


def hier16(p: float, n: int, g: int, width: int = 2) -> Cost:
    """Horovod's hierarchical allreduce of ``width``-byte gradients: between nodes 2(m-1)/m w p per
    node, inside 2(g-1)/g w p per rank."""
    return hierarchical_allreduce(width * p, n, g)


def alq_allgather(p: float, n: int, g: int, bits: int = 3, algorithm: str = "ring") -> Cost:
    """Flat allgather exchange: each rank encodes p coordinates, its payload p q reaches every rank
    (ring: (n-1) p q out of each node), every rank decodes the n payloads (n p)."""
    return allgather(p * qbytes(bits), n, g, algorithm) + Cost(enc=p, dec=n * p)


def alq_two_phase(p: float, n: int, g: int, bits: int = 3, algorithm: str = "ring") -> Cost:
    """Two-phase exchange: alltoall of n shards of p/n (g(m-1)/m p q out of each node), the owner
    decodes its n shards (p coordinates), re-encodes its sum (p/n), allgather of the sums (ring:
    (n-1)/n p q per node), every rank decodes them (p)."""
    q = qbytes(bits)
    return alltoall(p / n * q, n, g) + allgather(p / n * q, n, g, algorithm) + Cost(enc=p + p / n, dec=2 * p)


def alq_hierarchical(p: float, n: int, g: int, bits: int = 3) -> Cost:
    """The hierarchical exchange: (1) float32 alltoall inside the node ((g-1) 4p/g per rank), the
    owner sums g shards; (2) it encodes its node sum of p/g coordinates and sends the payload to the
    m-1 owners of the same shard on the other nodes ((m-1) p q out of each node: an allgather of
    node sums, growing with m); (3) it forwards the m payloads to its node ((g-1) m p q/g per rank);
    every rank decodes m payloads of every shard (m p)."""
    m, q = n // g, qbytes(bits)
    stage1 = Cost(intra=(g - 1) * 4 * p / g, msgs_intra=g - 1)
    stage2 = Cost(inter=(m - 1) * p * q, msgs=m - 1)
    stage3 = Cost(intra=(g - 1) * m * p / g * q, msgs_intra=g - 1)
    return stage1 + stage2 + stage3 + Cost(enc=p / g, dec=m * p)


def alq_hierarchical_two_phase(p: float, n: int, g: int, bits: int = 3) -> Cost:
    """The hierarchical two-phase exchange (horovod_alq/exchange/hierarchical_two_phase.py), the
    answer to the growth of :func:`alq_hierarchical`'s stage 2: the same float32 reduce-scatter
    inside the node, then a two-phase exchange of each node sum of p/g among the m owners of that
    shard (2(m-1)/m p q out of each node, as a 16-bit allreduce's 2(m-1)/m 2p), then the codes
    forwarded inside the node ((g-1) p q/g per rank)."""
    m, q = n // g, qbytes(bits)
    stage1 = Cost(intra=(g - 1) * 4 * p / g, msgs_intra=g - 1)
    one = alq_two_phase(p / g, m, 1, bits)  # the g local ranks' exchanges run side by side
    across = Cost(inter=g * one.inter, msgs=one.msgs, enc=one.enc, dec=one.dec)
    stage3 = Cost(intra=(g - 1) * p / g * q, msgs_intra=g - 1, dec=(g - 1) * p / g)
    return stage1 + across + stage3


#: The projection's rows: label, cost function of (p, n, g), whether it quantizes.
ROWS = [
    ("ring allreduce fp16/bf16", lambda p, n, g: ring16(p, n, g), False),
    ("Horovod hierarchical fp16", lambda p, n, g: hier16(p, n, g), False),
    ("ALQ 3b flat allgather", lambda p, n, g: alq_allgather(p, n, g, 3), True),
    ("ALQ 3b two-phase", lambda p, n, g: alq_two_phase(p, n, g, 3), True),
    ("ALQ 3b hierarchical", lambda p, n, g: alq_hierarchical(p, n, g, 3), True),
    ("ALQ 4b hierarchical", lambda p, n, g: alq_hierarchical(p, n, g, 4), True),
    ("ALQ 3b hierarchical two-phase", lambda p, n, g: alq_hierarchical_two_phase(p, n, g, 3), True),
]
SIXTEEN = ROWS[:2]
SIXTEEN_LABELS = [r[0] for r in SIXTEEN]
ALQ_ROWS = [r[0] for r in ROWS[2:]]


# ----------------------------------------------------------------------------- one step
@dataclass(frozen=True)
class Params:
    """The machine: ``alpha`` / ``alpha_intra`` s per message between / inside nodes, ``eta`` the
    fraction of the inter-node rate achieved, ``b_intra`` bytes/s a rank sends inside its node,
    ``kappa`` times the codec kernels' time, ``phi`` the overlap of local work and wire time,
    ``b_host`` bytes/s of the host's TCP work per byte a rank sends between nodes."""

    alpha: float
    alpha_intra: float
    eta: float
    b_intra: float
    kappa: float = 1.0
    phi: float = 0.0
    b_host: float = math.inf


@dataclass(frozen=True)
class Codec:
    """Seconds per encoded coordinate (at 3 and 4 bits) and per decoded coordinate-payload."""

    enc3: float
    enc4: float
    dec: float

    def enc(self, bits: int) -> float:
        return self.enc3 if bits <= 3 else self.enc4


def parts(
    cost: Cost, rate: float, m: Params, codec: Codec, bits: int = 3, g: int = 1, share: float = 1.0
) -> tuple[float, float]:
    """(L, W) of the module docstring: the host's work (codec, copies inside the node, TCP) and the
    wire time (bytes between nodes at eta R, messages between nodes); ``rate`` in bytes/s per node
    link, ``g`` ranks per node, ``share`` the host's oversubscription."""
    local = m.kappa * (cost.enc * codec.enc(bits) + cost.dec * codec.dec)
    local += cost.intra / m.b_intra + cost.inter / g / m.b_host + cost.msgs_intra * m.alpha_intra
    wire = cost.inter / (m.eta * rate) + cost.msgs * m.alpha
    return share * local, wire


def step_time(cost: Cost, compute: float, rate: float, m: Params, codec: Codec, bits: int = 3, **kw) -> float:
    """T = T_compute + L + W - phi min(L, W) (module docstring; ``kw``: :func:`parts`' g and share)."""
    local, wire = parts(cost, rate, m, codec, bits, **kw)
    return compute + local + wire - m.phi * min(local, wire)
