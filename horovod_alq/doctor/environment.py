"""What one process can tell about this environment: versions, the codec each device gets, Horovod's
build, and the settings each front-end serves (from :mod:`horovod_alq.settings`' tables)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import warnings
from pathlib import Path

PACKAGES = ("horovod-alq", "numpy", "scipy", "torch", "tensorflow", "tensorflow-cpu", "tf_keras", "horovod")
PACKAGES += ("mpi4py", "triton")


def versions() -> dict[str, str]:
    """Python and every package of :data:`PACKAGES` that is installed (without importing them)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def codecs() -> list[dict]:
    """For each device torch sees (the CPU, every CUDA device): the codec ``codec="auto"`` gives its
    tensors, with whether the compiled CPU codec loads and whether Triton imports."""
    if importlib.util.find_spec("torch") is None:
        return [{"device": "cpu", "codec": "numpy (no torch: mpi4py's NumPy codec only)"}]
    import torch

    from ..torch.codecs import cpu_build, resolve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_status = cpu_build.status()
        triton = "importable" if importlib.util.find_spec("triton") is not None else "not installed"
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        out = []
        for device in devices:
            got = resolve("auto", device).name
            note = cpu_status if device == "cpu" else f"triton {triton}"
            if device != "cpu" and got == "triton":
                note += "; the Triton codec has run only under Triton's CPU interpreter, never on a GPU"
            out.append({"device": device, "codec": got, "note": note})
    return out


def horovod_build() -> dict:
    """Horovod's version and build: the frameworks it was built for (its extension libraries), its
    controllers and whether NCCL is built (asked through horovod.torch when that was built)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        return {"installed": False}
    root = Path(spec.origin).parent
    frameworks = [fw for fw in ("torch", "tensorflow", "mxnet") if any((root / fw).glob("mpi_lib*.so"))]
    out: dict = {"installed": True, "frameworks": frameworks}
    if "torch" in frameworks:
        import horovod.torch as hvd

        out["controllers"] = [name for name in ("mpi", "gloo") if getattr(hvd, f"{name}_built")()]
        out["nccl_built"] = bool(hvd.nccl_built())
        out["cuda_built"] = bool(hvd.cuda_built())
    return out


def served() -> dict[str, dict]:
    """For each front-end: the exchanges it runs and the settings it refuses or serves in part
    (:data:`horovod_alq.settings.NOT_SERVED`, :func:`horovod_alq.settings.partly`, the exchange
    registry)."""
    from ..exchange import registry
    from ..settings import FRONT_ENDS, NOT_SERVED, partly

    some = partly()
    out = {}
    for fe in FRONT_ENDS:
        exchanges = some.get(fe, {}).get("exchange", (registry.choices(), ""))[0]
        out[fe] = {
            "exchanges": list(exchanges),
            "refuses": sorted(NOT_SERVED[fe]),
            "partly": {k: list(v[0]) for k, v in some.get(fe, {}).items() if k != "exchange"},
        }
    return out
