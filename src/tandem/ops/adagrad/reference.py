"""Adagrad's update in plain PyTorch: the CPU kernel of ``tandem::adagrad_step``, the Triton kernel's oracle.

The update is torch.optim.Adagrad's; for step ``t`` (already counted), ``clr = lr / (1 + (t - 1) lr_decay)``::

    g = -grad if maximize else grad;   g = g + weight_decay * p   (when weight_decay != 0)
    sum = sum + g * g;                  p = p - clr * g / (sqrt(sum) + eps)

Two implementations live here:

* :func:`adagrad_tensor_ref`, the textbook update of one tensor with the same sequence of PyTorch ops as
  ``torch.optim.Adagrad(foreach=False)`` (dense, complex, sparse, and differentiable), and
  :func:`adagrad_group_ref`, the same math over a list with ``torch._foreach_*`` ops;
* :func:`adagrad_step_ref`, the CPU kernel: torch's fused CPU Adagrad (one vectorised pass that reads
  ``p, g, sum`` once and writes ``p, sum`` once) for contiguous float32/float64 tensors, the plain path for
  the rest. It matches ``foreach=False`` to float32 rounding: the fused kernel differs in the last bit of
  some elements (it is not the same sequence of roundings).

When the largest change ``max |p_new - p_old|`` is asked for, the fused path works through slices of
half a million elements: copy the slice's parameters into a scratch buffer, update the slice, subtract
and reduce while the slice is still in cache. That adds no pass over main memory, but the extra in-cache
passes (copy, subtract, abs, max) and their eager ops make a tracked step about 2x an untracked one on
CPU. Measured alternatives: a separate pass after the update over all tensors, from ``g`` and the new
``sum`` with foreach ops, 5x; the fused update of a zeroed scratch "parameter" per slice (it yields the
nominal step, not the change, and cannot do weight decay), no faster than the copy. The Triton kernel
tracks in its single pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "adagrad_step_ref",
    "adagrad_group_ref",
    "adagrad_tensor_ref",
    "fused_adagrad_supported",
    "unscale_like_grad_scaler_",
]

# Elements per slice when the largest change is tracked: a slice's parameters and their copy (2 x 2 MiB
# in float32) stay in cache between the update and the reduction. Measured on a 2-core EPYC, 1 thread,
# 10M parameters: 2**16 16.2 ms, 2**18 11.6, 2**19 10.6, 2**20 10.8, 2**21 12.2 (untracked: 5.2 ms);
# small slices lose to the per-op overhead of the eager ops, large ones fall out of cache.
_TRACK_SLICE = 1 << 19

_FUSED_DTYPES = (torch.float32, torch.float64)


def fused_adagrad_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype go to torch's fused CPU kernel (when contiguous).

    Half types go to the plain path: the fused kernel rounds ``lr`` and ``eps`` to the parameter's dtype,
    which moves bfloat16 training visibly away from ``torch.optim.Adagrad``'s default path. The kernel
    walks ``p, g, sum`` as flat arrays by address: each tensor must be contiguous (checked per tensor).
    """
    return hasattr(torch, "_fused_adagrad_") and device.type == "cpu" and dtype in _FUSED_DTYPES


def bump_versions(tensors: list[Tensor]) -> None:
    """Count a version of each of ``tensors``, as an in-place op does, after a kernel wrote them behind
    autograd's back."""
    try:
        torch._C._increment_version(tensors)
    except TypeError:  # torch versions whose binding takes one tensor
        for t in tensors:
            torch._C._increment_version(t)


def unscale_like_grad_scaler_(grads: list[Tensor], grad_scale: Tensor) -> None:
    """Unscale ``grads`` (dense tensors, or sparse ones' values) in place as ``torch.amp.GradScaler.unscale_``
    does before torch's per-tensor and foreach updates: times the scale's reciprocal, taken in float64 and
    rounded to float32. (torch's fused kernels divide by the scale instead: where the scale is not a power
    of two the two differ in the last bit.)

    Example::

        g = torch.ones(2)
        unscale_like_grad_scaler_([g], torch.tensor(1000.0))  # g == 1 * float32(1 / 1000)
    """
    inv_scale = grad_scale.double().reciprocal().float()
    for g in grads:
        g.mul_(inv_scale.to(g.device))


def _clr(lr: float, lr_decay: float, step: float) -> float:
    return lr / (1 + (step - 1) * lr_decay)


def _sparse(like: Tensor, indices: Tensor, values: Tensor) -> Tensor:
    # The indices come from a coalesced tensor: the invariants hold (and checking them costs a pass).
    return torch.sparse_coo_tensor(indices, values, like.size(), check_invariants=False)


