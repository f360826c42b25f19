"""``tandem.ops.adagrad``: the Adagrad update of many tensors, fused, with the largest change on request."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor
from torch.nn import Parameter

from tandem._device import to_device
from tandem.ops.adagrad.op import adagrad_step_dispatch
from tandem.ops.adagrad.reference import adagrad_tensor_ref, unscale_like_grad_scaler_

__all__ = [
    "adagrad",
    "adagrad_unchecked",
    "check_state_device",
    "hyperparameters",
    "refuse_early",
    "step_device",
]


def hyperparameters(
    lr: float | Tensor,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    tensors: Iterable[tuple[Tensor, Tensor, Tensor, Tensor]] = (),
    on_tape: bool = False,
) -> tuple[float | Tensor, float, float, float | Tensor, bool]:
    """``lr``, ``lr_decay``, ``weight_decay``, ``eps`` as floats and ``maximize`` as a bool, read as
    torch's per-tensor update reads them: a tensor ``lr`` by its value, a ``Fraction`` or numpy number
    by Python's arithmetic with a float, ``maximize`` by its truth value. What that update refuses raises
    its error here, before any tensor changes (the kernels take floats and a bool only).

    ``tensors`` are the ``(param, grad, state_sum, step)`` the update is for: whether torch's ops take a
    number depends on their dtypes (an ``lr`` of 1e39 overflows a float32 parameter's update, not a
    float64 one's). Without them the numbers are tried as for float64 tensors.

    With a non-zero ``lr_decay``, a tensor or numpy ``lr`` or ``lr_decay`` of another dtype than float64
    is returned as itself (a tensor 0-d): torch's update computes its decayed rate in that dtype, which the
    per-tensor path does too (see :func:`_rounds_clr`; eagerly: a compiled step takes the kernels' floats).

    Under ``torch.compile`` a real tensor ``lr`` stays a tensor, read by the op when it runs: reading it
    here would make the compiled step depend on its value, and recompile at every change an LR scheduler
    makes to it (torch's compiled optimizers take a tensor lr for that reason).

    ``on_tape``: a differentiable step in grad mode, whose ops torch's update keeps on the tape. An ``eps``
    that requires grad is returned as itself (0-d), and an ``lr`` or ``lr_decay`` that does is refused
    (:func:`_refuse_off_the_tape`)."""
    _refuse_off_the_tape(lr, lr_decay, on_tape)
    given = lr
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            # a tensor lr set in param_groups after construction: torch's update refuses it with a
            # TypeError (its addcdiv_ takes a number)
            raise TypeError(
                "Adagrad: expected lr as a number or a 1-element tensor, got a tensor of shape "
                f"{list(lr.shape)}"
            )
        if torch.compiler.is_compiling() and not lr.is_complex():
            # its dtype decides what torch's update makes of it; a number of that kind stands in for it
            kind = bool if lr.dtype == torch.bool else float if lr.is_floating_point() else int
            _, *rest = hyperparameters(kind(1), lr_decay, weight_decay, eps, maximize, tensors, on_tape)
            return (lr, *rest)
        lr = lr.item()  # its value, for the checks and the kernels (a half one with lr_decay: below)
    _refuse_as_torch(dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize),
                     list(tensors), given)  # fmt: skip
    maximize = bool(maximize)
    if isinstance(lr, complex):  # one torch's addcdiv_ took: its imaginary part is 0
        lr = lr.real
    # torch's update adds eps to the root of the sum on the tape: d/d eps is computed
    eps = eps.reshape(()) if on_tape and isinstance(eps, Tensor) and eps.requires_grad else _float(eps)
    if not torch.compiler.is_compiling() and _rounds_clr(given, lr_decay):  # (compiled: the kernels' floats)
        # torch's per-tensor update divides lr by 1 + (step - 1) * lr_decay as they come: a tensor or numpy
        # number of another dtype than float64 rounds its clr to that dtype (float32: ~1e-8 from the float
        # the kernels would compute, float16 a relative 2e-4, bfloat16 4e-3). They stay as they are (a
        # tensor squeezed), which sends the update the per-tensor way
        as_given = given.reshape(()) if isinstance(given, Tensor) else given
        decay = lr_decay.reshape(()) if isinstance(lr_decay, Tensor) else lr_decay
        return as_given, decay, _float(weight_decay), eps, maximize
    return float(lr), _float(lr_decay), _float(weight_decay), eps, maximize


def _refuse_off_the_tape(lr: object, lr_decay: object, on_tape: bool) -> None:
    """torch's update takes ``clr = lr / (1 + (step - 1) * lr_decay)`` as a number: where it is computed
    on the tape (``on_tape``: a differentiable step in grad mode) from an ``lr`` or ``lr_decay`` that
    requires grad, its addcdiv_ refuses the tensor, with a TypeError, after counting the step and adding to
    the sum. Here before anything changes: a gradient with respect to it would otherwise be lost."""
    if not on_tape:
        return
    for key, value in (("lr", lr), ("lr_decay", lr_decay)):
        if isinstance(value, Tensor) and value.requires_grad:
            raise TypeError(
                f"Adagrad: differentiable=True takes {key} as a number or a tensor that does not require "
                "grad, got a tensor that requires grad"
            )


def _float(x: object) -> float:
    """``x`` as a float; a tensor that requires grad without autograd's warning (torch's update takes its
    value, or keeps it on the tape: see :func:`hyperparameters`)."""
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


def _rounds_clr(lr: float | Tensor, lr_decay: float | Tensor) -> bool:
    """Whether torch's ``clr = lr / (1 + (step - 1) * lr_decay)`` is computed in another arithmetic than
    Python's float (see :func:`hyperparameters`): ``lr_decay`` is not 0 and ``lr`` or ``lr_decay`` is a
    tensor or numpy number of another dtype than float64. The per-tensor path computes it as torch does."""
    return _narrow(lr) or _narrow(lr_decay) if bool(lr_decay != 0) else False


def _narrow(x: object) -> bool:
    if isinstance(x, Tensor):
        return x.dtype != torch.float64
    return isinstance(x, np.generic) and x.dtype != np.float64


_TAKEN: set = set()  # the numbers and kinds of tensors _refuse_as_torch saw taken at step 1


def _refuse_as_torch(
    hyper: dict, tensors: list[tuple[Tensor, Tensor, Tensor, Tensor]], lr_as_given: object = None
) -> None:
    """Raise what torch's per-tensor update raises for these numbers, in the order its ops raise it: its
    ops run on one-element stand-ins of each kind of tensor (the dtypes and the gradient's layout decide
    which numbers an op takes), at step 1. At a later step ``clr = lr / (1 + (step - 1) * lr_decay)``
    may be smaller than ``lr``: where step 1 is refused, each tensor is tried in order at its own next
    step, which reads the step counts (from the device), as torch's update does."""
    if tensors and _negative(hyper["lr_decay"]):
        # (set in param_groups: the constructor refuses it) the rate's denominator 1 + (step - 1) * lr_decay
        # may reach 0 at a later step, where torch's division raises (a Python number's; a tensor lr's
        # gives inf): each tensor at its own next step
        if isinstance(lr_as_given, Tensor):
            hyper = {**hyper, "lr": lr_as_given.reshape(())}
        for p, g, s, t in tensors:
            _try_on_stand_ins(_kind(p, g, s), float(t) + 1, hyper)
        return
    kinds = tuple(dict.fromkeys(_kind(p, g, s) for p, g, s, _ in tensors)) or (
        (torch.float64,) * 3 + (False,),
    )
    plain = all(type(v) in (float, int, bool) for v in hyper.values())
    key = (tuple((type(v), v) for v in hyper.values()), kinds) if plain else None
    if key is not None and key in _TAKEN:  # (trying costs ~13 us a group a step; these were taken before)
        return
    try:
        for kind in kinds:
            _try_on_stand_ins(kind, 1.0, hyper)
        if key is not None:
            if len(_TAKEN) >= 64:
                _TAKEN.clear()
            _TAKEN.add(key)
    except Exception:
        if not tensors:
            raise
        for p, g, s, t in tensors:
            _try_on_stand_ins(_kind(p, g, s), float(t) + 1, hyper)


def _negative(x: object) -> bool:
    try:
        return bool(x < 0)  # type: ignore[operator]
    except (TypeError, RuntimeError):  # a complex number, a tensor of several elements: refused elsewhere
        return False


def _kind(p: Tensor, g: Tensor, s: Tensor) -> tuple[torch.dtype, torch.dtype, torch.dtype, bool]:
    return p.dtype, g.dtype, s.dtype, g.is_sparse


def _try_on_stand_ins(
    kind: tuple[torch.dtype, torch.dtype, torch.dtype, bool], step: float, hyper: dict
) -> None:
    p_dtype, g_dtype, s_dtype, sparse = kind
    p, s = torch.zeros(1, dtype=p_dtype), torch.zeros(1, dtype=s_dtype)
    if sparse:
        g = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=g_dtype), (1,))
    else:
        g = torch.zeros(1, dtype=g_dtype)
    with torch.no_grad():
        adagrad_tensor_ref(p, g, s, step, **hyper)


