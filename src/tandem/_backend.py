"""The one place that decides which kernel runs (shared/DESIGN.md, cross-cutting conventions).

Triton kernels run for CUDA tensors when Triton imports. ``TANDEM_FORCE_TRITON=1``, read once at
import, makes the ops run their Triton kernels on CPU tensors too; with ``TRITON_INTERPRET=1`` that is
how CI tests the GPU kernels on a machine without a GPU. Nothing else in tandem reads the environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

__all__ = ["FORCE_TRITON", "as_given", "triton_available", "use_triton"]

FORCE_TRITON: bool = os.environ.get("TANDEM_FORCE_TRITON", "0") == "1"


# Looked up once at import, a plain constant: torch.compile traces use_triton, and a cached function
# there makes Dynamo warn at every compile of a model with tandem's layers.
_TRITON_AVAILABLE: bool = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is an optional extra)."""
    return _TRITON_AVAILABLE


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op given ``t`` should run its Triton kernel rather than its PyTorch reference."""
    return _TRITON_AVAILABLE and (t.is_cuda or (FORCE_TRITON and t.device.type == "cpu"))


def as_given(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context in which ops on ``t``'s device compute in the dtypes they are given: autocast off there.
    What a custom op's kernel runs under (its caller has cast what autocast casts, as torch's autocast
    wrappers do before they exclude autocast), so the products inside are not cast again to autocast's
    dtype, which may differ from the one chosen (cuDNN's RNNs run in float16 under a bfloat16 autocast)."""
    device = t.device.type
    if not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)
