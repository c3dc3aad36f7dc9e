"""The PyTorch compressors across real ranks (mpirun and horovodrun --gloo).

A 2-rank launch of torch and Horovod costs seconds of start-up on a 2-core host, so each launch
(one per launcher and rank count) runs every scenario of that size in turn: groups of
tests/workers/torch_compressor.py's scenarios with options of their own, each under its label
(``_launch``); each test asserts on its own group's results.
"""

import pytest
from helpers import assert_bernstein_unbiased, assert_t_unbiased, scenario
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc
ALL = ["alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd", "terngrad"]
EXCHANGED = ALL + ["alq-l2", "amq-n-l2"]  # adaptive methods default to max-abs buckets: the paper's L2 too


def _exchange(method, op="average", rounds=150, bits=3):
    return ["exchange", "--method", method, "--op", op, "--rounds", rounds, "--bits", bits, "--numel", 3000]


def _two_phase():  # 7 buckets of 512 (the last short): shards of whole buckets that do not divide by N
    return ["exchange", "--method", "alq", "--exchange", "two-phase", "--rounds", 120, "--numel", 3100]


def _train(method, **extra):
    return ["train", "--method", method, "--steps", 150, *[w for k, v in extra.items() for w in (f"--{k}", v)]]


def _auto(*extra):
    return ["auto", "--steps", 100, "--rounds", 80, *extra]


MISMATCHES = {
    "bits": "differ in bits 3 on some ranks, 4 on others",
    "bucket": "bucket_size 256 on some ranks, 512 on others",
    "levels": "levels differ",
    "method": "differ in method",
    "norm": "differ in norm",
    "budget": "bit_budget (thousandths of a bit: 2500 on some ranks, 3000 on others)",
    "allocation": "bit allocations of bits='auto'",
    "bits_max": "levels differ",  # the widths' level sets: 2 to 4 on one rank, 2 to 8 on the other
}

#: (launcher, ranks) -> {label: the worker's arguments}: the groups of one launch, run in turn (every
#: group with --bucket 512 unless it names its own)
GROUPS = {
    ("mpi", 2): {
        "exchanged": _exchange(",".join(EXCHANGED)),  # 150 averaged exchanges with every method
        # the small model trained through the stock optimizer with every method
        "trained": _train(",".join(m for m in ALL if m != "terngrad"), bits=4),
        "trained-terngrad": _train("terngrad", bits=2),
        "two-phase": _two_phase(),
        "large": ["exchange", "--method", "alq", "--numel", 65536, "--bucket", 8192, "--rounds", 3],
        "overlap-allgather": ["overlap", "--exchange", "allgather", "--rounds", 40],
        "overlap-two-phase": ["overlap", "--exchange", "two-phase", "--rounds", 40],
        "auto": _auto("--exchange", "allgather"),
        "bits-per-bucket": _auto("--bits-per", "bucket"),
        # dtypes, state and amp, then each mismatch in turn (the ranks go on after each refusal) and a
        # match: last
        "checks": ["dtypes+state+amp+mismatch", "--what", ",".join(MISMATCHES)],
    },
    ("mpi", 3): {
        "sum": _exchange("alq", op="sum", rounds=120),
        "two-phase": _two_phase(),
        "auto": _auto("--exchange", "two-phase"),
    },
    ("mpi", 4): {"two-phase": _two_phase()},
    ("gloo", 2): {"sum": _exchange("alq", op="sum", rounds=120), "train-groups": _train("alq", groups=2, bpps=2)},
}
_LAUNCHES: dict = {}  # (launcher, ranks) -> the ranks' reports of that launch


def _launch(launcher: str, np_: int) -> list:
    """The ranks' reports, {label: result} each, of the launch of GROUPS[(launcher, np_)] (once)."""
    key = (launcher, np_)
    if key not in _LAUNCHES:
        groups = GROUPS[key]
        args = []
        for label, words in groups.items():
            args += [*(["::"] if args else []), *words, "--label", label]
            if "--bucket" not in words:
                args += ["--bucket", 512]
        # each group was a launch of its own with 300-600 s; the 10 groups of 2 ranks take ~100 s quiet
        timeout = 600 if len(groups) <= 3 else 1200
        _LAUNCHES[key] = run_ranks("torch_compressor.py", np=np_, launcher=launcher, timeout=timeout, args=args)
    return _LAUNCHES[key]


def _group(label: str, launcher: str = "mpi", np_: int = 2) -> list:
    """Group ``label``'s result on every rank of the launch of (``launcher``, ``np_``)."""
    return scenario(_launch(launcher, np_), label)


@pytest.fixture(scope="module")
def exchanged():
    res = _group("exchanged")
    return {m: [r[m] for r in res] for m in EXCHANGED}


@pytest.fixture(scope="module")
def trained():
    res = _group("trained")
    out = {m: [r[m] for r in res] for m in ALL if m != "terngrad"}
    out["terngrad"] = _group("trained-terngrad")
    return out


