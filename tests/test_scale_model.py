"""scripts/study/scale.py: the alpha-beta model's formulas on hand-computed cases, the crossover
solver, the calibration on synthetic steps made from known parameters, and its --quick run."""

import json
import math

import numpy as np
import pytest

from scripts.study import scale

Q3 = 3 / 8 + 4 / 8192  # bytes per coordinate at 3 bits, a float32 norm per bucket of 8192


def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_bytes_on_every_link():
    c = scale.ring16(1000, 4, 2)  # 2 nodes of 2: 2000 bytes of fp16
    assert c.inter == pytest.approx(2 * 3 / 4 * 2000)  # one ring link leaves each node
    assert c.intra == pytest.approx(0.5 * 2 * 3 / 4 * 2000)  # half the ranks send on a link inside the node
    assert (c.msgs, c.msgs_intra, c.enc, c.dec) == (6, 0, 0, 0)
    one_node = scale.ring16(1000, 4, 4)
    assert one_node.inter == 0 and one_node.msgs == 0 and one_node.msgs_intra == 6


def test_hierarchical_allreduce_and_the_2x2_counters():
    """Horovod's hierarchical scheme: 2(M-1)/M w P between nodes per node, 2(G-1)/G w P inside per
    rank; at 2 x 2 that is what the interface counters of Open MPI's allreduce showed (1.403 MB
    per node, 5.61 MB on lo for 701,466 fp16 coordinates)."""
    c = scale.hier16(701466, 4, 2)
    assert c.inter == pytest.approx(2 * 701466)
    assert c.intra * 4 == pytest.approx(4 * 2 * 701466)
    big = scale.hier16(10**6, 64, 8)
    assert big.inter == pytest.approx(2 * 7 / 8 * 2e6) and big.intra == pytest.approx(2 * 7 / 8 * 2e6)
    assert (big.msgs, big.msgs_intra) == (14, 14)


def test_alltoall_and_allgather_bytes():
    a = scale.alltoall(10.0, 8, 2)  # 4 nodes of 2
    assert (a.inter, a.intra, a.msgs, a.msgs_intra) == (2 * 6 * 10.0, 10.0, 6, 1)
    ring = scale.allgather(10.0, 8, 2)
    assert ring.inter == 70.0 and ring.intra == 35.0 and ring.msgs == 7
    assert scale.allgather(10.0, 8, 2, "pairwise") == a


@pytest.mark.parametrize("n,g", [(4, 2), (16, 8), (64, 8), (1024, 8)])
def test_hierarchical_between_nodes_against_the_flat_exchanges(n, g):
    """(M-1) P q per node: 1/G^2 of a pairwise flat allgather's, 1/G of flat two-phase's at 2
    nodes, M/(2G) of it in general (both two-phase collectives pairwise)."""
    p, m = 8192 * 100, n // g
    h = scale.alq_hierarchical(p, n, g, 3)
    assert h.inter == pytest.approx((m - 1) * p * Q3)
    assert h.inter == pytest.approx(scale.alq_allgather(p, n, g, 3, "pairwise").inter / g**2)
    flat = scale.alq_two_phase(p, n, g, 3, "pairwise")
    assert flat.inter == pytest.approx(2 * g * (m - 1) / m * p * Q3)
    assert h.inter / flat.inter == pytest.approx(m / (2 * g))
    if m == 2:
        assert h.inter == pytest.approx(flat.inter / g)
    assert h.intra == pytest.approx((g - 1) * 4 * p / g + (g - 1) * m * p * Q3 / g)
    assert (h.enc, h.dec, h.msgs, h.msgs_intra) == (p / g, m * p, m - 1, 2 * (g - 1))


def test_hierarchical_two_phase_sends_what_a_16_bit_allreduce_sends_times_q_over_2():
    p, n, g = 10**6, 256, 8
    h2 = scale.alq_hierarchical_two_phase(p, n, g, 3)
    assert h2.inter == pytest.approx(scale.hier16(p, n, g).inter * Q3 / 2)
    assert h2.enc == pytest.approx(p / g + p / n) and h2.dec == pytest.approx(p + p / g)


