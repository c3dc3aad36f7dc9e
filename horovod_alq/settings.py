"""The settings every front-end shares, defined once.

:class:`Settings` holds them, each field with its default and its documentation, validated when
the object is made. Every front-end (the Horovod compressors for PyTorch and TensorFlow, the DDP
hook's ``ALQState``, FSDP2's ``ALQReduceScatter``, mpi4py's ``QuantizedAllreduce``, ``DiLoCo``) takes either a
``Settings`` (``settings=``) or the same names as keywords, and documents only its own arguments
(the process group or set, TensorFlow's ``jit_compile``, mpi4py's ``collect_every``)::

    from horovod_alq.settings import Settings
    settings = Settings(method="alq", bits=3, bucket_size=8192, timeout=60)
    compression = ALQCompressor(settings=settings)      # Horovod PyTorch
    state = ALQState(settings=settings)                 # DDP hook, same settings

A front-end that cannot serve a setting refuses a value other than its default with a ValueError
that says why (:data:`NOT_SERVED`; some values only: :func:`partly`); :func:`served_table` writes
the table of docs/guides/settings.md.
:func:`configure` builds what a front-end runs from its settings: both quantizers, the refit
schedule, the round state, the seed and the exchange engine.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Sequence

from .core.auto_bits import AutoBits, check_auto
from .core.entropy import check_wire
from .core.methods import check_bits, check_norm, get_method
from .core.precondition import check_precondition
from .core.protocol import MASK64, resolve_timeout
from .core.quantizer import Quantizer, check_code_entropy
from .core.rounds import RefitSchedule, RoundState, schedule_from
from .core.speed import check_compress, resolve_compress
from .exchange import registry
from .exchange.engine import Engine, resolve_fusion_bytes, resolve_pipeline_bytes
from .exchange.feedback import ErrorFeedback, check_feedback
from .exchange.registry import check_exchange

__all__ = ["Settings", "Setup", "configure", "served_table"]

#: ``bit_budget`` of ``bits="auto"`` when none is given.
DEFAULT_BIT_BUDGET = 3.0
#: The default width (TernGrad always sends 2 bits).
DEFAULT_BITS = 3


@dataclass(frozen=True)
class Settings:
    """What every front-end shares: the method, its widths and levels' schedule, the exchange, the
    codec and the waits. Immutable; ``settings.replace(bits=4)`` gives a changed copy. Each field
    is checked when the object is made (ValueError naming the field)."""

    method: str = "alq"
    """``"alq"``, ``"alq-n"``, ``"amq"``, ``"amq-n"`` (adaptive levels), ``"qsgdinf"``, ``"qsgd"``,
    ``"nuqsgd"``, ``"terngrad"`` (fixed levels); :data:`horovod_alq.core.methods.METHODS`."""

    bits: int | str = DEFAULT_BITS
    """Bits per coordinate on the wire, 2 to 8 (TernGrad: 2, which it takes whatever the default).
    ``"auto"`` (adaptive methods): a width from 2 to 8 per tensor, chosen at every refit so that
    the step's quantization variance is smallest within ``bit_budget``; one level set per width
    (docs/design/design.md, "Bits per tensor"). Until the first refit every tensor gets
    ``floor(bit_budget)`` bits."""

    bucket_size: int = 8192
    """Coordinates per float32 norm (8192 costs 0.004 bits per coordinate)."""

    norm: str | None = None
    """Bucket norm, ``"l2"`` or ``"linf"`` (adaptive methods take either; fixed methods only their
    own); None: the method's default (``"linf"`` but for QSGD and NUQSGD)."""

    bit_budget: float | None = None
    """``bits="auto"`` only: mean bits per coordinate of the compressed tensors (bucket norms not
    counted), 2 to 8; None: :data:`DEFAULT_BIT_BUDGET`."""

    bits_per: str | None = None
    """``bits="auto"`` only: what gets a width. ``"tensor"`` (None): the allocation above, agreed by
    every rank. ``"bucket"``: every quantization bucket of every payload, chosen by each rank at
    every step from its own bucket norms; each payload fills ``bit_budget`` and carries a width byte
    per bucket (docs/design/design.md, "Bits per bucket"); bucket sizes that are multiples of 8."""

    bits_max: int | None = None
    """``bits="auto"`` with widths per tensor only: the widest width a tensor may get, 3 to 8; None: 8.
    A refit computes every tensor's error at every width and fits the widths in use, so a lower cap
    makes refits cheaper and bounds any one tensor's bytes, at some variance (measured in
    docs/results/codec_speed.md#bench_refit)."""

    exchange: str = "auto"
    """How codes travel: one of :func:`horovod_alq.exchange.registry.choices`, the registered
    exchanges (each module's docstring says how it moves codes; docs/design/design.md, "Exchange"),
    or ``"auto"``, :func:`~horovod_alq.exchange.registry.choose_exchange`'s rule. Built in:
    ``"allgather"`` (one quantization, ``(N-1)(b + 32/d)`` bits received per coordinate),
    ``"two-phase"`` (a second quantization, about ``2(N-1)/N (b + 32/d)`` bits), ``"hierarchical"``
    and ``"hierarchical-two-phase"`` (exact sums inside nodes of consecutive ranks, codes between
    them; nodes from ``$HOROVOD_ALQ_LOCAL_SIZE`` or the launcher)."""

    bits_second: int | None = None
    """Bits of the two-phase exchanges' second quantization; None: ``bits``."""

    adapt_second: bool | None = None
    """How the second (two-phase) quantization's levels follow the gradients. None: at equal bits they
    are the first quantizer's, copied at every refit; at other bits they are refit from the reduced
    shards' statistics. True: refit them at equal bits too. False: at other bits keep their initial
    fit (docs/results/variance_training.md#variance_two_phase)."""

    update_steps: Sequence[int] | None = None
    """Rounds (optimizer steps) whose statistics refit the levels; None: (0, 100, 2000)."""

    update_every: int | None = None
    """After the last of ``update_steps``, refit every this many rounds; None: 10000; 0: never."""

    min_size: int = 1024
    """Tensors with fewer elements travel uncompressed (the framework's plain allreduce)."""

    seed: int | None = None
    """Seed of the stochastic rounding (mixed with the rank, round, buffer and phase); None: fresh
    entropy on every rank."""

    wire: str = "fixed"
    """How payloads travel: ``"fixed"``, every code on ``bits`` bits; ``"entropy"``, each payload's
    codes rANS-coded with its own code frequencies (carried in the payload), decoded back to the
    same codes, so the same results for fewer bytes (docs/design/entropy_wire.md). The coder runs on
    the host (the compiled CPU codec where it loads, else NumPy); payloads on a GPU are copied
    there and back."""

    code_entropy: float | None = None
    """With ``wire="entropy"``, ALQ and ALQ-N at fixed ``bits``: fit the ``2**bits`` levels for the
    least variance whose codes carry at most this entropy (bits per coordinate under the fitted
    distribution; above 0, at most ``bits``) instead of the least variance for the count of levels:
    ``bits=4, code_entropy=2.5`` pays about 2.5 bits per coordinate on the wire, plus the fitted
    distribution's mismatch (docs/design/entropy_wire.md). Not ``bit_budget``, which is the fixed-length bits of
    ``bits="auto"``. None: ALQ's fit."""

    error_feedback: bool = False
    """Keep what each quantization dropped and add it to the next round's input, on every rank and for
    every exchange (a two-phase or hierarchical owner also keeps the error of the sums it
    quantizes): nothing extra on the wire, one buffer of the compressed gradients' size per rank.
    The sum of what was applied stays within one buffer of the true sum, but a step's estimate is
    no longer unbiased. Whether it helps depends on the optimizer (docs/guides/settings.md). The
    buffers go into ``state_dict()``; a bucket holding NaN or Inf keeps its previous error."""

    error_feedback_dtype: str = "float32"
    """The error buffers' dtype: ``"float32"``, or ``"bfloat16"`` (torch tensors) for half the memory."""

    precondition: Any = None
    """Quantize where Adam feels the error: each tensor is quantized as ``g * w`` and comes back as
    ``decode(...) / w``, with ``w = 1 / (sqrt(v_hat) + floor)`` from an Adam-family optimizer's
    second moment (``torch.optim.AdamW``, ``Adam``, ``FrozenVarianceAdamW``: pass the optimizer
    that steps), or any per-coordinate scale (``horovod_alq.torch.Preconditioner(fn,
    parameters=...)``). Still unbiased (``w`` is the same on every rank; its digest is in every
    round's handshake); error feedback, if on, keeps its error in the scaled space. An optimizer
    without a second moment (SGD) is refused. mpi4py takes a scale array per call instead
    (``scales=``). docs/design/design.md, "Preconditioned quantization"."""

    codec: str = "auto"
    """PyTorch codec backend (:mod:`horovod_alq.torch.codecs`): ``"auto"`` (Triton for CUDA tensors
    when importable, the compiled CPU codec for CPU tensors when it loads, torch ops otherwise),
    ``"triton"``, ``"cpu"`` or ``"torch"``. The Triton codec on CUDA has not run on a GPU yet."""

    fusion_bytes: int | None = None
    """A round's gradients are quantized and exchanged in buffers of this many bytes of float32;
    None: ``$HOROVOD_ALQ_FUSION_BYTES``, else 64 MiB; 0: one buffer per tensor."""

    pipeline_bytes: int | None = None
    """A round's fusion buffer of more than this many bytes of float32 travels in chunks of about
    this size, each chunk encoded and decoded while another is on the wire (the same results bit
    for bit; the compiled CPU codec, the allgather, two-phase and hierarchical exchanges, either wire:
    on the entropy wire each chunk is also coded while another travels, on Horovod's transport);
    None: ``$HOROVOD_ALQ_PIPELINE_BYTES``, else 0: off (opt-in until a run measures it faster; 4 MiB
    is a starting point). docs/design/design.md, "Pipelined round"."""

    overlap: bool = True
    """Start each fusion buffer's exchange as soon as it is complete, during the backward pass, not
    at the round's first ``decompress``. Results are the same either way."""

    compress: str | None = None
    """When to quantize. ``"always"``: every round (what the studies and benchmarks of docs/results
    run). ``"when-faster"``: only while that measures faster than the framework's own 16-bit path
    (Horovod: its allreduce of an fp16 cast; DDP: what ``fp16_compress_hook`` does; FSDP2: its
    reduce-scatter in bfloat16, as ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``), timing real
    training steps (the slowest rank's) in interleaved trials of 8 rounds (up to 24 where the paths
    differ by less than 10%) from round 2, again from round 100, every 2000 rounds and when the step
    time drifts (docs/guides/settings.md, "Never slower than 16 bits").
    ``"auto"``: ``"when-faster"`` where the front-end serves it (Horovod PyTorch, the DDP hook, FSDP2),
    ``"always"`` elsewhere. None: ``$HOROVOD_ALQ_COMPRESS``, else ``"auto"``."""

    timeout: float | None = None
    """Seconds to wait for any of the front-end's own collectives (payloads, handshake, statistics)
    before raising :class:`~horovod_alq.core.protocol.CollectiveTimeout` naming it; None:
    ``$HOROVOD_ALQ_TIMEOUT``, else 300; 0: no limit."""

    clip: bool | float = False
    """TernGrad only: clip buckets at this many standard deviations (True: 2.5); biased, off by
    default."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize in place once
        method = get_method(self.method)
        set_(self, "method", method.name)
        bits = self.bits
        if isinstance(bits, str):
            if bits != "auto":
                raise ValueError(f"bits must be an integer from 2 to 8 or 'auto', got {bits!r}")
            if not method.adaptive:
                raise ValueError(f"bits='auto' needs an adaptive method (alq, alq-n, amq, amq-n), not {method.name!r}")
            if self.bits_second is not None or self.adapt_second:
                raise ValueError(
                    "bits='auto' quantizes both phases of the two-phase exchange with each tensor's "
                    "width: bits_second and adapt_second=True do not apply"
                )
            budget = DEFAULT_BIT_BUDGET if self.bit_budget is None else self.bit_budget
            check_auto(budget, "tensor" if self.bits_per is None else self.bits_per, self.bits_max)
        else:
            if method.name == "terngrad" and bits == DEFAULT_BITS and not isinstance(bits, bool):
                bits = 2
            set_(self, "bits", check_bits(method, bits))
            for name in ("bit_budget", "bits_per", "bits_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to bits='auto' only (got bits={self.bits!r})")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive integer, got {self.bucket_size!r}")
        check_norm(method, self.norm)
        set_(self, "exchange", check_exchange(self.exchange))
        if self.bits_second is not None:
            check_bits(method, self.bits_second)
        if self.adapt_second not in (None, True, False):
            raise ValueError(f"adapt_second must be None, True or False, got {self.adapt_second!r}")
        if self.update_steps is not None:
            set_(self, "update_steps", tuple(self.update_steps))
        schedule_from(self.update_steps, self.update_every)
        check_min_size(self.min_size)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        check_wire(self.wire)
        check_feedback(self.error_feedback, self.error_feedback_dtype)
        check_precondition(self.precondition)
        if self.code_entropy is not None:
            if self.wire != "entropy":
                raise ValueError("code_entropy fits levels for the entropy-coded wire: it needs wire='entropy'")
            if bits == "auto":
                raise ValueError("code_entropy applies to a fixed width (bits=2..8), not bits='auto'")
            check_code_entropy(method, self.bits, self.code_entropy)
        if not isinstance(self.codec, str):
            raise ValueError(f"codec must be a backend's name, got {self.codec!r}")
        resolve_fusion_bytes(self.fusion_bytes)
        resolve_pipeline_bytes(self.pipeline_bytes)
        set_(self, "overlap", bool(self.overlap))
        check_compress(self.compress)
        resolve_timeout(self.timeout)
        if self.clip is not False and self.clip is not None and method.name != "terngrad":
            raise ValueError(f"clip applies to terngrad only, not {method.name}")

    # ------------------------------------------------------------------ building one
    @classmethod
    def of(cls, settings: Settings | None = None, front_end: str | None = None, **keywords: Any) -> Settings:
        """``settings`` with ``keywords`` applied (or the defaults with them), refused where
        ``front_end`` (a key of :data:`NOT_SERVED`) does not serve a value given. Keywords that are
        None are not given; an unknown keyword raises TypeError naming it."""
        unknown = sorted(set(keywords) - set(NAMES))
        if unknown:
            raise TypeError(
                f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the settings are {', '.join(NAMES)}"
            )
        if settings is not None and not isinstance(settings, Settings):
            raise TypeError(f"settings must be a horovod_alq.settings.Settings, got {type(settings).__name__}")
        keywords = {k: v for k, v in keywords.items() if v is not None}
        out = cls(**keywords) if settings is None else dataclasses.replace(settings, **keywords)
        if front_end is not None:
            out.check_served(front_end)
        return out

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (checked like a new object)."""
        return Settings.of(self, **changes)

    def check_served(self, front_end: str) -> None:
        """ValueError if a setting ``front_end`` does not serve differs from its default, or takes a
        value the front-end does not serve (:func:`partly`)."""
        for name, why in NOT_SERVED[front_end].items():
            value = getattr(self, name)
            if value != DEFAULTS[name]:
                shown = repr(value) if isinstance(value, (bool, int, float, str, tuple)) else type(value).__name__
                raise ValueError(f"{front_end} does not serve {name}={shown}: {why}")
        for name, (allowed, why) in partly().get(front_end, {}).items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"{front_end} does not serve {name}={value!r} (it serves {', '.join(map(repr, allowed))}): {why}"
                )

    def keywords(self) -> dict:
        """The settings as keywords (every field; ``Settings(**s.keywords()) == s``)."""
        return {name: getattr(self, name) for name in NAMES}


