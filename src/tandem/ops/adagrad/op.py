"""Registration of ``tandem::adagrad_step``, the in-place Adagrad update of a list of tensors.

One call covers tensors of one device and one dtype (``tandem.ops.adagrad`` groups them). The op counts
the step itself (``step += 1``, and ``-= found_inf`` afterwards, as torch's fused optimizers do) so that
``state_steps`` and the kernels stay consistent whichever kernel runs.

:func:`adagrad_step_dispatch` is how tandem calls it. Under ``torch.compile``/``export`` or a dispatch
mode it goes through the registered op; in plain eager mode it calls the same body directly: the
custom-op wrapper costs ~0.23 ms per call for 100 parameters (it converts and version-bumps 400 tensor
arguments in Python), 5-10% of a whole CPU step of 6-10M parameters.
"""

# No ``from __future__ import annotations`` here: torch 2.4's custom_op reads the annotations at
# registration time and does not resolve string annotations (``Tensor | None`` unquoted is fine: it equals
# ``Optional[Tensor]``).

import torch
from torch import Tensor

from tandem._backend import use_triton
from tandem.ops.adagrad.reference import adagrad_step_ref

__all__ = ["adagrad_step", "adagrad_step_dispatch"]

# A CPU scalar added with alpha takes foreach's tensor overload: one wrapped scalar instead of one per
# step tensor (0.04 ms instead of 0.16 ms for 100 CPU steps, the trick torch's foreach Adagrad uses).
_ONE = torch.tensor(1.0)


def _count_steps(state_steps: list[Tensor]) -> None:
    if state_steps[0].is_cpu:
        torch._foreach_add_(state_steps, _ONE, alpha=1.0)
    else:
        torch._foreach_add_(state_steps, 1)


def _adagrad_step_impl(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    track: bool,
    lr_tensor: Tensor | None = None,
) -> Tensor | None:
    if lr_tensor is not None:
        lr = float(lr_tensor.item())  # (read before anything changes: what it holds now, as torch's update)
    if not params:
        return torch.zeros((), dtype=torch.float32, device="cpu") if track else None
    _count_steps(state_steps)
    kernel = adagrad_step_ref
    if use_triton(params[0]):
        from tandem.ops.adagrad.triton import adagrad_step_triton as kernel
    largest = kernel(
        params,
        grads,
        state_sums,
        state_steps,
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=grad_scale,
        found_inf=found_inf,
        track=track,
    )
    if found_inf is not None:
        torch._foreach_sub_(state_steps, [found_inf] * len(state_steps))
    return largest


@torch.library.custom_op(
    "tandem::adagrad_step", mutates_args=("params", "grads", "state_sums", "state_steps")
)
def adagrad_step(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    track: bool,
    lr_tensor: Tensor | None = None,
) -> Tensor:
    """Adagrad step of dense real tensors of one device and dtype, in place.

    ``state_steps`` are float32 0-d tensors on the parameters' device; ``grads`` change only with
    ``grad_scale`` (unscaled in place). ``lr_tensor``, a real 1-element tensor, replaces ``lr`` when
    given: read when the op runs, so that a compiled step follows an LR scheduler's changes to it without
    recompiling. Returns the largest absolute parameter change (0-d float32) when ``track``, else an empty
    tensor.
    """
    largest = _adagrad_step_impl(
        params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
        grad_scale, found_inf, track, lr_tensor,
    )  # fmt: skip
    if largest is None:
        like = params[0] if params else torch.empty(0)
        return like.new_empty(0, dtype=torch.float32)
    return largest


@adagrad_step.register_fake
def _adagrad_step_fake(
    params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale, found_inf,
    track, lr_tensor=None,
):  # fmt: skip
    like = params[0] if params else torch.empty(0)
    return like.new_empty(() if track else (0,), dtype=torch.float32)


def adagrad_step_dispatch(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    lr: float | Tensor,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    track: bool,
) -> Tensor | None:
    """``tandem::adagrad_step`` (returning None instead of an empty tensor when not ``track``); a tensor
    ``lr`` goes to the op as ``lr_tensor``."""
    lr_tensor = lr if isinstance(lr, Tensor) else None
    if lr_tensor is not None:
        lr = float("nan")  # (the op reads lr_tensor instead)
    args = (params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        largest = adagrad_step(*args, grad_scale, found_inf, track, lr_tensor)
        return largest if track else None
    return _adagrad_step_impl(*args, grad_scale, found_inf, track, lr_tensor)
