"""Conformance: every exchange of the registry through every allreduce front-end, on 2 real ranks.

The front-ends are the Horovod torch compressor (mpirun), the Horovod TensorFlow compressor
(mpirun), the DDP communication hook (torchrun, gloo) and mpi4py's ``QuantizedAllreduce`` (mpirun).
One launch per front-end (tests/workers/conformance.py) averages each rank's fixed float32 vector
with a fixed method (qsgdinf) and an adaptive one (alq, refit once in a warm-up round), 3 bits,
buckets of 256, for every exchange, R rounds of the same input. A front-end *conforms* when, for
every exchange and method:

1. both ranks get bit-identical results, every round;
2. the mean of the R results is the exact average (unbiasedness, a t-test per bucket);
3. ``metrics()["bytes_sent"]`` (and ``bytes_received``) of every round is what the wire format says
   (:func:`expected_bytes`), so it is the same on every front-end;
4. across front-ends: the same levels, the same bytes, and the same error distribution (mean squared
   error per bucket: the same quantizer and exchange must add the same noise).

Adding an exchange: one module, one :func:`horovod_alq.exchange.registry.register`; this file then
runs it on every front-end, its expected bytes from its descriptor's ``plan``
(:func:`test_plans_are_the_wire_format` checks the built-in plans against the wire format). A
front-end that refuses it fails here (no skip), unless its capability flags say it refuses
(:data:`REFUSED`, TensorFlow without ``graph``); one that runs another exchange under its name shows
in the byte and noise checks. Reduce-scatters (a shard per rank, not an allreduce) are FSDP2's:
tests/torch/test_fsdp_ranks.py. tests/test_toy_exchange.py runs the same checks on an exchange that
it defines and registers itself.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import t_bound, t_stat
from multiproc import run_ranks
from scipy.stats import t as student

from horovod_alq.core.quantizer import Quantizer
from horovod_alq.core.wire import payload_size
from horovod_alq.exchange import registry
from horovod_alq.exchange.plan import shards

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "conformance.py"
SIZE = 2  # ranks
N, BITS, BUCKET, ROUNDS, SEED = 10900, 3, 256, 40, 5  # 43 buckets (the last short): uneven two-phase shards
METHODS = ("qsgdinf", "alq")
EXCHANGE_NAMES = registry.allreduce_names()  # a new exchange is tested without editing this file
#: front-end -> (launcher, module it needs)
FRONTENDS = {
    "torch": ("mpi", "horovod.torch"),
    "tf": ("mpi", "horovod.tensorflow"),
    "ddp": ("torchrun", "torch.distributed"),
    "mpi": ("mpi", "mpi4py"),
}
ALPHA = 1e-6  # false-alarm probability of each statistical check (one front-end, exchange and method)


def _load_worker():
    spec = importlib.util.spec_from_file_location("conformance_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rank_data = _load_worker().rank_data  # the ranks' inputs, regenerated here


def exact_average() -> np.ndarray:
    return np.mean([rank_data(r, N).astype(np.float64) for r in range(SIZE)], axis=0)


def expected_bytes(exchange: str, rank: int) -> tuple[int, int]:
    """(bytes_sent, bytes_received) of one round of the ``N``-element tensor on ``rank``: what the
    exchange's plan says (one node of ``SIZE`` ranks)."""
    return registry.get(exchange).bytes(N, rank, SIZE, Quantizer("qsgdinf", BITS, BUCKET))


def wire_format_bytes(
    exchange: str, rank: int, n: int = N, size: int = SIZE, bits: int = BITS, bucket: int = BUCKET
) -> tuple[int, int]:
    """(bytes_sent, bytes_received) of one round of one ``n``-element tensor on ``rank`` of one node,
    worked out by hand from the wire format (docs/design/design.md, "bytes_sent": payloads with
    headers; an allgather sends this rank's payload N - 1 times, an alltoall what goes to other
    ranks; control vectors and handshakes not)."""
    if exchange == "allgather":
        p = payload_size(n, bits, bucket)
        return (size - 1) * p, (size - 1) * p
    if exchange == "two-phase":  # alltoall of the first-phase shards, allgather of the owners' second ones
        parts = [payload_size(b - a, bits, bucket) for a, b in shards(0, n, size, bucket)]
        others = [p for j, p in enumerate(parts) if j != rank]
        return sum(others) + (size - 1) * parts[rank], (size - 1) * parts[rank] + sum(others)
    if exchange in ("hierarchical", "hierarchical-two-phase"):
        # SIZE ranks as one node: floats of the other shards out, codes forwarded (two-phase between
        # nodes: each shard one sub-shard, re-quantized at the same bits, so the same bytes)
        parts = shards(0, n, size, bucket)
        floats = [4 * (b - a) for a, b in parts]
        codes = [payload_size(b - a, bits, bucket) for a, b in parts]
        return (
            sum(f for j, f in enumerate(floats) if j != rank) + (size - 1) * codes[rank],
            (size - 1) * floats[rank] + sum(c for j, c in enumerate(codes) if j != rank),
        )
    raise KeyError(exchange)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase", "hierarchical", "hierarchical-two-phase"])
