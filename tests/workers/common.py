"""Helpers for worker scripts started by :func:`multiproc.run_ranks`.

A worker is a plain Python script run once per rank (under mpirun or horovodrun). It does its work
and calls :func:`report` once with a JSON-serializable object; ``run_ranks`` returns the reported
objects in rank order. Anything it prints goes to a per-rank log that is shown when the test fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULT_DIR_ENV = "HOROVOD_ALQ_RESULT_DIR"
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK", "PMIX_RANK")


def launcher_rank() -> int:
    """This process's rank as set by the launcher (before any ``hvd.init()``)."""
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError(f"no rank variable set ({', '.join(_RANK_VARS)}); start this script with run_ranks")


def _plain(obj: Any) -> Any:
    """json.dumps fallback: arrays and tensors (NumPy, torch, TF) become lists, scalars numbers."""
    if hasattr(obj, "numpy") and not hasattr(obj, "tolist"):  # TF eager tensor
        obj = obj.numpy()
    if hasattr(obj, "detach"):  # torch tensor
        obj = obj.detach().cpu()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot report an object of type {type(obj).__name__}")


def report(obj: Any) -> None:
    """Hand ``obj`` (JSON-serializable; arrays and tensors are turned into lists) to the test.

    Writes ``$HOROVOD_ALQ_RESULT_DIR/rank{N}.json`` atomically. Call it once per rank, at the end.
    """
    result_dir = Path(os.environ[RESULT_DIR_ENV])
    rank = launcher_rank()
    tmp = result_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(obj, default=_plain))
    tmp.replace(result_dir / f"rank{rank}.json")
