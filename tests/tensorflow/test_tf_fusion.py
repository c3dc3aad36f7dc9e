"""horovod_alq.tensorflow.fusion in one process: how tensors are grouped into fusion buffers, and
the refusal of what is not a horovod_alq compressor (the exchange itself: the ``fusion`` scenario of
tests/tensorflow/test_tf_compressor_ranks.py, on 2 ranks)."""

import pytest

tf = pytest.importorskip("tensorflow")

from horovod_alq.tensorflow.fusion import buffers, fused_allreduce  # noqa: E402


def _t(n, dtype=tf.float32):
    return tf.zeros([n], dtype)


def test_buffers_fill_from_the_last_tensor_one_dtype_each():
    ts = [_t(100), _t(3), _t(50, tf.float16), _t(200), _t(10, tf.int32), _t(300), _t(40, tf.float16)]
    groups, direct = buffers(ts, fusion_bytes=4 * 500, min_size=8)
    # from the last: fp16 [6, 2]; fp32 300 -> [5], 200 fits (500) -> [5, 3], 100 does not -> [0]
    assert groups == [[6, 2], [5, 3], [0]]
    assert direct == [1, 4]  # 3 elements (below min_size), int32


def test_a_tensor_larger_than_the_buffer_is_a_buffer_and_zero_means_one_each():
    ts = [_t(10), _t(1000), _t(10)]
    assert buffers(ts, fusion_bytes=400, min_size=1)[0] == [[2], [1], [0]]
    assert buffers(ts, fusion_bytes=0, min_size=1)[0] == [[2], [1], [0]]
    assert buffers(ts, fusion_bytes=1 << 20, min_size=1)[0] == [[2, 1, 0]]


def test_unknown_sizes_travel_alone():
    spec = tf.TensorSpec([None], tf.float32)
    seen = {}

    @tf.function(input_signature=[spec])
    def f(x):
        seen["split"] = buffers([x, _t(20)], fusion_bytes=1 << 20, min_size=1)
        return x

    f(tf.zeros([5]))
    assert seen["split"] == ([[1]], [0])


def test_fused_allreduce_needs_a_horovod_alq_compressor():
    with pytest.raises(TypeError, match="horovod_alq.tensorflow compressor instance"):
        fused_allreduce([_t(10)], compression=None)
