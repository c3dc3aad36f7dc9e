"""Fixtures of the torch tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo process group of this process alone (the world, rank 0 of 1), for one test module."""
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialized in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
