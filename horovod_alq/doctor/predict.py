"""ALQ's step against fp16's, from measured links and codec, with the scale model (:mod:`.model`)."""

from __future__ import annotations

import math

from ..exchange.registry import choose_exchange
from .model import (
    Codec,
    Params,
    alq_allgather,
    alq_hierarchical,
    alq_hierarchical_two_phase,
    alq_two_phase,
    hier16,
    ring16,
    small_allreduce,
    step_time,
)

#: The model of each exchange ``exchange="auto"`` may pick.
EXCHANGES = {
    "allgather": alq_allgather,
    "two-phase": alq_two_phase,
    "hierarchical": alq_hierarchical,
    "hierarchical-two-phase": alq_hierarchical_two_phase,
}
#: How far the predicted ratio ALQ / fp16 was from the measured one, as predicted over measured:
#: the lowest and highest over the measured rows of docs/results/doctor_check.md (2 and 4 nodes of
#: 2 ranks on 2 shared cores, 100 Mbit/s and 1 Gbit/s; tests/test_doctor.py checks these against its
#: data). The model left out what made ALQ slower there (Python, copies, ranks waiting for cores).
KNOWN_RANGE = (0.59, 0.99)


def machine(links: dict, kappa: float = 1.0) -> tuple[Params, float]:
    """The model's machine from :func:`.measure.links`' result (latencies, throughputs) and the rate
    between nodes in bytes/s (inf on one node: nothing crosses a node link)."""
    inside, between = links.get("inside"), links.get("between")
    near = inside or between
    alpha_intra = near["latency_s"] if near else 0.0
    b_intra = near["bytes_per_s"] if near else math.inf
    alpha = between["latency_s"] if between else alpha_intra
    rate = between["bytes_per_s"] if between else math.inf
    return Params(alpha, alpha_intra, 1.0, b_intra, kappa, 0.0), rate


def predict(
    params: float,
    ranks: int,
    per_node: int,
    links: dict,
    codec: Codec,
    compute: float = 0.0,
    bits: int = 3,
    share: float = 1.0,
    kappa: float = 1.0,
) -> dict:
    """The step of ALQ (``bits``, the exchange ``exchange="auto"`` picks) and of the faster 16-bit
    allreduce (ring, or Horovod's hierarchical across nodes of several ranks), for ``params``
    gradient coordinates, ``compute`` seconds of forward and backward, ``share`` ranks per core
    (at least 1) and ``kappa`` times the codec's kernel time for its whole path."""
    if ranks < 2:
        raise ValueError("a prediction needs at least 2 ranks")
    m, rate = machine(links, kappa)
    g = per_node if 1 <= per_node <= ranks and ranks % per_node == 0 else 1
    exchange = choose_exchange("auto", ranks, g)
    alq = EXCHANGES[exchange](params, ranks, g, bits) + small_allreduce(ranks, g) * 2
    sixteen = {"ring allreduce fp16": ring16(params, ranks, g)}
    if 1 < g < ranks:
        sixteen["Horovod hierarchical fp16"] = hier16(params, ranks, g)
    kw = dict(g=g, share=share)
    fp16 = {k: step_time(c, compute, rate, m, codec, 2, **kw) for k, c in sixteen.items()}
    best = min(fp16, key=fp16.get)
    t_alq = step_time(alq, compute, rate, m, codec, bits, **kw)
    return {
        "exchange": exchange,
        "fp16_row": best,
        "alq_s": t_alq,
        "fp16_s": fp16[best],
        "ratio": t_alq / fp16[best],
        "bytes_between_nodes": {"alq": alq.inter, "fp16": sixteen[best].inter},
    }
