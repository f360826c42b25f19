"""Registration of the local kernels of synchronized batch norm with the dispatcher.

``tandem::syncbn_stats`` (local count, mean, M2), ``tandem::syncbn_fwd`` (normalise by given
statistics), ``tandem::syncbn_bwd_reduce`` (local sums of dy and dy * x_hat) and ``tandem::syncbn_bwd``
(dx from global means). Each runs its Triton kernel when :func:`tandem._backend.use_triton` says so and
the plain-PyTorch reference otherwise.

The ops get fake (meta) registrations but no autograd one: the gradient of batch norm with synchronized
statistics needs a collective *between* two kernels (backward reduce, all_reduce, backward elementwise),
and a custom op can take no process group. The autograd therefore lives one level up, in
``tandem.ops.syncbn``, which composes these ops and the two collectives.
"""

# No ``from __future__ import annotations`` here: torch 2.4's custom_op reads the annotations at
# registration time and does not resolve string annotations.

import torch
from torch import Tensor

from tandem._backend import use_triton
from tandem.ops.syncbn.reference import (
    acc_dtype,
    syncbn_bwd_reduce_ref,
    syncbn_bwd_ref,
    syncbn_fwd_ref,
    syncbn_stats_ref,
)

__all__ = ["syncbn_stats", "syncbn_fwd", "syncbn_bwd_reduce", "syncbn_bwd"]


@torch.library.custom_op("tandem::syncbn_stats", mutates_args=())
def syncbn_stats(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [C] float64, m2 [C], count [])`` of the real frames of ``x`` ``[N, C, *S]``.

    ``mask`` is ``[N, *S]`` bool (True = real frame) or None.
    """
    if use_triton(x):
        from tandem.ops.syncbn.triton import syncbn_stats_triton

        return syncbn_stats_triton(x, mask)
    return syncbn_stats_ref(x, mask)


@syncbn_stats.register_fake
def _syncbn_stats_fake(x, mask):
    acc = acc_dtype(x.dtype)
    channels = x.shape[1]
    return (
        x.new_empty(channels, dtype=torch.float64),
        x.new_empty(channels, dtype=acc),
        x.new_empty((), dtype=acc),
    )


@torch.library.custom_op("tandem::syncbn_fwd", mutates_args=())
def syncbn_fwd(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mask: Tensor | None,
) -> Tensor:
    """``(x - mean) * invstd * weight + bias``, 0 on masked-out frames; ``x``'s dtype and layout."""
    if use_triton(x):
        from tandem.ops.syncbn.triton import syncbn_fwd_triton

        return syncbn_fwd_triton(x, mean, invstd, weight, bias, mask)
    return syncbn_fwd_ref(x, mean, invstd, weight, bias, mask)


@syncbn_fwd.register_fake
def _syncbn_fwd_fake(x, mean, invstd, weight, bias, mask):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


@torch.library.custom_op("tandem::syncbn_bwd_reduce", mutates_args=())
def syncbn_bwd_reduce(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Local ``(sum(dy) [C], sum(dy * x_hat) [C])`` over the real frames, in ``invstd``'s dtype."""
    if use_triton(x):
        from tandem.ops.syncbn.triton import syncbn_bwd_reduce_triton

        return syncbn_bwd_reduce_triton(dy, x, mean, invstd, mask)
    return syncbn_bwd_reduce_ref(dy, x, mean, invstd, mask)


@syncbn_bwd_reduce.register_fake
def _syncbn_bwd_reduce_fake(dy, x, mean, invstd, mask):
    return invstd.new_empty(invstd.shape), invstd.new_empty(invstd.shape)


@torch.library.custom_op("tandem::syncbn_bwd", mutates_args=())
def syncbn_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    mean_dy: Tensor,
    mean_dy_xhat: Tensor,
    mask: Tensor | None,
) -> Tensor:
    """``dx = w * invstd * (dy - mean_dy - x_hat * mean_dy_xhat)``, 0 on masked-out frames."""
    if use_triton(x):
        from tandem.ops.syncbn.triton import syncbn_bwd_triton

        return syncbn_bwd_triton(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask)
    return syncbn_bwd_ref(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask)


@syncbn_bwd.register_fake
def _syncbn_bwd_fake(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