@pytest.mark.parametrize("method", EXCHANGED)
def test_average_unbiased_and_identical_on_all_ranks(method, exchanged):
    res = exchanged[method]
    for r in res:
        assert_bernstein_unbiased(r)
    assert res[0]["digests"] == res[1]["digests"], "ranks got different averaged gradients"
    assert res[0]["levels"] == res[1]["levels"]
    bits = 2 if method == "terngrad" else 3
    # 32-byte header per 3000-coordinate tensor, one float32 norm per 512 coordinates
    expected = bits + (32 + 4 * 6) * 8 / 3000
    assert res[0]["bits_per_coordinate"] == pytest.approx(expected, rel=1e-3)
    if method.startswith(("alq", "amq")):
        assert res[0]["level_updates"] == 2


@pytest.mark.parametrize("launcher,np_", [("gloo", 2), ("mpi", 3)])
def test_sum_op_unbiased_gloo_and_three_ranks(launcher, np_):
    res = _group("sum", launcher, np_)
    for r in res:
        assert_bernstein_unbiased(r)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    assert all(r["levels"] == res[0]["levels"] for r in res)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_two_phase_unbiased_and_identical_on_all_ranks(np_):
    """7 buckets of 512 (the last short): shards of whole buckets that do not divide by N."""
    res = _group("two-phase", "mpi", np_)
    for r in res:  # two-sided t tests at 1e-6 (per bucket: Bonferroni over the buckets)
        assert_t_unbiased(r)
        assert r["exchange"] == "two-phase" and r["level_updates"] == 1
        assert r["second_levels"] == r["levels"]  # equal bits: the second quantizer follows the first
        assert r["rel_err"] < 0.6, r["rel_err"]
    assert all(r["digests"] == res[0]["digests"] for r in res), "ranks got different results"
    assert all(r["levels"] == res[0]["levels"] for r in res)


@pytest.mark.parametrize("method", ALL)
def test_training_converges_with_identical_parameters(method, trained):
    res = trained[method]
    for r in res:
        assert r["last_loss"] < 0.5 * r["first_loss"]
        assert r["accuracy"] > 0.85, r["accuracy"]
    assert res[0]["params"] == res[1]["params"], "parameters diverged across ranks"
    assert res[0]["levels"] == res[1]["levels"]
    assert res[0]["step"] == 150 and res[0]["core_decoded_shape"] == [128 * 64]
    if method in ("alq", "alq-n", "amq", "amq-n"):
        assert res[0]["level_updates"] == 3
        assert res[0]["levels"] != res[0]["start_levels"], "adaptive levels never moved"
    else:
        assert res[0]["levels"] == res[0]["start_levels"]


def test_training_with_groups_and_backward_passes_over_gloo():
    res = _group("train-groups", "gloo")
    assert res[0]["params"] == res[1]["params"]
    assert res[0]["accuracy"] > 0.85
    assert res[0]["step"] == 150 and res[0]["level_updates"] == 3


def test_wire_bits_per_coordinate_on_large_tensors():
    res = _group("large")
    # bits + 32 / bucket_size, within 1% (header: 32 bytes per 65536 coordinates)
    assert res[0]["bits_per_coordinate"] == pytest.approx(3 + 32 / 8192, rel=0.01)
    assert res[0]["payload_bytes"] * 8 / res[0]["coordinates"] < 3.01


@pytest.fixture(scope="module")
def checks():
    return _group("checks")


@pytest.fixture(scope="module")
def mismatched(checks):
    return [r["mismatch"] for r in checks]


@pytest.mark.parametrize("what", MISMATCHES)
def test_mismatched_configuration_is_refused_on_every_rank(what, mismatched):
    # the round's handshake finds the difference before any payload is used (Horovod carries the first
    # buffer's first blocks with it: exchange/carrier.py), on every rank
    for rank, r in enumerate(mismatched):
        assert r[what]["error"] is not None, f"rank {rank} decoded a mismatched payload"
        assert MISMATCHES[what] in r[what]["error"], r[what]["error"]


def test_matching_exchange_works_after_the_refusals(mismatched):
    after = [r["after"] for r in mismatched]
    assert after[0]["error"] is None and after[1]["error"] is None, after
    assert after[0]["out"] == after[1]["out"]


def test_dtypes_shapes_and_nan_stay_visible(checks):
    res = [r["dtypes"] for r in checks]
    for r in res:
        for name in ("float16", "bfloat16", "float32", "float64"):
            big, small = r[f"{name}.1000"], r[f"{name}.10"]
            assert big["dtype"] == f"torch.{name}" and big["same_shape"]
            assert big["rel_err"] < 0.5  # 4-bit ALQ, bucket 128: quantization noise, not garbage
            assert small["exact"] and small["dtype"] == f"torch.{name}"
        for name in ("int32", "int64"):
            assert r[f"{name}.1000"]["exact"] and r[f"{name}.10"]["exact"]
        assert r["nan_buckets"] == [False, False, True, False]
        # default ALQ (3 bits, bucket 8192) on 4096 Gaussian values: noise ~0.5 of the norm (random seed), not garbage
        assert r["class_rel_err"] < 2.0 and r["class_metrics_coordinates"] == 4096
    assert res[0]["float32.1000"]["digest"] == res[1]["float32.1000"]["digest"]


