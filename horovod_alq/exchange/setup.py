"""What every front-end builds from its keywords: both quantizers, the refit schedule, the round
state, the seed and the engine (:func:`configure`), so that the PyTorch compressors, the
torch.distributed front-ends (DDP hook, FSDP2 comm), mpi4py and TensorFlow agree on defaults and
checks by construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..core.allocation import AutoBits
from ..core.methods import get_method
from ..core.protocol import MASK64
from ..core.quantizer import Quantizer
from ..core.rounds import RefitSchedule, RoundState, schedule_from
from .engine import Engine


@dataclass
class Setup:
    """A front-end's quantization state: ``state`` (both quantizers, schedule, counters) and the
    64-bit ``seed`` of its rounding noise; :meth:`engine` runs its rounds."""

    state: RoundState
    seed: int

    @property
    def quantizer(self) -> Quantizer:
        """The ranks' own codes' quantizer (its levels are the current levels)."""
        return self.state.quantizer

    @property
    def second(self) -> Quantizer:
        """The two-phase exchange's quantizer of the reduced shards."""
        return self.state.second

    def engine(self, **keywords) -> Engine:
        """The exchange engine over this state (keywords: those of :class:`Engine` but the seed)."""
        return Engine(self.state.quantizer, self.state, seed=self.seed, **keywords)


#: ``bit_budget`` of ``bits="auto"`` when none is given.
DEFAULT_BIT_BUDGET = 3.0


def configure(method: str, bits: int | str | None = None, bucket_size: int = 8192, *, norm: str | None = None,
              bit_budget: float | None = None, bits_per: str | None = None,
              bits_second: int | None = None, update_steps: Sequence[int] | None = None,
              update_every: int | None = None, adapt_second: bool | None = None, clip: bool | float = False,
              seed: int | None = None, on_request: bool = False, front_end: str | None = None) -> Setup:
    """Build a front-end's :class:`Setup` from its keywords (each checked by the core, which raises
    ValueError naming it). ``bits_second`` defaults to ``bits``; ``seed`` None draws fresh entropy;
    ``on_request``: no refit schedule (the front-end refits when asked, as mpi4py's ``adapt()``).

    ``bits="auto"`` (adaptive methods): a width from 2 to 8 bits per tensor, chosen at every refit
    under ``bit_budget`` (default :data:`DEFAULT_BIT_BUDGET`; :class:`~horovod_alq.core.allocation.AutoBits`);
    both phases of the two-phase exchange use a tensor's width and levels, so ``bits_second`` and
    ``adapt_second=True`` are refused. ``bits_per="bucket"``: a width per bucket of every payload
    instead, chosen by each rank from its own bucket norms (:mod:`~horovod_alq.core.bucket_widths`;
    bucket sizes that are multiples of 8). ``front_end``: the name of a front-end that does not serve
    ``bits="auto"`` (named in the error), None for one that does."""
    auto = None
    if isinstance(bits, str):
        if bits != "auto":
            raise ValueError(f"bits must be an integer from 2 to 8 or 'auto', got {bits!r}")
        if front_end is not None:
            raise ValueError(f"bits='auto' is served by the Horovod compressors (horovod_alq.torch and "
                             f"horovod_alq.tensorflow ALQCompressor / AMQCompressor), the DDP hook's ALQState, "
                             f"FSDP2's ALQReduceScatter and mpi4py's QuantizedAllreduce only; {front_end} takes a "
                             f"fixed width from 2 to 8")
        if not get_method(method).adaptive:
            raise ValueError(f"bits='auto' needs an adaptive method (alq, alq-n, amq, amq-n), not {method!r}")
        if bits_second is not None or adapt_second:
            raise ValueError("bits='auto' quantizes both phases of the two-phase exchange with each tensor's "
                             "width: bits_second and adapt_second=True do not apply")
        auto = AutoBits(method, DEFAULT_BIT_BUDGET if bit_budget is None else bit_budget, bucket_size, norm=norm,
                        bits_per="tensor" if bits_per is None else bits_per)
        first = second = auto.quantizers[auto.default]
        adapt_second = False
    elif bit_budget is not None or bits_per is not None:
        name = "bit_budget" if bit_budget is not None else "bits_per"
        raise ValueError(f"{name} applies to bits='auto' only (got bits={bits!r})")
    else:
        first = Quantizer(method, bits, bucket_size, clip=clip, norm=norm)
        second = Quantizer(method, first.bits if bits_second is None else bits_second, first.bucket_size,
                           norm=first.norm)
    schedule = RefitSchedule((), 0) if on_request else schedule_from(update_steps, update_every)
    seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & MASK64
    return Setup(RoundState(first, schedule, second, adapt_second, auto=auto), seed)
