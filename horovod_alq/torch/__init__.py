"""PyTorch compressors for ``hvd.DistributedOptimizer(compression=...)`` and ``hvd.allreduce``."""

from .compressor import (
    ALQCompressor,
    AMQCompressor,
    NUQSGDCompressor,
    QSGDCompressor,
    QuantizedCompressor,
    TernGradCompressor,
    compressor,
)

__all__ = ["ALQCompressor", "AMQCompressor", "NUQSGDCompressor", "QSGDCompressor",
           "QuantizedCompressor", "TernGradCompressor", "compressor"]
