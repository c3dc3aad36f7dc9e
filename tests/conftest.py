"""Shared pytest set-up: tests/ on sys.path so that any test can ``from multiproc import run_ranks``."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