def adagrad_tensor_ref(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    step: float,
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    differentiable: bool = False,
    track: bool = False,
) -> Tensor | None:
    """Update one ``param`` (and its ``state_sum``) in place; ``step`` is the step count after this step.

    Dense, complex (updated through ``view_as_real``) and sparse COO gradients, the latter touching only
    the rows they name. With ``differentiable`` the ops stay on the autograd tape. Returns the largest
    absolute change of ``param`` (a 0-d tensor of its real dtype) when ``track``, else ``None``.

    Example::

        p, s = torch.zeros(3), torch.zeros(3)
        adagrad_tensor_ref(p, torch.ones(3), s, 1.0, lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
                           maximize=False)  # p == -0.1
    """
    g = -grad if maximize else grad
    if weight_decay != 0:
        if g.is_sparse:
            raise RuntimeError("weight_decay option is not compatible with sparse gradients")
        g = g.add(param, alpha=weight_decay)
    clr = _clr(lr, lr_decay, step)

    if g.is_sparse:
        g = g.coalesce()  # the update is not linear in g: every index must appear once
        indices, values = g._indices(), g._values()
        old = param.sparse_mask(g)._values().clone() if track else None
        state_sum.add_(_sparse(g, indices, values.pow(2)))
        std_values = state_sum.sparse_mask(g)._values().sqrt_().add_(eps)
        param.add_(_sparse(g, indices, values / std_values), alpha=-clr)
        if old is None:
            return None
        return _largest(param.sparse_mask(g)._values().detach() - old)

    if torch.is_complex(param):
        param, g, state_sum = torch.view_as_real(param), torch.view_as_real(g), torch.view_as_real(state_sum)
    old = param.detach().clone() if track else None
    state_sum.addcmul_(g, g, value=1)
    std = state_sum.sqrt() + eps if differentiable else state_sum.sqrt().add_(eps)
    param.addcdiv_(g, std, value=-clr)
    return None if old is None else _largest(param.detach() - old)


def _largest(delta: Tensor) -> Tensor:
    """``max |delta|`` as a 0-d tensor; 0 for an empty tensor, NaN if any entry is NaN."""
    if delta.numel() == 0:
        return delta.new_zeros(())
    return delta.abs().amax()


def adagrad_group_ref(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    track: bool = False,
) -> Tensor | None:
    """:func:`adagrad_tensor_ref` over dense real tensors of one device and dtype, with ``_foreach`` ops.

    The roundings of torch's per-tensor Adagrad (``foreach=False``, torch's default for CPU tensors):
    bit for bit its result on the CPU, in every dtype. (torch's multi-tensor path, its default on CUDA,
    first rounds ``-clr * grad`` to the tensors' dtype: in bfloat16 and float16 that differs by an ulp
    here and there.) ``state_steps`` are read (already counted), not changed. Returns the largest
    absolute change over all ``params`` when ``track``.
    """
    if not params:
        return None
    g = torch._foreach_neg(grads) if maximize else grads
    if weight_decay != 0:
        g = torch._foreach_add(g, params, alpha=weight_decay)
    minus_clr = [-_clr(lr, lr_decay, float(t)) for t in state_steps]
    old = [p.clone() for p in params] if track else None
    torch._foreach_addcmul_(state_sums, g, g, value=1)
    std = torch._foreach_sqrt(state_sums)
    torch._foreach_add_(std, eps)
    torch._foreach_addcdiv_(params, g, std, minus_clr)  # clr unrounded, as the for-loop's addcdiv_
    if old is None:
        return None
    torch._foreach_sub_(old, params)
    return torch.stack([_largest(d) for d in old]).amax()


