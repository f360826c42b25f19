"""Fixtures of the process-group tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_rank(tmp_path):
    """A Gloo group of this process alone (file store), destroyed after the test."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
