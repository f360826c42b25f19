"""Moving small host-built tensors to the device the work runs on, without stalling it; launching
kernels on the GPU that holds their tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["on_tensors_device", "to_device"]

F = TypeVar("F", bound=Callable[..., Any])


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device`` without waiting for the GPU: a blocking copy to a GPU synchronises the stream,
    making the host wait for all the work queued before it. Into CPU memory (read right after) it blocks.
    """
    return x.to(device, non_blocking=device.type != "cpu")


def on_tensors_device(fn: F) -> F:
    """``fn`` run with the current CUDA device set to that of its first tensor argument (in a list or tuple
    too): Triton launches its kernels on the current device and its current stream, while torch's own ops
    follow their tensors. A model on ``cuda:1`` while the current device is 0 (a rank that never called
    ``torch.cuda.set_device``) ran its kernels on GPU 0 with GPU 1's memory."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            first = arg[0] if isinstance(arg, (list, tuple)) and arg else arg
            if isinstance(first, Tensor):
                if first.is_cuda:
                    with torch.cuda.device(first.device):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
