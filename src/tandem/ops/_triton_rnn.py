"""What the Triton kernels of the recurrent ops (GRU, LSTM) share: how a tile product is taken, and in
which precision. Imported only by the Triton modules (Triton is optional)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["dot", "upcast", "tf32", "compute_dtype"]


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr, TF32: tl.constexpr):
    """``acc + a @ b``. "ieee": float32 operands are not rounded to TF32 (Triton's GPU default) unless
    ``TF32`` (see :func:`tf32`); no effect on the other dtypes. ``UPCAST`` (see :func:`upcast`): float32
    operands, exact since bfloat16 products are."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif TF32:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


def upcast(x: Tensor) -> bool:
    """Triton kernels see CPU tensors only under the interpreter, whose bfloat16 ``tl.dot`` multiplies the
    bit patterns as integers (triton-lang/triton#11584): there bfloat16 tiles go through float32."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def tf32(x: Tensor) -> bool:
    """Float32 products in TF32 on GPUs exactly when ``torch.backends.cudnn.allow_tf32`` lets torch's
    cuDNN RNNs use it (on by default); exact otherwise."""
    return x.dtype == torch.float32 and x.is_cuda and torch.backends.cudnn.allow_tf32


def compute_dtype(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype]:
    """The math and carry dtype for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)
