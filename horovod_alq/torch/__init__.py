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
from .precondition import Preconditioner

__all__ = [
    "ALQCompressor",
    "AMQCompressor",
    "FrozenVarianceAdamW",
    "NUQSGDCompressor",
    "Preconditioner",
    "QSGDCompressor",
    "QuantizedCompressor",
    "TernGradCompressor",
    "compressor_for",
]