@pytest.mark.parametrize("size, n", [(2, N), (3, 5000), (4, 300)])
def test_plans_are_the_wire_format(exchange, size, n):
    """The built-in exchanges' plans (what :func:`expected_bytes` reads) count the bytes the wire
    format says, on every rank of one node."""
    q = Quantizer("qsgdinf", BITS, BUCKET)
    for rank in range(size):
        assert registry.get(exchange).bytes(n, rank, size, q) == wire_format_bytes(exchange, rank, n, size)


# ------------------------------------------------------------------ launches (one per front-end)
_CACHE: dict = {}  # front-end -> its launch's {tag: results}, or the failure of that launch


def _launch(
    tmp_path_factory, frontend: str, tag: str, args: list, exchanges=EXCHANGE_NAMES, plugin: str | None = None
) -> tuple:
    """One launch of the worker on ``frontend`` with ``args`` over ``exchanges`` (``plugin``:
    ``FILE:FUNCTION`` that registers more): (per-rank reports, rank 0's outputs)."""
    return _launch_groups(tmp_path_factory, frontend, {tag: args}, exchanges, plugin)[tag]


def _launch_groups(
    tmp_path_factory, frontend: str, groups: dict, exchanges=EXCHANGE_NAMES, plugin: str | None = None
) -> dict:
    """One launch of the worker on ``frontend`` that runs each of ``groups`` (tag -> its arguments)
    in turn: {tag: (per-rank reports, rank 0's outputs)}."""
    launcher, module = FRONTENDS[frontend]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is not installed")
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **PINNED_KERNELS}  # this checkout's package
    argv, outs = [], {}
    for tag, args in groups.items():
        outs[tag] = out = tmp_path_factory.mktemp(f"{tag}-{frontend}")
        common = ["--frontend", frontend, "--exchanges", ",".join(exchanges), "--elements", N, "--bits", BITS]
        common += ["--bucket", BUCKET, "--seed", SEED, "--out", out] + (["--plugin", plugin] if plugin else [])
        argv += [*(["::"] if argv else []), *common, *args]
    reports = run_ranks(WORKER, np=SIZE, launcher=launcher, timeout=300 * len(groups), env=env, args=argv)
    if len(groups) > 1:
        reports = {tag: [r["groups"][k] for r in reports] for k, tag in enumerate(groups)}
    else:
        reports = {tag: reports for tag in groups}
    return {tag: (reports[tag], dict(np.load(outs[tag] / f"{frontend}.npz"))) for tag in groups}


