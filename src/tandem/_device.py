"""Moving small host-built tensors to the device the work runs on, without stalling it."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["to_device"]


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device`` without waiting for the GPU: a blocking copy to a GPU synchronises the stream,
    making the host wait for all the work queued before it. Into CPU memory (read right after) it blocks.
    """
    return x.to(device, non_blocking=device.type != "cpu")
