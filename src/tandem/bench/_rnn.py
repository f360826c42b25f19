"""What the GRU and LSTM benchmarks share."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["with_kernel_settings"]


def with_kernel_settings(thunk: Callable[[], None], kernels: str, **settings: Any) -> Callable[[], None]:
    """``thunk`` run with the Triton kernels module ``kernels`` (e.g. ``"tandem.ops.gru.triton"``) given
    ``settings`` (e.g. ``TIME_LOOP="per-step"``, ``CUDA_GRAPHS=True``), restored after each call."""

    def run() -> None:
        module = importlib.import_module(kernels)
        saved = {name: getattr(module, name) for name in settings}
        for name, value in settings.items():
            setattr(module, name, value)
        try:
            thunk()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return run
