"""The five user-facing quantization schemes, shared by the PyTorch and TensorFlow compressors.

Each class here is a mixin that turns a scheme's own keywords (``normless=``, ``norm=``) into a
method name of :mod:`horovod_alq.core.methods` and calls the framework's base class with it;
each framework declares its public classes on top of its base::

    class ALQCompressor(compressor_mixins.ALQ, QuantizedCompressor): ...

so the keywords, defaults and checks exist once for both frameworks; so do the base pieces of
their ``QuantizedCompressor`` (:class:`CompressorBase`, :class:`DefaultBound`) and the
configuration properties of every front-end (:class:`Configured`, mpi4py's too). Plain Python
over the NumPy :class:`~horovod_alq.core.Quantizer`, with no framework import; the settings the
front-ends share are :class:`horovod_alq.settings.Settings`.
"""

from __future__ import annotations

import sys

from .core.methods import check_norm, get_method


class ALQ:
    """ALQ: levels adapted by coordinate descent to the gradients' statistics (Faghri et al. 2020).

    ``normless=True`` gives ALQ-N (one truncated normal instead of the norm-weighted mixture).
    ``norm="linf"`` (the default) normalizes each bucket by its max-abs; ``norm="l2"`` by its L2
    norm, the paper's form (2x to 6x the variance on real gradients, docs/results/bucket_norm.md)."""

    method = "alq"

    def __init__(
        self,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        normless: bool = False,
        norm: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__("alq-n" if normless else "alq", bits, bucket_size, norm=norm, **kwargs)


class AMQ:
    """AMQ: levels ``+-{p**s, ..., p, 1}`` with the multiplier ``p`` adapted; ``normless=True``: AMQ-N.

    ``norm="linf"`` (the default): max-abs buckets; ``norm="l2"``: the paper's L2 buckets."""

    method = "amq"

    def __init__(
        self,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        normless: bool = False,
        norm: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__("amq-n" if normless else "amq", bits, bucket_size, norm=norm, **kwargs)


class QSGD:
    """QSGD with uniform levels; ``norm="linf"`` (default) is QSGDinf, ``norm="l2"`` the original QSGD."""

    method = "qsgdinf"

    def __init__(self, bits: int | None = None, bucket_size: int | None = None, norm: str = "linf", **kwargs) -> None:
        if norm not in ("linf", "l2"):
            raise ValueError(f"norm must be 'linf' (QSGDinf) or 'l2' (QSGD), got {norm!r}")
        super().__init__("qsgdinf" if norm == "linf" else "qsgd", bits, bucket_size, **kwargs)


class NUQSGD:
    """NUQSGD: fixed exponential levels ``+-{2**-s, ..., 1/2, 1}``."""

    method = "nuqsgd"

    def __init__(self, bits: int | None = None, bucket_size: int | None = None, **kwargs) -> None:
        super().__init__("nuqsgd", bits, bucket_size, **kwargs)


class TernGrad:
    """TernGrad: levels {-1, 0, 1} scaled by the bucket's max-abs, 2 bits on the wire."""

    method = "terngrad"

    def __init__(self, bucket_size: int | None = None, bits: int | None = None, **kwargs) -> None:
        if bits not in (None, 2):
            raise ValueError(f"TernGrad always sends 2 bits per coordinate, got bits={bits!r}")
        super().__init__("terngrad", 2, bucket_size, **kwargs)


SCHEMES = (ALQ, AMQ, QSGD, NUQSGD, TernGrad)


class DefaultBound(type):
    """Metaclass: the class itself as ``compression=`` (``ALQCompressor``) runs its
    :meth:`CompressorBase.default` instance's ``compress``, ``decompress`` and ``metrics``; an
    instance's are plain methods, with no descriptor of Python's to run at every tensor's call."""

    compress = property(lambda cls: cls.default().compress)
    decompress = property(lambda cls: cls.default().decompress)
    metrics = property(lambda cls: cls.default().metrics)


class Configured:
    """The configuration of a front-end, read from its NumPy ``_quantizer``."""

    @property
    def bits(self) -> int | str:
        """Bits per coordinate, or ``"auto"`` (a width per tensor, :attr:`bit_budget`)."""
        return "auto" if self.bit_budget is not None else self._quantizer.bits

    @property
    def bit_budget(self) -> float | None:
        """Mean bits per coordinate of ``bits="auto"``; None with fixed bits."""
        auto = getattr(getattr(self, "_state", None), "auto", None)
        return None if auto is None else auto.budget

    @property
    def bucket_size(self) -> int:
        return self._quantizer.bucket_size

    @property
    def norm(self) -> str:
        """Bucket norm, ``"l2"`` or ``"linf"``."""
        return self._quantizer.norm

    @property
    def levels(self):
        """Current levels, shape (L,), float64 (a copy); identical on all ranks."""
        return self._quantizer.levels


class CompressorBase(Configured):
    """What the frameworks' ``QuantizedCompressor`` s share: the default instance behind the class
    used as ``compression=``, and the configuration."""

    @classmethod
    def default(cls):
        """The instance used when the class itself is passed as ``compression=``."""
        if "_default_instance" not in cls.__dict__:
            cls._default_instance = cls()
        return cls._default_instance


def _package_frames(package: str, depth: int):
    """The frames of ``package`` among the ``depth`` frames above the caller's caller."""
    frame = sys._getframe(3)
    for _ in range(depth):
        if frame is None:
            return
        if frame.f_globals.get("__name__", "").startswith(package):
            yield frame
        frame = frame.f_back


_COUNTERS: dict = {}  # package -> its library's horovod_number_of_process_sets


def other_sets(package: str) -> bool:
    """Whether Horovod (``package``'s) holds a process set besides the global one: one call into its
    library (under a microsecond), which spares the frame walk of :func:`calling_process_set` (1-2 ms
    a step of 62 tensors, docs/results/compress_when_faster.md); True where it cannot tell."""
    count = _COUNTERS.get(package)
    if count is None:
        try:
            count = sys.modules[package + ".mpi_ops"]._basics.MPI_LIB_CTYPES.horovod_number_of_process_sets
        except Exception:  # noqa: BLE001 (another Horovod build: walk the frames)
            return True
        _COUNTERS[package] = count
    return count() != 1


def calling_process_set(package: str, depth: int = 8):
    """The ``process_set`` of the nearest frame of ``package`` (e.g. ``"horovod.torch"``) among the
    ``depth`` frames above the caller: the argument of the Horovod collective (or the
    ``process_set`` of the Horovod object, e.g. a ``DistributedOptimizer``) that called
    ``compress``; None if there is none. Horovod does not pass the process set to ``compress``."""
    for frame in _package_frames(package, depth):
        local = frame.f_locals
        ps = local.get("process_set", getattr(local.get("self"), "process_set", None))
        if ps is not None and hasattr(ps, "process_set_id"):
            return ps
    return None


def calling_tensor_name(package: str, tensor, depth: int = 10):
    """The name Horovod knows ``tensor`` by, read from the nearest frames of ``package`` above the
    caller (Horovod does not pass it to ``compress``): the parameter's name in a
    ``DistributedOptimizer`` (its ``_parameter_names``), else the ``name=`` of the Horovod
    collective (with the tensor's index in a grouped one); None if there is none."""
    for frame in _package_frames(package, depth):
        local = frame.f_locals
        outer = frame.f_back.f_locals if frame.f_back is not None else {}
        names = getattr(local.get("self", outer.get("self")), "_parameter_names", None)
        p = local.get("p")
        if isinstance(names, dict) and p is not None and names.get(p) is not None:
            return names[p]
        name = local.get("name", outer.get("name"))
        if isinstance(name, str):
            group = local.get("tensors", outer.get("tensors"))
            if isinstance(group, (list, tuple)) and len(group) > 1:
                index = next((i for i, t in enumerate(group) if t is tensor), None)
                return None if index is None else (name, index)
            return name
    return None


class Delegated:
    """The context of a tensor that the compressor of another process set compressed."""

    __slots__ = ("compressor", "ctx")

    def __init__(self, compressor, ctx) -> None:
        self.compressor, self.ctx = compressor, ctx


class PerProcessSet:
    """One Horovod compressor for every process set it is used with, as Horovod's own compressions
    do: a compressor made without ``process_set=`` hands a tensor of any set other than the global
    one to a compressor of its own for that set (made at the set's first use by :meth:`_for_set`,
    with the same settings), so levels, statistics and rounds are kept per set. The framework's
    ``QuantizedCompressor`` sets ``HOROVOD`` (its Horovod package), ``_process_set`` and calls
    :meth:`_init_sets`; ``metrics()`` / ``state_dict()`` carry the other sets' under
    ``process_sets`` (keyed by ranks)."""

    HOROVOD = ""

    def _init_sets(self) -> None:
        self._per_set = {}  # "r0,r1,...": the compressor of that process set
        self._per_set_states = {}  # states loaded before their set's first use

    def _for_set(self, process_set):
        """A new compressor like this one, pinned to ``process_set``."""
        raise NotImplementedError

    def _for_calling_process_set(self):
        """The compressor of the process set of the Horovod allreduce calling ``compress`` (read
        from its frame: Horovod does not pass it), when that is not the global set and this
        compressor is not pinned; None otherwise. The reduced control vector checks the result:
        a wrong guess raises on every rank, naming the set."""
        if self._process_set is not None:
            return None
        if not other_sets(self.HOROVOD):
            return None
        ps = calling_process_set(self.HOROVOD, depth=10)
        if ps is None or ps.process_set_id in (None, 0):
            return None
        key = ",".join(str(int(r)) for r in ps.ranks)
        if key not in self._per_set:
            child = self._for_set(ps)
            if key in self._per_set_states:
                child.load_state_dict(self._per_set_states.pop(key))
            self._per_set[key] = child
        return self._per_set[key]

    def _sets_metrics(self, out: dict) -> dict:
        if self._per_set:
            out["process_sets"] = {
                tuple(int(r) for r in key.split(",")): c.metrics() for key, c in self._per_set.items()
            }
        return out

    def _sets_state(self, state: dict) -> dict:
        sets = {**self._per_set_states, **{key: c.state_dict() for key, c in self._per_set.items()}}
        if sets:
            state["process_sets"] = sets
        return state

    def _load_sets(self, state: dict) -> dict:
        """Load the other sets' states (kept until their first use); returns ``state`` without them."""
        state = dict(state)
        sets = state.pop("process_sets", {})
        self._per_set_states = {key: s for key, s in sets.items() if key not in self._per_set}
        for key, child in self._per_set.items():
            if key in sets:
                child.load_state_dict(sets[key])
        return state


# method name -> (class name in each framework package, the keywords that select the method)
_BY_NAME = {
    "alq": ("ALQCompressor", {}),
    "alq-n": ("ALQCompressor", {"normless": True}),
    "amq": ("AMQCompressor", {}),
    "amq-n": ("AMQCompressor", {"normless": True}),
    "qsgdinf": ("QSGDCompressor", {"norm": "linf"}),
    "qsgd": ("QSGDCompressor", {"norm": "l2"}),
    "nuqsgd": ("NUQSGDCompressor", {}),
    "terngrad": ("TernGradCompressor", {}),
}


def compressor_by_name(classes: dict, method: str, **kwargs):
    """Build ``method``'s compressor from ``classes`` (a framework module's namespace).

    TernGrad ignores ``bits`` (it always sends 2 bits). ``norm`` goes to the adaptive methods; the
    fixed ones accept None or their own norm (another raises ValueError naming the method)."""
    if method not in _BY_NAME:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(_BY_NAME)}")
    name, selected = _BY_NAME[method]
    if method == "terngrad":
        kwargs.pop("bits", None)
    if "norm" in kwargs and name not in ("ALQCompressor", "AMQCompressor"):
        check_norm(get_method(method), kwargs.pop("norm"))
    return classes[name](**selected, **kwargs)
