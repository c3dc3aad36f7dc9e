"""Shared pytest set-up (tests/ is on the path through setup.cfg's ``pythonpath``): on machines
without an NVIDIA GPU, Triton's interpreter (``TRITON_INTERPRET=1``) before anything imports
triton, so that the Triton codec's tests run on CPU tensors whichever test imports triton first
(Triton fixes its mode at import). Triton is then loaded before any test loads TensorFlow: triton
3.7.1 (what PyPI's CUDA build of torch 2.13 requires) crashes in its import when TensorFlow 2.21
was loaded first (a segfault, seen in a Debian 13 root), and works loaded before it."""

import importlib.util
import os
from pathlib import Path

import pytest

# in-process tests quantize every round, as launched ranks do (scripts/common/launch.py's RANK_ENV)
os.environ.setdefault("HOROVOD_ALQ_COMPRESS", "always")
# Every mpirun a test starts (they inherit this): Open MPI ranks that wait in a collective yield
# the core instead of spinning. Each Horovod rank's background thread waits in MPI collectives
# while its main thread computes; spinning, it takes the core the main thread needs (2 ranks, 4
# busy threads on 2 cores): 2 ranks' 150 exchanges took 3x the time without this.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidia0").exists():
    os.environ["TRITON_INTERPRET"] = "1"
if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401

#: What marks a test module as starting several processes (``make test-fast`` leaves them out).
_LAUNCHES = ("run_ranks(", "mpirun", "torchrun", "horovodrun")


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that launches ranks (tests/multiproc.py, or a launcher by name)
    ``multiproc``, as its own ``pytestmark`` may also do: ``-m "not multiproc"`` is the fast tier;
    and the tests of the research scripts ``studies``. (This runs before ``-m`` and ``-k`` deselect.)"""
    import helpers

    launches: dict[str, bool] = {}
    for item in items:
        path = str(item.fspath)
        if Path(path).name in helpers.STUDY_MODULES:
            item.add_marker(pytest.mark.studies)
        if path not in launches:
            text = Path(path).read_text()
            launches[path] = any(word in text for word in _LAUNCHES)
        if launches[path]:
            item.add_marker(pytest.mark.multiproc)
    if _whole_suite(config):
        _STUDY_FILES[:] = sorted({Path(str(i.fspath)).name for i in items if i.get_closest_marker("studies")})


#: The files of the tests marked ``studies`` in this session, where it collected all of tests/.
_STUDY_FILES: list = []


def _whole_suite(config) -> bool:
    """Whether this session collects every test of tests/ (``pytest tests``, as make test runs it)."""
    here = Path(__file__).resolve().parent
    args = [(Path(config.invocation_params.dir) / a).resolve() for a in config.args]
    skipped = config.getoption("ignore", None) or config.getoption("ignore_glob", None)
    return args == [here] and not skipped and not config.getoption("lf", False)


@pytest.fixture
def study_files():
    """The files whose tests this session marked ``studies``, or None where it did not collect all
    of tests/ (tests/test_install.py then collects in a pytest of its own)."""
    return list(_STUDY_FILES) or None