def step_device(device: torch.device) -> torch.device:
    """Where the step count of a parameter on ``device`` lives: on that device (the kernels read it
    there), except for meta tensors, which hold no values: their count lives on the CPU, as
    torch.optim.Adagrad keeps every count without ``fused``."""
    return torch.device("cpu") if device.type == "meta" else device


def adagrad(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    differentiable: bool = False,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    return_max_change: bool = False,
) -> Tensor | None:
    """One Adagrad step of ``params`` in place, as ``torch.optim.adagrad.adagrad`` (the functional API).

    ``params[i]`` (any shape, real or complex) is updated with ``grads[i]`` (dense or sparse COO, same
    shape) and its accumulator ``state_sums[i]`` (same shape and dtype); ``state_steps[i]`` is its step
    count, a 0-d float32 tensor on the parameter's device (the CPU for a meta one, see
    :func:`step_device`), incremented here. Dense tensors are grouped by
    device and dtype and each group is one ``tandem::adagrad_step`` (one Triton launch on GPU, torch's
    fused kernel on CPU); sparse gradients, tensor subclasses and ``differentiable=True`` take the
    per-tensor PyTorch path.

    ``grad_scale``/``found_inf`` are AMP's, as in torch's fused optimizers: gradients are unscaled in
    place, and a step with ``found_inf == 1`` changes nothing (step counts included).

    Returns, when ``return_max_change``, ``max |p_new - p_old|`` over all parameters as a 0-d float32
    tensor on ``params[0]``'s device (+inf if a change is NaN), else None. Dense gradients never make the
    host wait for the device; the per-tensor path reads step counts (and ``found_inf``) as torch's does.

    Example::

        p = torch.zeros(3)
        s, t = torch.zeros(3), torch.zeros(())
        adagrad([p], [torch.ones(3)], [s], [t], lr=0.1, return_max_change=True)  # tensor(0.1000)
    """
    n = len(params)
    if not len(grads) == len(state_sums) == len(state_steps) == n:
        raise ValueError(
            "adagrad: expected as many grads, state_sums and state_steps as params "
            f"({n}), got {len(grads)}, {len(state_sums)} and {len(state_steps)}"
        )
    for i, (p, g, s, t) in enumerate(zip(params, grads, state_sums, state_steps)):
        _check(i, p, g, s, t)
    lr, lr_decay, weight_decay, eps, maximize = hyperparameters(
        lr, lr_decay, weight_decay, eps, maximize, zip(params, grads, state_sums, state_steps),
        on_tape=differentiable and torch.is_grad_enabled(),
    )  # fmt: skip
    return adagrad_unchecked(
        params,
        grads,
        state_sums,
        state_steps,
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        differentiable=differentiable,
        grad_scale=grad_scale,
        found_inf=found_inf,
        return_max_change=return_max_change,
    )


