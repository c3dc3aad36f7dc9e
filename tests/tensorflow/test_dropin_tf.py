"""Horovod's TF2 synthetic benchmark with its compression line swapped for ``ALQCompressor(...)``
(tests/workers/dropin_tf_benchmark.py), on 2 real ranks: the compressor is built inside a
``tf.function`` traced twice, and the retrace reuses the first trace's compressor."""

import pytest
from multiproc import run_ranks

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")


@pytest.mark.multiproc
def test_compressor_built_inside_a_retraced_function():
    steps = 12
    r0, r1 = run_ranks("dropin_tf_benchmark.py", np=2, timeout=600, args=["--steps", steps])
    for r in (r0, r1):
        # first_batch=True and False; TensorFlow traces the first call twice, the second time
        # after the first made the variables
        assert r["traces"] >= 2, "a retrace"
        assert r["distinct"] == 1, "every trace got the first trace's compressor"
        first, *others = r["pairs"]
        assert len(set(first)) == 2 and all(p == first for p in others), "two built at one line: two, the same"
        assert r["steps"] == steps, "one round per step, counted on the one compressor"
        assert r["level_updates"] >= 1 and r["bits_per_coordinate"] < 4
    assert r0["digest"] == r1["digest"], "identical weights on both ranks"
    assert r0["levels"] == r1["levels"]
    assert r0["losses"][-1] < r0["losses"][0]


def test_one_compressor_per_line_and_arguments_across_retraces():
    """In one process, no ranks: a retrace (another input shape) gets the first trace's compressors,
    one per line, arguments and occurrence; eagerly every call makes a new one."""
    import tensorflow as tf

    from horovod_alq.tensorflow import ALQCompressor

    got = []

    @tf.function
    def step(x):
        a = ALQCompressor(bits=3, bucket_size=512)
        b = ALQCompressor(bits=3, bucket_size=512, update_steps=[0, 7])  # a list: compared by value
        c = ALQCompressor(bits=4, bucket_size=512)
        got.append((a, b, c, ALQCompressor(bits=3, bucket_size=512)))
        return x * 2

    step(tf.constant(1.0))
    step(tf.constant([1.0, 2.0]))  # another shape: a retrace
    assert len(got) >= 2
    first = got[0]
    assert all(all(x is y for x, y in zip(first, later)) for later in got[1:])
    assert len({id(x) for x in first}) == 4, "other arguments, another line: other compressors"
    assert first[2].bits == 4 and ALQCompressor(bits=3) is not ALQCompressor(bits=3)
