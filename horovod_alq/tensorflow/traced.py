"""Compressors built inside a traced ``tf.function``: made once, reused by every retrace.

Horovod's own examples choose the compression inside the training step, e.g. its TF2 synthetic
benchmark's ``compression = hvd.Compression.fp16`` inside a ``tf.function`` that is traced twice
(``first_batch=True``, then False). Horovod's compressions are stateless; ours keep their levels and
counters in ``tf.Variable`` s, and ``tf.function`` refuses variables made by any trace but the first.
So a compressor constructed while a function is being traced is kept here, keyed by its class, its
arguments, the line that builds it and how many it built before in the same trace: a retrace of that
line gets the same compressor (same state, same variables, made under ``tf.init_scope`` by the first
trace), and a trace that builds several there still gets distinct ones. Built eagerly, a compressor
is always a new object, as before.
"""

from __future__ import annotations

import collections
import os
import sys
import weakref

import tensorflow as tf

from .graph import outermost_graph

_MADE: dict = {}  # (class, arguments, call site, occurrence) -> the compressor a trace built
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # traced graph -> builds per key
_SKIP = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (sys.modules["horovod_alq"], tf) if getattr(m, "__file__", None)
)


def _site() -> tuple[str, int]:
    """File and line of the nearest frame outside horovod_alq and TensorFlow (autograph's
    converted code is a generated module, the same one for every retrace)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("", 0)


def _frozen(value):
    """A hashable stand-in for one constructor argument: a process set by its id and ranks, an
    array by its contents, anything else unhashable by its repr."""
    if hasattr(value, "process_set_id") and hasattr(value, "ranks"):
        return ("process_set", value.process_set_id, tuple(value.ranks or ()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if hasattr(value, "tobytes") and hasattr(value, "shape"):
        return ("array", tuple(value.shape), str(value.dtype), value.tobytes())
    try:
        hash(value)
    except TypeError:
        return ("repr", type(value).__name__, repr(value))
    return value


def key(cls, args: tuple, keywords: dict):
    """The cache key of a compressor being built while a ``tf.function`` is traced; None when
    executing eagerly (no cache)."""
    if tf.executing_eagerly():
        return None
    k = (cls, _frozen(args), _frozen(keywords), _site())
    built = _BUILT.setdefault(outermost_graph(), collections.Counter())
    built[k] += 1
    return (*k, built[k])


def made(k):
    """The compressor an earlier trace built for key ``k`` (None: none yet, or eager)."""
    return None if k is None else _MADE.get(k)


def keep(k, compressor) -> None:
    """Remember ``compressor`` for key ``k`` (no-op when eager)."""
    if k is not None:
        _MADE[k] = compressor
