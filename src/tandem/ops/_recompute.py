"""Second derivatives of the recurrent ops: the layer recomputed with autograd-tracked PyTorch ops.

The backward kernels (``tandem::gru_bwd``, ``tandem::lstm_bwd``) are not differentiable themselves. When a
backward runs with ``create_graph=True`` (a gradient penalty, a Hessian-vector product) and something it
differentiates requires grad, the ops' autograd formulas instead recompute the layer step by step with
plain differentiable PyTorch ops and differentiate that: slower, with the same values up to rounding,
and differentiable again, as torch.nn.GRU and torch.nn.LSTM are on the CPU (cuDNN's are not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad

from tandem.ops._packed import PackedSteps

__all__ = ["packed_layer", "wants_graph", "grads_through"]


def packed_layer(
    x: Tensor,
    batch_sizes: Tensor | list[int],
    init: tuple[Tensor, ...],
    project: Callable[[int, Tensor], Tensor],
    cell: Callable[[int, Tensor, tuple[Tensor, ...]], tuple[Tensor, ...]],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """One recurrent layer over packed rows (the layout of :mod:`tandem.ops._packed`), every op tracked
    by autograd.

    ``init`` holds the initial states, each ``[D, B, ...]``; ``project(d, rows)`` maps direction ``d``'s
    input rows ``[P, I]`` (in its step order) to what its cell reads; ``cell(d, rows, states)`` maps one
    step's ``[n, ...]`` rows and states to the new states, whose first is the step's output. Returns
    ``(y [P, D * R], finals)``: the outputs time-packed, the reverse direction's aligned with the input
    frames, and each state after each sequence's last step, ``[D, B, ...]``. Also serves an empty batch
    (``B = 0``), which the ops' kernels do not take.
    """
    directions, batch = init[0].shape[:2]
    if batch == 0:
        # an empty batch (torch.nn.GRU/LSTM take one): one step over no rows keeps every weight in the
        # graph, so each gets a zero gradient as it does in torch
        finals = [cell(d, project(d, x), tuple(s[d] for s in init)) for d in range(directions)]
        return torch.cat([f[0] for f in finals], 1), tuple(torch.stack(parts) for parts in zip(*finals))
    steps = PackedSteps.build(batch_sizes, x.shape[0], batch, directions, x.device)
    sizes = steps.sizes
    outputs, finals = [], []
    for d in range(directions):
        rows = project(d, x if d == 0 else x.index_select(0, steps.rev_rows))
        states = tuple(s[d] for s in init)
        outs, done = [], []
        for s, rows_s in enumerate(rows.split(sizes)):
            n, n_next = sizes[s], sizes[s + 1] if s + 1 < len(sizes) else 0
            states = cell(d, rows_s, tuple(t[:n] for t in states))
            outs.append(states[0])
            if n_next < n:  # sequences n_next..n-1 end at this step
                done.append(tuple(t[n_next:] for t in states))
        out = torch.cat(outs)
        outputs.append(out if d == 0 else out.index_select(0, steps.rev_rows))
        finals.append(tuple(torch.cat(parts) for parts in zip(*reversed(done))))
    return torch.cat(outputs, 1), tuple(torch.stack(parts) for parts in zip(*finals))


def transformed() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, jacrev, jacfwd, vmap) is running, in eager mode and
    under torch.compile (which traces this query; the interpreter stack it cannot: compiled, tandem's
    hand-written backward once ran under torch.func.grad and its gradient came out zero)."""
    return torch._C._are_functorch_transforms_active()


def needs_autograd_ops(*tensors: Tensor | None) -> bool:
    """Whether a hand-written backward (an ``autograd.Function`` without ``jvp``/``vmap``) cannot serve:
    forward-mode AD (a tangent on any of ``tensors``) or a torch.func transform. Then an op computes with
    autograd-tracked PyTorch ops instead, which every AD mode differentiates."""
    if transformed():
        return True
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def mutation_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is on: there autograd keeps what an
    op saved as it was when a tensor changes in place, and raises no error (so no version check of ours)."""
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


def versions_unchanged(
    tensors: Sequence[Tensor], names: Sequence[str], versions: Sequence[int], hint: str, grad: Tensor
) -> None:
    """A tensor hook for an op that saved copies of ``tensors``: autograd's in-place error, naming the
    tensor (``names``, "GRU's weight_hh_l0"), if one has changed since its ``versions`` were taken, where
    autograd would raise it had the op saved the tensors themselves; ``hint`` ends the message."""
    for t, name, then in zip(tensors, names, versions):
        if t._version != then:
            raise RuntimeError(  # autograd's words
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: {name} [{t.type()} {list(t.shape)}] is at version {t._version}; expected "
                f"version {then} instead (changed after the forward that used it{hint})"
            )


def wants_graph(*tensors: Tensor | None) -> bool:
    """Whether the running backward builds a graph for a further derivative: ``create_graph=True`` (the
    autograd engine runs backward formulas with grad mode on exactly then) and one of ``tensors`` (the
    inputs and incoming gradients of the formula) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def grads_through(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None],
    inputs: Sequence[Tensor | None],
    needed: Sequence[bool],
) -> list[Tensor | None]:
    """The gradients of ``outputs`` (weighted by ``grad_outputs``; None: that output was not used) with
    respect to the ``inputs`` that are ``needed``, as differentiable tensors; None for the others."""
    used = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
    wrt = [t for t, need in zip(inputs, needed) if need and t is not None]
    got = iter(
        torch.autograd.grad(
            [o for o, _ in used], wrt, [g for _, g in used], create_graph=True, allow_unused=True
        )
        if wrt
        else ()
    )
    return [next(got) if need and t is not None else None for t, need in zip(inputs, needed)]
