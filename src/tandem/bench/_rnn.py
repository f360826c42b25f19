"""What the GRU and LSTM benchmarks share."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["with_time_loop"]


def with_time_loop(thunk: Callable[[], None], kernels: str, time_loop: str) -> Callable[[], None]:
    """``thunk`` run with the Triton kernels module ``kernels`` (e.g. ``"tandem.ops.gru.triton"``) set to
    ``TIME_LOOP = time_loop`` ("per-step" / "persistent"), restored after each call."""

    def run() -> None:
        module = importlib.import_module(kernels)
        saved, module.TIME_LOOP = module.TIME_LOOP, time_loop
        try:
            thunk()
        finally:
            module.TIME_LOOP = saved

    return run