def test_step_time_composes_host_work_and_wire():
    cost = scale.Cost(inter=1e6, intra=2e6, msgs=3, msgs_intra=2, enc=1e6, dec=4e6)
    codec = scale.Codec(1e-9, 2e-9, 2e-10)
    m = scale.Params(alpha=1e-3, alpha_intra=1e-4, eta=0.5, b_intra=1e9, kappa=2.0, phi=0.0)
    local = 2.0 * (1e6 * 1e-9 + 4e6 * 2e-10) + 2e6 / 1e9 + 2 * 1e-4
    wire = 1e6 / (0.5 * 1e8) + 3 * 1e-3
    assert scale.parts(cost, 1e8, m, codec) == pytest.approx((local, wire))
    assert scale.step_time(cost, 0.1, 1e8, m, codec) == pytest.approx(0.1 + local + wire)
    half = scale.Params(1e-3, 1e-4, 0.5, 1e9, 2.0, phi=0.5, b_host=1e9)
    host = local + 1e6 / 2 / 1e9  # TCP work for the bytes a rank sends between nodes (G = 2)
    assert scale.step_time(cost, 0.1, 1e8, half, codec, g=2, share=2.0) == pytest.approx(
        0.1 + 2 * host + wire - 0.5 * min(2 * host, wire)
    )


def test_crossover_is_where_both_sides_are_equal():
    m = scale.Params(alpha=5e-6, alpha_intra=1e-6, eta=1.0, b_intra=400e9)
    codec = scale.Codec(1e-11, 1.4e-11, 2e-12)
    p, t, n, g = 1e9, 0.125, 16, 8
    rate = scale.crossover("ALQ 3b hierarchical", p, t, n, g, m, codec)
    assert rate is not None and math.isfinite(rate)

    def step(label, r):
        cost, bits = scale.row_cost(label, p, n, g)
        return scale.step_time(cost, t, r, m, codec, bits)

    best = min(step(label, rate) for label in scale.SIXTEEN_LABELS)
    assert step("ALQ 3b hierarchical", rate) == pytest.approx(best, rel=1e-9)
    assert step("ALQ 3b hierarchical", rate / 2) < min(step(k, rate / 2) for k in scale.SIXTEEN_LABELS)
    assert step("ALQ 3b hierarchical", rate * 2) > min(step(k, rate * 2) for k in scale.SIXTEEN_LABELS)
    # the closed form (no overlap: both steps are a constant plus bytes / rate)
    alq, bits = scale.row_cost("ALQ 3b hierarchical", p, n, g)
    h16, _ = scale.row_cost("Horovod hierarchical fp16", p, n, g)
    const = [scale.step_time(c, t, math.inf, m, codec, b) for c, b in ((alq, bits), (h16, 3))]
    assert rate == pytest.approx((h16.inter - alq.inter) / (const[0] - const[1]), rel=1e-6)
    # an allgather of the node sums over 128 nodes sends more than a 16-bit allreduce: never faster
    assert scale.crossover("ALQ 3b hierarchical", p, t, 1024, g, m, codec) is None


def synthetic_rows(truth: scale.Params, codec: scale.Codec) -> list[dict]:
    rows = []
    for key in ("hvd-fp16", "hvd-alq-2p", "hvd-alq-h", "hvd-alq-h4", "ddp-fp16", "ddp-alq-2p", "ddp-alq-h"):
        for n, g in ((4, 2), (8, 2), (8, 4), (2, 1)):
            for rate, compute in ((1.2e7, 0.07), (1.2e8, 0.08), (1.2e9, 0.3)):
                cost, bits = scale.measured_cost(key, 7e5, n, g, 3000.0)
                row = {"cost": cost, "bits": bits, "g": g, "share": max(1.0, n / 2), "rate_Bps": rate}
                row["compute_s"] = compute
                rows.append(row)
    measured = scale.predict(rows, truth, codec)
    for row, t in zip(rows, measured):
        row["measured_s"] = float(t)
    return rows