#: The setting names, in field order.
NAMES = tuple(f.name for f in fields(Settings))
#: Every setting's default.
DEFAULTS = {f.name: f.default for f in fields(Settings)}


def check_min_size(min_size) -> int:
    """``min_size`` as given, or ValueError: tensors smaller than it travel uncompressed."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative integer, got {min_size!r}")
    return min_size


# ---------------------------------------------------------------------------------- front-ends
#: The front-ends, by the names their errors and the table use.
FRONT_ENDS = ("Horovod PyTorch", "Horovod TensorFlow", "DDP hook", "FSDP2", "mpi4py", "DiLoCo")

_ON_REQUEST = "levels are refit when asked (adapt()); collect_every chooses the calls that record statistics"
_TERNGRAD_CLIP = "clipping is a NumPy reference feature; the compiled codecs have no clipping kernel"
_STREAMED = "its rounds are streamed buffer by buffer; only Horovod PyTorch's fused round is pipelined"
#: For each front-end, the settings it refuses (other than their default) and why.
NOT_SERVED: dict[str, dict[str, str]] = {
    "Horovod PyTorch": {"clip": _TERNGRAD_CLIP},
    "Horovod TensorFlow": {
        "codec": "TensorFlow runs its own codec (TF ops, XLA-compiled: jit_compile=)",
        "bits_per": "per-bucket widths need the mixed-payload codec, written for torch and NumPy only",
        "overlap": "in a traced step TensorFlow's executor starts each tensor's or fusion buffer's exchange once "
        "its inputs exist; there is no switch",
        "clip": _TERNGRAD_CLIP,
        "code_entropy": "it fits levels for the entropy-coded wire, which TensorFlow does not serve",
        "wire": "TensorFlow moves payloads inside its graph, where no host-side coder runs; for the "
        "entropy-coded wire use the PyTorch front-ends or mpi4py",
        "precondition": "a Keras optimizer's slots are not readable inside the compressor's graph in one "
        "agreed form (and Horovod TF hands the compressor gradients, not variables); use the PyTorch front-ends",
        "pipeline_bytes": "TensorFlow's graph runs its codec ops, which draw per encode, not per coordinate: "
        "they cannot encode a buffer's chunks; use the PyTorch front-ends",
    },
    "DDP hook": {
        "overlap": "DDP overlaps by itself: each bucket's exchange starts when its hook runs",
        "clip": _TERNGRAD_CLIP,
        "pipeline_bytes": _STREAMED,
    },
    "FSDP2": {
        "bits_per": "a reduce-scatter shard has no per-bucket mixed-width codec yet",
        "bits_second": "the reduce-scatter quantizes once",
        "adapt_second": "the reduce-scatter quantizes once",
        "fusion_bytes": "FSDP2's own reduce-scatter input is the buffer",
        "overlap": "FSDP2 overlaps by itself: each module's reduce-scatter starts when its backward ends",
        "clip": _TERNGRAD_CLIP,
        "pipeline_bytes": _STREAMED,
        "precondition": "Adam's second moment is sharded like the parameters: a rank holds v only for its own "
        "shard, while every rank must scale the whole unsharded gradient it reduce-scatters",
    },
    "mpi4py": {
        "min_size": "QuantizedAllreduce quantizes every array it is given; reduce small ones with comm.Allreduce",
        "codec": "mpi4py runs the NumPy codec",
        "fusion_bytes": "each array of a call is its own buffer",
        "overlap": "a call exchanges its arrays at once, there is no backward pass to overlap",
        "update_steps": _ON_REQUEST,
        "update_every": _ON_REQUEST,
        "precondition": "mpi4py holds no optimizer: pass each call a scale array per array (scales=)",
        "pipeline_bytes": _STREAMED,
    },
    "DiLoCo": {
        "overlap": "the pseudo-gradient is complete when the outer step starts: there is no backward pass to overlap",
        "clip": _TERNGRAD_CLIP,
        "pipeline_bytes": _STREAMED,
        "precondition": "the outer step exchanges a pseudo-gradient (the drift of many inner steps) applied by "
        "the outer optimizer (SGD with Nesterov momentum): the inner optimizer's v is not the outer step's scale",
    },
}
#: The front-ends that serve ``compress="when-faster"`` (each times its own 16-bit path) ...
MEASURES = ("Horovod PyTorch", "DDP hook", "FSDP2")
_ALWAYS = "; use compress='always' (or 'auto', which is 'always' here)"
#: ... and why the others do not.
NOT_MEASURED = {
    "Horovod TensorFlow": "no timed comparison with Horovod's fp16 compression is built into the traced step yet"
    + _ALWAYS,
    "mpi4py": "a call is not a training step: there is no step to time and no 16-bit path of its own to compare"
    + _ALWAYS,
    "DiLoCo": "an outer step comes every sync_every inner steps: too few rounds to time a comparison" + _ALWAYS,
}
#: Settings a front-end accepts but that change nothing there, and why.
IGNORED: dict[str, dict[str, str]] = {
    "DDP hook": {"fusion_bytes": "checked equal on every rank; DDP's bucket_cap_mb is the fusion"},
}


def partly() -> dict[str, dict[str, tuple[tuple, str]]]:
    """Settings a front-end serves for some values only: the values, and why not the others (the
    exchanges from :mod:`horovod_alq.exchange.registry`'s capability flags; ``compress`` from
    :data:`NOT_MEASURED`)."""
    out: dict[str, dict[str, tuple[tuple, str]]] = {
        "Horovod TensorFlow": {
            "exchange": (
                ("auto", *registry.graph_names()),
                "the other exchanges have no graph execution; "
                "for them use the PyTorch compressors, the DDP hook or mpi4py",
            ),
            "error_feedback_dtype": (("float32",), "the graph's buffers are float32 variables"),
        },
        "mpi4py": {
            "error_feedback_dtype": (("float32",), "NumPy has no bfloat16: the buffers are float32"),
        },
        "FSDP2": {
            "exchange": (
                registry.shard_choices(),
                "FSDP2 reduce-scatters (each rank receives its own shard): "
                "'auto' is node-aware across nodes of several ranks, flat otherwise",
            )
        },
    }
    for front_end, why in NOT_MEASURED.items():
        out.setdefault(front_end, {})["compress"] = ((None, "auto", "always"), why)
    return out


def served_table() -> str:
    """The Markdown table of docs/guides/settings.md: which front-end serves which setting, and why not."""
    notes: list[str] = []
    partial = partly()
    head = "| setting | default | " + " | ".join(FRONT_ENDS) + " |"
    rows = [head, "|" + "---|" * (len(FRONT_ENDS) + 2)]
    for name in NAMES:
        cells = []
        for fe in FRONT_ENDS:
            some = partial.get(fe, {}).get(name)
            why = NOT_SERVED[fe].get(name) or IGNORED.get(fe, {}).get(name)
            if some is not None:
                why = f"{', '.join(map(repr, some[0]))} only: {some[1]}"
            if why is None:
                cells.append("yes")
                continue
            if why not in notes:
                notes.append(why)
            mark = "no" if name in NOT_SERVED[fe] else "partly" if some is not None else "ignored"
            cells.append(f"{mark} ({notes.index(why) + 1})")
        rows.append(f"| `{name}` | `{DEFAULTS[name]!r}` | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f"{i}. {why}." for i, why in enumerate(notes, 1)]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------- building
@dataclass
class Setup:
    """A front-end's quantization state built from its :class:`Settings`: ``state`` (both
    quantizers, schedule, counters), the 64-bit ``seed`` of its rounding noise, and :meth:`engine`."""

    settings: Settings
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

    def engine(
        self, uid: str | None, exchange: str | None = None, fusion_bytes: int | None = None, early: bool | None = None
    ) -> Engine:
        """The exchange engine over this state, with the settings' exchange, fusion and overlap
        (``exchange``, ``fusion_bytes``, ``early``: a front-end's own in place of the settings')."""
        s = self.settings
        return Engine(
            self.state.quantizer,
            self.state,
            seed=self.seed,
            uid=uid,
            early=s.overlap if early is None else early,
            exchange=s.exchange if exchange is None else exchange,
            fusion_bytes=s.fusion_bytes if fusion_bytes is None else fusion_bytes,
            wire=s.wire,
            pipeline_bytes=s.pipeline_bytes,
        )


def configure(
    settings: Settings, *, on_request: bool = False, adapt_second: bool | None = None, front_end: str | None = None
) -> Setup:
    """Build a front-end's :class:`Setup` from ``settings``. ``on_request``: no refit schedule (the
    front-end refits when asked, as mpi4py's ``adapt()``); ``adapt_second``: a front-end's own
    choice in place of the setting's (TensorFlow's); ``front_end``: resolves ``compress`` (``"auto"``
    measures where the front-end is one of :data:`MEASURES`).

    ``bits="auto"``: both phases of the two-phase exchange use a tensor's width and levels
    (:class:`~horovod_alq.core.auto_bits.AutoBits`); ``bits_per="bucket"``: a width per bucket of
    every payload, chosen by each rank (:mod:`~horovod_alq.core.bucket_widths`)."""
    s = settings
    adapt = s.adapt_second if adapt_second is None else adapt_second
    auto = None
    if s.bits == "auto":
        auto = AutoBits(
            s.method,
            DEFAULT_BIT_BUDGET if s.bit_budget is None else s.bit_budget,
            s.bucket_size,
            norm=s.norm,
            bits_per="tensor" if s.bits_per is None else s.bits_per,
            bits_max=s.bits_max,
        )
        first = second = auto.quantizers[auto.default]
        adapt = False
    else:
        first = Quantizer(s.method, s.bits, s.bucket_size, clip=s.clip, norm=s.norm, code_entropy=s.code_entropy)
        bits2 = first.bits if s.bits_second is None else s.bits_second
        entropy2 = None if s.code_entropy is None else min(s.code_entropy, bits2)
        second = Quantizer(s.method, bits2, first.bucket_size, norm=first.norm, code_entropy=entropy2)
    schedule = RefitSchedule((), 0) if on_request else schedule_from(s.update_steps, s.update_every)
    seed = int.from_bytes(os.urandom(8), "little") if s.seed is None else int(s.seed) & MASK64
    feedback = ErrorFeedback(s.error_feedback_dtype) if s.error_feedback else None
    state = RoundState(first, schedule, second, adapt, auto=auto, feedback=feedback)
    state.compress = resolve_compress(s.compress, front_end in MEASURES)
    return Setup(s, state, seed)