def _front(tmp_path_factory, frontend: str) -> dict:
    """The front-end's one launch: the fixed wire (every method), then the entropy-coded wire and
    error feedback where it serves them (below): {tag: (per-rank reports, rank 0's outputs)}."""
    if frontend not in _CACHE:
        groups = {"conformance": ["--methods", ",".join(METHODS), "--rounds", ROUNDS]}
        if frontend in ENTROPY_FRONTENDS:
            groups["entropy"] = ["--methods", "alq", "--rounds", ENTROPY_ROUNDS, "--wire", "entropy"]
        if frontend in FEEDBACK_FRONTENDS:
            groups["feedback"] = ["--methods", "alq", "--rounds", FEEDBACK_ROUNDS, "--error-feedback"]
        try:
            _CACHE[frontend] = _launch_groups(tmp_path_factory, frontend, groups)
        except pytest.fail.Exception as exc:  # fail every test of this front-end, launch once
            _CACHE[frontend] = exc
    if isinstance(_CACHE[frontend], BaseException):
        raise _CACHE[frontend]
    return _CACHE[frontend]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(frontend)``: (per-rank reports, rank 0's outputs) of the fixed wire, every method."""
    return lambda frontend: _front(tmp_path_factory, frontend)["conformance"]


def _run(launched, frontend, method, exchange):
    """Every rank's report of one (method, exchange), and rank 0's outputs (ROUNDS, N) float32."""
    reports, arrays = launched(frontend)
    key = f"{method}|{exchange}"
    infos = [r["runs"][key] for r in reports]
    for rank, info in enumerate(infos):
        assert info.get("error") is None, f"{frontend} refused {exchange} with {method} on rank {rank}: {info['error']}"
    return infos, arrays[key]


def refusal(frontend: str, exchange: str) -> str | None:
    """The words of the error with which ``frontend`` refuses ``exchange`` by design (its capability
    flags: TensorFlow runs only the exchanges with a graph execution), else None."""
    if frontend == "tf" and not registry.get(exchange).graph:
        return "for them use the PyTorch compressors"
    return None


#: (front-end, exchange) pairs refused by design, and the words of the error.
REFUSED = {(f, e): refusal(f, e) for f in FRONTENDS for e in EXCHANGE_NAMES if refusal(f, e)}
CASES = [pytest.param(f, e, id=f"{f}-{e}") for f in FRONTENDS for e in EXCHANGE_NAMES if (f, e) not in REFUSED]


def test_every_refusal_says_what_to_use(launched):
    """The (front-end, exchange) pairs refused by design (none since TensorFlow runs every exchange
    in its graph) raise with the words that name the alternative, for every method and rank."""
    for frontend, exchange in REFUSED:
        reports, _ = launched(frontend)
        for method in METHODS:
            for rank, r in enumerate(reports):
                error = r["runs"][f"{method}|{exchange}"].get("error")
                assert error is not None and refusal(frontend, exchange) in error, (rank, method, error)
    assert all(registry.get(e).graph for e in EXCHANGE_NAMES) == (not REFUSED)


def test_registry_is_consistent():
    """Every exchange is an allreduce (tested here) or a reduce-scatter that names the allreduce
    whose first stages it is; names and wire ids are unique and the handshake knows them."""
    from horovod_alq.core.protocol import EXCHANGE_NAMES as HANDSHAKE_NAMES

    assert EXCHANGE_NAMES, "the registry is empty"
    ids = {e.wire_id: e.name for e in registry.REGISTRY.values()}
    assert len(ids) == len(registry.REGISTRY) and HANDSHAKE_NAMES == ids
    for e in registry.REGISTRY.values():
        assert e.allreduce or e.shard_of is None or e.shard_of in EXCHANGE_NAMES, e
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("allgather"))


@pytest.mark.parametrize("frontend, exchange", CASES)
def test_runs_the_exchange(launched, frontend, exchange):
    """The front-end accepted the exchange, ran it (its metrics say so) on every round, quantized
    the whole tensor, and refit the adaptive levels once."""
    for method in METHODS:
        infos, _ = _run(launched, frontend, method, exchange)
        for info in infos:
            assert info["exchange"] == exchange, (frontend, method, info["exchange"])
            assert info["step"] == ROUNDS + 1 and info["uncompressed_coordinates"] == 0, (frontend, method, info)
            assert info["coordinates"] == (ROUNDS + 1) * N, (frontend, method, info)
            assert info["level_updates"] == (1 if method == "alq" else 0), (frontend, method, info)
            assert info["second_levels"] == info["levels"], "equal bits: the second levels follow the first"


@pytest.mark.parametrize("frontend, exchange", CASES)
def test_identical_on_both_ranks(launched, frontend, exchange):
    """1. Bit-identical results (and levels) on both ranks, every round."""
    for method in METHODS:
        infos, outs = _run(launched, frontend, method, exchange)
        assert outs.shape == (ROUNDS, N) and outs.dtype == np.float32
        digests = [info["digests"] for info in infos]  # SHA-1 of each round's output on each rank
        assert len(digests[0]) == ROUNDS
        differ = [i for i in range(ROUNDS) if len({d[i] for d in digests}) > 1]
        assert not differ, f"{frontend}/{exchange}/{method}: ranks differ in rounds {differ}"
        assert all(info["levels"] == infos[0]["levels"] for info in infos)


