"""Scratch memory that the CPU kernels reuse from call to call.

A fresh multi-megabyte CPU tensor costs a page fault per 4 KiB on first touch: glibc hands large
blocks back to the kernel when they are freed, so every call of a kernel that allocates its
temporaries pays for zeroed pages again (in a T50-B32-H256 LSTM training step, ~8000 faults and ~10 ms
of system time out of ~65 ms on one thread). Temporaries whose lifetime ends inside one kernel call
(never an output, never saved) are carved from one flat buffer per thread, dtype and device instead,
kept for the next call. Requests above :data:`MAX_CACHED_BYTES` are allocated fresh and not kept.

Example::

    k, u = scratch(x, (d, p, 4 * h), (d, p, h))  # uninitialised views, valid until the next scratch()
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["MAX_CACHED_BYTES", "scratch", "release"]

MAX_CACHED_BYTES = 256 << 20  # the largest workspace kept alive between calls, per thread

_ALIGN = 64  # bytes: each view starts on a cache line
_local = threading.local()


def scratch(like: Tensor, *shapes: tuple[int, ...]) -> list[Tensor]:
    """Contiguous uninitialised tensors of ``shapes`` with ``like``'s dtype and device.

    They share this thread's workspace: the next call of ``scratch`` on the thread (any kernel) may hand
    out the same memory, so a kernel takes all its scratch tensors in one call and lets none escape.
    """
    if not shapes:
        return []
    item = like.element_size()
    step = max(1, _ALIGN // item)
    sizes = [_numel(shape) for shape in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // step) * step
    if total * item > MAX_CACHED_BYTES:
        flat = like.new_empty(total)
    else:
        buffers: dict[tuple[torch.device, torch.dtype], Tensor] = _local.__dict__.setdefault("buffers", {})
        key = (like.device, like.dtype)
        flat = buffers.get(key)
        if flat is None or flat.numel() < total:
            # Never an inference tensor: a buffer first made under torch.inference_mode could not be
            # written outside it, so every later call (no_grad, training) would fail on the first copy.
            with torch.inference_mode(False):
                flat = buffers[key] = like.new_empty(total)
    return [flat[o : o + n].view(shape) for o, n, shape in zip(offsets, sizes, shapes)]


def release() -> None:
    """Free this thread's cached workspaces (they are rebuilt on the next call)."""
    _local.__dict__.pop("buffers", None)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
