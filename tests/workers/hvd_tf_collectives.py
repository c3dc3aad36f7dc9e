"""Worker: Horovod TensorFlow allreduce (Sum, Average) and allgather with rank-dependent values."""

import horovod.tensorflow as hvd
import tensorflow as tf
from common import report

hvd.init()
r, n = hvd.rank(), hvd.size()

x = tf.constant([r + 1.0, 10.0 * (r + 1), -float(r), 0.25], dtype=tf.float32)
rows = tf.reshape(tf.range((r + 1) * 3, dtype=tf.float64), (r + 1, 3)) + 100.0 * r

report(
    {
        "rank": r,
        "size": n,
        "mpi_enabled": hvd.mpi_enabled(),
        "gloo_enabled": hvd.gloo_enabled(),
        "sum": hvd.allreduce(x, op=hvd.Sum, name="tf.sum"),
        "average": hvd.allreduce(x, op=hvd.Average, name="tf.avg"),
        "gather": hvd.allgather(rows, name="tf.gather"),
    }
)
hvd.shutdown()
