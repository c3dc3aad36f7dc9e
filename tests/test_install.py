"""The install's checks: `make test` fails when the compiled CPU codec (codec 'cpu', the default
for CPU tensors) cannot load, unless HOROVOD_ALQ_ALLOW_TORCH_CODEC=1 asks for the plain torch
kernels (scripts/install/check_codec.py); `HOROVOD_ALQ_GPU=1 make install` fails early, naming what
is missing, where CUDA's toolkit is not there, and leaves .venv alone (scripts/install/install_gpu.sh);
the Horovod patch that releases the GIL in every enqueue (scripts/install/patch_horovod.py)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "install" / "check_codec.py"
ALLOW = "HOROVOD_ALQ_ALLOW_TORCH_CODEC"


def _check(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW, "HOROVOD_ALQ_FUSED")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _broken_build(tmp_path):
    """A build that must fail: no usable C++ compiler and an empty library cache."""
    return {"CXX": "/bin/false", "HOROVOD_ALQ_CACHE": str(tmp_path / "empty-cache")}


def test_check_fails_when_the_compiled_codec_cannot_be_built(tmp_path):
    res = _check(_broken_build(tmp_path))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "ERROR: codec 'cpu'" in res.stderr and "did not load" in res.stderr, res.stderr
    assert f"{ALLOW}=1" in res.stderr, res.stderr
    assert "/bin/false" in res.stderr, res.stderr  # the reason: the compiler that failed
    assert not list((tmp_path / "empty-cache").rglob("*.so"))


def test_check_passes_with_a_warning_when_the_fallback_is_asked_for(tmp_path):
    res = _check({**_broken_build(tmp_path), ALLOW: "1"})
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "WARNING: codec 'cpu'" in res.stderr and "going on with codec 'torch'" in res.stderr, res.stderr


def test_install_reports_a_broken_build_without_failing(tmp_path):
    res = _check(_broken_build(tmp_path), "--warn")
    assert res.returncode == 0 and "`make test` fails on this" in res.stderr, (res.stdout, res.stderr)


def test_check_passes_where_the_codec_builds():
    res = _check({})
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "codec 'cpu' (the compiled CPU codec) loaded" in res.stdout


def test_make_test_runs_the_check_before_pytest():
    res = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    check = [i for i, line in enumerate(lines) if "scripts/install/check_codec.py" in line and "--warn" not in line]
    pytest_run = [i for i, line in enumerate(lines) if "-m pytest tests" in line]
    assert check and pytest_run and check[0] < pytest_run[0], res.stdout
    lint = [i for i, line in enumerate(lines) if "ruff check" in line or "ruff format --check" in line]
    assert len(lint) == 2 and max(lint) < pytest_run[0], res.stdout  # the lint and format check first
    assert '-m "not studies"' in lines[pytest_run[0]], lines[pytest_run[0]]  # the research scripts: test-studies


def test_studies_are_marked_and_left_to_their_target(study_files):
    """The research scripts' tests carry the ``studies`` marker: ``make test`` deselects exactly them.
    A session that collected all of tests/ (make test's) knows which files' tests it marked (marks
    come before ``-m`` deselects: tests/conftest.py); any other collects all of tests/ in a pytest
    of its own (seconds: it imports every test module)."""
    from helpers import STUDY_MODULES  # (not conftest: several conftest modules share that name)

    if study_files is not None:
        assert set(study_files) == set(STUDY_MODULES), study_files
        return
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "studies", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    files = {line.split("::")[0] for line in res.stdout.splitlines() if "::" in line}
    assert {Path(f).name for f in files} == set(STUDY_MODULES), res.stdout[-2000:]


def _gpu_install(tmp_path, cuda_home):
    """install.sh with HOROVOD_ALQ_GPU=1 from a copy of scripts/install/ (its root: tmp_path, where
    a .venv stands in for the CPU venv), CUDA's folder ``cuda_home`` and no nvcc on PATH."""
    (tmp_path / "scripts").mkdir()
    shutil.copytree(ROOT / "scripts" / "install", tmp_path / "scripts" / "install")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "marker").write_text("cpu venv")
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvcc").exists())
    env = {**os.environ, "HOROVOD_ALQ_GPU": "1", "HOROVOD_CUDA_HOME": str(cuda_home), "PATH": path}
    env.pop("HOROVOD_ALQ_STOP_AFTER", None)
    res = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "install" / "install.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "nothing was installed and .venv is untouched" in res.stderr, res.stderr
    assert not (tmp_path / ".venv-gpu").exists()
    assert sorted(p.name for p in (tmp_path / ".venv").iterdir()) == ["marker"]
    assert (tmp_path / ".venv" / "marker").read_text() == "cpu venv"
    return res.stderr


