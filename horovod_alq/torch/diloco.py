"""DiLoCo-style training over torch.distributed: local steps, then a quantized outer step.

Usage (launched with ``torchrun``; gloo on CPU, NCCL on GPU)::

    import torch.distributed as dist
    from horovod_alq.torch.diloco import DiLoCo

    dist.init_process_group("gloo")
    torch.manual_seed(0)                  # the same initial parameters on every rank
    model = Net()                         # a plain module: no DDP
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, inner, sync_every=50, method="alq", bits=2, error_feedback=True)
    for x, y in batches:                  # this rank's own data
        loss_fn(model(x), y).backward()
        diloco.step()                     # in place of inner.step()
        inner.zero_grad()

Every rank takes ``sync_every`` steps of its inner optimizer on its own data; then one *outer
step*: each rank's pseudo-gradient ``global - local`` (the global parameters, float32, kept here,
minus the rank's parameters) is exchanged through the engine of :mod:`horovod_alq.exchange` as one
streamed round (:mod:`horovod_alq.exchange.stream`; the same handshake, wire format, payload
checks, methods, levels fitted to the pseudo-gradients' statistics, refit schedule in outer steps,
``bits="auto"``, allgather or two-phase as the DDP hook), averaged, and given to the outer optimizer,
SGD with Nesterov momentum (``outer_lr``, ``outer_momentum``) on the global parameters, whose
result is loaded into the model. Parameters with fewer than ``min_size`` elements travel
uncompressed (one float32 ``all_reduce``). The global parameters are bit-identical on every rank
after every outer step; between outer steps the ranks' parameters differ.

``error_feedback=True`` (the shared setting, :mod:`horovod_alq.exchange.feedback`): what this rank
meant to send minus what its own payload decodes to is added to its next pseudo-gradient, with
every exchange (in the two-phase ones the shard owner also keeps the second quantization's error).

Agreement: the first outer step's handshake carries a hash of ``sync_every``, ``outer_lr``,
``outer_momentum``, ``error_feedback``, the parameters' shapes and (first outer step after
construction or ``load_state_dict``) the global parameters' bytes; with the engine's own fields
(method, bits, levels, ...) a rank that differs makes every rank raise ValueError naming what
differs and on which ranks, at that outer step. Inner steps run no collective, so a rank with
another ``sync_every`` meets the others at its first outer step, and all raise there.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
import torch

from ..core.protocol import PREFIX, CollectiveTimeout, ProtocolError, error_text, shape_hash, stable_hash
from ..exchange.engine import resolve_fusion_bytes
from ..settings import Settings
from .dist_state import StreamedState

__all__ = ["DiLoCo"]

#: Refit schedule when neither ``update_steps`` nor ``update_every`` is given (outer steps): the
#: pseudo-gradients' distribution moves over training, and a refit costs one small allreduce.
DEFAULT_UPDATE_STEPS = (0, 1, 2, 5)
DEFAULT_UPDATE_EVERY = 5


class _OuterState(StreamedState):
    """The settings, levels, engine and transports of :class:`DiLoCo`'s outer steps."""

    what = "DiLoCo state"
    FRONT_END = "DiLoCo"  # what it does not serve: horovod_alq.settings.NOT_SERVED

    def __init__(self, process_group, settings: Settings | None, keywords: dict) -> None:
        self._configure(process_group, settings, "diloco", **keywords)  # the one call into the settings