def adagrad_unchecked(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    differentiable: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    return_max_change: bool,
) -> Tensor | None:
    """:func:`adagrad` without the per-tensor argument checks, for callers whose state is known good, and
    with the hyper-parameters as :func:`hyperparameters` gives them (floats and a bool, ``lr`` a tensor under
    ``torch.compile``: the callers read them once, before any group moves).

    ``tandem.optim.Adagrad`` creates (or validates on load) every state tensor, and torch checks every
    ``.grad`` against its parameter; the checks cost ~0.35 us per tensor per step otherwise.
    """
    if weight_decay != 0 and any(g.is_sparse for g in grads):
        raise RuntimeError("weight_decay option is not compatible with sparse gradients")

    # Group before touching anything. Tensor subclasses (DTensor, ...) take the per-tensor PyTorch path:
    # the kernels address plain storage. So does a gradient of another dtype, device or shape than its
    # parameter's (set through ``.data``): torch's per-tensor ops promote or broadcast it, or refuse it;
    # and a state of another dtype (the model converted, ``model.double()``, after the optimizer was made:
    # torch trains on, the kernels would read the state as the parameter's dtype). So does a step count
    # set by hand (``opt.state[p]``) not in float32, which the kernels would misread: an int64 or float64
    # one, in which torch counts on; and a sum of another size. (A sum of the parameter's size in another
    # shape, which torch's ops refuse, is updated element by element as if of the parameter's: its shape
    # is not checked here, where that costs 0.2 us a parameter a step, its size 0.05.)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], ...]] = {}
    plain: list[int] = []
    all_plain = differentiable or (_rounds_clr(lr, lr_decay) and not torch.compiler.is_compiling())
    for i, (p, g, s, t) in enumerate(zip(params, grads, state_sums, state_steps)):
        check_state_device(i, p, s, t)
        if (
            all_plain
            or g.is_sparse
            or not (type(p) is Parameter or type(p) is Tensor)
            or g.dtype != p.dtype
            or g.device != p.device
            or g.shape != p.shape
            or s.dtype != p.dtype
            or s.numel() != p.numel()
            or t.dtype is not torch.float32
        ):
            plain.append(i)
            continue
        if p.is_complex():
            p, g, s = torch.view_as_real(p), torch.view_as_real(g), torch.view_as_real(s)
        key = (p.device, p.dtype)
        lists = groups.get(key)
        if lists is None:
            lists = groups[key] = ([], [], [], [])
        lists[0].append(p)
        lists[1].append(g)
        lists[2].append(s)
        lists[3].append(t)

    hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize)
    if plain and (groups or len(plain) > 1):  # what the per-tensor path refuses, before anything moves
        refuse_early([params[i] for i in plain], [grads[i] for i in plain], [state_sums[i] for i in plain],
                      [state_steps[i] for i in plain], hyper)  # fmt: skip

    maxima: list[Tensor] = []
    for (device, _), (ps, gs, ss, ts) in groups.items():
        largest = adagrad_step_dispatch(
            ps, gs, ss, ts, lr, lr_decay, weight_decay, eps, maximize,
            _on(grad_scale, device), _on(found_inf, device), return_max_change,
        )  # fmt: skip
        if largest is not None:
            maxima.append(largest)

    if plain:
        maxima += _plain_step(
            [params[i] for i in plain],
            [grads[i] for i in plain],
            [state_sums[i] for i in plain],
            [state_steps[i] for i in plain],
            hyper,
            differentiable=differentiable,
            grad_scale=grad_scale,
            found_inf=found_inf,
            track=return_max_change,
        )

    if not return_max_change:
        return None
    device = params[0].device if params else torch.device("cpu")
    if not maxima:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(maxima) == 1:
        largest = to_device(maxima[0], device).float()
    else:
        largest = torch.stack([to_device(m, device).float() for m in maxima]).amax()
    return torch.nan_to_num(largest, nan=float("inf"), posinf=float("inf"))


