"""``tandem.ops.syncbn``: batch norm whose statistics are synchronized over a process group.

The local kernels are custom ops (``torch.ops.tandem.syncbn_*``, see ``op.py``); this layer owns the two
collectives, one per direction on a small float64 tensor (:func:`gather_over_ranks` of every rank's
statistics forward, :func:`sum_over_ranks` of the gradient sums backward), and the autograd that spans
them.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from tandem._backend import use_triton
from tandem.ops._recompute import (
    grads_through,
    mutation_allowed,
    needs_autograd_ops,
    versions_unchanged,
    wants_graph,
)
from tandem.ops.syncbn import op as _op  # noqa: F401  (registers torch.ops.tandem.syncbn_*)
from tandem.ops.syncbn.reference import (
    acc_dtype,
    syncbn_bwd_reduce_ref,
    syncbn_bwd_ref,
    syncbn_fwd_ref,
    syncbn_pack_ref,
    syncbn_stats_ref,
    syncbn_unpack_ref,
)

__all__ = ["check_eps", "gather_over_ranks", "sync_batch_norm", "sync_group", "sum_over_ranks"]


def sync_group(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group statistics are synchronized over, or None when there is nothing to synchronize with
    (torch.distributed unavailable or not initialised, or a group of one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def sync_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    sync: bool = True,
) -> Tensor:
    """``F.batch_norm`` whose training statistics cover every rank of ``process_group``, and real frames only.

    With ``training=True`` the mean and (biased) variance are those of all ranks' frames together,
    weighted by each rank's frame count (a rank may have none), merged stably after one collective
    (:func:`gather_over_ranks`); ``running_mean``/``running_var``, when given, move by ``momentum`` towards
    the global mean and unbiased variance, identically on every rank. The backward does one collective
    (when the input needs a gradient); weight and bias gradients are the rank's own, as in
    torch.nn.SyncBatchNorm. With ``training=False`` the running statistics normalise and nothing is
    communicated. Without a group to synchronize with (see :func:`sync_group`) and without a mask this is
    ``F.batch_norm``.

    Args:
        input: ``[N, C, *S]`` (2-D to 5-D; any float dtype, statistics in float32 or float64).
        running_mean, running_var: ``[C]`` or None.
        weight, bias: ``[C]`` or None.
        training, momentum, eps: as for ``F.batch_norm``.
        mask: ``[N, *S]`` bool, True on real frames, or None. Masked-out frames are left out of the
            statistics, whatever they hold, and get output 0 and gradient 0.
        process_group: the group to synchronize over; None is the default (world) group.
        sync: False keeps the statistics local (torch.nn.SyncBatchNorm's eval mode without running
            statistics).

    Returns:
        ``[N, C, *S]`` in the input's dtype and memory format.

    Example::

        >>> x = torch.randn(4, 3, 10)  # [N, C, L]
        >>> lengths = torch.tensor([10, 7, 3, 1])
        >>> mask = torch.arange(10) < lengths[:, None]  # [N, L]
        >>> y = sync_batch_norm(x, None, None, training=True, mask=mask)
        >>> y.shape, bool((y[3, :, 1:] == 0).all())
        (torch.Size([4, 3, 10]), True)
    """
    if input.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    if mask is not None:
        _check_mask(mask, input)
    if not training:  # F.batch_norm's errors
        for name, stat in (("running_mean", running_mean), ("running_var", running_var)):
            if stat is None:
                raise RuntimeError(f"{name} must be defined in evaluation mode")
    group = sync_group(process_group) if training and sync else None
    if group is None and mask is None:  # (which checks eps itself, after the batch's size)
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    check_eps(eps, training, momentum)
    _check_as_torch(input, running_mean, running_var, weight, bias, training)
    if needs_autograd_ops(input, weight, bias):
        if group is not None:
            raise RuntimeError(
                "SyncBatchNorm: forward-mode AD and torch.func transforms are not supported while the "
                "statistics are synchronized over processes"
            )
        y = _autograd_batch_norm(
            input, mask, running_mean, running_var, weight, bias, training, momentum, eps
        )
    else:
        dense = _dense(input)
        y = _SyncBatchNorm.apply(
            dense, weight, bias, mask, running_mean, running_var, training, momentum, eps, group
        )
        checked = not (torch.compiler.is_compiling() or mutation_allowed())
        if dense is not input and y.requires_grad and checked:
            # the op saved a copy: an in-place change of the input before backward raises autograd's error
            # all the same, as torch's batch norm, which saves the input itself
            try:
                version = input._version
            except RuntimeError:  # an inference tensor keeps none (torch refuses to save one anyway)
                version = None
            if version is not None:
                check = functools.partial(
                    versions_unchanged, [input], ["SyncBatchNorm's input"], [version], ""
                )
                y.register_hook(check)
    return _torch_layout(y)


def check_eps(eps: float, training: bool, momentum: float = 0.1) -> None:
    """F.batch_norm's errors for ``eps`` (in eval too: a negative one made the masked path's output NaN),
    with the installed torch's rule and words: torch 2.13 takes 0 in eval and refuses a negative eps as
    "non-negative", torch 2.11 refuses ``eps <= 0`` in either mode as "positive"; and its TypeErrors for
    an ``eps`` or ``momentum`` that is no number it takes (a string from a configuration file, which the
    masked path compared with other words, or computed with in eval). F.batch_norm itself checks, on one
    tiny batch, when ``eps`` is not positive or either is not a float."""
    if isinstance(eps, float) and eps > 0.0 and isinstance(momentum, float):  # every torch takes them
        return
    stat = torch.zeros(1), torch.ones(1)
    F.batch_norm(torch.ones(2, 1), *stat, training=training, momentum=momentum, eps=eps)


def _check_as_torch(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
) -> None:
    """torch's batch_norm errors for what the kernels would compute anyway: an integer, bool or complex
    input, an input and parameters of dtypes torch does not mix, one running statistic without the
    other. The same call on two frames raises them (copies of the running statistics: nothing moves)."""
    copies = [None if t is None or not training else t.clone() for t in (running_mean, running_var)]
    stats = copies if training else [running_mean, running_var]
    with torch.no_grad():
        F.batch_norm(input.new_zeros((2, input.shape[1])), *stats, weight, bias, training, 0.1, 1.0)


def _autograd_batch_norm(
    x: Tensor,
    mask: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Tensor:
    """Batch norm over the real frames with autograd-tracked ops (one process): what forward-mode AD and
    torch.func's transforms differentiate, where the kernels' hand-written backward does not reach. The
    numbers of BatchNorm over the real frames alone, as the kernels'."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    keep = _real(x, mask)
    if training:
        x_hat, mean, var = _normalized(x, keep, eps)
        frames = int(keep[:, 0].sum())
        if frames == 1:
            raise ValueError("Expected more than 1 value per channel when training, got 1 frame")
        if running_mean is not None and running_var is not None and frames > 0:
            with torch.no_grad():
                batch_mean = forward_ad.unpack_dual(mean).primal.flatten()
                batch_var = forward_ad.unpack_dual(var).primal.flatten() * frames / (frames - 1)
                running_mean.mul_(1 - momentum).add_(batch_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(batch_var.to(running_var.dtype), alpha=momentum)
    else:
        x_hat, _, _ = _normalized(
            x, keep, eps, running_mean.view(shape), torch.rsqrt(running_var.view(shape) + eps)
        )
    y = x_hat if weight is None else x_hat * weight.view(shape)
    y = y if bias is None else y + bias.view(shape)
    return torch.where(keep, y, 0).to(x.dtype)


def _real(x: Tensor, mask: Tensor | None) -> Tensor:
    """Which elements of ``x`` ``[N, C, *S]`` are on real frames: ``mask`` ``[N, *S]`` over the channels."""
    return torch.ones_like(x, dtype=torch.bool) if mask is None else mask.unsqueeze(1).expand_as(x)


def _normalized(
    x: Tensor, keep: Tensor, eps: float, mean: Tensor | None = None, invstd: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``x`` normalised over its real frames (``keep``, see :func:`_real`) with autograd-tracked ops, 0 on
    the others: by ``mean`` and ``invstd`` (``[1, C, 1...]``) where given, else by the real frames' own
    mean and biased variance, which come back too (``[1, C, 1...]``; None otherwise). BatchNorm's numbers
    over the real frames alone, for every AD mode (see :func:`_autograd_batch_norm`, and
    :func:`_differentiable_grads` for a second derivative)."""
    if mean is not None:
        return torch.where(keep, (x - mean) * invstd, 0), None, None
    dims = [0, *range(2, x.dim())]
    # no real frame: 0 / 0 made the mean NaN, and 0 * NaN every x_hat and the weight's gradient (torch's
    # batch norm of an empty batch has a gradient of 0); over at least one frame the count is itself
    count = keep.sum(dims, keepdim=True).clamp(min=1)
    batch_mean = torch.where(keep, x, 0).sum(dims, keepdim=True) / count
    centred = torch.where(keep, x - batch_mean, 0)
    var = centred.square().sum(dims, keepdim=True) / count
    return centred * torch.rsqrt(var + eps), batch_mean, var


def _torch_layout(y: Tensor) -> Tensor:
    """``y`` in the memory format torch's batch norm gives for an input of ``y``'s strides: channels_last
    (4-D) and channels_last_3d (5-D) kept, anything else contiguous (a transposed ``[N, L, C]`` input
    seen as ``[N, C, L]`` included)."""
    if y.is_contiguous():
        return y
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    fmt = formats.get(y.dim())
    if fmt is not None and y.is_contiguous(memory_format=fmt):
        return y
    return y.contiguous()


def _check_mask(mask: Tensor, input: Tensor) -> None:
    expected = [input.shape[0], *input.shape[2:]]
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor (True = real frame), got {mask.dtype}")
    if list(mask.shape) != expected:
        raise ValueError(
            f"mask: expected shape {expected} (the input's shape without the channel dim), "
            f"got {list(mask.shape)}"
        )
    if mask.device != input.device:
        raise ValueError(f"mask: expected device {input.device} (the input's), got {mask.device}")


def _dense(x: Tensor) -> Tensor:
    """``x`` itself if it is dense and its spatial dims merge into one (contiguous, channels_last,
    a transposed ``[N, L, C]`` seen as ``[N, C, L]``, ...), else a contiguous copy."""
    frames = x.shape[2:].numel()
    try:
        strides = x.view(x.shape[0], x.shape[1], frames).stride()
    except RuntimeError:
        return x.contiguous()
    expected = 1
    for size, stride in sorted(zip((x.shape[0], x.shape[1], frames), strides), key=lambda p: p[1]):
        if size > 1 and stride != expected:
            return x.contiguous()
        expected *= size
    return x


def _eager_reference(x: Tensor) -> bool:
    """Call the reference kernels directly, lending them the output as scratch (see ``reference._scratch``):
    plain eager mode on the reference backend. Under torch.compile or a dispatch mode the registered
    ops run (same kernels, no buffer lending)."""
    return not (use_triton(x) or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0)


class _SyncBatchNorm(torch.autograd.Function):
    """The autograd of synchronized batch norm: kernels and collectives, one all_reduce each way."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, running_mean, running_var, batch_stats, momentum, eps, group):
        acc = acc_dtype(x.dtype)
        eager = _eager_reference(x)
        # the output, lent to the statistics pass as its scratch first (same dtype only)
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if eager else None
        count = None
        if batch_stats:
            if eager:
                mean_l, m2_l, count_l = syncbn_stats_ref(x, mask, scratch=y)
            else:
                mean_l, m2_l, count_l = torch.ops.tandem.syncbn_stats(x, mask)
            packed = syncbn_pack_ref(mean_l, m2_l, count_l).unsqueeze(0)  # float64 [1, 2C + 1]
            if group is not None:
                packed = gather_over_ranks(packed[0], group)  # [ranks, 2C + 1]
            mean, m2, count = syncbn_unpack_ref(packed)  # float64: the kernels split the mean into hi + lo
            # The frame count is on the host for CPU tensors only; on CUDA the check would cost a sync.
            # One frame in all is torch's error; none (every batch empty, or every frame masked) is
            # torch's BatchNorm on an empty batch: an empty output, the running statistics as they were.
            if not packed.is_cuda and float(count) == 1:
                raise ValueError(
                    "Expected more than 1 value per channel when training, got "
                    f"{int(count)} frame(s) over all ranks"
                )
            var = m2 / count.clamp(min=1)
            if running_mean is not None and running_var is not None:
                with torch.no_grad():
                    _update(running_mean, mean, momentum, count)
                    # unbiased; one frame in all is torch's error, checked above where the count is on the
                    # host: on CUDA the variance stays as it was rather than become 0 / 0
                    _update(running_var, m2 / (count - 1), momentum, count, least=2)
            invstd = torch.rsqrt(var + eps).to(acc)
            count = count.to(acc)
        else:
            # a copy: the buffer may move on (a later training step) before this backward runs
            mean = running_mean.to(torch.float64, copy=True)
            invstd = torch.rsqrt(running_var.to(acc) + eps)
        if eager:
            y = syncbn_fwd_ref(x, mean, invstd, weight, bias, mask, out=y)
        else:
            y = torch.ops.tandem.syncbn_fwd(x, mean, invstd, weight, bias, mask)
        ctx.save_for_backward(x, weight, mean, invstd, mask, count)
        ctx.eps = eps
        ctx.group = group
        ctx.batch_stats = batch_stats
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, mask, count = ctx.saved_tensors
        need_dx, need_w, need_b = ctx.needs_input_grad[:3]
        if wants_graph(dy, x, weight):  # create_graph=True: a second derivative may follow
            if ctx.group is not None:
                raise RuntimeError(
                    "SyncBatchNorm: a second derivative (backward with create_graph=True) is not supported "
                    "while the statistics are synchronized over processes"
                )
            return (*_differentiable_grads(ctx, dy, x, weight, mean, invstd, mask), *(None,) * 7)
        eager = _eager_reference(x)
        dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if eager else None
        dw = db = None
        sums = None
        if (ctx.batch_stats and need_dx) or need_w or need_b:
            if eager:
                sum_dy, sum_dy_xhat = syncbn_bwd_reduce_ref(dy, x, mean, invstd, mask, scratch=dx)
            else:
                sum_dy, sum_dy_xhat = torch.ops.tandem.syncbn_bwd_reduce(dy, x, mean, invstd, mask)
            if need_w:
                dw = sum_dy_xhat.to(weight.dtype)
            if need_b:
                db = sum_dy.to(ctx.bias_dtype)
            sums = (sum_dy, sum_dy_xhat)
        if not need_dx:
            dx = None
        elif not ctx.batch_stats:
            # fixed (running) statistics: y is affine in x, dx = dy * weight * invstd, x unread (the kernel's
            # (x - mean) * 0 made an inf or NaN frame's gradient NaN; torch's stays finite)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            full = torch.mul(dy.to(invstd.dtype), scale.view([1, -1] + [1] * (x.dim() - 2)))
            if mask is not None:
                full.masked_fill_(~mask.unsqueeze(1), 0)
            dx = full.to(x.dtype) if dx is None else dx.copy_(full)  # (x's strides, as the kernel's)
        else:
            combined = torch.cat(sums)  # [2C]: the sums of every rank, then divided by all frames
            if ctx.group is not None:
                # float64 on the wire whatever the rank's dtype: ranks of float32 and float64 inputs send
                # the same bytes
                combined = sum_over_ranks(combined.double(), ctx.group).to(sums[0].dtype)
            mean_dy, mean_dy_xhat = (combined / count.clamp(min=1)).chunk(2)
            if eager:
                dx = syncbn_bwd_ref(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask, out=dx)
            else:
                dx = torch.ops.tandem.syncbn_bwd(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, mask)
        if dx is not None:  # in torch's layout, as its batch norm's: a hook upstream may view it
            dx = _torch_layout(dx)
        return dx, dw, db, None, None, None, None, None, None, None


def _differentiable_grads(
    ctx, dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor, mask: Tensor | None
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` as differentiable tensors (one process): the normalisation recomputed with
    autograd-tracked ops over the real frames (what BatchNorm over those frames alone computes) and
    differentiated, as :mod:`tandem.ops._recompute` does for the recurrent layers."""
    need_dx, need_w, need_b = ctx.needs_input_grad[:3]
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    keep = _real(x, mask)
    # float32 for half inputs, as the kernels compute (in float16 the derivative of rsqrt(var), var^-1.5,
    # overflowed for a small variance: an inf or NaN gradient where torch's stays finite)
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    with torch.enable_grad():
        xs = x if need_dx else x.detach()
        xw = xs.to(work)
        if ctx.batch_stats:
            x_hat, _, _ = _normalized(xw, keep, ctx.eps)
        else:  # the running statistics: constants
            x_hat, _, _ = _normalized(
                xw, keep, ctx.eps, mean.to(work).view(shape), invstd.to(work).view(shape)
            )
        y = x_hat if weight is None else x_hat * weight.to(work).view(shape)
        dx, dw = grads_through([y], [dy.to(work)], [xs, weight], [need_dx, need_w])
        db = torch.where(keep, dy, 0).sum(dims).to(ctx.bias_dtype) if need_b else None
    # torch's batch norm gives every gradient of a create_graph backward its double-backward node, also
    # one that depends on no differentiable input (dx in eval, dbias): a penalty on it runs, and leaves
    # the inputs' gradients None. Such a gradient came back detached here, and the penalty raised.
    anchors = [t for t in (x, weight, dy) if t is not None and t.requires_grad]
    if anchors:
        dx, dw, db = (
            g if g is None or g.requires_grad else _Attached.apply(g, *anchors) for g in (dx, dw, db)
        )
    return dx, dw, db


class _Attached(torch.autograd.Function):
    """``value`` as the output of a node whose backward reaches none of ``anchors`` (see
    :func:`_differentiable_grads`)."""

    @staticmethod
    def forward(ctx, value: Tensor, *anchors: Tensor) -> Tensor:
        ctx.inputs = 1 + len(anchors)
        return value.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, ...]:
        return (None,) * ctx.inputs


# How long a rank that waits for the others' statistics on the CPU polls for them before it sleeps. A
# sleeping rank is woken through Gloo's threads, which on a machine with a rank on every core often waits
# for the scheduler: in `tandem bench --op train` (2 ranks, 2 cores) a step's 8 synchronizations took
# 16.5-18.4 ms asleep against 10-12 ms polling, and an epoch 1.20-1.25x torch's against 1.31-1.34x. Under
# torchrun, with the ranks pinned to their cores as tandem train pins them, a step took 129-132 ms asleep
# against 124-128 ms polling (unpinned, no difference was measurable).
POLL_S = 0.02


def gather_over_ranks(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Every rank's ``t`` (a few hundred bytes), stacked in rank order: ``[ranks, *t.shape]``, the same
    on every rank of ``group`` (None: the default group). One ``all_gather``; on the CPU the rank polls
    for it first, as :func:`sum_over_ranks` does."""
    ranks = dist.get_world_size(group)
    if t.is_cuda:
        out = t.new_empty((ranks, *t.shape))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out
    parts = [torch.empty_like(t) for _ in range(ranks)]
    work = dist.all_gather(parts, t, group=group, async_op=True)
    _poll(work.is_completed, POLL_S)
    work.wait()
    return torch.stack(parts)


def sum_over_ranks(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The sum of ``t`` (a few hundred bytes of statistics) over the ranks of ``group`` (None: the
    default group): the one collective of each direction of :func:`sync_batch_norm`.

    CUDA tensors: one ``all_reduce``. CPU tensors (Gloo): an ``all_gather`` and the sum of the gathered
    copies on every rank, because Gloo's all_reduce of so small a tensor is latency-bound and slower:
    1.8 ms against 0.8 ms for the all_gather with 2 ranks, 2.9 ms against 2.0 ms with 3 (torch 2.13,
    the 2-core machine, idle), and a training step synchronizes twice per batch-norm layer. Every rank
    adds the same copies in the same order, so the sums are bitwise equal on all of them. The rank polls
    for the result for up to :data:`POLL_S` seconds, yielding its core between polls, before it blocks
    in ``wait()`` (whose errors and timeout are the process group's, as without polling).

    Example::

        >>> total = sum_over_ranks(torch.tensor([loss, count], dtype=torch.float64))  # in every rank
    """
    if t.is_cuda:
        dist.all_reduce(t, group=group)
        return t
    return gather_over_ranks(t, group).sum(0)


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def _poll(done: Callable[[], bool], seconds: float) -> bool:
    """Call ``done`` until it returns True (then True) or ``seconds`` have passed (then False), giving the
    core to any other runnable thread between calls."""
    end = time.perf_counter() + seconds
    while not done():
        if time.perf_counter() >= end:
            return False
        _yield()
    return True


def _update(running: Tensor, batch: Tensor, momentum: float, count: Tensor, least: int = 1) -> None:
    """``running = (1 - momentum) * running + momentum * batch``, formed in float64 and rounded once;
    unchanged where fewer than ``least`` frames counted, without reading the count on the host."""
    updated = running.to(torch.float64) * (1.0 - momentum) + batch * momentum
    running.copy_(torch.where(count >= least, updated, running.to(torch.float64)))
