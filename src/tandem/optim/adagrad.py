"""``tandem.optim.Adagrad``: torch.optim.Adagrad's API and state, a fused update, a device-side ``tol``."""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.optim import Optimizer

from tandem._device import to_device
from tandem.ops.adagrad import (
    adagrad_unchecked,
    check_state_device,
    hyperparameters,
    refuse_early,
    step_device,
)

try:  # torch's check of fused=True, with its message (a private helper: absent, nothing is checked)
    from torch.optim.optimizer import _device_dtype_check_for_fused
except ImportError:  # pragma: no cover - other torch versions

    def _device_dtype_check_for_fused(p: Tensor, cuda_unsupported: bool = False) -> None:
        pass


@functools.cache
def _fused_check_options() -> dict[str, bool]:
    """How torch's Adagrad calls that check: with ``cuda_unsupported=True`` where its fused update has no
    CUDA kernel (torch 2.11, whose refusal then lists the devices without 'cuda'), without where it has one
    (2.13). Read off torch's source, which running its step would not leave alone (global step hooks)."""
    try:
        source = inspect.getsource(torch.optim.Adagrad)
    except (OSError, TypeError):  # pragma: no cover - a torch installed without its sources
        return {}
    return {"cuda_unsupported": True} if "cuda_unsupported=True" in source else {}


@functools.cache
def _torch_fused_takes_the_scale() -> bool:
    """Whether the installed torch's fused Adagrad takes GradScaler's scale into its step
    (``_step_supports_amp_scaling``, torch 2.13: the kernel divides by it) or lets GradScaler unscale the
    gradients first, as for torch's default (torch 2.11: times the scale's float32 reciprocal)."""
    try:
        fused = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):  # pragma: no cover - a torch without a fused Adagrad
        return False
    return bool(getattr(fused, "_step_supports_amp_scaling", False))


def torch_fused_takes(device: torch.device) -> bool:
    """Whether ``torch.optim.Adagrad(fused=True)`` updates parameters on ``device`` (the CPU, and CUDA
    where the installed torch has the kernel): the side-by-side benchmarks' baseline."""
    return device.type == "cpu" or (device.type == "cuda" and not _fused_check_options())


__all__ = ["Adagrad"]