def _on(x: Tensor | None, device: torch.device) -> Tensor | None:
    """AMP's scalars on ``device`` (a no-op when already there; torch's fused path copies them likewise)."""
    return None if x is None else to_device(x, device)


def _check(i: int, p: Tensor, g: Tensor, s: Tensor, t: Tensor) -> None:
    for name, x in (("grads", g), ("state_sums", s)):
        if x.shape != p.shape or x.dtype != p.dtype or x.device != p.device:
            raise ValueError(
                f"adagrad: expected {name}[{i}] to match params[{i}] (shape {tuple(p.shape)}, {p.dtype}, "
                f"{p.device}), got shape {tuple(x.shape)}, {x.dtype}, {x.device}"
            )
    if s.is_sparse:
        raise ValueError(f"adagrad: expected state_sums[{i}] to be dense, got a sparse tensor")
    if t.dtype != torch.float32 or t.device != step_device(p.device) or t.dim() != 0:
        raise ValueError(
            f"adagrad: expected state_steps[{i}] to be a 0-d float32 tensor on {step_device(p.device)}, "
            f"got {t.dim()}-d {t.dtype} on {t.device}"
        )


def check_state_device(i: int, p: Tensor, s: Tensor, t: Tensor) -> None:
    """Refuse parameter ``i`` whose state (sum ``s``, step ``t``) is on another device: the model moved
    (``model.cuda()``) after the optimizer was made. torch's ops refuse it after changing the parameters
    before it; here nothing has changed yet. A step count that is no tensor (set by hand) is refused with
    torch's error."""
    if not isinstance(t, Tensor):
        raise RuntimeError("API has changed, `state_steps` argument must contain a list of singleton tensors")
    if s.device != p.device or t.device != step_device(p.device):
        raise RuntimeError(
            f"Adagrad: the state of parameter {i} is on {s.device} (its step count on {t.device}), the "
            f"parameter on {p.device}: was the model moved after the optimizer was made? Make the "
            "optimizer after moving the model"
        )


