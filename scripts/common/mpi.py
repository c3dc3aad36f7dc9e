"""One host's Open MPI launch: the options and the rank environment that the tests, the studies and
the benchmarks share.

Shared memory and loopback only, no InfiniBand probing; no single-copy (CMA) shared memory, which
containers often forbid; root allowed; one thread per library in every rank (2 ranks on 2 cores
must not oversubscribe).
"""

from __future__ import annotations

import re
import subprocess


def open_mpi_major() -> int | None:
    """The major version of the ``mpirun`` on PATH when it is Open MPI's, else None."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"Open MPI\)?\s+v?(\d+)\.", out)
    return int(found.group(1)) if found else None


#: Open MPI 5's runtime (PRRTE) finds no interface for its own messages when told to use the
#: loopback only ("No network interfaces were found for out-of-band communications"), so only
#: older versions are told to.
MPI_OPTIONS: tuple[str, ...] = (
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to",
    "none",
    "--mca",
    "btl",
    "self,vader,tcp",
    "--mca",
    "btl_vader_single_copy_mechanism",
    "none",
    "--mca",
    "btl_tcp_if_include",
    "lo",
) + (("--mca", "oob_tcp_if_include", "lo") if (open_mpi_major() or 4) < 5 else ())
RANK_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}
