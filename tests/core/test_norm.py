"""The bucket norm of the adaptive methods (``norm="l2" | "linf"``): variance, unbiasedness, wire
header, state and argument checks of the NumPy core."""

import numpy as np
import pytest

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import METHODS, NORMS, check_norm
from horovod_alq.core.quantizer import gaussian_sigma
from horovod_alq.core.statistics import normalize
from horovod_alq.core.wire import parse_header

ADAPTIVE = ["alq", "alq-n", "amq", "amq-n"]
N = 1 << 18


def exact_variance(q: Quantizer, x: np.ndarray) -> float:
    """E||Q(x) - x||^2 / ||x||^2 of unbiased stochastic rounding with ``q``'s norm and levels:
    sum over coordinates of n_b^2 (hi - r)(r - lo)."""
    nz = normalize(x, q.bucket_size, q.norm)
    r = nz.r.reshape(-1)[: x.size]
    norms = np.repeat(nz.norms.astype(np.float64), q.bucket_size)[: x.size]
    levels = q.levels
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    return float((norms**2 * (levels[j + 1] - r) * (r - levels[j])).sum() / (x.astype(np.float64) ** 2).sum())


def _data(kind: str) -> np.ndarray:
    rng = np.random.default_rng({"gaussian": 0, "student-t3": 1}[kind])
    return rng.standard_normal(N) if kind == "gaussian" else rng.standard_t(3, N)


@pytest.mark.parametrize("d", [512, 8192])
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("kind", ["gaussian", "student-t3"])
def test_max_norm_buckets_lower_the_exact_variance(kind, bits, d):
    """Issue 15's synthetic cases: levels fitted to the data itself, exact variance (no sampling,
    so the comparison is deterministic given the seeded data). Ratios linf / l2 measured on these
    data: ALQ and AMQ 0.17 to 0.70 (asserted below 0.75); the -N forms 0.17 to 1.00: AMQ-N on
    Student-t(3) at 3 bits, d = 8192 gains nothing (0.692 vs 0.695), its single truncated normal
    fits heavy tails badly with either norm (asserted: not worse than 1%)."""
    x = _data(kind)
    for method in ADAPTIVE:
        var = {}
        for norm in ("l2", "linf"):
            q = Quantizer(method, bits=bits, bucket_size=d, norm=norm)
            q.adapt(q.statistics(x))
            var[norm] = exact_variance(q, x)
        if method in ("alq", "amq"):
            assert var["linf"] < 0.75 * var["l2"], (method, var)
        else:
            assert var["linf"] <= 1.01 * var["l2"], (method, var)


@pytest.mark.parametrize(
    "method,bits,bucket", [("alq", 2, 64), ("alq", 3, 100), ("amq", 3, 100), ("alq-n", 4, 256), ("amq-n", 2, 1000)]
)
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_unbiased_with_either_norm(method, bits, bucket, norm):
    """Mean of M core encodes within a per-coordinate Bernstein bound of x (exact variance of each
    coordinate's rounding), failure probability 1e-9 per coordinate."""
    q = Quantizer(method, bits=bits, bucket_size=bucket, seed=0, norm=norm)
    rng = np.random.default_rng(bits)
    n, m = 1500, 400
    x = (rng.standard_t(3, n)).astype(np.float32)
    x[:bucket] = 0.0
    q.adapt(q.statistics(x))
    payloads = [q.encode(x) for _ in range(m)]
    mean = np.stack([q.decode(p) for p in payloads]).astype(np.float64).mean(0)
    nz = normalize(x, bucket, norm)
    norms = np.repeat(nz.norms.astype(np.float64), bucket)[:n]
    target = x.astype(np.float64)
    r = np.clip(np.divide(target, norms, out=np.zeros(n), where=norms > 0), -1, 1)
    levels = q.levels.astype(np.float32).astype(np.float64)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    var = norms**2 * np.clip((levels[j + 1] - r) * (r - levels[j]), 0, None)
    c = norms * (levels[j + 1] - levels[j]) / m
    log_term = np.log(2 / 1e-9)
    bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var / m * log_term)
    bound += 1e-6 * (np.abs(target) + norms)  # float32 decode
    assert (np.abs(mean - target) <= bound).all()
    assert (mean[:bucket] == 0).all()


