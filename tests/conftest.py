"""Shared pytest set-up (tests/ is on the path through setup.cfg's ``pythonpath``): on machines
without an NVIDIA GPU, Triton's interpreter (``TRITON_INTERPRET=1``) before anything imports
triton, so that the Triton codec's tests run on CPU tensors whichever test imports triton first
(Triton fixes its mode at import)."""

import os
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidia0").exists():
    os.environ["TRITON_INTERPRET"] = "1"
