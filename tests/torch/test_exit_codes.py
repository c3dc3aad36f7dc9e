"""After an agreement error every rank exits with the error's status, never a signal (issue 56): real
ranks under torchrun (tests/workers/exit_workers.py), each front-end's mismatch a few times in a row,
every rank's own exit status recorded by the shim of tests/exit_ranks.py. The DiLoCo ranks
differ in sync_every (the report), the DDP hook and FSDP2's comm in bits, the hierarchical exchange
in node layout (its companion groups); a rank that stops calling makes the other raise
CollectiveTimeout with a collective left in flight. The same paths under load, 20 runs each, are in
docs/results/exit_stress.md (a campaign whose CLI is retired)."""

from __future__ import annotations

import pytest
from exit_ranks import describe, run_once

pytestmark = pytest.mark.multiproc

RUNS = 3


@pytest.mark.parametrize("path", ["diloco", "ddp", "fsdp", "hierarchical"])
def test_every_rank_exits_with_the_errors_status(path, tmp_path):
    for k in range(RUNS):
        result = run_once(path, np=2, timeout=90, keep=tmp_path)
        statuses = [describe(s) for s in result["statuses"]]
        assert statuses == ["1", "1"] and not result["hung"], (k, result, _logs(result))


def test_collective_timeout_exits_with_the_errors_status(tmp_path):
    # rank 0 raises CollectiveTimeout after 3 s, its handshake still in flight; rank 1 fails later
    result = run_once("timeout", np=2, timeout=90, keep=tmp_path)
    assert [describe(s) for s in result["statuses"]] == ["1", "1"] and not result["hung"], (result, _logs(result))


def _logs(result: dict) -> str:
    """The ranks' logs of a run kept for its failure (the last 3000 characters of each)."""
    from pathlib import Path

    folder = result.get("kept")
    if folder is None:
        return ""
    return "\n".join(
        f"---- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(Path(folder).glob("*.log"))
    )
