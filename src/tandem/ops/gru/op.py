"""Registration of ``tandem::gru_fwd`` / ``tandem::gru_bwd`` with the dispatcher.

The forward returns the saved activations as extra outputs (custom ops see only their inputs and
outputs in ``setup_context``); they are marked non-differentiable, and unused outputs get ``None``
gradients instead of materialised zeros.

Kernels: one implementation for every device, with autocast off (:func:`tandem._backend.as_given`): the
time loops run in Triton (:mod:`tandem.ops.gru.triton`) for CUDA tensors, and for CPU tensors when
``TANDEM_FORCE_TRITON=1`` (how CI runs them under Triton's interpreter); otherwise in plain PyTorch
(:mod:`tandem.ops.gru.reference`). No kernel is registered for "cuda" apart: the dispatcher would call it
without that body, so under autocast the products outside the loops ran in autocast's dtype.
"""

# No ``from __future__ import annotations`` here: torch 2.4's custom_op reads the annotations at
# registration time and does not resolve string annotations.

import torch
from torch import Tensor

from tandem._backend import as_given, use_triton
from tandem.ops._flops import gru_bwd_flops, gru_fwd_flops
from tandem.ops._flops import register as register_flop_formula
from tandem.ops._recompute import grads_through, wants_graph
from tandem.ops.gru.reference import gru_bwd_ref, gru_fwd_ref, gru_layer_autograd

__all__ = ["gru_fwd", "gru_bwd"]


@torch.library.custom_op("tandem::gru_fwd", mutates_args=())
def gru_fwd(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, h_n, gates, hn, states)`` of one GRU layer; see :func:`gru_fwd_ref` for the shapes."""
    kernel = _triton_fwd if use_triton(x) else gru_fwd_ref
    with as_given(x):
        return kernel(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh)


@gru_fwd.register_fake
def _gru_fwd_fake(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh):
    d_, batch, hid = h0.shape
    total = x.shape[0]
    states = x.new_empty(d_, total, hid) if d_ == 2 else x.new_empty(0)
    return (
        x.new_empty(total, d_ * hid),
        h0.new_empty(d_, batch, hid),
        x.new_empty(d_, total, 3 * hid),
        x.new_empty(d_, total, hid),
        states,
    )


@torch.library.custom_op("tandem::gru_bwd", mutates_args=())
def gru_bwd(
    dy: Tensor | None,
    dh_n: Tensor | None,
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    y: Tensor,
    gates: Tensor,
    hn: Tensor,
    states: Tensor,
    has_bias: bool,
    need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dh0, dw_ih, dw_hh, db_ih, db_hh)``; empty bias gradients without bias, empty dx unless
    ``need_dx``."""
    kernel = _triton_bwd if use_triton(x) else gru_bwd_ref
    with as_given(x):
        return kernel(dy, dh_n, x, batch_sizes, h0, w_ih, w_hh, y, gates, hn, states, has_bias, need_dx)


@gru_bwd.register_fake
def _gru_bwd_fake(dy, dh_n, x, batch_sizes, h0, w_ih, w_hh, y, gates, hn, states, has_bias, need_dx):
    d_ = h0.shape[0]
    bias = (
        (w_ih.new_empty(d_, w_ih.shape[1]), w_ih.new_empty(d_, w_ih.shape[1]))
        if has_bias
        else (
            w_ih.new_empty(0),
            w_ih.new_empty(0),
        )
    )
    return (
        x.new_empty(x.shape) if need_dx else x.new_empty(0),
        h0.new_empty(h0.shape),
        w_ih.new_empty(w_ih.shape),
        w_hh.new_empty(w_hh.shape),
        *bias,
    )


def _setup_context(ctx, inputs, output):
    x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh = inputs
    y, _, gates, hn, states = output
    ctx.mark_non_differentiable(gates, hn, states)
    ctx.set_materialize_grads(False)
    ctx.has_bias = b_ih is not None
    # y only where it holds the states (one direction; tandem.ops.gru.gru hands the caller a copy), so
    # that the caller may change its output in place before backward, as torch.nn.GRU's callers may
    saved_y = y if h0.shape[0] == 1 else None
    ctx.save_for_backward(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh, saved_y, gates, hn, states)


def _backward(ctx, dy, dh_n, *_):
    x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh, y, gates, hn, states = ctx.saved_tensors
    if dy is None and dh_n is None:
        return (None,) * 7
    y = states if y is None else y  # two directions: y is not read
    inputs = (x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh)
    if wants_graph(dy, dh_n, *inputs):
        # create_graph=True: a derivative of these gradients may follow (see tandem.ops._recompute)
        with torch.enable_grad():
            outputs = gru_layer_autograd(*inputs)
        return tuple(grads_through(outputs, (dy, dh_n), inputs, ctx.needs_input_grad))
    need_dx = ctx.needs_input_grad[0]
    dx, dh0, dw_ih, dw_hh, db_ih, db_hh = gru_bwd(
        dy, dh_n, x, batch_sizes, h0, w_ih, w_hh, y, gates, hn, states, ctx.has_bias, need_dx
    )
    if not need_dx:
        dx = None
    if not ctx.has_bias:
        db_ih = db_hh = None
    return dx, None, dh0, dw_ih, dw_hh, db_ih, db_hh


gru_fwd.register_autograd(_backward, setup_context=_setup_context)


# The Triton module is imported on first use: importing triton costs ~1 s, and Triton is optional.
def _triton_fwd(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh):
    from tandem.ops.gru.triton import gru_fwd_triton

    return gru_fwd_triton(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh)


def _triton_bwd(dy, dh_n, x, batch_sizes, h0, w_ih, w_hh, y, gates, hn, states, has_bias, need_dx):
    from tandem.ops.gru.triton import gru_bwd_triton

    return gru_bwd_triton(dy, dh_n, x, batch_sizes, h0, w_ih, w_hh, y, gates, hn, states, has_bias, need_dx)


register_flop_formula(torch.ops.tandem.gru_fwd, gru_fwd_flops)
register_flop_formula(torch.ops.tandem.gru_bwd, gru_bwd_flops)
