"""What the torch.distributed front-ends share (the DDP hook's :class:`~horovod_alq.torch.ddp.ALQState`,
FSDP2's :class:`~horovod_alq.torch.fsdp.ALQReduceScatter`): the method settings, both quantizers,
the round state and engine, their metrics, checkpoints and pickling, the transports of a process
group and the codec per device. Their rounds are streamed (:mod:`horovod_alq.exchange.stream`)."""

from __future__ import annotations

import numpy as np
import torch

from ..core.protocol import PREFIX, resolve_timeout
from ..exchange.registry import exchange_for, get
from ..settings import Settings, configure
from . import codecs
from .amp import loss_scale_of
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
    FRONT_END = ""  # its name in horovod_alq.settings.NOT_SERVED
    ENGINE_EXCHANGE: str | None = None  # the engine's exchange when not the settings' (FSDP2)

    def _configure(self, process_group, settings: Settings | None, uid: str, **keywords) -> None:
        """Settings from ``settings`` and ``keywords`` (:meth:`Settings.of`), then the state and engine."""
        self.settings = s = Settings.of(settings, self.FRONT_END, **keywords)
        self.process_group = process_group
        self.method = s.method
        self.min_size = s.min_size
        self.codec = codecs.check_name(s.codec)
        setup = configure(s, front_end=self.FRONT_END)
        auto = setup.state.auto
        self.bits = "auto" if auto is not None else setup.quantizer.bits
        self.bit_budget = None if auto is None else auto.budget
        self.bits_per = None if auto is None else auto.bits_per
        self.bucket_size, self.norm = setup.quantizer.bucket_size, setup.quantizer.norm
        self.round_state, self.seed = setup.state, setup.seed
        self.engine = setup.engine(uid=uid, exchange=self.ENGINE_EXCHANGE, early=False)  # streamed rounds
        self.timeout = resolve_timeout(s.timeout)
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
        return (
            f"{type(self).__name__}(method={self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
            f"norm={self.norm!r}, min_size={self.min_size}, exchange={self.exchange!r})"
        )

    # ------------------------------------------------------------------ metrics and state
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``second_levels``, ``level_updates``, ``step`` (rounds
        exchanged), ``calls`` (quantized buffers), ``payload_bytes``, ``coordinates``,
        ``uncompressed_coordinates``, ``bits_per_coordinate``, ``bytes_sent`` / ``bytes_received``,
        ``exchange``, ``collectives`` (those this front-end started, every stage's): the keys of the
        Horovod compressors' ``metrics()``."""
        done = sum(t.collectives for stages in self._transports.values() for t in stages)
        return {**self.round_state.metrics(), "collectives": done}

    def state_dict(self) -> dict:
        """Levels (both quantizations), counters, seed and settings: a resumed run continues with
        identical levels. Call between steps."""
        if self._pending:
            raise RuntimeError("state_dict() during a step's exchange: call it between steps")
        return {**{k: getattr(self, k) for k in SETTINGS}, "seed": self.engine.seed, **self.round_state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same method, bits, bucket size and norm). Load the same state on
        every rank, or the next step raises on every rank (the handshake compares the levels)."""
        if self._pending:
            raise RuntimeError("load_state_dict() during a step's exchange: call it between steps")
        differ = [
            f"{k}: saved {state[k]!r}, this {self.what} {getattr(self, k)!r}"
            for k in SETTINGS
            if k in state and state[k] != getattr(self, k)
        ]
        if differ:
            raise ValueError(f"{PREFIX}: the saved state has other settings ({'; '.join(differ)})")
        self.round_state.load_state_dict(state)
        self.seed = self.engine.seed = int(state["seed"])

    def use_grad_scaler(self, scaler) -> None:
        """AMP: read the loss scale of ``scaler`` (a ``torch.amp.GradScaler``) so that error-feedback
        buffers stay in unscaled units and a step the scaler skips leaves them unchanged (without
        ``error_feedback``: a no-op after the check)."""
        read = loss_scale_of(scaler)
        if self.round_state.feedback is not None:
            self.round_state.feedback.loss_scale = read

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(state)``): settings and :meth:`state_dict`; the process group is
        not picklable and comes back as the default group."""
        # precondition (an optimizer) is not pickled: give it again to the unpickled state
        return {"settings": {**self.settings.keywords(), "precondition": None}, "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        if "config" in saved:  # pickled before horovod_alq.settings: the keywords themselves
            self.__init__(None, **saved["config"])
        else:
            self.__init__(None, settings=Settings(**saved["settings"]))
        self.load_state_dict(saved["state"])

    # ------------------------------------------------------------------ internals
    def _ops_for(self, device: torch.device) -> TorchOps:
        return ops_for(self._ops, device, self.codec)

    def _stages(self, group=None, exchange: str | None = None) -> list[DistTransport]:
        """The transports of a streamed round over ``group`` (default: ``process_group``): the
        group, then one companion group per further collective of a buffer (two-phase: 1,
        hierarchical: 2, hierarchical two-phase: 3). The group is the user's to destroy; the
        companions are :mod:`.dist_transport`'s (destroyed at exit, or by its ``destroy_companions``)."""
        group = self.process_group if group is None else group
        stages = self._transports.setdefault(group, [])
        if not stages:
            stages.append(DistTransport(group, timeout=self.timeout))
        exchange = exchange or exchange_for(self.exchange, stages[0])
        while len(stages) < get(exchange).stages:
            stages.append(
                DistTransport(
                    companion_group(group, len(stages)), timeout=self.timeout, local_size=stages[0].local_size
                )
            )
        return stages

    @property
    def _pending(self) -> bool:
        return self._round is not None
