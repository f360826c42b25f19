"""Test-wide settings: a fixed seed, and fresh ``torch.empty`` memory filled with NaN.

Deterministic mode with ``fill_uninitialized_memory`` (on by default) makes every ``torch.empty`` /
``new_empty`` return NaN for floating dtypes (flash-linear-attention's trick, done with PyTorch's own
switch): a kernel that forgets to write part of an output fails its comparison instead of passing on
leftover zeros. ``warn_only`` keeps ops without a deterministic implementation usable.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_nan_fill():
    torch.manual_seed(0)
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
