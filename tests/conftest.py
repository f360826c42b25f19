"""Test-wide settings: a fixed seed, and fresh ``torch.empty`` memory filled with NaN.

Deterministic mode with ``fill_uninitialized_memory`` (on by default) makes every ``torch.empty`` /
``new_empty`` return NaN for floating dtypes (flash-linear-attention's trick, done with PyTorch's own
switch): a kernel that forgets to write part of an output fails its comparison instead of passing on
leftover zeros. ``warn_only`` keeps ops without a deterministic implementation usable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tests that start groups of processes (torchrun, Gloo ranks) or bound their time: `make test` runs them
# alone, after the others, which it runs in 2 pytest-xdist workers (a rank that shares its core with
# another test's work is late for its group's deadlines). A test elsewhere takes `@pytest.mark.serial`.
SERIAL_FILES = {
    "asr/test_cores.py", "asr/test_fault_tolerance.py", "asr/test_group.py", "asr/test_manifest.py",
    "asr/test_train_asr.py", "bench/test_syncbn_bench.py", "bench/test_train_bench.py",
    "nn/test_syncbn_module.py", "parallel/test_ddp.py", "parallel/test_zero.py", "test_cli.py",
    "test_train_classify.py",
}  # fmt: skip
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:  # (all the session's items: a path given beside tests/ too)
        if item.path.is_relative_to(_TESTS) and item.path.relative_to(_TESTS).as_posix() in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


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
