"""What the torch.distributed front-ends share (the DDP hook's :class:`~horovod_alq.torch.ddp.ALQState`,
FSDP2's :class:`~horovod_alq.torch.fsdp.ALQReduceScatter`): the method settings, both quantizers,
the round state and engine, their metrics, checkpoints and pickling, the transports of a process
group and the codec per device. Their rounds are streamed (:mod:`horovod_alq.exchange.stream`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..core import frontends
from ..core.methods import get_method
from ..core.protocol import PREFIX, resolve_timeout
from ..exchange.engine import choose_exchange
from ..exchange.setup import configure
from . import codecs
from .dist_transport import DistTransport, companion_group
from .ops import TorchOps, ops_for

COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Keywords saved by ``state_dict`` and checked by ``load_state_dict``.
SETTINGS = ("method", "bits", "bucket_size", "norm")


class StreamedState:
    """Settings, levels and round bookkeeping of one torch.distributed front-end (see the
    subclasses for the keywords). Attributes: ``engine`` (its ``quantizer`` holds the current
    levels) and ``round_state`` (counters, schedule, both quantizers)."""

    what = "state"  # how errors name the object ("hook's state", "reduce-scatter comm")
    AUTO_BITS = False  # whether it serves bits="auto"

    def _configure(self, process_group, method: str, bits: int, bucket_size: int, exchange: str,
                   seed: int | None, update_steps: Sequence[int] | None, update_every: int | None,
                   min_size: int, codec: str, fusion_bytes: int | None, bits_second: int | None,
                   adapt_second: bool | None, norm: str | None, uid: str, timeout: float | None,
                   bit_budget: float | None = None, bits_per: str | None = None) -> None:
        m = get_method(method)
        if m.name == "terngrad":
            bits = 2
        self.process_group = process_group
        self.method = m.name
        self.min_size = frontends.check_min_size(min_size)
        self.codec = codecs.check_name(codec)
        setup = configure(m.name, bits, bucket_size, norm=norm, bits_second=bits_second,
                          update_steps=update_steps, update_every=update_every, adapt_second=adapt_second,
                          seed=seed, bit_budget=bit_budget, bits_per=bits_per, front_end=None if self.AUTO_BITS else f"the {self.what}")
        auto = setup.state.auto
        self.bits = "auto" if auto is not None else setup.quantizer.bits
        self.bit_budget = None if auto is None else auto.budget
        self.bits_per = None if auto is None else auto.bits_per
        self.bucket_size, self.norm = setup.quantizer.bucket_size, setup.quantizer.norm
        self.round_state, self.seed = setup.state, setup.seed
        self.engine = setup.engine(exchange=exchange, fusion_bytes=fusion_bytes, uid=uid)
        self.timeout = resolve_timeout(timeout)
        self._transports: dict[object, list[DistTransport]] = {}  # process group -> its stages
        self._ops: dict[str, TorchOps] = {}
        self._round = None  # the streamed round in progress

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        return self.engine.quantizer.levels

    @property
    def exchange(self) -> str:
        return self.engine.exchange

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"norm={self.norm!r}, min_size={self.min_size}, exchange={self.exchange!r})")

    # ------------------------------------------------------------------ metrics and state
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``second_levels``, ``level_updates``, ``step`` (rounds
        exchanged), ``calls`` (quantized buffers), ``payload_bytes``, ``coordinates``,
        ``uncompressed_coordinates``, ``bits_per_coordinate``, ``bytes_sent`` / ``bytes_received``,
        ``exchange``: the keys of the Horovod compressors' ``metrics()``."""
        return self.round_state.metrics()

    def state_dict(self) -> dict:
        """Levels (both quantizations), counters, seed and settings: a resumed run continues with
        identical levels. Call between steps."""
        if self._pending:
            raise RuntimeError("state_dict() during a step's exchange: call it between steps")
        return {**{k: getattr(self, k) for k in SETTINGS}, "seed": self.engine.seed,
                **self.round_state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same method, bits, bucket size and norm). Load the same state on
        every rank, or the next step raises on every rank (the handshake compares the levels)."""
        if self._pending:
            raise RuntimeError("load_state_dict() during a step's exchange: call it between steps")
        differ = [f"{k}: saved {state[k]!r}, this {self.what} {getattr(self, k)!r}" for k in SETTINGS
                  if k in state and state[k] != getattr(self, k)]
        if differ:
            raise ValueError(f"{PREFIX}: the saved state has other settings ({'; '.join(differ)})")
        self.round_state.load_state_dict(state)
        self.seed = self.engine.seed = int(state["seed"])

    def _config(self) -> dict:
        """The keywords that rebuild this object (pickling)."""
        config = {k: getattr(self, k) for k in ("method", "bits", "bucket_size", "norm", "min_size", "codec")}
        if self.bit_budget is not None:
            config["bit_budget"] = self.bit_budget
        if self.bits_per == "bucket":
            config["bits_per"] = self.bits_per
        config["timeout"] = 0 if self.timeout == float("inf") else self.timeout
        st = self.round_state
        config.update(update_steps=st.schedule.steps, update_every=st.schedule.every)
        return config

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(state)``): settings and :meth:`state_dict`; the process group is
        not picklable and comes back as the default group."""
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(None, **saved["config"])
        self.load_state_dict(saved["state"])

    # ------------------------------------------------------------------ internals
    def _ops_for(self, device: torch.device) -> TorchOps:
        return ops_for(self._ops, device, self.codec)

    def _stages(self, group=None, exchange: str | None = None) -> list[DistTransport]:
        """The transports of a streamed round over ``group`` (default: ``process_group``): the
        group, then (two-phase) its companion group."""
        group = self.process_group if group is None else group
        stages = self._transports.setdefault(group, [])
        if not stages:
            stages.append(DistTransport(group, timeout=self.timeout))
        exchange = exchange or choose_exchange(self.exchange, stages[0].size)
        if exchange == "two-phase" and len(stages) < 2:
            stages.append(DistTransport(companion_group(group), timeout=self.timeout))
        return stages

    @property
    def _pending(self) -> bool:
        return self._round is not None
