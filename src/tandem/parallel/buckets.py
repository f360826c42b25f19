"""Gradient buckets: which parameters share a flat buffer, and what a communication hook sees of one.

A bucket holds the gradients of parameters of one device and dtype in a flat buffer, one contiguous
view per parameter. Buckets are cut by size (``bucket_assignment``) along an order of parameters: the
reverse of ``module.parameters()`` at first, then the order in which gradients actually became ready.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["GradBucket", "bucket_assignment"]


def bucket_assignment(order: Sequence[int], params: Sequence[Tensor], caps: Sequence[int]) -> list[list[int]]:
    """Cut ``order`` (parameter indices) into buckets of one device and dtype each.

    A bucket closes as soon as its bytes reach the cap: ``caps[0]`` for the first bucket of each
    (device, dtype), ``caps[-1]`` for the others; a cap of 0 gives one parameter per bucket. Buckets
    come out ordered by the position of their first parameter in ``order``, which is the order they
    fill in (and are launched in) when gradients arrive in ``order``.

    Example::

        >>> ps = [torch.zeros(100), torch.zeros(100), torch.zeros(10, dtype=torch.float64)]
        >>> bucket_assignment([2, 1, 0], ps, caps=[400])
        [[2], [1], [0]]
    """
    if not caps or any(c < 0 for c in caps):
        raise ValueError(f"bucket_assignment: expected non-negative byte caps, got {list(caps)}")
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
    cut_count: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[int]] = []
    for i in order:
        p = params[i]
        key = (p.device, p.dtype)
        members, size = open_.get(key, ([], 0))
        if not members:
            done.append(members)  # a bucket takes its place when its first parameter arrives
        members.append(i)
        size += p.numel() * p.element_size()
        cap = caps[min(cut_count.get(key, 0), len(caps) - 1)]
        if size >= cap:
            cut_count[key] = cut_count.get(key, 0) + 1
            open_[key] = ([], 0)
        else:
            open_[key] = (members, size)
    return done


class GradBucket:
    """What a communication hook receives: the methods of ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat gradient buffer of this bucket (the local gradients, averaged by nothing
    yet when a hook is registered); ``gradients()`` are its per-parameter views, in the order of
    ``parameters()``. A hook returns a ``torch.futures.Future`` whose value is a tensor with the
    buffer's number of elements: the reduced gradients, which are written back into the buffer.

    Example::

        def hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            buf = bucket.buffer().div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last", "_sent_bytes")

    def __init__(
        self, index: int, buffer: Tensor, gradients: list[Tensor], parameters: list[Tensor], is_last: bool
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last
        # Bytes handed to the collective; tandem's compression hooks set it, others leave the buffer's.
        self._sent_bytes: int | None = None

    def index(self) -> int:
        """Position of this bucket in the launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat gradient buffer: ``[numel]`` of the bucket's dtype, on its device."""
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        """Replace the buffer that ``buffer()`` returns (as ``torch.distributed.GradBucket.set_buffer``)."""
        self._buffer = tensor

    def gradients(self) -> list[Tensor]:
        """One view of the buffer per parameter, shaped like the parameter."""
        return list(self._gradients)

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the bucket launched last in an iteration."""
        return self._is_last

    def record_sent_bytes(self, nbytes: int) -> None:
        """For hooks that send something other than the buffer (compression): the bytes all-reduced."""
        self._sent_bytes = int(nbytes)