class DiLoCo:
    """Outer steps every ``sync_every`` inner steps, exchanging the pseudo-gradient quantized.

    Create one per model, on every rank with the same arguments, after
    ``dist.init_process_group``; the model's parameters must be equal on every rank.

    Parameters
    ----------
    model : torch.nn.Module
        The model (not wrapped in DDP); its parameters that require grad are synchronized.
    inner_optimizer : torch.optim.Optimizer
        Steps the model's parameters on this rank's data; :meth:`step` calls its ``step()``.
    sync_every : int
        Inner steps per outer step (DiLoCo's H).
    outer_lr, outer_momentum : float
        The outer optimizer: SGD with Nesterov momentum on the global parameters, the averaged
        pseudo-gradient as its gradient (``outer_momentum=0``: plain SGD; ``outer_lr=1``, no
        momentum: the parameters' average).
    process_group : ProcessGroup, optional
        The ranks that average (None: the world).
    method, bits, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (fields as keywords; None: the
        default, ``method="alq"``, ``bits=3``).
        ``update_steps`` / ``update_every`` count outer steps (neither given: refits after outer
        steps 0, 1, 2, 5, then every 5th); ``min_size``: smaller parameters travel uncompressed;
        ``fusion_bytes``: the pseudo-gradient goes in buffers of this many bytes of float32.
        A setting DiLoCo does not serve raises ValueError naming why
        (:data:`horovod_alq.settings.NOT_SERVED`; the table in docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        process_group=None,
        method: str | None = None,
        bits: int | str | None = None,
        settings: Settings | None = None,
        **keywords: Any,
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer (inner steps per outer step), got {sync_every!r}")
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
            raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
        if (
            isinstance(outer_momentum, bool)
            or not isinstance(outer_momentum, (int, float))
            or not 0 <= outer_momentum < 1
        ):
            raise ValueError(f"outer_momentum must lie in [0, 1), got {outer_momentum!r}")
        given = dict(settings.keywords()) if settings is not None else {}
        given.update({k: v for k, v in keywords.items() if v is not None})
        if given.get("update_steps") is None and given.get("update_every") is None:
            keywords.update(update_steps=DEFAULT_UPDATE_STEPS, update_every=DEFAULT_UPDATE_EVERY)
        self.state = _OuterState(process_group, settings, dict(method=method, bits=bits, **keywords))
        self.model, self.inner_optimizer = model, inner_optimizer
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, float(outer_lr), float(outer_momentum)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self._names = [n for n, _ in named]  # error_feedback: each parameter's errors' key
        if not self.params:
            raise ValueError("DiLoCo: the model has no parameters that require grad")
        stage = self.state._stages()[0]
        self._rank, self._size = stage.rank, stage.size
        with torch.no_grad():
            self.global_params = [p.detach().float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.global_params]
        self.inner_steps = 0
        self.outer_steps = 0
        self.plain_bytes_sent = 0
        self._check_start = True  # the next outer step's handshake carries the global parameters' digest

    # ------------------------------------------------------------------ stepping
    def step(self) -> bool:
        """The inner optimizer's step; every ``sync_every``-th call, then the outer step (collective).
        Returns whether an outer step ran."""
        self.inner_optimizer.step()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """One outer step now (collective; :meth:`step` calls it every ``sync_every`` steps): exchange
        the pseudo-gradients, average, take the outer optimizer's step, load the result into the model."""
        st = self.state
        min_size = st.min_size
        sends, error = [], None
        try:
            for k, (p, g) in enumerate(zip(self.params, self.global_params)):
                if p.shape != g.shape:
                    raise ValueError(f"parameter {k} changed shape from {tuple(g.shape)} to {tuple(p.shape)}")
                sends.append((g - p.detach().float()).reshape(-1))
        except Exception as err:  # noqa: BLE001 - travels in the handshake: no rank waits alone
            error = err
        quantized = [k for k, g in enumerate(self.global_params) if g.numel() >= max(min_size, 1)]
        plain = [k for k, g in enumerate(self.global_params) if g.numel() < max(min_size, 1)]
        shown = self._agreement()
        ops, stages = st._ops_for(self.global_params[0].device), st._stages()
        try:
            rnd = st.engine.open_stream(
                ops,
                stages,
                min_size=min_size,
                error=error_text(error),
                elements=sum(self.global_params[k].numel() for k in quantized),
                order=stable_hash(shown),
            )
        except CollectiveTimeout:
            raise
        except ProtocolError as err:
            raise ValueError(self._explain(err, error, shown, stages[0])) from None
        self._check_start = False
        results: dict[int, tuple] = {}  # buffer -> (decoded, failure), set on the backend's threads
        layouts = []
        buffers = self._buffers(quantized)
        for b, members in enumerate(buffers):
            parts = [sends[k] for k in members]
            tensors = (
                [
                    (sends[k].numel(), shape_hash(tuple(self.params[k].shape), str(self.params[k].dtype)))
                    for k in members
                ]
                if st.round_state.auto is not None
                else None
            )
            layouts.append(
                rnd.add(
                    parts,
                    sum(p.numel() for p in parts),
                    lambda decoded, failure, b=b: results.__setitem__(b, (decoded, failure)),
                    tensors=tensors,
                    whole=len(buffers) == 1,
                    idents=[(self._names[k], sends[k].numel()) for k in members],
                )
            )
        averaged: dict[int, torch.Tensor] = {}
        if plain:
            flat = torch.cat([sends[k] for k in plain])
            stages[0].wait(
                torch.distributed.all_reduce(flat, group=st.process_group, async_op=True),
                f"{PREFIX}.diloco.{st.round_state.step - 1}.plain",
            )
            flat /= self._size
            st.round_state.uncompressed_coordinates += flat.numel()
            self.plain_bytes_sent += 8 * flat.numel() * (self._size - 1) // self._size  # ring: 2 (N-1)/N floats
            for k, piece in zip(plain, torch.split(flat, [sends[k].numel() for k in plain])):
                averaged[k] = piece
        rnd.wait()
        failure = next((results[b][1] for b in range(len(buffers)) if results[b][1] is not None), None)
        if isinstance(failure, ProtocolError) and not isinstance(failure, CollectiveTimeout):
            text = str(failure)
            raise ValueError(text if text.startswith(PREFIX) else f"{PREFIX}: {text}") from None
        if failure is not None:
            raise failure
        for b, (members, layout) in enumerate(zip(buffers, layouts)):
            decoded = results[b][0]
            for k, start in zip(members, layout.starts):
                averaged[k] = decoded.read(start, start + sends[k].numel(), 1.0 / self._size)
        rnd.close()  # the refit, in the rounds that collect
        bad = [k for k in sorted(averaged) if not bool(torch.isfinite(averaged[k]).all())]
        if bad:  # the average is the same on every rank: every rank raises here, nothing is written
            raise ValueError(self._nonfinite(bad, sends))
        mu, lr = self.outer_momentum, self.outer_lr
        for k, (p, g, m) in enumerate(zip(self.params, self.global_params, self.momentum)):
            delta = averaged[k].view_as(g)
            if mu:
                m.mul_(mu).add_(delta)
                g.sub_(delta.add(m, alpha=mu), alpha=lr)  # Nesterov: g - lr (delta + mu m)
            else:
                g.sub_(delta, alpha=lr)
            p.copy_(g)
        self.outer_steps += 1

    def _nonfinite(self, bad: list[int], sends: list) -> str:
        """The error of an outer step whose averaged pseudo-gradient holds NaN or Inf (parameters ``bad``)."""
        named = {id(p): n for n, p in self.model.named_parameters()}
        names = ", ".join(named.get(id(self.params[k]), f"parameter {k}") for k in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        own = "finite" if all(bool(torch.isfinite(s).all()) for s in sends) else "NOT finite"
        return (
            f"{PREFIX}: DiLoCo outer step {self.outer_steps}: the averaged pseudo-gradient holds NaN or Inf "
            f"in {names}{more}, so no outer step was taken: the global parameters and the outer momentum "
            f"are unchanged on every rank, and each rank's model keeps its local parameters. This rank's "
            f"own pseudo-gradient is {own} (a rank whose local steps diverged sends NaN or Inf). Restore "
            f"the model (for instance from diloco.global_params or a checkpoint) before training on"
        )

    def _buffers(self, members: list[int]) -> list[list[int]]:
        """The quantized parameters, in order, in buffers of about ``fusion_bytes`` of float32 (0: one each)."""
        limit = resolve_fusion_bytes(self.state.settings.fusion_bytes)
        out: list[list[int]] = []
        size = 0
        for k in members:
            nbytes = 4 * self.global_params[k].numel()
            if not out or limit == 0 or size + nbytes > limit:
                out.append([])
                size = 0
            out[-1].append(k)
            size += nbytes
        return out

    def _explain(self, err: ProtocolError, error: Exception | None, shown: dict, transport) -> str:
        """After a failed handshake (alike on every rank; two more collectives on every rank): the
        ranks' own errors, else the DiLoCo fields that differ with every rank's value, else ``err``."""
        name = f"{PREFIX}.diloco.{self.state.round_state.step}.messages"
        shared = _gather_json(transport, [error_text(error), shown], name)
        failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(shared) if m is not None]
        if failed:
            return f"{PREFIX}: DiLoCo could not form the pseudo-gradient on " + "; ".join(failed)
        differ = [
            f"{k} ({', '.join(f'rank {r}: {e[k]}' for r, (_, e) in enumerate(shared))})"
            for k in shown
            if len({json.dumps(e[k]) for _, e in shared}) > 1
        ]
        if differ:
            return (
                f"{PREFIX}: the ranks' DiLoCo settings differ: {'; '.join(differ)}. Every rank must build "
                f"DiLoCo with the same arguments, the same model and the same initial parameters"
            )
        return str(err)

    def _agreement(self) -> dict:
        """What every rank must share beyond the engine's handshake (its hash travels as ``order``)."""
        shapes = [tuple(g.shape) for g in self.global_params]
        start = stable_hash(*(_digest(g) for g in self.global_params)) if self._check_start else 0
        return {
            "sync_every": self.sync_every,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "error_feedback": self.error_feedback,
            "shapes": stable_hash(shapes),
            "global_parameters": start,
        }

    @property
    def error_feedback(self) -> bool:
        return self.state.settings.error_feedback

    # ------------------------------------------------------------------ metrics and state
    def metrics(self) -> dict:
        """The other front-ends' keys (``step`` and the byte counts: the outer steps' quantized
        exchange) and ``inner_steps``, ``outer_steps``, ``plain_bytes_sent`` (the uncompressed
        parameters' all_reduce, modeled as a ring: ``8 (N-1)/N`` bytes per coordinate) and
        ``total_bytes_sent`` (both)."""
        out = self.state.metrics()
        out.update(
            inner_steps=self.inner_steps,
            outer_steps=self.outer_steps,
            plain_bytes_sent=self.plain_bytes_sent,
            total_bytes_sent=out["bytes_sent"] + self.plain_bytes_sent,
        )
        return out

    def state_dict(self) -> dict:
        """Global parameters, outer momentum, step counters and the exchange's state (levels,
        counters, seed, error buffers). The model and the inner optimizer are saved by
        their own ``state_dict``. Call between steps."""
        return {
            "sync_every": self.sync_every,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "error_feedback": self.error_feedback,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "plain_bytes_sent": self.plain_bytes_sent,
            "global_params": [g.clone() for g in self.global_params],
            "momentum": [m.clone() for m in self.momentum],
            "exchange": self.state.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same settings and parameter shapes; ValueError otherwise).
        Load the same state on every rank: the next outer step checks the global parameters."""
        keys = ("sync_every", "outer_lr", "outer_momentum", "error_feedback")
        differ = [
            f"{k}: saved {state[k]!r}, this DiLoCo {getattr(self, k)!r}" for k in keys if state[k] != getattr(self, k)
        ]
        shapes = [tuple(t.shape) for t in state["global_params"]]
        if shapes != [tuple(g.shape) for g in self.global_params]:
            differ.append("parameter shapes")
        if differ:
            raise ValueError(f"{PREFIX}: the saved DiLoCo state has other settings ({'; '.join(differ)})")
        self.state.load_state_dict(state["exchange"])
        for dst, key in ((self.global_params, "global_params"), (self.momentum, "momentum")):
            for d, s in zip(dst, state[key]):
                d.copy_(s)
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        self.plain_bytes_sent = int(state["plain_bytes_sent"])
        self._check_start = True

    def __repr__(self) -> str:
        return (
            f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
            f"error_feedback={self.error_feedback}, {self.state!r})"
        )


def _gather_json(transport, value: Any, name: str) -> list:
    """Every rank's JSON ``value``, in rank order (two collectives)."""
    raw = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    n = int(transport.allreduce_max(np.array([raw.size], dtype=np.int64), f"{name}.size")[0])
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[: raw.size] = torch.from_numpy(raw.copy())
    got = transport.allgather(buf, [n] * transport.size, name)().cpu().numpy()
    return [json.loads(bytes(got[r * n : (r + 1) * n]).rstrip(b"\0").decode()) for r in range(transport.size)]


def _digest(t: torch.Tensor) -> int:
    """A 62-bit hash of a tensor's bytes (the same on every rank for equal tensors)."""
    raw = hashlib.blake2b(t.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2