def check_hyperparameters(
    lr: float | Tensor, lr_decay: float, weight_decay: float, initial_accumulator_value: float, eps: float
) -> None:
    """torch.optim.Adagrad's checks of its hyper-parameters, with its messages, in its order."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    # 0.0 <= x, as torch writes it: a value that does not compare raises torch's TypeError
    if not 0.0 <= lr:  # noqa: SIM300
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= lr_decay:  # noqa: SIM300
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if not 0.0 <= weight_decay:  # noqa: SIM300
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= initial_accumulator_value:  # noqa: SIM300
        raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    if not 0.0 <= eps:  # noqa: SIM300
        raise ValueError(f"Invalid epsilon value: {eps}")


# What torch.optim.Adagrad's __setstate__ fills in for a group that lacks them (an older checkpoint's)
GROUP_DEFAULTS = {"foreach": None, "maximize": False, "differentiable": False, "fused": None}


def _float32_at_most(value: float) -> float:
    """The largest float32 number <= ``value``: a float32 change compares with it as with ``value`` itself
    (``value`` rounded to float32, 0.1 to 0.10000000149, would take a change of that size for <= 0.1)."""
    with np.errstate(over="ignore"):  # above float32's range: inf, then the largest float32
        rounded = np.float32(value)
    if float(rounded) > value:
        rounded = np.nextafter(rounded, np.float32(-np.inf))
    return float(rounded)


def _checked_tol(tol: Any) -> float | None:
    """``tol`` as a float (a Python, numpy or 1-element tensor real number >= 0), or None."""
    if tol is None:
        return None
    value = None
    if isinstance(tol, Tensor):
        if tol.numel() == 1 and not (tol.is_complex() or tol.dtype == torch.bool):
            value = tol.item()
    elif isinstance(tol, numbers.Real) and not isinstance(tol, (bool, np.bool_)):
        value = float(tol)
    if value is None or not value >= 0.0:  # (NaN too)
        many = isinstance(tol, Tensor) and tol.numel() != 1
        shown = f"a tensor of shape {list(tol.shape)}" if many else repr(tol)
        raise ValueError(f"Invalid tol value: expected None or a real number >= 0, got {shown}")
    return float(value)


class Adagrad(Optimizer):
    r"""Adagrad, a drop-in for :class:`torch.optim.Adagrad` with a fused update and a convergence test.

    Same arguments, defaults, checks, update rule and state (``state["sum"]``, ``state["step"]``) as
    ``torch.optim.Adagrad``: a ``state_dict()`` of either loads into the other, mid-training. Each
    ``step()`` runs one fused update per (device, dtype) group of parameters: a multi-tensor Triton
    kernel on GPU, torch's fused CPU kernel on CPU. ``foreach`` and ``fused`` are accepted (and kept in
    the parameter groups) for compatibility; they do not change which kernel runs.

    Args:
        params: iterable of parameters or of dicts defining parameter groups.
        lr: learning rate (default: 1e-2).
        lr_decay: learning rate decay: step ``t`` uses ``lr / (1 + (t - 1) * lr_decay)`` (default: 0).
        weight_decay: L2 penalty (default: 0).
        initial_accumulator_value: initial value of the sum of squared gradients (default: 0).
        eps: term added to the denominator (default: 1e-10).
        foreach, fused: accepted as in torch (``fused`` with ``differentiable`` or ``foreach`` raises, and
            ``fused=True`` refuses the devices and dtypes torch's does: CUDA tensors too under torch 2.11).
        maximize: maximize the objective instead of minimizing it (default: False).
        differentiable: keep the step on the autograd tape (per-tensor PyTorch path) (default: False).
        tol: when set, every step also computes ``max |p_new - p_old|`` over all parameters, on their
            device and inside the fused pass, and :attr:`converged` becomes a 0-d bool tensor that is
            true when that change is ``<= tol`` (default: None: no tracking). Each change is computed in
            its parameter's dtype and the maximum kept in float32: for float64 parameters the test is as
            exact as float32 (a relative 6e-8; a change below 1e-45 counts as 0), for float16 and
            bfloat16 ones as their subtraction.

    Example::

        model = torch.nn.Linear(4, 1)
        opt = tandem.optim.Adagrad(model.parameters(), lr=0.1, tol=1e-6)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step % 100 == 0 and opt.converged:  # reading it is the only host sync
                break
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        tol: float | None = None,
    ) -> None:
        # torch.optim.Adagrad's checks and messages, in its order (the hyper-parameters, the parameters in
        # Optimizer.__init__, then fused's options), and tol's before them.
        check_hyperparameters(lr, lr_decay, weight_decay, initial_accumulator_value, eps)
        tol = _checked_tol(tol)

        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
        )
        super().__init__(params, defaults)
        if fused:
            if differentiable:
                raise RuntimeError("`fused` does not support `differentiable`")
            if foreach:
                raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
            # as torch: step() checks the first parameter with a gradient once, with torch's error
            self._need_device_dtype_check_for_fused = True
        self.tol = tol
        # Where torch's fused Adagrad says so, GradScaler hands grad_scale/found_inf to step() instead of
        # unscaling the grads itself: the fused update unscales them in its single pass.
        self._step_supports_amp_scaling = _torch_fused_takes_the_scale()
        self._converged: Tensor | None = None
        self._max_change: Tensor | None = None
        if tol is not None:
            # made here and written in place by step(): a compiled step's assignments to the optimizer's
            # attributes are dropped (dynamo), its in-place writes to their tensors are kept
            device = self._first_device()
            # float32 whatever the default dtype (a float16 one would round every change it holds)
            self._max_change = torch.full((), float("inf"), dtype=torch.float32, device=device)
            self._converged = torch.zeros((), dtype=torch.bool, device=device)

        # As torch: the state exists from construction (initial_accumulator_value of the constructor).
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        if len(state) == 0:
            init = self.defaults["initial_accumulator_value"]
            if torch.is_complex(p):
                init = complex(init, init)
            # float32 on the parameter's device, as torch's fused path keeps it: the kernels read it there
            # (a meta parameter's on the CPU: see step_device).
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device(p.device))
            state["sum"] = torch.full_like(p, init, memory_format=torch.preserve_format)
        return state

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only: a copy (copy.deepcopy, pickle, torch.save of
        # the optimizer) would lose tol, and its converged would raise.
        state = super().__getstate__()
        state.update(tol=self.tol, _converged=self._converged, _max_change=self._max_change)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also the end of load_state_dict(): states saved by torch.optim.Adagrad (a CPU step, float64
        # under a float64 default dtype, or a Python number in old checkpoints) move to our convention.
        # A sum of the wrong shape would make the kernels read out of bounds: refuse it before any change.
        per_param = state.get("state", {})
        for group in state.get("param_groups", []):
            for p in group["params"]:
                if per_param.get(p) and "step" not in per_param[p]:  # torch's KeyError, but before any change
                    keys = sorted(per_param[p])
                    raise KeyError(
                        f"Adagrad: expected 'step' in the state of each parameter, got {keys} for one of "
                        f"shape {tuple(p.shape)}"
                    )
                total = per_param.get(p, {}).get("sum")
                if total is not None and (not torch.is_tensor(total) or total.shape != p.shape):
                    got = tuple(total.shape) if torch.is_tensor(total) else type(total).__name__
                    raise ValueError(
                        "Adagrad: expected state['sum'] of the shape of its parameter "
                        f"{tuple(p.shape)}, got {got}"
                    )
        super().__setstate__(state)
        for group in self.param_groups:
            for key, default in GROUP_DEFAULTS.items():
                group.setdefault(key, default)
            for p in group["params"]:
                p_state = self.state.get(p)
                if not p_state or "step" not in p_state:
                    continue
                step, device = p_state["step"], step_device(p.device)
                if not torch.is_tensor(step):
                    p_state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
                elif step.dtype != torch.float32 or step.device != device:
                    p_state["step"] = step.to(dtype=torch.float32, device=device)
        loading = "tol" not in state  # load_state_dict (a copy or unpickling brings tol along)
        self.__dict__.setdefault("tol", None)
        self.__dict__.setdefault("_converged", None)
        self.__dict__.setdefault("_max_change", None)
        if loading and self._max_change is not None and self._converged is not None:
            # what the steps before the load found says nothing of the loaded state: as before any step
            self._max_change.fill_(float("inf"))
            self._converged.fill_(False)
        self.__dict__.setdefault("_step_supports_amp_scaling", _torch_fused_takes_the_scale())

    def share_memory(self) -> None:
        """Call ``share_memory_()`` on the ``sum`` state tensors (as torch.optim.Adagrad)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"].share_memory_()

    @property
    def converged(self) -> Tensor:
        """0-d bool tensor on the parameters' device: the last step's largest change was ``<= tol``.

        False before the first step and after a step that AMP skipped (``found_inf``). Reading its value
        (``bool(opt.converged)``) is the only host synchronisation.
        """
        if self.tol is None:
            raise RuntimeError("Adagrad: converged is only tracked when tol is set, got tol=None")
        if self._converged is None:
            return torch.zeros((), dtype=torch.bool, device=self._first_device())
        return self._converged.clone()  # (the optimizer's own is written in place at each step)

    @property
    def max_change(self) -> Tensor:
        """0-d float32 tensor: the last step's ``max |p_new - p_old|`` (+inf before any step, or if NaN);
        for a complex parameter, over its real and imaginary parts apart (not the modulus)."""
        if self.tol is None:
            raise RuntimeError("Adagrad: max_change is only tracked when tol is set, got tol=None")
        if self._max_change is None:
            return torch.full((), float("inf"), dtype=torch.float32, device=self._first_device())
        return self._max_change.clone()

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        track = self.tol is not None
        # Gather every group first: a bad combination raises before any group has moved.
        work = []
        for group in self.param_groups:
            params, grads, sums, steps = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["fused"] and getattr(self, "_need_device_dtype_check_for_fused", True):
                    # torch's error for a device or dtype its fused update refuses
                    _device_dtype_check_for_fused(p, **_fused_check_options())
                    self._need_device_dtype_check_for_fused = False
                if group["fused"] and not self.state[p]:
                    _device_dtype_check_for_fused(p, **_fused_check_options())  # as torch, at the first step
                state = self._init_state(p)
                params.append(p)
                grads.append(p.grad)
                sums.append(state["sum"])
                steps.append(state["step"])
            if group["foreach"] and group["differentiable"] and not group["fused"]:
                # torch's foreach update refuses autograd, with a gradient or without
                raise AssertionError("_foreach ops don't support autograd")
            if params:
                # torch's order: its fused update's refusal comes before the per-tensor update's
                if group["fused"] and any(g.is_sparse or torch.is_complex(p) for p, g in zip(params, grads)):
                    raise RuntimeError("`fused` does not support sparse grad or complex param")
                if group["weight_decay"] != 0 and any(g.is_sparse for g in grads):
                    raise RuntimeError("weight_decay option is not compatible with sparse gradients")
                if group["fused"] and not isinstance(group["maximize"], bool):
                    # torch's fused op takes a bool alone (its TypeError lists its signatures)
                    raise TypeError(
                        "_fused_adagrad_(): expected maximize as a bool, got "
                        f"{type(group['maximize']).__name__}"
                    )
                if group["fused"] and group["differentiable"]:  # set after construction: torch's error
                    raise RuntimeError("adagrad with fused=True does not support differentiable=True")
                # torch steps with grad mode on where the optimizer was made differentiable (whatever a
                # group says; a group added with differentiable=True to one made without it updates as any)
                grad_mode = self.defaults["differentiable"]
                differentiable = group["differentiable"] and grad_mode
                if grad_mode and any(p.is_leaf and p.requires_grad for p in params):
                    # what torch's update raises at its in-place change of such a parameter in grad mode,
                    # after it has counted the step and added to the sum: here before anything changes
                    raise RuntimeError(
                        "a leaf Variable that requires grad is being used in an in-place operation."
                    )
                lr = group["lr"]  # (a tensor of more elements: hyperparameters' TypeError, as torch's)
                # read as torch's update reads them; what it refuses, with its error, before any group moves
                hyper = hyperparameters(
                    lr, group["lr_decay"], group["weight_decay"], group["eps"], group["maximize"],
                    zip(params, grads, sums, steps), on_tape=differentiable,
                )  # fmt: skip
                work.append((group, hyper, params, grads, sums, steps))

        if len(work) > 1:  # (one group's are tried by the update itself, before it moves anything)
            index = 0  # a parameter's among those with gradients, as one group's update counts them
            for _, (lr, lr_decay, weight_decay, eps, maximize), params, grads, sums, steps in work:
                for p, s, t in zip(params, sums, steps):
                    check_state_device(index, p, s, t)
                    index += 1
                hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize)
                refuse_early(params, grads, sums, steps, hyper)

        maxima: list[Tensor] = []
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            for group, (lr, lr_decay, weight_decay, eps, maximize), params, grads, sums, steps in work:
                largest = adagrad_unchecked(
                    params,
                    grads,
                    sums,
                    steps,
                    lr=lr,
                    lr_decay=lr_decay,
                    weight_decay=weight_decay,
                    eps=eps,
                    maximize=maximize,
                    differentiable=group["differentiable"],
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                    return_max_change=track,
                )
                if largest is not None:
                    maxima.append(largest)

        if track:
            device = self._first_device()
            if maxima:
                largest = torch.stack([to_device(m, device) for m in maxima]).amax()
            else:  # no parameter had a gradient: nothing moved
                largest = torch.zeros((), dtype=torch.float32, device=device)
            converged = largest <= _float32_at_most(self.tol)  # (tol rounded up would take larger changes)
            if found_inf is not None:  # a skipped step says nothing about convergence
                converged = converged & (to_device(found_inf, device) == 0)
            if self._max_change is None or self._converged is None or self._max_change.device != device:
                self._max_change, self._converged = largest, converged  # (an optimizer of older pickles)
            else:
                self._max_change.copy_(largest)
                self._converged.copy_(converged)
        return loss