@pytest.mark.parametrize("frontend, exchange", CASES)
def test_unbiased(launched, frontend, exchange):
    """2. The mean of the R rounds is the exact average.

    With the levels fixed after the warm-up, the R rounds are i.i.d. (fresh rounding noise each
    round). Per bucket ``b``, the per-round error sum ``S_rb = sum_{i in b} (y_ri - avg_i)`` is a sum
    of 256 bounded rounding errors, close to normal (CLT), with mean ``sum_i bias_i``; its sample
    variance over the rounds includes the covariances within the bucket (two-phase: the second
    norm depends on the first-phase sum), so ``t_b = mean_r S_rb / (sd_r S_rb / sqrt(R))`` is
    Student(R - 1) for an unbiased front-end. Also the sum over all coordinates (an offset) and the
    sum signed by the exact average (a scale error). Bonferroni over these 43 + 2 statistics at
    ``ALPHA``: |t| < 7.0 for R = 40 (a 1% scale error gave t = 18 with allgather, 8 with two-phase).
    float32 rounding of the outputs is ~1e-7 relative: negligible against the noise (~0.3 relative).
    """
    truth = exact_average()
    starts = np.arange(0, N, BUCKET)
    for method in METHODS:
        _, outs = _run(launched, frontend, method, exchange)
        err = outs.astype(np.float64) - truth
        stats = np.concatenate(
            [
                t_stat(np.add.reduceat(err, starts, axis=1)),
                t_stat(err.sum(1, keepdims=True)),
                t_stat((err @ np.sign(truth))[:, None]),
            ]
        )
        bound = t_bound(ROUNDS, stats.size, ALPHA)
        rel = float(np.sqrt((err**2).sum(1).mean() / (truth**2).sum()))
        what = f"{frontend}/{exchange}/{method}: t per bucket, total, signed = {np.round(stats, 2)}, bound {bound:.2f}"
        assert np.all(np.isfinite(stats)), what + " (no noise: not quantized?)"
        assert np.abs(stats).max() < bound, what
        assert 0.05 < rel < 0.8, f"{what}; relative error {rel:.3f}: 3-bit noise, not garbage"


@pytest.mark.parametrize("frontend, exchange", CASES)
def test_bytes_from_the_wire_format(launched, frontend, exchange):
    """3. bytes_sent and bytes_received of every round (the warm-up's included) are the wire format's."""
    for method in METHODS:
        infos, _ = _run(launched, frontend, method, exchange)
        for rank, info in enumerate(infos):
            sent, received = expected_bytes(exchange, rank)
            assert set(info["bytes_sent"]) == {sent}, (frontend, exchange, method, rank, info["bytes_sent"], sent)
            assert set(info["bytes_received"]) == {received}, (
                frontend,
                exchange,
                method,
                rank,
                info["bytes_received"],
                received,
            )
            assert len(info["bytes_sent"]) == ROUNDS + 1


@pytest.mark.parametrize("exchange", EXCHANGE_NAMES)
@pytest.mark.parametrize("method", METHODS)
def test_frontends_agree(launched, exchange, method):
    """4. Across front-ends: the same levels and bytes (exactly), and the same noise.

    Noise: per bucket, the per-round squared error ``E_rb = sum_{i in b} (y_ri - avg_i)^2`` has mean
    the bucket's MSE; over the R i.i.d. rounds its mean has standard error ``sd_r E_rb / sqrt(R)``.
    Two front-ends with the same levels and exchange draw from one law (the codecs differ only in
    their random streams), so ``z = (mean_f - mean_g) / sqrt(se_f^2 + se_g^2)`` is about Student
    with ~2(R - 1) degrees of freedom; Bonferroni over the 43 buckets and 6 pairs at ``ALPHA``
    (|z| < 6.6). This catches correlated random streams (noise added twice in one direction),
    which unbiasedness does not.
    """
    truth = exact_average()
    starts = np.arange(0, N, BUCKET)
    serving = [f for f in FRONTENDS if refusal(f, exchange) is None]
    runs = {f: _run(launched, f, method, exchange) for f in serving}
    levels = {f: infos[0]["levels"] for f, (infos, _) in runs.items()}
    sent = {f: [i["bytes_sent"][0] for i in infos] for f, (infos, _) in runs.items()}
    mse, se = {}, {}
    for f, (_, outs) in runs.items():
        e = np.add.reduceat((outs.astype(np.float64) - truth) ** 2, starts, axis=1)
        mse[f], se[f] = e.mean(0), e.std(0, ddof=1) / np.sqrt(ROUNDS)
    pairs = list(itertools.combinations(serving, 2))
    bound = student.isf(ALPHA / (2 * len(pairs) * starts.size), 2 * (ROUNDS - 1))
    table = "\n".join(
        f"  {f:5s} MSE per bucket {np.round(mse[f] / np.diff([*starts, N]), 4)}  bytes_sent {sent[f]}" for f in serving
    )
    assert len({repr(v) for v in levels.values()}) == 1, f"levels differ across front-ends: {levels}"
    assert len({repr(v) for v in sent.values()}) == 1, f"bytes_sent differ across front-ends:\n{table}"
    worst = {(f, g): float(np.abs((mse[f] - mse[g]) / np.sqrt(se[f] ** 2 + se[g] ** 2)).max()) for f, g in pairs}
    bad = {k: round(v, 1) for k, v in worst.items() if v >= bound}
    assert not bad, (
        f"{exchange}/{method}: noise differs between front-ends (max |z| {bad}, bound {bound:.1f}):\n{table}"
    )