def test_calibration_recovers_known_parameters():
    codec = scale.Codec(1.2e-9, 1.65e-9, 2.3e-10)
    truth = scale.Params(alpha=2e-3, alpha_intra=2e-3, eta=0.8, b_intra=3e8, kappa=12.0, phi=0.4, b_host=3e8)
    fitted, ratios, _ = scale.calibrate(synthetic_rows(truth, codec), codec)
    assert np.allclose(ratios, 1.0, atol=1e-6)
    for name in ("alpha", "eta", "b_intra", "kappa", "phi"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_cpu_codec_reads_the_first_table():
    codec, source = scale.cpu_codec()
    assert codec.enc3 == pytest.approx(3.89e-3 / 3276800)
    assert codec.enc4 == pytest.approx(5.41e-3 / 3276800) and codec.dec == pytest.approx(0.74e-3 / 3276800)
    assert "3,276,800" in source and source.startswith("codec_speed.md#bench_codec_widths ")


def test_cpu_codec_reads_a_fresh_report_and_names_a_missing_section(tmp_path):
    """A report of scripts.bench.codec_widths as it writes it (no anchor: the file's first table,
    not its history below); a section the page lacks is a clear error."""
    report = tmp_path / "bench_codec_widths.md"
    row = "| {} | {} | {} | 1.00 | 1.0 | {} | 1.00 |"
    table = ["| kernels | bits | encode ms | vs 3 bits | ns | decode ms | vs 3 bits |", "|---|" * 7]
    fresh = [row.format("AVX2", 3, 2.0, 0.5), row.format("AVX2", 4, 3.0, 0.6)]
    old = [row.format("AVX2", 3, 9.0, 9.0), row.format("AVX2", 4, 9.0, 9.0)]
    text = ["# Codec", "", "1,000,000 float32 coordinates", "", *table, *fresh, "", "## History", "", *table, *old]
    report.write_text("\n".join(text) + "\n")
    codec, source = scale.cpu_codec(str(report))
    assert (codec.enc3, codec.enc4, codec.dec) == pytest.approx((2.0e-9, 3.0e-9, 0.5e-9))
    assert source == "bench_codec_widths.md (AVX2, one thread, 1,000,000 coordinates)"
    with pytest.raises(ValueError, match="no section with the anchor"):
        scale.cpu_codec("docs/results/codec_speed.md" + "#no_such_report")


def test_quick_run_writes_page_plot_and_data(tmp_path):
    assert scale.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / "scale_model.md").read_text()
    assert (tmp_path / "scale_model.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "data" / "scale_model.json").read_text())
    expected = scale.median_rows([c for c in scale.CALIBRATION if c.exists()])
    assert len(data["calibration"]) == len(expected) >= 40  # 2 layouts x 2 rates x the modelled rows
    assert all(r["predicted_over_measured"] > 0 for r in data["calibration"])
    assert {x["gpus"] for x in data["projection"]} == {16, 64}
    assert len(data["crossover"]) == 2 * 2 * 5  # codecs x scales x ALQ rows
    for heading in ("## Calibration", "## Projection", "## Crossover", "predicted / measured", "not measured"):
        assert heading in text


def test_median_rows_take_each_rows_median_over_runs(tmp_path):
    """Three runs of one command: every row's step, compute and rate are the medians over them."""
    src = json.loads((scale.DATA / "bench_train_step_nodes_tcp.json").read_text())
    paths = []
    for k, factor in enumerate((1.0, 3.0, 1.2)):
        run = json.loads(json.dumps(src))
        for r in run["runs"]:
            for row in r["run"]["results"].values():
                row["step_s"] *= factor
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(run))
    one = {(r["layout"], r["rate"], r["row"]): r for r in scale.load_rows(paths[0])}
    rows = scale.median_rows(paths)
    assert len(rows) == len(one)
    for r in rows:
        base = one[r["layout"], r["rate"], r["row"]]
        assert r["runs"] == 3
        assert r["measured_s"] == pytest.approx(1.2 * base["measured_s"])
        assert r["compute_s"] == pytest.approx(1.2 * base["compute_s"])
        assert r["spread"] == pytest.approx(3.0)
