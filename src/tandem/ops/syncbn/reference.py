"""Synchronized batch norm in plain PyTorch: the CPU kernels of ``tandem::syncbn_*`` and the oracle the
Triton kernels are tested against.

An input ``x`` is ``[N, C, *S]`` (``S`` any spatial/time dims, possibly none); statistics are per channel
over the ``N * prod(S)`` frames. An optional frame ``mask`` ``[N, *S]`` (True = a real frame) excludes
padding: masked-out frames count for nothing, are ignored whatever they hold (NaN included), get output 0
and gradient 0.

One training step, per rank, with one collective in each direction (the module/functional layer owns
the collectives; everything here is local):

1. ``syncbn_stats_ref``: the rank's frame count ``n_r``, mean ``m_r`` (float64) and centred sum of
   squares ``M2_r = sum (x - m_r)^2`` (sums of ``x - K`` for a ``K`` near the mean, never
   ``E[x^2] - E[x]^2``).
2. ``syncbn_pack_ref`` -> ``all_gather`` -> ``syncbn_unpack_ref``: every rank's ``(m_r, M2_r, n_r)`` in
   float64, merged on every rank in the same order by Chan's parallel merge
   (:func:`merge_stats_ref`): ``M2 = sum_r M2_r + sum_r n_r (m_r - m)^2`` from centred differences, so
   nothing cancels however large ``|m| / std`` is (a merge of sums, ``sum_r n_r m_r^2 - N m^2``, loses
   ``(|m| / std)^2`` of relative precision: everything at a mean of 1e9, a timestamp).
3. ``syncbn_fwd_ref``: ``y = (x - mean) * invstd * w + b``, as a centred difference ``x - hi`` with the
   float64 mean split into ``hi + lo`` (:func:`split_mean`) rather than ``x * a + b'``, so a large mean
   cancels nothing in float32: at ``|mean|/std = 1e4`` the output is within ~1e-6 of float64, where a
   float32 mean alone costs 5e-4.
4. backward: ``syncbn_bwd_reduce_ref`` gives the local ``sum(dy)`` and ``sum(dy * x_hat)`` (these are the
   local bias and weight gradients), one all_reduce makes them global, and ``syncbn_bwd_ref`` forms
   ``dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat))`` with the global means.

Means are float64 (they are tiny ``[C]`` vectors); the other statistics and all elementwise math are
float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "acc_dtype",
    "merge_stats_ref",
    "split_mean",
    "syncbn_stats_ref",
    "syncbn_pack_ref",
    "syncbn_unpack_ref",
    "syncbn_fwd_ref",
    "syncbn_bwd_reduce_ref",
    "syncbn_bwd_ref",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics' dtype for an input dtype: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """``[C]`` -> ``[1, C, 1, ...]`` so it broadcasts against an ``ndim``-D input."""
    return v.view(1, -1, *([1] * (ndim - 2)))


def _scratch(buffer: Tensor | None, like: Tensor) -> Tensor:
    """Where an elementwise result the size of ``like`` goes: ``buffer`` when it fits (same shape, dtype
    and strides), else a new tensor with ``like``'s strides.

    Why buffers at all: on the CPU a fresh ``[N, C, *S]`` temporary of a few MB comes from mmap and is
    returned on free, so every step pays its page faults again: two such temporaries per step measured
    ~10 ms of a ~15 ms training step under load here. The functional layer lends the step's own output
    (y in the forward, dx in the backward) as the scratch of the reduction that precedes it.
    """
    fits = buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype
    if fits and buffer.stride() == like.stride():
        return buffer
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)


def _finish(result: Tensor, x: Tensor, out: Tensor | None) -> Tensor:
    """``result`` in ``x``'s dtype (and in ``out`` when one was given)."""
    if out is None:
        return result.to(x.dtype)
    if result.data_ptr() != out.data_ptr():
        out.copy_(result)
    return out


