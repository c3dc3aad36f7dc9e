"""Shared pytest set-up: tests/ on sys.path so that any test can ``from multiproc import run_ranks``;
on machines without an NVIDIA GPU, Triton's interpreter (``TRITON_INTERPRET=1``) before anything
imports triton, so that the Triton codec's tests run on CPU tensors whichever test imports triton
first (Triton fixes its mode at import)."""

import os
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidia0").exists():
    os.environ["TRITON_INTERPRET"] = "1"
