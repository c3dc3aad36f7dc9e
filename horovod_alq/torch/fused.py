"""The compiled CPU codec (``csrc/fused_codec.cpp``), built on first use with
``torch.utils.cpp_extension`` and cached under ``$HOROVOD_ALQ_CACHE`` (default
``~/.cache/horovod-alq``). ``HOROVOD_ALQ_FUSED=0`` disables it; where it cannot be built the
compressors fall back to the plain torch kernels and say so once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

_MODULE = None
_FAILED: str | None = None


def _build_dir() -> Path:
    root = Path(os.environ.get("HOROVOD_ALQ_CACHE", Path.home() / ".cache" / "horovod-alq"))
    import torch

    path = root / "torch_extensions" / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(verbose: bool = False):
    """Return the compiled module, building it if needed; ``None`` if disabled or unavailable."""
    global _MODULE, _FAILED
    if _MODULE is not None or _FAILED is not None:
        return _MODULE
    if os.environ.get("HOROVOD_ALQ_FUSED", "1") == "0":
        _FAILED = "disabled by HOROVOD_ALQ_FUSED=0"
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        source = Path(__file__).with_name("csrc") / "fused_codec.cpp"
        _MODULE = load_extension(
            name="horovod_alq_fused_codec",
            sources=[str(source)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            verbose=verbose,
        )
    except Exception as exc:  # compiler missing, headers missing, ...
        _FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"horovod_alq: fused CPU codec unavailable ({_FAILED}); using plain torch kernels")
    return _MODULE


def status() -> str:
    """One line: whether the fused codec is in use, and if not, why."""
    load()
    return "fused CPU codec loaded" if _MODULE is not None else f"plain torch kernels ({_FAILED})"
