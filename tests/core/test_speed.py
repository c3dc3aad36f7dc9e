"""``compress="when-faster"``'s arbiter (horovod_alq.core.speed) with an injected clock and simulated
ranks: the default schedule and its cost on fast and slow links, which rounds a trial counts, its
units, both choices, drift and periodic re-measurement, agreement on the slowest rank, rounds that
differ across ranks, and the setting's resolution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.core.speed import PATTERN, SpeedArbiter, resolve_compress, speed_metrics
from horovod_alq.settings import Settings, configure


def _lockstep(n, cost, rounds, **kw):
    """Simulated ranks where every agree sees every rank's vector: rank r's vector is computed from
    its own state, so run the ranks' starts on copies first to gather the vectors, then for real."""
    import copy

    now = [0.0] * n
    arbiters = [SpeedArbiter(rank=r, clock=lambda r=r: now[r], **kw) for r in range(n)]
    choices = []
    for t in range(rounds):
        gathered: dict[str, list] = {}
        for a in arbiters:  # a dry run on a copy: the vectors each rank will pass
            dry = copy.copy(a)
            dry._plan, dry._samples, dry._window = (
                list(a._plan),
                {k: list(v) for k, v in a._samples.items()},
                list(a._window),
            )
            dry.start(lambda v, name: gathered.setdefault(name, []).append(np.asarray(v)) or np.asarray(v), "t")
        out = [a.start(lambda v, name: np.max(gathered[name], axis=0), "t") for a in arbiters]
        assert len(set(out)) == 1, f"ranks chose differently at round {t}"
        for r, q in enumerate(out):
            now[r] += cost(r, t, q)
        choices.append(out[0])
    return arbiters, choices


def _unit() -> list[bool]:
    """One trial unit's paths with the default block of 2: quantized, 16-bit, 16-bit, quantized."""
    return [q for q in PATTERN for _ in range(2)]


def test_the_default_schedule_on_a_fast_link_costs_six_quantized_rounds_then_confirms_at_round_100():
    # quantized 1.3 s (a fast link: ALQ's step longer than fp16's), 16-bit 1.0 s
    arbiters, choices = _lockstep(2, lambda r, t, q: 1.3 if q else 1.0, 140)
    unit = _unit()
    assert choices[:2] == [True] * 2 and choices[2:10] == unit  # warm-up, one unit: a clear difference
    assert not any(choices[10:100]) and choices[100:108] == unit and not any(choices[108:])
    a = arbiters[0]
    assert a.trials == 2 and a.changes == 1 and a.trial_rounds == 16 and a._next_trial == 108 + 2000
    assert a.times["quantized"] == pytest.approx(1.3) and a.times["16-bit"] == pytest.approx(1.0)
    # the cost of not knowing: 2 + 4 + 4 quantized rounds at 0.3 s more than a run of 16 bits alone
    assert sum(1.3 if q else 1.0 for q in choices) - 140 * 1.0 == pytest.approx(10 * 0.3)


def test_the_default_schedule_on_a_slow_link_costs_eight_16_bit_rounds():
    # quantized 0.5 s (a slow link: ALQ's step half of fp16's), 16-bit 1.0 s
    arbiters, choices = _lockstep(2, lambda r, t, q: 0.5 if q else 1.0, 140)
    assert choices[2:10] == _unit() and choices[100:108] == _unit()
    assert [i for i, q in enumerate(choices) if not q] == [4, 5, 6, 7, 102, 103, 104, 105]
    m = speed_metrics(arbiters[0])
    assert m["compress_choice"] == "quantized" and m["compress_changes"] == 0 and m["rounds_16bit"] == 8
    assert sum(0.5 if q else 1.0 for q in choices) - 140 * 0.5 == pytest.approx(8 * 0.5)


