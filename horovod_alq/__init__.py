"""Adaptive gradient quantization (ALQ, AMQ) for Horovod.

Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020.
Framework compressors live in :mod:`horovod_alq.torch` and :mod:`horovod_alq.tensorflow`;
the framework-free core in :mod:`horovod_alq.core`.
"""

__version__ = "0.1.0"