def merge_stats_ref(count: Tensor, mean: Tensor, m2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Chan's merge of ``K`` partial statistics into one, in the partials' dtype.

    Args:
        count: ``[K]`` frames per partial (0 allowed).
        mean, m2: ``[K, C]`` partial means and centred sums of squares.

    Returns:
        ``(count [], mean [C], m2 [C])``. The between-partial term is formed from centred differences
        ``(mean_k - mean)^2``, so nothing cancels.

    Example::

        >>> x = torch.randn(10, 3)
        >>> parts = [x[:4], x[4:]]
        >>> mean = torch.stack([p.mean(0) for p in parts])
        >>> m2 = torch.stack([((p - p.mean(0)) ** 2).sum(0) for p in parts])
        >>> n, m, s = merge_stats_ref(torch.tensor([4.0, 6.0]), mean, m2)
        >>> torch.allclose(s / n, x.var(0, correction=0))
        True
    """
    weights = count.unsqueeze(-1)  # [K, 1]
    total = count.sum()
    merged = (weights * mean).sum(0) / total.clamp(min=1)
    return total, merged, m2.sum(0) + (weights * (mean - merged) ** 2).sum(0)


def split_mean(mean: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """A float64 mean as ``hi + lo`` in ``acc``: ``x - hi`` is exact for x near the mean (Sterbenz), so
    ``(x - hi) - lo`` keeps float64's mean where a float32 mean would be off by half an ulp of the
    offset (5e-4 at 1e4). For float64 inputs ``lo`` is 0."""
    hi = mean.to(acc)
    return hi, (mean - hi.to(mean.dtype)).to(acc)


def syncbn_stats_ref(
    x: Tensor, mask: Tensor | None, *, scratch: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Local statistics of ``x`` ``[N, C, *S]``: ``(mean [C] float64, m2 [C], count [])``, m2 and count in
    :func:`acc_dtype`.

    ``count`` is the number of frames (``N * prod(S)``, or ``mask.sum()``); with no frame, mean and m2
    are 0. ``mask`` is ``[N, *S]`` bool or None. A first pass gives a rough mean ``K`` (float32 sum); the
    sums of ``x - K`` (small numbers) then give the float64 mean ``K + sum(x - K) / n`` and
    ``m2 = sum((x - K)^2) - sum(x - K)^2 / n``, where nothing large cancels because ``K`` is within
    rounding of the mean. (Four cheap reductions/elementwise passes: ``torch.var_mean`` over
    non-innermost dims costs ~3x more on the CPU.)

    ``scratch``, if given, is an ``x``-shaped tensor of :func:`acc_dtype` that may be overwritten; the
    one ``[N, C, *S]`` temporary then costs no allocation (see :func:`_scratch`).
    """
    acc = acc_dtype(x.dtype)
    channels = x.shape[1]
    dims = _dims(x)
    xa = x.to(acc)
    if mask is None:
        frames = x.numel() // channels if channels else 0
        count = torch.tensor(float(frames), dtype=acc, device=x.device)
        if frames == 0:
            return x.new_zeros(channels, dtype=torch.float64), x.new_zeros(channels, dtype=acc), count
        pivot = xa.sum(dims) / frames  # [C]
        shifted = torch.sub(xa, _per_channel(pivot, x.dim()), out=_scratch(scratch, xa))
    else:
        keep = mask.unsqueeze(1)  # [N, 1, *S]
        drop = ~keep
        count = mask.sum(dtype=acc)
        # where, not a product: padded frames may hold anything, NaN included
        shifted = torch.where(keep, xa, xa.new_zeros(()), out=_scratch(scratch, xa))
        pivot = shifted.sum(dims) / count.clamp(min=1)
        shifted.sub_(_per_channel(pivot, x.dim())).masked_fill_(drop, 0)
    s1 = shifted.sum(dims)
    s2 = shifted.square_().sum(dims)  # in place: one [N, C, *S] temporary in all
    n = count.clamp(min=1)
    mean = pivot.to(torch.float64) + s1.to(torch.float64) / n
    # an infinite pivot (a channel holding inf) makes s1 NaN: the mean is the pivot, as torch's sum / n
    mean = torch.where(pivot.isinf(), pivot.to(torch.float64), mean)
    return mean, (s2 - s1 * s1 / n).clamp(min=0), count


def syncbn_pack_ref(mean: Tensor, m2: Tensor, count: Tensor) -> Tensor:
    """float64 ``[2C + 1]`` = ``[mean, m2, n]``: one rank's statistics, as the collective carries them."""
    return torch.cat([mean.to(torch.float64), m2.to(torch.float64), count.to(torch.float64).reshape(1)])


def syncbn_unpack_ref(packs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [C], m2 [C], count [])`` in float64: the merge of ``K`` :func:`syncbn_pack_ref` tensors
    ``[K, 2C + 1]`` (one per rank, in rank order), or one pack's own statistics for ``K = 1``."""
    channels = (packs.shape[-1] - 1) // 2
    mean, m2, n = packs[:, :channels], packs[:, channels : 2 * channels], packs[:, 2 * channels]
    if packs.shape[0] == 1:
        return mean[0], m2[0], n[0]
    total, merged, m2 = merge_stats_ref(n, mean, m2)
    return merged, m2, total


def syncbn_fwd_ref(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mask: Tensor | None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``y = (x - mean) * invstd * weight + bias`` per channel, 0 on masked-out frames; ``x``'s dtype and
    layout. ``mean`` is ``[C]`` float64, ``invstd`` ``[C]`` in :func:`acc_dtype`; weight/bias ``[C]`` or
    None. ``out``: an ``x``-like tensor to write ``y`` into (returned)."""
    nd = x.dim()
    acc = invstd.dtype
    hi, lo = split_mean(mean, acc)
    scale = invstd if weight is None else invstd * weight.to(acc)
    # (x - hi) * scale + (bias - lo * scale): lo folded into the per-channel shift
    shift = -lo * scale if bias is None else bias.to(acc) - lo * scale
    xa = x.to(acc)
    y = torch.sub(xa, _per_channel(hi, nd), out=_scratch(out, xa))
    # in place; (addcmul with a broadcast first argument measured 3x slower than mul_ + add_ here)
    y.mul_(_per_channel(scale, nd)).add_(_per_channel(shift, nd))
    if mask is not None:
        y.masked_fill_(~mask.unsqueeze(1), 0)
    return _finish(y, x, out)


def syncbn_bwd_reduce_ref(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, mask: Tensor | None, *, scratch: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Local ``(sum(dy) [C], sum(dy * x_hat) [C])`` over the real frames, in ``invstd``'s dtype.

    They are this rank's bias and weight gradients, and (summed over ranks) what the input gradient needs.
    ``scratch``: as for :func:`syncbn_stats_ref`.
    """
    acc = invstd.dtype
    dims = _dims(x)
    hi, lo = split_mean(mean, acc)
    dya = dy.to(acc)
    xa = x.to(acc)
    if mask is not None:
        keep = mask.unsqueeze(1)
        dya = torch.where(keep, dya, 0)
    sum_dy = dya.sum(dims)
    centred = torch.sub(xa, _per_channel(hi, x.dim()), out=_scratch(scratch, xa))
    if mask is not None:
        centred.masked_fill_(~keep, 0)  # padded frames of x may be NaN, and 0 * NaN is NaN
    sum_dy_xmu = centred.mul_(dya).sum(dims) - lo * sum_dy
    return sum_dy, sum_dy_xmu * invstd


def syncbn_bwd_ref(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    mean_dy: Tensor,
    mean_dy_xhat: Tensor,
    mask: Tensor | None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``dx = w * invstd * (dy - mean_dy - x_hat * mean_dy_xhat)``, 0 on masked-out frames (written into
    ``out`` if given).

    ``mean_dy``/``mean_dy_xhat`` ``[C]`` are the global (all ranks, real frames) means of ``dy`` and
    ``dy * x_hat``; with zeros this is the backward of a normalisation by fixed (running) statistics.
    """
    nd = x.dim()
    acc = invstd.dtype
    hi, lo = split_mean(mean, acc)
    scale = invstd if weight is None else invstd * weight.to(acc)
    # dx = dy * scale + (x - hi) * k + c, with k = -scale * invstd * mean_dy_xhat and
    # c = -scale * mean_dy - lo * k: four in-place elementwise passes on the CPU and no temporary
    k = -scale * invstd * mean_dy_xhat
    c = -scale * mean_dy - lo * k
    xa = x.to(acc)
    dx = torch.sub(xa, _per_channel(hi, nd), out=_scratch(out, xa))
    dx.mul_(_per_channel(k, nd)).add_(_per_channel(c, nd))
    dx.addcmul_(dy.to(acc), _per_channel(scale, nd))
    if mask is not None:
        dx.masked_fill_(~mask.unsqueeze(1), 0)
    return _finish(dx, x, out)
