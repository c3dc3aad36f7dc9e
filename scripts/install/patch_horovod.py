#!/usr/bin/env python3
"""Patch an unpacked Horovod 0.28.1 source distribution so that it builds here.

Horovod 0.28.1 (the last PyPI release) does not build unpatched against
torch >= 2.1 and TensorFlow 2.21. Three edits make it build and run, and a
fourth keeps it from hanging at shutdown with torch >= 2.10:

1. top-level CMakeLists.txt: C++14 -> C++17. Gloo and the torch library must
   agree on the standard, otherwise linking fails with a duplicate
   ``kDefaultTimeout``.
2. horovod/torch/CMakeLists.txt: C++14 -> C++17 (torch >= 2.1 headers need it).
3. horovod/tensorflow/CMakeLists.txt: drop xla_mpi_ops.cc from TF_SOURCES
   (TensorFlow 2.21's XLA headers miss a highwayhash include). Horovod's
   optional XLA ops are then unavailable; the regular TF ops are unaffected.
4. horovod/torch/mpi_ops_v2.cc: the torch functions that enqueue a collective
   (``horovod_torch_*_async_*``, join, barrier) release the GIL. They take the
   process-set table's lock, and at shutdown Horovod's background thread holds
   that lock while it drops its references to queued tensors. With torch's
   PyObject preservation (torch >= 2.10) dropping the last C++ reference to a
   tensor that Python also holds takes the GIL, so an enqueue made during the
   shutdown (a peer failed; an elastic reset) waited forever
   (tests/torch/test_shutdown_enqueue.py reproduces it).

Usage: python scripts/patch_horovod.py SOURCE_DIR

Idempotent: an edit that is already applied is reported and skipped. Any file
that matches neither the original nor the patched text makes the script exit
with status 1, naming the file, so that a different Horovod version fails
loudly instead of building something half-patched.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# (relative path, original text, replacement text, text present only once patched or None,
# text absent once patched). Each original must occur exactly once in its file.
EDITS = [
    (
        "CMakeLists.txt",
        "\nset(CMAKE_CXX_STANDARD 14)\n",
        "\nset(CMAKE_CXX_STANDARD 17)\n",
        "\nset(CMAKE_CXX_STANDARD 17)\n",
        "\nset(CMAKE_CXX_STANDARD 14)\n",
    ),
    (
        "horovod/torch/CMakeLists.txt",
        "\n    set(CMAKE_CXX_STANDARD 14)\n",
        "\n    set(CMAKE_CXX_STANDARD 17)\n",
        "\n    set(CMAKE_CXX_STANDARD 17)\n",
        "CMAKE_CXX_STANDARD 14",
    ),
    (
        "horovod/tensorflow/CMakeLists.txt",
        '\nlist(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
        "\n",
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc")',
        "xla_mpi_ops.cc",
    ),
]


def patch(source_dir: Path) -> None:
    for rel, old, new, present, absent in EDITS:
        path = source_dir / rel
        if not path.is_file():
            raise SystemExit(f"patch_horovod: {path} not found; is {source_dir} an unpacked horovod-0.28.1 sdist?")
        text = path.read_text()
        count = text.count(old)
        if count == 1:
            path.write_text(text.replace(old, new))
            print(f"patch_horovod: patched {rel}")
        elif count == 0 and present in text and absent not in text:
            print(f"patch_horovod: {rel} already patched")
        else:
            raise SystemExit(
                f"patch_horovod: {rel}: expected the original text once, found it {count} times; "
                "this script is written for horovod 0.28.1"
            )


#: Edit 4: each pybind ``m.def`` of a torch function that enqueues, before and after.
_ENQUEUE_DEF = re.compile(r'm\.def\(\s*("horovod_torch_(?:\w+_async_\w+|join|barrier)")\s*,\s*(&\w+)\s*\)\s*;')
_RELEASED_DEF = re.compile(r'"horovod_torch_\w+",\s*&\w+,\s*py::call_guard<py::gil_scoped_release>\(\)\);')
_BINDINGS = "horovod/torch/mpi_ops_v2.cc"


def release_gil(source_dir: Path) -> None:
    """Edit 4: the enqueueing torch functions run with the GIL released."""
    path = source_dir / _BINDINGS
    text = path.read_text()
    patched, count = _ENQUEUE_DEF.subn(r"m.def(\1, \2, py::call_guard<py::gil_scoped_release>());", text)
    if count:
        path.write_text(patched)
        print(f"patch_horovod: patched {_BINDINGS} ({count} functions release the GIL)")
    elif _RELEASED_DEF.search(text):
        print(f"patch_horovod: {_BINDINGS} already patched")
    else:
        raise SystemExit(f"patch_horovod: {_BINDINGS}: no enqueueing m.def found; written for horovod 0.28.1")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: patch_horovod.py SOURCE_DIR", file=sys.stderr)
        return 2
    patch(Path(argv[1]))
    release_gil(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