def test_the_first_round_of_a_trial_and_each_switch_are_not_counted():
    # the trial's first round (a refit, say) and every round that changes path are slow: the medians
    # are exactly the paths' steps, so the counted rounds are exactly the others
    def cost(rank, t, q):
        trial_first = t in (2, 100)
        switch = t in (4, 8, 102, 106)
        return 50.0 if trial_first else (9.0 if switch else (2.0 if q else 1.0))

    arbiters, choices = _lockstep(2, cost, 110)
    a = arbiters[0]
    assert a.times["quantized"] == 2.0 and a.times["16-bit"] == 1.0 and a.trials == 2 and not choices[-1]


def test_a_close_difference_runs_more_units_and_a_clear_one_stops_after_one():
    # 5% apart (below `sure`, 10%): three units, 24 rounds, then the margin (3%) decides: quantized
    arbiters, choices = _lockstep(2, lambda r, t, q: 1.0 if q else 1.05, 40, confirm=None)
    assert choices[2:26] == _unit() * 3 and all(choices[26:]) and arbiters[0].trial_rounds == 24
    # 20% apart: one unit
    arbiters, choices = _lockstep(2, lambda r, t, q: 1.0 if q else 1.25, 40, confirm=None)
    assert choices[2:10] == _unit() and all(choices[10:]) and arbiters[0].trial_rounds == 8
    # units=1: one unit whatever the difference
    arbiters, _ = _lockstep(2, lambda r, t, q: 1.0 if q else 1.05, 40, confirm=None, units=1)
    assert arbiters[0].trial_rounds == 8 and arbiters[0].quantizing


def test_a_median_that_the_pairs_do_not_confirm_keeps_16_bits():
    # quantized steps 0.95 s but 2 in 5 of them 1.5 s, 16-bit 1.0 s: the median says 5% shorter
    # (beyond the 3% margin), yet only about 3 in 5 pairs have the quantized step shorter (under 75%)
    def make_cost():
        seen = {0: 0, 1: 0}  # quantized rounds so far, per rank

        def cost(rank, t, q):
            if not q:
                return 1.0
            seen[rank] += 1
            return 1.5 if seen[rank] % 5 in (1, 3) else 0.95

        return cost

    arbiters, choices = _lockstep(2, make_cost(), 40, confirm=None)
    a = arbiters[0]
    assert a.times["quantized"] == pytest.approx(0.95) and 0.5 < a.shorter < 0.75, (a.times, a.shorter)
    assert a.trial_rounds == 24 and not choices[-1]  # three units, then the framework's path
    # with pairs=0.6 the same steps quantize
    arbiters, choices = _lockstep(2, make_cost(), 40, confirm=None, pairs=0.6)
    assert choices[-1] and arbiters[0].shorter == pytest.approx(a.shorter)


def test_a_slower_quantized_step_switches_to_16_bits_and_back_when_it_pays_again():
    # quantized costs 2 s, 16-bit 1 s, until round 60 where the link slows: 16-bit costs 4 s
    def cost(rank, t, q):
        return (2.0 if q else 1.0) if t < 60 else (2.0 if q else 4.0)

    kw = dict(warmup=5, block=3, watch=10, recheck=1000, drift=0.25, confirm=None)
    arbiters, choices = _lockstep(2, cost, 120, **kw)
    trial = [q for q in PATTERN for _ in range(3)]
    assert choices[:5] == [True] * 5 and choices[5 : 5 + len(trial)] == trial  # warm-up, then ABBA blocks
    after = 5 + len(trial)
    assert not any(choices[after:60]), "16 bits should be chosen after the first trial"
    assert all(choices[-20:]), "the drift check should re-measure and go back to quantized"
    m = speed_metrics(arbiters[0])
    assert m["compress_choice"] == "quantized" and m["compress_trials"] == 2 and m["compress_changes"] == 2
    assert m["step_time_quantized"] == pytest.approx(2.0) and m["step_time_16bit"] == pytest.approx(4.0)
    assert m["rounds_16bit"] == sum(not q for q in choices)


