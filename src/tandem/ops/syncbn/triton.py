"""Triton kernels of ``tandem::syncbn_*``: statistics (one read of x), normalisation, backward reduce and
backward elementwise.

Layout: a dense input ``[N, C, *S]`` (contiguous, channels_last, or any layout whose spatial dims merge)
is addressed as the 3-D view ``[N, C, S]`` with its strides, so no kernel needs a copy. When the batch
dim merges with the spatial ones (channels_last, 2-D ``[N, C]``), the view becomes ``[1, C, N*S]``:
programs then see one long run of frames. The work is tiles of ``[BLOCK_S frames, BLOCK_C channels]``;
grid axis 0 takes a block of channels, axis 1 a contiguous range of tiles. The frame mask ``[N, S]`` is
one byte per frame, read once per tile and shared by all its channels.

The statistics kernel works on ``x - pivot`` (the first real frame of each channel, so the numbers are small
and their mean keeps float32's precision relative to the spread) and merges tile after tile with Chan's update
(tile mean and centred M2 from the registers, then ``mean = (mean * n + mean_t * n_t) / (n + n_t)``, ``M2 +=
M2_t + delta^2 * n * n_t / (n + n_t)``): x is read once and nothing cancels at large means, whatever the
pivot. The per-program partials ``[P, C]`` are merged the same way by :func:`merge_stats_ref`, and the float64
mean is ``pivot + merged mean``. The elementwise kernels take per-channel vectors prepared on the host
(``hi``, ``scale``, ``shift``...; the float64 mean enters as ``hi`` plus a ``lo`` folded into the shift), so
each is one FMA-like expression per element.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tandem._device import on_tensors_device
from tandem.ops.syncbn.reference import acc_dtype, merge_stats_ref, split_mean

__all__ = ["syncbn_stats_triton", "syncbn_fwd_triton", "syncbn_bwd_reduce_triton", "syncbn_bwd_triton"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _program(C, n_tiles, tiles_per_prog, BLOCK_C: tl.constexpr):
    """What every kernel's program ``(i_c, i_p)`` covers: its ``BLOCK_C`` channels (offsets, in-bounds
    mask) and its contiguous range of tiles ``[t_start, t_end)``, as ``(i_c, i_p, o_c, m_c, t_start,
    t_end)``."""
    i_c, i_p = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_start = i_p * tiles_per_prog
    return i_c, i_p, o_c, o_c < C, t_start, tl.minimum(t_start + tiles_per_prog, n_tiles)


@triton.jit
def _tile(
    t, p_mask, o_c, m_c, C, S, n_sblocks, s_n, s_c, s_s,
    HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Offsets ``[BLOCK_S, BLOCK_C]`` of tile ``t``, its in-bounds mask and its real-frame mask."""
    i_n = t // n_sblocks
    o_s = (t % n_sblocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < S
    m_in = m_s[:, None] & m_c[None, :]
    m_f = m_s
    if HAS_MASK:
        m_f = m_s & (tl.load(p_mask + i_n.to(tl.int64) * S + o_s, mask=m_s, other=0) != 0)
    o = i_n.to(tl.int64) * s_n + o_s[:, None].to(tl.int64) * s_s + o_c[None, :].to(tl.int64) * s_c
    return o, m_in, m_f


@triton.jit
def _syncbn_stats_kernel(
    p_x, p_mask, p_pivot, p_count, p_mean, p_m2,
    C, S, n_sblocks, n_tiles, tiles_per_prog, s_n, s_c, s_s,
    ACC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i_c, i_p, o_c, m_c, t_start, t_end = _program(C, n_tiles, tiles_per_prog, BLOCK_C)
    # statistics of x - pivot: small numbers whose mean float32 holds to its own precision
    b_pivot = tl.load(p_pivot + o_c, mask=m_c, other=0.0).to(ACC)
    b_n = tl.zeros([BLOCK_C], dtype=ACC)  # frames merged so far (equal in every channel)
    b_mean = tl.zeros([BLOCK_C], dtype=ACC)
    b_m2 = tl.zeros([BLOCK_C], dtype=ACC)
    for t in range(t_start, t_end):
        o, m_in, m_f = _tile(t, p_mask, o_c, m_c, C, S, n_sblocks, s_n, s_c, s_s, HAS_MASK, BLOCK_S)
        m = m_f[:, None] & m_c[None, :]
        b_x = tl.where(m, tl.load(p_x + o, mask=m, other=0.0).to(ACC) - b_pivot[None, :], 0.0)
        t_n = tl.sum(m_f.to(ACC), axis=0)
        t_mean = tl.sum(b_x, axis=0) / tl.maximum(t_n, 1.0)
        b_d = tl.where(m, b_x - t_mean[None, :], 0.0)
        t_m2 = tl.sum(b_d * b_d, axis=0)
        # Chan's merge of the tile into the running statistics
        n_new = b_n + t_n
        w = t_n / tl.maximum(n_new, 1.0)
        delta = t_mean - b_mean
        # the mean as a weighted average, not b_mean + delta * w: an infinite frame keeps the mean infinite
        # (inf - inf is NaN), as torch's; no cross term while nothing is merged (inf * 0 would be NaN for a
        # tile whose spread overflows)
        b_mean = b_mean * (1.0 - w) + t_mean * w
        b_m2 += t_m2 + tl.where(b_n > 0, delta * delta * b_n * w, 0.0)
        b_n = n_new
    tl.store(p_mean + i_p * C + o_c, b_mean, mask=m_c)
    tl.store(p_m2 + i_p * C + o_c, b_m2, mask=m_c)
    if i_c == 0:
        tl.store(p_count + i_p, tl.max(b_n, axis=0))


@triton.jit
def _syncbn_fwd_kernel(
    p_x, p_y, p_mask, p_hi, p_scale, p_shift,
    C, S, n_sblocks, n_tiles, tiles_per_prog, s_n, s_c, s_s,
    ACC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    _, i_p, o_c, m_c, t_start, t_end = _program(C, n_tiles, tiles_per_prog, BLOCK_C)
    b_hi = tl.load(p_hi + o_c, mask=m_c, other=0.0)
    b_scale = tl.load(p_scale + o_c, mask=m_c, other=0.0)
    b_shift = tl.load(p_shift + o_c, mask=m_c, other=0.0)
    for t in range(t_start, t_end):
        o, m_in, m_f = _tile(t, p_mask, o_c, m_c, C, S, n_sblocks, s_n, s_c, s_s, HAS_MASK, BLOCK_S)
        b_x = tl.load(p_x + o, mask=m_in, other=0.0).to(ACC)
        # centred first (x - hi is exact near the mean): x * scale + b' would cancel at large means
        b_y = (b_x - b_hi[None, :]) * b_scale[None, :] + b_shift[None, :]
        if HAS_MASK:
            b_y = tl.where(m_f[:, None], b_y, 0.0)
        tl.store(p_y + o, b_y.to(p_y.dtype.element_ty), mask=m_in)


@triton.jit
def _syncbn_bwd_reduce_kernel(
    p_dy, p_x, p_mask, p_hi, p_sum_dy, p_sum_dy_xmu,
    C, S, n_sblocks, n_tiles, tiles_per_prog, s_n, s_c, s_s,
    ACC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    _, i_p, o_c, m_c, t_start, t_end = _program(C, n_tiles, tiles_per_prog, BLOCK_C)
    b_hi = tl.load(p_hi + o_c, mask=m_c, other=0.0)
    b_sdy = tl.zeros([BLOCK_C], dtype=ACC)
    b_sdyx = tl.zeros([BLOCK_C], dtype=ACC)
    for t in range(t_start, t_end):
        o, m_in, m_f = _tile(t, p_mask, o_c, m_c, C, S, n_sblocks, s_n, s_c, s_s, HAS_MASK, BLOCK_S)
        m = m_f[:, None] & m_c[None, :]
        b_dy = tl.load(p_dy + o, mask=m, other=0.0).to(ACC)
        b_x = tl.load(p_x + o, mask=m, other=0.0).to(ACC)
        b_sdy += tl.sum(b_dy, axis=0)
        b_sdyx += tl.sum(b_dy * tl.where(m, b_x - b_hi[None, :], 0.0), axis=0)
    tl.store(p_sum_dy + i_p * C + o_c, b_sdy, mask=m_c)
    tl.store(p_sum_dy_xmu + i_p * C + o_c, b_sdyx, mask=m_c)


@triton.jit
def _syncbn_bwd_kernel(
    p_dy, p_x, p_dx, p_mask, p_hi, p_scale, p_k, p_c,
    C, S, n_sblocks, n_tiles, tiles_per_prog, s_n, s_c, s_s,
    ACC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    _, i_p, o_c, m_c, t_start, t_end = _program(C, n_tiles, tiles_per_prog, BLOCK_C)
    b_hi = tl.load(p_hi + o_c, mask=m_c, other=0.0)
    b_scale = tl.load(p_scale + o_c, mask=m_c, other=0.0)
    b_k = tl.load(p_k + o_c, mask=m_c, other=0.0)
    b_c = tl.load(p_c + o_c, mask=m_c, other=0.0)
    for t in range(t_start, t_end):
        o, m_in, m_f = _tile(t, p_mask, o_c, m_c, C, S, n_sblocks, s_n, s_c, s_s, HAS_MASK, BLOCK_S)
        b_dy = tl.load(p_dy + o, mask=m_in, other=0.0).to(ACC)
        b_x = tl.load(p_x + o, mask=m_in, other=0.0).to(ACC)
        b_dx = b_dy * b_scale[None, :] + (b_x - b_hi[None, :]) * b_k[None, :] + b_c[None, :]
        if HAS_MASK:
            b_dx = tl.where(m_f[:, None], b_dx, 0.0)
        tl.store(p_dx + o, b_dx.to(p_dx.dtype.element_ty), mask=m_in)


# --------------------------------------------------------------------------------------------------
# launchers


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count


class _Grid:
    """The ``[N, C, S]`` addressing of a dense input and the split of its tiles over programs."""

    def __init__(self, x: torch.Tensor) -> None:
        n, c = x.shape[0], x.shape[1]
        s = math.prod(x.shape[2:])
        s_n, s_c, s_s = x.view(n, c, s).stride()
        if s == 1:
            s_s = s_n
        if n == 1 or s_n == s * s_s:  # the batch dim continues the frames: one long run
            n, s, s_n = 1, n * s, 0
        self.C, self.S, self.strides = c, s, (s_n, s_c, s_s)
        if s_c == 1 and s > 1:  # channels innermost: wide along C for coalesced reads
            self.block_c, self.block_s = min(64, triton.next_power_of_2(c)), 32
        else:  # frames innermost: wide along S
            self.block_c, self.block_s = min(8, triton.next_power_of_2(c)), 128
        self.block_s = min(self.block_s, max(16, triton.next_power_of_2(s)))
        # Launch options. num_warps: 8 values a thread, as Triton's layer-norm tutorial picks: the 32 x 64
        # tile with 4 warps spills in the float16 backward (Triton 3.9) and the float64 statistics (3.6),
        # with 8 none does. Contracted multiply-adds, as the RNN kernels: Triton 3.9 warns when this is
        # left to its default, and 3.10 turns that default off.
        warps = min(8, max(1, self.block_c * self.block_s // 256))
        self.launch = dict(num_warps=warps, enable_fp_fusion=True)
        self.n_sblocks = triton.cdiv(s, self.block_s)
        self.n_tiles = n * self.n_sblocks
        self.n_cblocks = triton.cdiv(c, self.block_c)
        # enough programs to fill the GPU a few times over; each walks a contiguous range of tiles. The
        # interpreter (tests) gets two programs, so that programs walk several tiles there too.
        target = 4 * _sm_count(x.device.index) if x.is_cuda else 2
        progs = min(self.n_tiles, max(1, target // self.n_cblocks))
        self.tiles_per_prog = triton.cdiv(self.n_tiles, progs)
        self.progs = triton.cdiv(self.n_tiles, self.tiles_per_prog)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.n_cblocks, self.progs)

    def args(self) -> tuple[int, ...]:
        return (self.C, self.S, self.n_sblocks, self.n_tiles, self.tiles_per_prog, *self.strides)


def _acc(x: torch.Tensor):
    return _TL_DTYPES[acc_dtype(x.dtype)]


def _mask_bytes(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The frame mask as contiguous bytes ``[N * S]`` (or a dummy pointer for no mask)."""
    if mask is None:
        return x
    return mask.reshape(-1).contiguous().view(torch.uint8)


def _like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` with ``x``'s strides (dy from ``.sum().backward()`` is an expanded tensor, for example)."""
    if t.stride() == x.stride():
        return t
    return torch.empty_strided(x.shape, x.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _pivot(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A value near each channel's data, ``[C]`` in :func:`acc_dtype`: the first real frame (device-side
    indexing, no host sync). Any finite pivot gives the right statistics; a close one keeps the mean
    exact to float32's precision *relative to the spread*, not to the offset."""
    n, c = x.shape[0], x.shape[1]
    frames = x.view(n, c, -1)
    if mask is None:
        pivot = frames[0, :, 0]
    else:
        first = mask.reshape(-1).to(torch.uint8).argmax()  # 0 when no frame is real: then unused
        pivot = frames[first // frames.shape[2], :, first % frames.shape[2]]
    return pivot.to(acc_dtype(x.dtype)).nan_to_num(0.0, 0.0, 0.0)


@on_tensors_device
def syncbn_stats_triton(x: torch.Tensor, mask: torch.Tensor | None):
    """Triton version of :func:`syncbn_stats_ref`: ``(mean [C] float64, m2 [C], count [])``."""
    acc = acc_dtype(x.dtype)
    c = x.shape[1]
    if x.numel() == 0:
        return x.new_zeros(c, dtype=torch.float64), x.new_zeros(c, dtype=acc), x.new_zeros((), dtype=acc)
    g = _Grid(x)
    pivot = _pivot(x, mask)
    count = x.new_empty(g.progs, dtype=acc)
    mean = x.new_empty(g.progs, c, dtype=acc)
    m2 = x.new_empty(g.progs, c, dtype=acc)
    _syncbn_stats_kernel[g.grid](
        x, _mask_bytes(mask, x), pivot, count, mean, m2, *g.args(),
        ACC=_acc(x), HAS_MASK=mask is not None, BLOCK_S=g.block_s, BLOCK_C=g.block_c, **g.launch,
    )  # fmt: skip
    # Partial counts are exact in float32 only up to 2^24 frames: sum them in float64.
    total = count.to(torch.float64).sum().to(acc)
    _, mean, m2 = merge_stats_ref(count, mean, m2)
    return pivot.to(torch.float64) + mean.to(torch.float64), m2, total


@on_tensors_device
def syncbn_fwd_triton(x, mean, invstd, weight, bias, mask):
    """Triton version of :func:`syncbn_fwd_ref`."""
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    acc = invstd.dtype
    hi, lo = split_mean(mean, acc)
    scale = invstd if weight is None else invstd * weight.to(acc)
    shift = -lo * scale if bias is None else bias.to(acc) - lo * scale
    g = _Grid(x)
    _syncbn_fwd_kernel[g.grid](
        x, y, _mask_bytes(mask, x), hi, scale, shift, *g.args(),
        ACC=_acc(x), HAS_MASK=mask is not None, BLOCK_S=g.block_s, BLOCK_C=g.block_c, **g.launch,
    )  # fmt: skip
    return y


@on_tensors_device
def syncbn_bwd_reduce_triton(dy, x, mean, invstd, mask):
    """Triton version of :func:`syncbn_bwd_reduce_ref`."""
    c = x.shape[1]
    if x.numel() == 0:
        return invstd.new_zeros(c), invstd.new_zeros(c)
    hi, lo = split_mean(mean, invstd.dtype)
    g = _Grid(x)
    sum_dy = invstd.new_empty(g.progs, c)
    sum_dy_xmu = invstd.new_empty(g.progs, c)
    _syncbn_bwd_reduce_kernel[g.grid](
        _like(dy, x), x, _mask_bytes(mask, x), hi, sum_dy, sum_dy_xmu, *g.args(),
        ACC=_acc(x), HAS_MASK=mask is not None, BLOCK_S=g.block_s, BLOCK_C=g.block_c, **g.launch,
    )  # fmt: skip
    sum_dy = sum_dy.sum(0)
    return sum_dy, (sum_dy_xmu.sum(0) - lo * sum_dy) * invstd


@on_tensors_device
def syncbn_bwd_triton(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask):
    """Triton version of :func:`syncbn_bwd_ref`."""
    dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx
    acc = invstd.dtype
    hi, lo = split_mean(mean, acc)
    scale = invstd if weight is None else invstd * weight.to(acc)
    k = -scale * invstd * mean_dy_xhat
    c = -scale * mean_dy - lo * k
    g = _Grid(x)
    _syncbn_bwd_kernel[g.grid](
        _like(dy, x), x, dx, _mask_bytes(mask, x), hi, scale, k, c, *g.args(),
        ACC=_acc(x), HAS_MASK=mask is not None, BLOCK_S=g.block_s, BLOCK_C=g.block_c, **g.launch,
    )  # fmt: skip
    return dx