def test_gpu_install_without_nvcc_fails_early_naming_it(tmp_path):
    cuda = tmp_path / "no-cuda"
    cuda.mkdir()
    err = _gpu_install(tmp_path, cuda)
    assert f"nvcc ({cuda}/bin/nvcc" in err, err
    assert "CUDA runtime headers" in err and "libcudart" in err, err


def test_gpu_install_with_nvcc_but_no_cuda_headers_names_them(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    err = _gpu_install(tmp_path, cuda)
    assert "bin/nvcc" not in err.split("missing:")[1], err
    assert f"the CUDA runtime headers ({cuda}/include/cuda_runtime.h" in err, err


@pytest.mark.skipif(
    not Path("/usr/local/cuda/include/cuda_runtime.h").exists()
    or not all(map(shutil.which, ("g++", "cmake", "mpicc"))),
    reason="no CUDA toolkit in /usr/local/cuda, or no g++, cmake or mpicc",
)
def test_gpu_install_without_the_cuda_packages_fails_before_the_venv(tmp_path):
    """An index that does not serve torch's CUDA build (here: an empty one) stops the install at its
    check of the index, before .venv-gpu is created."""
    for name in ("requirements", "scripts"):
        (tmp_path / name).mkdir()
    shutil.copytree(ROOT / "scripts" / "install", tmp_path / "scripts" / "install")
    for name in ("requirements/pinned.txt", "setup.cfg", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "index").mkdir()
    env = {**os.environ, "HOROVOD_CUDA_HOME": "/usr/local/cuda", "HOROVOD_ALQ_GPU_INDEX": (tmp_path / "index").as_uri()}
    res = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "install" / "install_gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "failed at step 'CUDA packages on file://" in res.stderr, res.stderr
    assert "cannot resolve torch==" in res.stderr and ".venv is untouched" in res.stderr, res.stderr
    assert not (tmp_path / ".venv-gpu").exists()


def test_horovod_patch_releases_the_gil_in_every_enqueue_once(tmp_path):
    """patch_horovod.py's edit 4 on a copy of Horovod 0.28.1's binding lines: each enqueueing
    m.def (one spread over two lines too) gets the GIL release, others not; a second run changes
    nothing; a file without any enqueueing m.def fails loudly."""
    spec = importlib.util.spec_from_file_location("patch_horovod", ROOT / "scripts" / "install" / "patch_horovod.py")
    patch_horovod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patch_horovod)
    src = tmp_path / "horovod" / "torch" / "mpi_ops_v2.cc"
    src.parent.mkdir(parents=True)
    src.write_text(
        'PYBIND11_MODULE(mpi_lib_v2, m) {\n  m.def("horovod_torch_allreduce_async_torch_FloatTensor", &DoAllreduce);\n'
        '  m.def("horovod_torch_alltoall_async_torch_cuda_FloatTensor",\n        &DoAlltoallCudaOnCPU);\n'
        '  m.def("horovod_torch_join", &DoJoin);\n  m.def("horovod_torch_barrier", &DoBarrier);\n'
        '  m.def("horovod_torch_poll", &PollHandle);\n}\n'
    )
    patch_horovod.release_gil(tmp_path)
    once = src.read_text()
    guarded = [line for line in once.splitlines() if "py::call_guard<py::gil_scoped_release>()" in line]
    assert len(guarded) == 4 and not any("poll" in line for line in guarded), once
    patch_horovod.release_gil(tmp_path)
    assert src.read_text() == once
    src.write_text('m.def("horovod_torch_poll", &PollHandle);\n')
    with pytest.raises(SystemExit, match="no enqueueing m.def"):
        patch_horovod.release_gil(tmp_path)