def test_the_slowest_rank_decides_and_a_tie_goes_to_16_bits():
    # rank 1's quantized steps are slow, rank 0's fast: the MAX (rank 1's) decides on both ranks
    def cost(rank, t, q):
        return (3.0 if rank == 1 else 0.5) if q else 1.0

    arbiters, choices = _lockstep(2, cost, 30, warmup=2, block=2, watch=50, recheck=1000)
    assert not choices[-1] and all(a.times["quantized"] == pytest.approx(3.0) for a in arbiters)
    _, tie = _lockstep(2, lambda r, t, q: 1.0, 30, warmup=2, block=2, watch=50, recheck=1000)
    assert tie[-1] is False  # quantizing must be at least `margin` (3%) faster
    _, close = _lockstep(2, lambda r, t, q: 0.98 if q else 1.0, 30, warmup=2, block=2, watch=50, recheck=1000)
    _, clear = _lockstep(2, lambda r, t, q: 0.9 if q else 1.0, 30, warmup=2, block=2, watch=50, recheck=1000)
    assert close[-1] is False and clear[-1] is True


def test_periodic_re_measurement_and_median_against_outliers():
    # one huge outlier in a 16-bit trial round does not flip the choice (median); recheck re-runs trials
    def cost(rank, t, q):
        return 100.0 if t == 6 else (2.0 if q else 1.0)

    arbiters, choices = _lockstep(2, cost, 80, warmup=0, block=4, watch=1000, recheck=30, confirm=None)
    assert arbiters[0].trials >= 2 and not choices[-1]


def test_ranks_at_different_rounds_raise_on_every_rank():
    a = SpeedArbiter(warmup=0, block=2, clock=lambda: 0.0)
    for _ in range(len(PATTERN) * 2):
        a.start(lambda v, n: v, "t")
    with pytest.raises(ProtocolError, match="different rounds"):  # another rank was one round ahead
        a.start(lambda v, n: np.maximum(v, np.array([v[0] + 1, -(v[0]), *v[2:]])), "t")


def test_bad_schedules_raise():
    for bad in (dict(block=1), dict(units=0), dict(sure=1.0), dict(warmup=-1), dict(margin=-0.1), dict(pairs=0.4)):
        with pytest.raises(ValueError, match="SpeedArbiter: block >= 2"):
            SpeedArbiter(**bad)


def test_always_reports_the_quantized_choice_and_no_timings():
    m = speed_metrics(None)
    assert m["compress_choice"] == "quantized" and math.isnan(m["step_time_16bit"]) and m["rounds_16bit"] == 0


def test_the_setting_resolves_per_front_end_and_refuses_unknown_values():
    assert resolve_compress("auto", True, {}) == "when-faster"
    assert resolve_compress("auto", False, {}) == "always"
    assert resolve_compress(None, True, {"HOROVOD_ALQ_COMPRESS": "always"}) == "always"
    assert resolve_compress(None, False, {"HOROVOD_ALQ_COMPRESS": "when-faster"}) == "always"
    with pytest.raises(ValueError, match="HOROVOD_ALQ_COMPRESS must be one of 'auto', 'when-faster', 'always'"):
        resolve_compress(None, True, {"HOROVOD_ALQ_COMPRESS": "sometimes"})
    with pytest.raises(ValueError, match="compress must be one of 'auto', 'when-faster', 'always'"):
        Settings(compress="faster")
    for front_end in ("Horovod TensorFlow", "mpi4py", "DiLoCo"):
        with pytest.raises(
            ValueError, match=f"{front_end} does not serve compress='when-faster'.*use compress='always'"
        ):
            Settings.of(None, front_end, compress="when-faster")
        Settings.of(None, front_end, compress="always")
    assert configure(Settings(compress="always"), front_end="DDP hook").state.compress == "always"
    assert configure(Settings(compress="auto"), front_end="FSDP2").state.compress == "when-faster"
    assert configure(Settings(compress="auto"), front_end="mpi4py").state.compress == "always"
    assert configure(Settings(compress="auto"), front_end="Horovod PyTorch").state.compress == "when-faster"
