"""A round, followed from Engine.finish through its calls, enters no module of horovod_alq more
than twice on any call path (the code of one concept lives in one place)."""

import collections
import threading

import numpy as np
import pytest

from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import exchange_round

ROOT_FILE = "exchange/engine.py"


def _module(frame) -> str | None:
    name = frame.f_code.co_filename
    return name.split("/horovod_alq/", 1)[1] if "/horovod_alq/" in name else None


@pytest.mark.parametrize(
    "exchange, bits, ranks",
    [("allgather", 3, 2), ("two-phase", 3, 4), ("allgather", "auto", 2), ("two-phase", "auto", 3)],
)
def test_a_round_enters_each_module_at_most_twice_on_any_path(exchange, bits, ranks):
    worst: dict[str, tuple[int, list]] = {}
    lock = threading.Lock()

    def profile(frame, event, arg):
        if event != "call":
            return
        path, f = [], frame
        while f is not None:  # the horovod_alq frames up to Engine.finish, innermost first
            m = _module(f)
            if m is not None:
                path.append(m)
            if m == ROOT_FILE and f.f_code.co_name == "finish":
                break
            f = f.f_back
        if f is None:
            return
        path.reverse()
        entries = [m for i, m in enumerate(path) if i == 0 or path[i - 1] != m]  # runs of one module
        with lock:
            for m, count in collections.Counter(entries).items():
                if count > worst.get(m, (0, []))[0]:
                    worst[m] = (count, entries)

    budget = 3.0 if bits == "auto" else None
    setups = [
        configure(
            Settings("alq", bits, 64, bit_budget=budget, update_steps=(0,), update_every=0, seed=1, exchange=exchange)
        )
        for _ in range(ranks)
    ]
    engines = [s.engine(uid="t") for s in setups]
    rng = np.random.default_rng(0)
    xs = [[rng.standard_normal(n).astype(np.float32) for n in (300, 200, 70)] for _ in range(ranks)]
    threading.setprofile(profile)
    try:
        out = exchange_round(engines, xs, NumpyOps(), "path")  # round 0 refits: the statistics path too
    finally:
        threading.setprofile(None)
    assert not any(isinstance(o, Exception) for o in out), out
    assert ROOT_FILE in worst, "the profile saw no call under Engine.finish"
    over = {m: " -> ".join(p) for m, (c, p) in worst.items() if c > 2}
    assert not over, f"modules entered more than twice on one call path: {over}"