def adagrad_step_ref(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    track: bool = False,
) -> Tensor | None:
    """The CPU kernel: update dense tensors of one device and dtype; ``state_steps`` are already counted.

    ``grad_scale``/``found_inf`` behave as in torch's fused optimizers (AMP): grads are unscaled in place
    (divided by ``grad_scale`` in torch's fused kernel; on the plain path as GradScaler unscales them for
    torch's default, see :func:`unscale_like_grad_scaler_`), and nothing is updated when ``found_inf`` is
    1. Returns the largest absolute change of any parameter (a 0-d float32 tensor; +inf if a change is
    NaN) when ``track``.

    Example::

        ps, gs = [torch.zeros(4)], [torch.ones(4)]
        ss, ts = [torch.zeros(4)], [torch.ones(())]
        adagrad_step_ref(ps, gs, ss, ts, lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False,
                         track=True)  # tensor(0.1000)
    """
    hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize)
    maxima: list[Tensor] = []
    fast = [False] * len(params)
    if fused_adagrad_supported(params[0].device, params[0].dtype):
        fast = [
            p.is_contiguous()
            and g.is_contiguous()
            and s.is_contiguous()
            and g.numel() == s.numel() == p.numel()
            for p, g, s in zip(params, grads, state_sums)
        ]
    lists = params, grads, state_sums, state_steps
    if all(fast):
        fast_lists, plain_lists = lists, None
    else:
        fast_lists = [[x[i] for i, f in enumerate(fast) if f] for x in lists]
        plain_lists = [[x[i] for i, f in enumerate(fast) if not f] for x in lists]

    # a step GradScaler skips (an inf found): torch's fused kernels test found_inf on the host (CPU) or per
    # block (CUDA); the version counts and the per-tensor fallback read it here
    skip = found_inf is not None and bool(found_inf.item() == 1.0)
    if fast_lists[0]:
        amp = dict(grad_scale=grad_scale, found_inf=found_inf)
        if track:
            maxima.append(_fused_tracked(*fast_lists, **hyper, **amp))
        else:
            torch._fused_adagrad_(*fast_lists, **hyper, **amp)
        if not skip:
            # torch's default updates with in-place ops, which count a version (a graph kept with
            # retain_graph that saved a parameter then refuses a second backward); its fused kernel, as this
            # one, writes behind autograd's back: counted here, 2 us for 60 tensors (as the Triton path does)
            changed = fast_lists[0] + fast_lists[2] + (fast_lists[1] if grad_scale is not None else [])
            bump_versions(changed)

    if plain_lists is not None:
        if not skip:
            if grad_scale is not None:  # the roundings of torch's default under GradScaler
                unscale_like_grad_scaler_(plain_lists[1], grad_scale)
            m = adagrad_group_ref(*plain_lists, **hyper, track=track)
            if m is not None:
                maxima.append(m)
        elif track:
            maxima.append(torch.zeros((), dtype=torch.float32, device=params[0].device))

    if not track:
        return None
    if not maxima:
        return torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    largest = torch.stack([m.to(torch.float32) for m in maxima]).amax()
    return torch.nan_to_num(largest, nan=float("inf"), posinf=float("inf"))


def _fused_tracked(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    **kwargs,
) -> Tensor:
    """torch's fused update slice by slice, each slice's change reduced while it is still in cache."""
    # on the parameters' device, not the default one (torch.set_default_device, a torch.device context)
    scratch = torch.empty(
        min(_TRACK_SLICE, sum(p.numel() for p in params)), dtype=params[0].dtype, device=params[0].device
    )
    maxima: list[Tensor] = []
    batch: tuple[list[Tensor], ...] = ([], [], [], [])
    flat_params: list[Tensor] = []  # batch[0] as 1-d views, to copy into and subtract from the scratch
    sizes: list[int] = []

    def flush() -> None:
        used = scratch[: sum(sizes)]
        old = used.split(sizes)
        torch._foreach_copy_(old, flat_params)
        torch._fused_adagrad_(*batch, **kwargs)
        torch._foreach_sub_(old, flat_params)
        if used.numel():  # (zero-size parameters alone change nothing: amax of nothing raises)
            maxima.append(used.abs_().amax())
        for x in (*batch, flat_params, sizes):
            x.clear()

    room = scratch.numel()
    for p, g, s, t in zip(params, grads, state_sums, state_steps):
        n = p.numel()
        if n <= scratch.numel():  # whole tensors, several per slice
            if n > room:
                flush()
                room = scratch.numel()
            for b, x in zip(batch, (p, g, s, t)):
                b.append(x)
            flat_params.append(p.view(-1))
            sizes.append(n)
            room -= n
            continue
        p, g, s = p.view(-1), g.view(-1), s.view(-1)  # a large tensor: cut into slices
        for start in range(0, n, scratch.numel()):
            k = min(scratch.numel(), n - start)
            if k > room:
                flush()
                room = scratch.numel()
            for b, x in zip(batch, (p[start : start + k], g[start : start + k], s[start : start + k], t)):
                b.append(x)
            flat_params.append(batch[0][-1])
            sizes.append(k)
            room -= k
    if sizes:
        flush()
    if not maxima:  # only empty tensors
        return torch.zeros((), dtype=torch.float32, device=params[0].device)
    return torch.stack(maxima).amax().float()
