"""An exchange defined in this file and registered here: the conformance suite then runs it on every
front-end, with no other file changed. The proof that an exchange is one module and one entry
(horovod_alq.exchange.registry).

The toy: each buffer is cut into two halves of whole buckets, and each half's codes are allgathered
by a collective of their own (two stages). Fixed widths only (it ignores ``bits="auto"``'s runs).
Without a graph execution, TensorFlow must refuse it with the registry's reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_alq.exchange import registry
from horovod_alq.exchange.descriptor import Exchange
from horovod_alq.exchange.job import Allgather, Piece
from horovod_alq.exchange.payloads import check_payloads
from horovod_alq.exchange.plan import BufferPlan, allgather_bytes, shards, sizes, total

pytestmark = pytest.mark.multiproc

NAME = "toy-halves"


def plan(lo, hi, size, rank, first, second=None, segments=None) -> BufferPlan:
    """The two halves, their payload sizes, and two allgathers' bytes."""
    parts = tuple(p for p in shards(lo, hi, 2, first.bucket_size) if p[1] > p[0])
    own = sizes(parts, first)
    return BufferPlan(parts, own, (), *total(*(allgather_bytes([s] * size, rank) for s in own)))


def steps(job, i):
    """Buffer ``i``: encode a half, gather it, check it; then the other half."""
    t = job.transport
    lo, hi = job.layout.buffers[i]
    p = plan(lo, hi, t.size, t.rank, job.first)
    pieces = []
    for h, (a, b) in enumerate(p.parts):
        payload = job.encode_range(a, b, job.first, job.seed(i, h))
        gathered = yield Allgather(payload, [p.first[h]] * t.size, f"toy{h}.{i}")
        offsets = check_payloads(job.ops, gathered, [b - a] * t.size, job.first, f"half {h} of buffer {i}")
        pieces.append(Piece(a, b, gathered, tuple(offsets), job.frozen(job.first)))
    return pieces


def empty_first(ops, size: int) -> Allgather:
    return Allgather(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, "toy0.0")


TOY = Exchange(NAME, 900, 2, steps, plan, empty_first)


def register_toy() -> None:
    """What each worker calls first (``--plugin tests/test_toy_exchange.py:register_toy``)."""
    registry.register(TOY)


# ------------------------------------------------------------------ the conformance suite, on it
FRONTENDS = ("torch", "ddp", "mpi")  # TensorFlow's refusal needs no launch: test_tensorflow_refuses_it


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """``toy(frontend)``: one launch per front-end of the conformance worker over the toy exchange,
    registered in this process too while the module runs."""
    import test_conformance as conformance

    register_toy()
    cache: dict = {}

    def get(frontend: str):
        if frontend not in cache:
            args = ["--methods", ",".join(conformance.METHODS), "--rounds", conformance.ROUNDS]
            cache[frontend] = conformance._launch(
                tmp_path_factory, frontend, "toy", args, exchanges=[NAME], plugin=f"{__file__}:register_toy"
            )
        return cache[frontend]

    yield get
    registry.unregister(NAME)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_conformance_suite_runs_the_toy(toy, frontend):
    import test_conformance as conformance

    conformance.test_runs_the_exchange(toy, frontend, NAME)
    conformance.test_identical_on_both_ranks(toy, frontend, NAME)
    conformance.test_unbiased(toy, frontend, NAME)
    conformance.test_bytes_from_the_wire_format(toy, frontend, NAME)


@pytest.mark.parametrize("method", ["qsgdinf", "alq"])
def test_front_ends_agree_on_the_toy(toy, method, monkeypatch):
    import test_conformance as conformance

    monkeypatch.setattr(conformance, "FRONTENDS", {f: conformance.FRONTENDS[f] for f in FRONTENDS})
    conformance.test_frontends_agree(toy, NAME, method)


def test_tensorflow_refuses_it(toy):
    from horovod_alq.settings import Settings

    assert NAME in registry.choices() and NAME not in registry.graph_names()
    with pytest.raises(ValueError, match=f"does not serve exchange='{NAME}'.*for them use the PyTorch compressors"):
        Settings.of(None, "Horovod TensorFlow", exchange=NAME)
    Settings.of(None, "Horovod PyTorch", exchange=NAME)  # the others serve it