def test_state_dict_round_trip_continues_identically(checks):
    res = [r["state"] for r in checks]
    for r in res:
        # five rounds, the restore, then one more round on each: both at step 6 with identical output
        assert r["levels_equal"] and r["step"] == 6 and r["updates"] == 2 and r["same_output"]
        assert r["levels"] != r["start_levels"]
    assert res[0]["levels"] == res[1]["levels"]


def test_grad_scaler_sees_an_overflow_on_one_rank(checks):
    res = [r["amp"] for r in checks]
    for r in res:
        assert r["skipped"], "the step with an inf gradient on rank 1 was not skipped"
        assert r["scale"] == 512.0 and r["moved_after"]
    assert res[0]["params"] == res[1]["params"]


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_payloads_start_inside_backward(exchange):
    """Four fusion buffers: the first three start their payload collectives while loss.backward()
    runs (the compress calls close them), in every step; the results are bit for bit those of
    overlap=False on every rank (same seeds, same codes), and the overlapped average is unbiased."""
    res = _group(f"overlap-{exchange}")
    first = "allgather" if exchange == "allgather" else "alltoall"
    for r in res:
        on, off = r["True"], r["False"]
        for step in on["early"]:
            assert [e[0] for e in step] == [first] * 3, step  # buffers 0-2, during backward
            assert all(".early" in e[2] for e in step), step
        assert all(step == [] for step in off["early"]), off["early"]
        assert on["grads"] == off["grads"] and on["params"] == off["params"]
        assert on["exchange"] == exchange and on["level_updates"] == 2
        u = r["unbiased"]
        assert u["buckets"] == 32, u
        assert_t_unbiased(u, ("t_max", "t_sum"))
    assert res[0]["True"]["params"] == res[1]["True"]["params"]
    assert res[0]["unbiased"]["digest"] == res[1]["unbiased"]["digest"]


@pytest.mark.parametrize("np_", [2, 3])
def test_auto_bits_agree_on_every_rank_train_and_stay_unbiased(np_):
    """bits="auto": every rank reaches the same allocation and levels and the same parameters
    (allgather and two-phase), within the budget, training as fixed bits do; the sum of tensors of
    widths chosen apart in one buffer stays unbiased (t tests at 1e-6, Bonferroni over buckets)."""
    res = _group("auto", "mpi", np_)
    for exchange in ("allgather", "two-phase"):
        runs = [r[exchange] for r in res]
        for key in ("params", "allocation", "width_levels"):
            assert all(r[key] == runs[0][key] for r in runs), (exchange, key)
        r = runs[0]
        assert r["bits"] == "auto" and r["exchange"] == exchange and r["level_updates"] == 3
        assert len(set(r["allocation"])) > 1, r["allocation"]  # widths differ inside the one buffer
        assert r["allocated_mean_bits"] <= 2.5 + 1e-9
        assert r["last_loss"] < 0.5 * r["first_loss"] and r["accuracy"] > 0.85, r
        assert r["reloaded"]
    u = [r["unbiased"] for r in res]
    assert all(x["digest"] == u[0]["digest"] for x in u), "ranks got different sums"
    for x in u:
        assert x["allocation"] == u[0]["allocation"] and len(set(x["allocation"])) > 1, x["allocation"]
        assert_t_unbiased(x, ("t_max",))


def test_bits_per_bucket_agree_on_every_rank_train_and_stay_unbiased():
    """bits="auto", bits_per="bucket" on 2 Horovod ranks: each rank's payloads carry widths per
    bucket chosen from its own norms; every rank ends with the same parameters and levels
    (allgather, two-phase), training as fixed bits do, checkpoints keep the error model, and the
    sums stay unbiased (t tests at 1e-6, Bonferroni over buckets)."""
    res = _group("bits-per-bucket")
    for exchange in ("allgather", "two-phase"):
        runs = [r[exchange] for r in res]
        for key in ("params", "width_levels"):
            assert all(r[key] == runs[0][key] for r in runs), (exchange, key)
        r = runs[0]
        assert r["exchange"] == exchange and r["level_updates"] == 3 and r["allocated_mean_bits"] == 2.5
        # codes within the budget, plus norms, widths and the parts' headers (260 bytes a payload)
        assert r["bits_per_coordinate"] < 3.0, r
        assert r["last_loss"] < 0.5 * r["first_loss"] and r["accuracy"] > 0.85, r
        assert r["reloaded"]
    u = [r["unbiased"] for r in res]
    assert all(x["digest"] == u[0]["digest"] for x in u), "ranks got different sums"
    for x in u:
        assert len(x["widths"]) > 2, x["widths"]  # buckets of a tensor set of scales 1000, 1, 0.001
        assert_t_unbiased(x, ("t_max",))
