"""PyTorch compressors for ``hvd.DistributedOptimizer(compression=...)`` and ``hvd.allreduce``."""

from .compressor import (
    ALQCompressor,
    AMQCompressor,
    NUQSGDCompressor,
    QSGDCompressor,
    QuantizedCompressor,
    TernGradCompressor,
    compressor_for,
)

__all__ = [
    "ALQCompressor",
    "AMQCompressor",
    "NUQSGDCompressor",
    "QSGDCompressor",
    "QuantizedCompressor",
    "TernGradCompressor",
    "compressor_for",
]
