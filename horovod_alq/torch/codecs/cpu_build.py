"""Build loader of the compiled CPU codec (``horovod_alq/torch/codecs/csrc/fused_codec.cpp``).

Built on first use with ``torch.utils.cpp_extension`` in a private temporary folder, then moved
atomically to ``$HOROVOD_ALQ_CACHE/torch_extensions/`` (default ``~/.cache/horovod-alq``) under a
name keyed by the source, the compile flags and the torch version. No lock file is involved, so a
build killed half-way cannot block later runs, and checkouts with different sources never share a
binary. ``make install`` builds it once
(``python -c "from horovod_alq.torch.codecs import cpu_build; print(cpu_build.status())"``).
``HOROVOD_ALQ_FUSED=0`` disables it; where it cannot be built the compressors fall back to the
plain torch kernels and warn once. Codec ``cpu`` (:mod:`horovod_alq.torch.codecs.cpu`) uses it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

NAME = "horovod_alq_fused_codec"
SOURCE = Path(__file__).resolve().parent / "csrc" / "fused_codec.cpp"  # horovod_alq/torch/codecs/csrc
HEADERS = (SOURCE.with_name("codec_kernels.h"),)
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no FMA: the same decoded floats on every CPU
LDFLAGS = ["-fopenmp"]

_MODULE = None
_FAILED: str | None = None


def cached_library() -> Path:
    """Where the compiled library for this source, these flags and this torch lives."""
    import torch

    sources = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(sources + repr((CFLAGS, LDFLAGS, torch.__version__)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("HOROVOD_ALQ_CACHE", Path.home() / ".cache" / "horovod-alq"))
    return root / "torch_extensions" / f"{NAME}-{key}.so"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(target: Path, verbose: bool):
    from torch.utils.cpp_extension import load as load_extension

    # torch builds with the ``ninja`` found on PATH; pip installs it next to this interpreter, which
    # is not on PATH when a virtual environment's python runs without being activated
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=here):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as tmp:
        module = load_extension(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=tmp,
            verbose=verbose,
        )
        staged = Path(tmp) / "staged.so"
        shutil.copy2(Path(tmp) / f"{NAME}.so", staged)
        os.replace(staged, target)  # atomic: concurrent builders just overwrite an identical file
    return module


def load(verbose: bool = False):
    """Return the compiled module, building it if needed; ``None`` if disabled or unavailable."""
    global _MODULE, _FAILED
    if _MODULE is not None or _FAILED is not None:
        return _MODULE
    if os.environ.get("HOROVOD_ALQ_FUSED", "1") == "0":
        _FAILED = "disabled by HOROVOD_ALQ_FUSED=0"
        return None
    try:
        import torch  # noqa: F401  (the library links against libtorch)

        target = cached_library()
        _MODULE = _import(target) if target.exists() else _build(target, verbose)
        _install_entropy(_MODULE)
    except Exception as exc:  # no compiler, no headers, a corrupt cache file, ...
        _FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"horovod_alq: fused CPU codec unavailable ({_FAILED}); using plain torch kernels")
    return _MODULE


def _install_entropy(module) -> None:
    """The entropy wire's coder (:mod:`horovod_alq.core.entropy`) runs on the compiled module from now on."""
    from ...core import entropy
    from .entropy_kernel import CompiledRans

    entropy.use_kernel(CompiledRans(module))


def status() -> str:
    """One line: whether the fused codec is in use, and if not, why."""
    load()
    return "fused CPU codec loaded" if _MODULE is not None else f"plain torch kernels ({_FAILED})"
