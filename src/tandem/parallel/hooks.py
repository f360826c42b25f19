"""Communication hooks for :meth:`tandem.parallel.DistributedDataParallel.register_comm_hook`.

A hook has torch's signature ``hook(state, bucket) -> torch.futures.Future[Tensor]``: ``state`` is what
was registered with it (here the process group, or None for the default group) and ``bucket`` a
:class:`tandem.parallel.GradBucket` (annotated as torch's ``GradBucket``, whose methods it has, so that
torch's DistributedDataParallel takes these hooks too). The future's value is the averaged flat
gradient of the bucket. torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work as
well.

Example::

    ddp = tandem.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, tandem.parallel.hooks.fp16_compress_hook)  # half the bytes on the wire
"""

# No ``from __future__ import annotations``: torch's DDP checks a hook's annotations as objects (the
# bucket's must be torch.distributed.GradBucket), so these hooks register with torch's wrapper too.

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from tandem.parallel.buckets import GradBucket

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _group_size(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(process_group)


def _first(fut: Future) -> Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[Tensor]:
    """Average the bucket over the ranks in its own dtype: what no hook at all does.

    The buffer is divided by the world size before the sum, as torch's ``allreduce_hook`` does, so
    float16 buffers do not overflow in the sum.
    """
    buffer = bucket.buffer().div_(_group_size(process_group))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(_first)


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: GradBucket | dist.GradBucket
):
    buffer = bucket.buffer()
    # Divide after the cast: the same rounding as torch's fp16/bf16 hooks, so results match bit for bit.
    compressed = buffer.to(dtype).div_(_group_size(process_group))
    if isinstance(bucket, GradBucket):
        bucket.record_sent_bytes(compressed.numel() * compressed.element_size())
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut: Future) -> Tensor:
        # In place into the full-precision buffer: no second full-size tensor at the peak.
        return buffer.copy_(_first(fut))

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[Tensor]:
    """All-reduce the bucket in float16 (divided by the world size first), then cast back.

    Half the bytes of float32 on the wire; gradients keep about 3 significant digits, and values
    beyond float16's range (65504 after the division) overflow to inf.
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[Tensor]:
    """All-reduce the bucket in bfloat16 (divided by the world size first), then cast back.

    Half the bytes of float32 on the wire with float32's range; gradients keep about 2 significant
    digits.
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)
