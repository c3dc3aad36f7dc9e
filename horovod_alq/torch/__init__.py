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
from .optim import FrozenVarianceAdamW

__all__ = [
    "ALQCompressor",
    "AMQCompressor",
    "FrozenVarianceAdamW",
    "NUQSGDCompressor",
    "QSGDCompressor",
    "QuantizedCompressor",
    "TernGradCompressor",
    "compressor_for",
]