# ------------------------------------------------------------------ the entropy-coded wire
#: The front-ends that serve ``wire="entropy"`` (TensorFlow refuses it: tests/test_settings.py).
ENTROPY_FRONTENDS = ("torch", "ddp", "mpi")
ENTROPY_ROUNDS = 3


@pytest.fixture(scope="module")
def launched_entropy(tmp_path_factory):
    """``launched_entropy(frontend)``: per-rank reports of the runs with ``wire="entropy"`` (alq,
    every exchange, the fixed runs' seed and inputs, ENTROPY_ROUNDS rounds; the front-end's launch)."""
    return lambda frontend: _front(tmp_path_factory, frontend)["entropy"][0]


@pytest.mark.parametrize("exchange", EXCHANGE_NAMES)
@pytest.mark.parametrize("frontend", ENTROPY_FRONTENDS)
def test_entropy_wire_gives_the_fixed_wires_results(launched, launched_entropy, frontend, exchange):
    """On real ranks, every exchange on the entropy-coded wire gives, round for round and on every
    rank, the bit-identical results of the fixed wire (same seed: same codes), for fewer bytes
    (the flat exchanges; the hierarchical ones on one node send mostly float32, verbatim)."""
    fixed, _ = _run(launched, frontend, "alq", exchange)
    coded = [r["runs"][f"alq|{exchange}"] for r in launched_entropy(frontend)]
    for rank, (f, c) in enumerate(zip(fixed, coded)):
        assert c.get("error") is None, (frontend, exchange, rank, c.get("error"))
        assert c["digests"] == f["digests"][:ENTROPY_ROUNDS], (frontend, exchange, rank)
        assert f["wire_coded_bytes"] == 0 and c["wire_fixed_bytes"] > 0, (f, c)
        # on one node the hierarchical exchanges send float32 sums (raw frames: 32 bytes more each)
        bound = 1.01 if exchange.startswith("hierarchical") else 1.0
        assert c["wire_coded_bytes"] < bound * c["wire_fixed_bytes"], (frontend, exchange, rank, c)


# ------------------------------------------------------------------ error feedback
#: The front-ends that serve ``error_feedback`` through these launches (FSDP2 and DiLoCo: tests/torch).
FEEDBACK_FRONTENDS = ("torch", "tf", "ddp", "mpi")
FEEDBACK_ROUNDS = 12


@pytest.fixture(scope="module")
def launched_feedback(tmp_path_factory):
    """``launched_feedback(frontend)``: (reports, rank 0's outputs) of the runs with
    ``error_feedback=True`` (alq, every exchange, FEEDBACK_ROUNDS rounds of the same input; the
    front-end's launch)."""
    return lambda frontend: _front(tmp_path_factory, frontend)["feedback"]


