"""The compiled rANS coder of the entropy wire (``csrc/fused_codec.cpp``) behind the NumPy interface
of :mod:`horovod_alq.core.entropy`, which uses it once the compiled CPU codec has loaded
(:func:`horovod_alq.torch.codecs.cpu_build.load` installs it)."""

from __future__ import annotations

import numpy as np
import torch


class CompiledRans:
    """``count``, ``encode``, ``decode`` of :mod:`horovod_alq.core.entropy` on the compiled module;
    its errors become ValueError, as the reference's."""

    def __init__(self, module) -> None:
        self._module = module

    @staticmethod
    def _t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    def count(self, codes: np.ndarray, n: int, bits: int) -> np.ndarray:
        return self._module.rans_count(self._t(codes), int(n), int(bits)).numpy()

    def encode(self, codes, n: int, d: int, bits: int, freq) -> tuple[np.ndarray, np.ndarray]:
        try:
            lengths, streams = self._module.rans_encode(
                self._t(codes), int(n), int(d), int(bits), self._t(np.asarray(freq, dtype=np.int64))
            )
        except RuntimeError as err:
            raise ValueError(str(err).splitlines()[0]) from None
        return lengths.numpy().astype(np.uint32), streams.numpy()

    def decode(self, streams, lengths, n: int, d: int, bits: int, freq) -> np.ndarray:
        try:
            return self._module.rans_decode(
                self._t(streams),
                self._t(np.asarray(lengths, dtype=np.int64)),
                int(n),
                int(d),
                int(bits),
                self._t(np.asarray(freq, dtype=np.int64)),
            ).numpy()
        except RuntimeError as err:
            raise ValueError(str(err).splitlines()[0]) from None