def refuse_early(
    params: list[Tensor], grads: list[Tensor], sums: list[Tensor], steps: list[Tensor], hyper: dict
) -> None:
    """Raise what the per-tensor path would raise part-way through a step, before any parameter moves: a
    gradient of another shape or dtype than its parameter's (set through ``.data``) that torch's ops refuse
    (they broadcast or promote others), tried on stand-ins of the same layouts (torch's words: the meta
    device words them otherwise)."""
    for p, g, s, t in zip(params, grads, sums, steps):
        if not g.is_sparse and (g.shape != p.shape or g.dtype != p.dtype or s.shape != p.shape):
            stand_ins = [torch.zeros_like(x, memory_format=torch.preserve_format) for x in (p, g, s)]
            hyper = _number_lr(hyper)
            with torch.no_grad():
                adagrad_tensor_ref(*stand_ins, float(t) + 1, **hyper)


def _number_lr(hyper: dict) -> dict:
    """``hyper`` with ``lr`` a number, as the per-tensor path's ops take it: a compiled step hands a tensor
    ``lr`` on (see :func:`hyperparameters`), read here. A float16 or bfloat16 one with ``lr_decay`` stays
    a tensor, as in torch's per-tensor update, whose ``clr`` is rounded to its dtype."""
    lr = hyper["lr"]
    if not isinstance(lr, Tensor) or _rounds_clr(lr, hyper["lr_decay"]):
        return hyper
    return {**hyper, "lr": float(lr.item())}


def _plain_step(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    state_steps: list[Tensor],
    hyper: dict,
    *,
    differentiable: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    track: bool,
) -> list[Tensor]:
    """Per-tensor PyTorch path (sparse gradients, differentiable steps) with the fused path's AMP rules."""
    hyper = _number_lr(hyper)
    # Reading found_inf syncs with the device; this path is the rare one (torch's fused kernels refuse it).
    if found_inf is not None and found_inf.item() == 1.0:
        return [torch.zeros((), dtype=torch.float32, device=params[0].device)] if track else []
    maxima = []
    for p, g, s, t in zip(params, grads, state_sums, state_steps):
        if grad_scale is not None:  # as GradScaler unscales them for torch's per-tensor update
            unscale_like_grad_scaler_([g._values() if g.is_sparse else g], grad_scale)
        t += 1
        m = adagrad_tensor_ref(p, g, s, t.item(), **hyper, differentiable=differentiable, track=track)
        if m is not None:
            maxima.append(m.detach())
    return maxima
