"""horovod_alq.core.rounds: which rounds refit (RefitSchedule, schedule_from), RoundState's
counters, refit flags and metrics, and its state_dict round trip and refusals."""

import math

import numpy as np
import pytest

from horovod_alq.core import Quantizer
from horovod_alq.core.rounds import (
    COUNTERS,
    DEFAULT_UPDATE_EVERY,
    DEFAULT_UPDATE_STEPS,
    AutoBits,
    RefitSchedule,
    RoundState,  # AutoBits: the type of RoundState.auto
    schedule_from,
)


def _collecting(schedule, upto):
    return [t for t in range(upto) if schedule.collects(t)]


def test_default_schedule_is_the_papers_then_periodic():
    s = RefitSchedule()
    assert (s.steps, s.every) == (DEFAULT_UPDATE_STEPS, DEFAULT_UPDATE_EVERY) == ((0, 100, 2000), 10_000)
    assert _collecting(s, 50_001) == [0, 100, 2000, 10_000, 20_000, 30_000, 40_000, 50_000]


def test_period_counts_only_past_the_last_step():
    assert _collecting(RefitSchedule((0, 25), 10), 61) == [0, 25, 30, 40, 50, 60]  # not 10 or 20
    assert _collecting(RefitSchedule((3, 7), 0), 1000) == [3, 7]  # every=0: never past the steps
    assert _collecting(RefitSchedule((), 5), 21) == [0, 5, 10, 15, 20]
    assert _collecting(RefitSchedule((), 0), 1000) == []


def test_steps_are_sorted_deduplicated_and_validated():
    s = RefitSchedule([100, 0, 100, 7], 3.0)
    assert s.steps == (0, 7, 100) and s.every == 3 and type(s.every) is int
    with pytest.raises(ValueError, match="update_steps must be non-negative"):
        RefitSchedule((0, -1))
    for every in (-1, 2.5, True, False):
        with pytest.raises(ValueError, match="update_every must be a non-negative integer"):
            RefitSchedule((0,), every)


def test_schedule_from_the_keywords():
    assert schedule_from(None, None) == RefitSchedule()
    assert schedule_from([5, 1], 0) == RefitSchedule((1, 5), 0)
    assert schedule_from(None, 7) == RefitSchedule(DEFAULT_UPDATE_STEPS, 7)
    assert schedule_from((), None) == RefitSchedule((), DEFAULT_UPDATE_EVERY)


def _state(method="alq", bits=3, second_bits=None, **kw) -> RoundState:
    q = Quantizer(method, bits=bits, bucket_size=64)
    second = None if second_bits is None else Quantizer(method, bits=second_bits, bucket_size=64)
    return RoundState(q, second=second, **kw)


def test_second_quantizer_defaults_to_the_first_and_follows_it():
    st = _state()
    assert (st.second.method, st.second.bits, st.second.bucket_size, st.second.norm) == ("alq", 3, 64, "linf")
    assert st.second is not st.quantizer and not st.adapt_second and st.follows_first
    levels = np.array([-1, -0.5, -0.2, -0.05, 0.05, 0.2, 0.5, 1])
    st.quantizer.set_levels(levels)
    assert not np.array_equal(st.second.levels, levels)
    st.refitted_first()
    assert np.array_equal(st.second.levels, levels)


def test_second_quantizer_with_other_bits_adapts_on_its_own():
    st = _state(second_bits=4)
    assert st.adapt_second and not st.follows_first
    before = st.second.levels.copy()
    st.quantizer.set_levels(np.array([-1, -0.5, -0.2, -0.05, 0.05, 0.2, 0.5, 1]))
    st.refitted_first()
    assert np.array_equal(st.second.levels, before)
    assert _state(second_bits=3, adapt_second=True).adapt_second  # asked for at equal bits


