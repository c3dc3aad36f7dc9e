"""horovod_alq.core.methods: the method table (against Table 1 of docs/design/design.md), the bits and
norm checks, and the fixed and initial level sets."""

import re
from pathlib import Path

import numpy as np
import pytest

from horovod_alq.core.methods import (
    MAX_BITS,
    METHODS,
    METHODS_BY_ID,
    MIN_BITS,
    NORMS,
    NORMS_BY_CODE,
    PAPER_NORM,
    check_bits,
    check_norm,
    get_method,
    initial_levels,
    multiplier_levels,
    nuqsgd_levels,
    terngrad_levels,
    uniform_levels,
)

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design" / "design.md"
BITS = range(MIN_BITS, MAX_BITS + 1)


def _design_table() -> dict:
    """``{name: (id, norm, adaptive column)}`` from the method table of docs/design/design.md."""
    rows = {}
    for line in DESIGN.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in METHODS:
            rows[cells[0]] = (int(cells[1]), cells[2].split()[0], cells[3])
    return rows


def test_table_is_the_one_in_design_md():
    table = _design_table()
    assert set(table) == set(METHODS) and len(METHODS) == 8
    for name, (id_, norm, adapts) in table.items():
        m = METHODS[name]
        assert (m.name, m.id, m.norm) == (name, id_, norm), name
        kind = adapts.replace(",", " ").split()[0]  # "no", "levels" or "multiplier"
        assert m.adapts == (None if kind == "no" else kind) and m.adaptive == (kind != "no"), name
        assert m.normless == ("single truncated normal" in adapts), name


def test_ids_and_norm_codes_are_one_to_one():
    assert sorted(METHODS_BY_ID) == list(range(len(METHODS)))
    assert all(METHODS_BY_ID[m.id] is m for m in METHODS.values())
    assert NORMS == {"l2": 0, "linf": 1} and NORMS_BY_CODE == {0: "l2", 1: "linf"} and PAPER_NORM == "l2"


def test_get_method_ignores_case_and_names_the_allowed_values():
    assert get_method("ALQ-N") is METHODS["alq-n"]
    for bad in ("alq2", "", None, 4):
        with pytest.raises(ValueError, match="allowed: qsgdinf, qsgd, nuqsgd, terngrad, alq"):
            get_method(bad)


@pytest.mark.parametrize("name", [n for n in METHODS if n != "terngrad"])
def test_check_bits_takes_2_to_8_integers(name):
    m = METHODS[name]
    for bits in BITS:
        assert check_bits(m, bits) == bits and type(check_bits(m, np.int64(bits))) is int
    for bits in (MIN_BITS - 1, MAX_BITS + 1, 0, -3):
        with pytest.raises(ValueError, match="bits must be from 2 to 8"):
            check_bits(m, bits)
    for bits in (True, 3.0, "3", None):
        with pytest.raises(ValueError, match="bits must be an integer from 2 to 8"):
            check_bits(m, bits)


def test_terngrad_takes_only_2_bits():
    m = METHODS["terngrad"]
    assert check_bits(m, 2) == 2
    for bits in (3, 8):
        with pytest.raises(ValueError, match="terngrad sends its 3 levels on 2 bits"):
            check_bits(m, bits)


@pytest.mark.parametrize("name", list(METHODS))
def test_check_norm(name):
    m = METHODS[name]
    assert check_norm(m, None) == m.norm
    assert check_norm(m, m.norm.upper()) == m.norm
    other = "l2" if m.norm == "linf" else "linf"
    if m.adaptive:
        assert check_norm(m, other) == other
    else:
        with pytest.raises(ValueError, match=f"{name} has fixed norm {m.norm!r}"):
            check_norm(m, other)
    for bad in ("l1", "", 2):
        with pytest.raises(ValueError, match="norm must be one of 'l2', 'linf'"):
            check_norm(m, bad)


@pytest.mark.parametrize("bits", BITS)
def test_fixed_and_initial_levels_follow_the_table(bits):
    """Table 1: linspace(-1, 1, 2^b) (QSGD, QSGDinf), +-{2^-s, ..., 1/2, 1} with s = 2^(b-1) - 1
    (NUQSGD, and the start of the adaptive methods before their Gaussian fit), TernGrad {-1, 0, 1}."""
    s = 2 ** (bits - 1) - 1
    uniform = np.linspace(-1, 1, 2**bits)
    half = 2.0 ** -np.arange(s, -1, -1)
    nuq = np.concatenate([-half[::-1], half])
    assert np.allclose(uniform_levels(bits), uniform, rtol=0, atol=1e-15)
    assert np.array_equal(uniform_levels(bits), -uniform_levels(bits)[::-1])  # exactly antisymmetric
    assert np.array_equal(nuqsgd_levels(bits), nuq)
    assert np.array_equal(multiplier_levels(0.5, bits), nuq)
    for name in ("qsgd", "qsgdinf"):
        assert np.array_equal(initial_levels(METHODS[name], bits), uniform_levels(bits))
    for name in ("nuqsgd", "alq", "alq-n", "amq", "amq-n"):
        assert np.array_equal(initial_levels(METHODS[name], bits), nuq)
    for name in METHODS:
        levels = initial_levels(METHODS[name], bits)
        assert levels.dtype == np.float64 and levels[0] == -1 and levels[-1] == 1
        assert np.all(np.diff(levels) > 0)
        if name != "terngrad":
            assert levels.size == 2**bits and not np.any(levels == 0)  # no zero level (TernGrad excepted)
    assert np.array_equal(initial_levels(METHODS["terngrad"], bits), [-1.0, 0.0, 1.0])
    assert np.array_equal(terngrad_levels(), [-1.0, 0.0, 1.0])


def test_multiplier_levels():
    p = 0.3
    levels = multiplier_levels(p, 3)
    assert np.allclose(levels, [-1, -p, -(p**2), -(p**3), p**3, p**2, p, 1], rtol=1e-15)
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=re.escape("multiplier p must lie in (0, 1)")):
            multiplier_levels(bad, 3)