@pytest.mark.parametrize("method", ADAPTIVE)
def test_payload_with_the_other_norm_is_refused(method):
    x = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    a = Quantizer(method, bits=3, bucket_size=512, seed=0, norm="linf")
    b = Quantizer(method, bits=3, bucket_size=512, seed=0, norm="l2")
    b.set_levels(a.levels)  # same levels, same fingerprint: only the norm differs
    pa, pb = a.encode(x), b.encode(x)
    assert parse_header(pa).norm == "linf" and pa[5] == NORMS["linf"] == 1
    assert parse_header(pb).norm == "l2" and pb[5] == NORMS["l2"] == 0
    with pytest.raises(ValueError, match="payload made with norm=linf, this quantizer uses norm=l2"):
        b.decode(pa)
    with pytest.raises(ValueError, match="payload made with norm=l2, this quantizer uses norm=linf"):
        a.decode(pb)
    np.testing.assert_array_equal(a.decode(pa), np.float32(a.decode(pa)))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_default_norm_and_fixed_norms(method):
    m = METHODS[method]
    assert Quantizer(method).norm == m.norm
    assert Quantizer(method, norm=m.norm).norm == m.norm
    other = {"l2": "linf", "linf": "l2"}[m.norm]
    if m.adaptive:
        assert Quantizer(method, norm=other).norm == other
        assert Quantizer(method, norm=other.upper()).norm == other
    else:
        with pytest.raises(ValueError, match=f"{method} has fixed norm '{m.norm}'"):
            Quantizer(method, norm=other)


@pytest.mark.parametrize("bad", ["l1", "L3", "", 2, True])
def test_bad_norm_names_the_allowed_values(bad):
    with pytest.raises(ValueError, match="norm must be one of 'l2', 'linf'"):
        Quantizer("alq", norm=bad)
    with pytest.raises(ValueError, match="norm must be one of 'l2', 'linf'"):
        check_norm(METHODS["amq"], bad)


@pytest.mark.parametrize("method", ["alq", "amq"])
def test_state_dict_round_trip_records_the_norm(method):
    x = np.random.default_rng(2).standard_t(3, 20000)
    a = Quantizer(method, bits=3, bucket_size=1024, seed=5, norm="linf")
    a.adapt(a.statistics(x))
    state = a.state_dict()
    assert state["norm"] == "linf"
    b = Quantizer(method, bits=3, bucket_size=1024, norm="linf")
    b.load_state_dict(state)
    assert b.fingerprint == a.fingerprint and b.norm == "linf"
    np.testing.assert_array_equal(b.encode(x), a.encode(x))  # same levels, same random state
    with pytest.raises(ValueError, match="state has norm='linf', this quantizer has norm='l2'"):
        Quantizer(method, bits=3, bucket_size=1024, norm="l2").load_state_dict(state)
    # a state saved before the norm was configurable has the paper's L2 buckets
    legacy = {
        k: v for k, v in Quantizer(method, bits=3, bucket_size=1024, norm="l2").state_dict().items() if k != "norm"
    }
    Quantizer(method, bits=3, bucket_size=1024, norm="l2").load_state_dict(legacy)
    with pytest.raises(ValueError, match="state has norm='l2', this quantizer has norm='linf'"):
        Quantizer(method, bits=3, bucket_size=1024, norm="linf").load_state_dict(legacy)


def test_gaussian_sigma_of_max_norm_buckets():
    """Initial levels of max-abs buckets assume N(0, sigma^2) with 1/sigma the median max-abs of d
    standard normals; checked against a seeded simulation (standard error of the median ~0.5%)."""
    rng = np.random.default_rng(0)
    for d in (64, 8192):
        sim = np.median(np.abs(rng.standard_normal((2000, d))).max(axis=1))
        assert abs(1 / gaussian_sigma(d, "linf") - sim) < 0.03 * sim
        assert gaussian_sigma(d, "l2") == 1 / np.sqrt(d)
    assert gaussian_sigma(1, "linf") == 1.0