def test_collecting_flags_follow_the_schedule():
    st = _state(schedule=RefitSchedule((0, 4), 0), second_bits=4)
    first, second = [], []
    for step in range(8):
        st.step = step
        first.append(st.collecting)
        second.append(st.collecting_second)
    assert first == [True, False, False, False, True, False, False, False]
    assert second == [False, True, False, False, False, True, False, False]  # the round after each refit
    same_bits = _state(schedule=RefitSchedule((0,), 0))
    same_bits.step = 1
    assert not same_bits.collecting_second  # follows the first instead
    fixed = _state("qsgd", schedule=RefitSchedule((0,), 1))
    for step in range(5):
        fixed.step = step
        assert not fixed.collecting and fixed.schedule.collects(step)  # fixed methods never refit


def test_metrics_report_the_counters():
    st = _state()
    m = st.metrics()
    assert all(m[key] == 0 for key in COUNTERS) and math.isnan(m["bits_per_coordinate"])
    assert m["exchange"] is None and np.array_equal(m["levels"], st.quantizer.levels)
    assert m["multiplier"] is None and np.array_equal(m["second_levels"], st.second.levels)
    st.payload_bytes, st.coordinates, st.exchange = 300, 800, "two-phase"
    m = st.metrics()
    assert m["bits_per_coordinate"] == 3.0 and m["exchange"] == "two-phase"
    assert "allocation" not in m
    amq = _state("amq")
    assert amq.quantizer.multiplier is not None and amq.metrics()["multiplier"] == amq.quantizer.multiplier


def _filled(st: RoundState) -> RoundState:
    for k, key in enumerate(COUNTERS):
        setattr(st, key, 10 + k)
    st.quantizer.set_levels(np.array([-1, -0.6, -0.3, -0.1, 0.1, 0.3, 0.6, 1]))
    st.second.set_levels(np.array([-1, -0.7, -0.4, -0.1, 0.1, 0.4, 0.7, 1]))
    return st


def test_state_dict_round_trip():
    saved = _filled(_state()).state_dict()
    assert set(saved) == {"quantizer", "second", *COUNTERS}
    st = _state()
    st.load_state_dict(saved)
    assert {key: getattr(st, key) for key in COUNTERS} == {key: 10 + k for k, key in enumerate(COUNTERS)}
    assert np.array_equal(st.quantizer.levels, saved["quantizer"]["levels"])
    assert np.array_equal(st.second.levels, saved["second"]["levels"])
    again = st.state_dict()
    assert {k: again[k] for k in COUNTERS} == {k: saved[k] for k in COUNTERS}


def test_old_state_without_second_or_byte_counters_loads():
    saved = _filled(_state()).state_dict()
    for key in ("second", "bytes_sent", "bytes_received", "recovered"):
        del saved[key]
    st = _state()
    initial_second = st.second.levels.copy()
    st.load_state_dict(saved)
    assert st.step == saved["step"] and st.bytes_sent == st.bytes_received == st.recovered == 0
    assert np.array_equal(st.second.levels, initial_second)


def test_state_of_another_configuration_is_refused():
    saved = _filled(_state()).state_dict()
    with pytest.raises(ValueError, match="state has bits=3, this quantizer has bits=4"):
        _state(bits=4).load_state_dict(saved)
    with pytest.raises(ValueError, match="state has method='alq', this quantizer has method='amq'"):
        _state("amq").load_state_dict(saved)
    auto = RoundState(Quantizer("alq", bits=3, bucket_size=64), auto=AutoBits("alq", 3.0, 64))
    with pytest.raises(ValueError, match="state was saved with bits=fixed, this compressor has bits='auto'"):
        auto.load_state_dict(saved)
    auto_saved = auto.state_dict()
    assert "auto" in auto_saved and "allocation" in auto.metrics()
    with pytest.raises(ValueError, match="state was saved with bits='auto', this compressor has bits=fixed"):
        _state().load_state_dict(auto_saved)
    other = RoundState(Quantizer("alq", bits=3, bucket_size=64), auto=AutoBits("alq", 3.0, 64))
    other.load_state_dict(auto_saved)
    assert other.state_dict()["auto"].keys() == auto_saved["auto"].keys()
