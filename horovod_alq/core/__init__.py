"""Framework-free core: level schemes, distributions, statistics, adaptation, reference codec.

NumPy and SciPy only. Names are loaded on first access, so ``import horovod_alq.core`` is cheap and
each submodule can also be imported on its own.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Quantizer": "quantizer",
    "stochastic_round": "quantizer",
    "METHODS": "methods",
    "Method": "methods",
    "get_method": "methods",
    "TruncatedNormal": "distributions",
    "NormWeightedMixture": "distributions",
    "GridDistribution": "grid",
    "expected_variance": "objective",
    "amq_objective": "objective",
    "amq_derivative": "objective",
    "fit_alq_levels": "adaptation",
    "fit_amq_multiplier": "adaptation",
    "levels_fingerprint": "wire",
    "payload_size": "wire",
    "parse_payload": "wire",
    "split_payloads": "wire",
    "pack_codes": "packing",
    "unpack_codes": "packing",
    "BucketMoments": "statistics",
    "bucket_moments": "statistics",
    "summarize": "statistics",
    "statistics_length": "statistics",
    "distribution_from_statistics": "statistics",
    "GRID": "statistics",
    "allocate_bits": "allocation",
    "Allocation": "allocation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