@pytest.mark.parametrize("exchange", EXCHANGE_NAMES)
@pytest.mark.parametrize("frontend", FEEDBACK_FRONTENDS)
def test_error_feedback_applies_the_true_sum_less_the_buffers(launched_feedback, frontend, exchange):
    """On real ranks, for every exchange: each round's average is ``(sum of what the ranks meant to
    send - what they keep) / N``, so over the rounds after the warm-up the applied sum is R times the
    exact average plus the ranks' buffers after the warm-up less their buffers after the last
    round, over N (every rank's buffers from its ``state_dict()``), and identical on both ranks."""
    reports, arrays = launched_feedback(frontend)
    infos = [r["runs"][f"alq|{exchange}"] for r in reports]
    for rank, info in enumerate(infos):
        assert info.get("error") is None, (frontend, exchange, rank, info.get("error"))
        assert info["digests"] == infos[0]["digests"], (frontend, exchange, "ranks differ")
    outs = arrays[f"alq|{exchange}"].astype(np.float64)
    first = np.sum([info["buffers"][0] for info in infos], axis=0)
    last = np.sum([info["buffers"][1] for info in infos], axis=0)
    drift = outs.sum(0) - FEEDBACK_ROUNDS * exact_average()
    assert np.abs(last).max() > 0, "no error kept"
    scale = np.abs(exact_average()).max()
    np.testing.assert_allclose(drift, (first - last) / SIZE, atol=1e-5 * FEEDBACK_ROUNDS * scale * 10)


# ------------------------------------------------------------------ golden rounds (refactoring guard)
GOLDEN = ROOT / "tests" / "data" / "golden_conformance.json"
#: The kernels of every conformance launch: torch's generic (not AVX2 / AVX-512) kernels, the
#: compiled codec's generic kernels, NumPy's x86-64-v2 baseline loops and no oneDNN in TensorFlow.
#: Results then do not depend on the CPU: test_golden_rounds runs, and compares, on any x86-64.
PINNED_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",
    "HOROVOD_ALQ_SIMD": "0",
    "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
    "TF_ENABLE_ONEDNN_OPTS": "0",
}
UPDATE_GOLDEN = "HOROVOD_ALQ_UPDATE_GOLDEN"


def _signature() -> dict:
    """What the recorded digests depend on besides the code: the architecture, the packages'
    versions and the kernels, which the launches pin (:data:`PINNED_KERNELS`), so that no CPU's
    vector width changes the order in which floats are summed: the same on every x86-64 CPU."""
    import platform

    import torch

    return {"machine": platform.machine(), "torch": torch.__version__, "numpy": np.__version__,
            "kernels": " ".join(f"{k}={v}" for k, v in sorted(PINNED_KERNELS.items()))}  # fmt: skip


def _fingerprint(infos: list) -> dict:
    """One (method, exchange) run: the digest of every round's output on every rank, levels, bytes."""
    import hashlib

    rounds = hashlib.sha1("".join(d for info in infos for d in info["digests"]).encode()).hexdigest()
    return {"rounds": rounds, "levels": infos[0]["levels"], "bytes_sent": [i["bytes_sent"][0] for i in infos]}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_golden_rounds(launched, frontend):
    """Every front-end, exchange and method gives the recorded results, bit for bit: the rounds'
    output digests on every rank, the levels and the bytes of tests/data/golden_conformance.json.
    A change that alters results on purpose (a wire format, a rounding rule) re-records them with
    ``HOROVOD_ALQ_UPDATE_GOLDEN=1 pytest tests/test_conformance.py -k golden`` and says why in its
    commit; a refactoring must leave them alone. The launches pin their kernels, so the digests are
    the same on any x86-64 CPU; skipped only on another architecture or other package versions
    than requirements/pinned.txt's (the recording's), never for the CPU model."""
    import json

    reports, _ = launched(frontend)
    keys = sorted(reports[0]["runs"])
    found = {
        key: _fingerprint([r["runs"][key] for r in reports])
        for key in keys
        if reports[0]["runs"][key].get("error") is None
    }
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"signature": _signature(), "frontends": {}}
    if os.environ.get(UPDATE_GOLDEN) == "1":
        stored["signature"] = _signature()
        stored["frontends"][frontend] = found
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    if stored["signature"] != _signature():
        pytest.skip(f"recorded on {stored['signature']}, this machine is {_signature()}")
    golden = stored["frontends"].get(frontend)
    assert golden is not None, f"no golden rounds for {frontend}: record them with {UPDATE_GOLDEN}=1"
    differ = sorted(k for k in set(golden) | set(found) if golden.get(k) != found.get(k))
    assert not differ, f"{frontend}: results differ from the recorded ones for {differ}"
