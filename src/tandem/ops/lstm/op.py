"""Registration of ``tandem::lstm_fwd`` / ``tandem::lstm_bwd`` with the dispatcher.

The forward returns the saved activations as extra outputs (custom ops see only their inputs and
outputs in ``setup_context``); they are marked non-differentiable, and unused outputs get ``None``
gradients instead of materialised zeros.

Kernels: one implementation for every device, which runs the Triton launchers of
:mod:`tandem.ops.lstm.triton` where :func:`tandem._backend.use_triton` says so (CUDA tensors when Triton
imports; CPU tensors with ``TANDEM_FORCE_TRITON=1``, how CI runs them under Triton's interpreter), else
the reference, with autocast off (:func:`tandem._backend.as_given`). No kernel is registered for "cuda"
apart: the dispatcher would call it without that body, under autocast (in a backward run inside
``torch.autocast`` the parameter products ran in bfloat16 beside float16 operands and failed). Triton is
imported only when a launcher runs: it is an optional extra.
"""

# No ``from __future__ import annotations`` here: torch 2.4's custom_op reads the annotations at
# registration time and does not resolve string annotations.

import torch
from torch import Tensor

from tandem._backend import as_given, use_triton
from tandem.ops._flops import lstm_bwd_flops, lstm_fwd_flops
from tandem.ops._flops import register as register_flop_formula
from tandem.ops._recompute import grads_through, wants_graph
from tandem.ops.lstm.reference import lstm_bwd_ref, lstm_fwd_ref, lstm_layer_autograd

__all__ = ["lstm_fwd", "lstm_bwd"]


@torch.library.custom_op("tandem::lstm_fwd", mutates_args=())
def lstm_fwd(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    need_saved: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, h_n, c_n, gates, cells, hr, states)`` of one LSTM layer; see :func:`lstm_fwd_ref`.
    The last four (what the backward needs) are empty unless ``need_saved``."""
    kernel = lstm_fwd_ref
    if use_triton(x):
        from tandem.ops.lstm.triton import lstm_fwd_triton as kernel
    with as_given(x):
        return kernel(x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, need_saved)


@lstm_fwd.register_fake
def _lstm_fwd_fake(x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, need_saved):
    d_, batch, hid = c0.shape
    out_size = h0.shape[2]
    total = x.shape[0]
    outputs = (
        x.new_empty(total, d_ * out_size),
        h0.new_empty(d_, batch, out_size),
        c0.new_empty(d_, batch, hid),
    )
    if not need_saved:
        return (*outputs, *(x.new_empty(0) for _ in range(4)))
    return (
        *outputs,
        x.new_empty(d_, total, 4 * hid),
        x.new_empty(d_, total, hid),
        x.new_empty(d_, total, hid) if w_hr is not None else x.new_empty(0),
        x.new_empty(d_, total, out_size) if d_ == 2 else x.new_empty(0),
    )


@torch.library.custom_op("tandem::lstm_bwd", mutates_args=())
def lstm_bwd(
    dy: Tensor | None,
    dh_n: Tensor | None,
    dc_n: Tensor | None,
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    w_hr: Tensor | None,
    y: Tensor,
    gates: Tensor,
    cells: Tensor,
    hr: Tensor,
    states: Tensor,
    has_bias: bool,
    need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr)``; empty bias gradients without bias, empty
    ``dw_hr`` without projection, empty dx unless ``need_dx``."""
    kernel = lstm_bwd_ref
    if use_triton(x):
        from tandem.ops.lstm.triton import lstm_bwd_triton as kernel
    with as_given(x):
        return kernel(
            dy,
            dh_n,
            dc_n,
            x,
            batch_sizes,
            h0,
            c0,
            w_ih,
            w_hh,
            w_hr,
            y,
            gates,
            cells,
            hr,
            states,
            has_bias,
            need_dx,
        )


@lstm_bwd.register_fake
def _lstm_bwd_fake(
    dy,
    dh_n,
    dc_n,
    x,
    batch_sizes,
    h0,
    c0,
    w_ih,
    w_hh,
    w_hr,
    y,
    gates,
    cells,
    hr,
    states,
    has_bias,
    need_dx,
):
    d_, rows = w_ih.shape[:2]
    return (
        x.new_empty(x.shape) if need_dx else x.new_empty(0),
        h0.new_empty(h0.shape),
        c0.new_empty(c0.shape),
        w_ih.new_empty(w_ih.shape),
        w_hh.new_empty(w_hh.shape),
        w_ih.new_empty(d_, rows) if has_bias else w_ih.new_empty(0),
        w_ih.new_empty(d_, rows) if has_bias else w_ih.new_empty(0),
        w_hr.new_empty(w_hr.shape) if w_hr is not None else w_ih.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, need_saved = inputs
    y, _, _, gates, cells, hr, states = output
    ctx.need_saved = need_saved
    ctx.mark_non_differentiable(gates, cells, hr, states)
    ctx.set_materialize_grads(False)
    ctx.has_bias = b_ih is not None
    # y only where it holds the states (one direction; tandem.ops.lstm.lstm hands the caller a copy), so
    # that the caller may change its output in place before backward, as torch.nn.LSTM's callers may
    saved_y = y if h0.shape[0] == 1 else None
    saved = (x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, saved_y, gates, cells, hr, states)
    ctx.save_for_backward(*saved)


def _backward(ctx, dy, dh_n, dc_n, *_):
    x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, y, gates, cells, hr, states = ctx.saved_tensors
    if dy is None and dh_n is None and dc_n is None:
        return (None,) * 10
    y = states if y is None else y  # two directions: y is not read
    if not ctx.need_saved:
        raise RuntimeError("tandem::lstm_fwd: a gradient was asked for but the op ran with need_saved=False")
    inputs = (x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)
    if wants_graph(dy, dh_n, dc_n, *inputs):
        # create_graph=True: a derivative of these gradients may follow (see tandem.ops._recompute)
        with torch.enable_grad():
            outputs = lstm_layer_autograd(*inputs)
        return (*grads_through(outputs, (dy, dh_n, dc_n), inputs, ctx.needs_input_grad[:9]), None)
    need_dx = ctx.needs_input_grad[0]
    dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr = lstm_bwd(
        dy,
        dh_n,
        dc_n,
        x,
        batch_sizes,
        h0,
        c0,
        w_ih,
        w_hh,
        w_hr,
        y,
        gates,
        cells,
        hr,
        states,
        ctx.has_bias,
        need_dx,
    )
    if not need_dx:
        dx = None
    if not ctx.has_bias:
        db_ih = db_hh = None
    if w_hr is None or (dy is None and dh_n is None and batch_sizes.numel() == 1):
        # in one step the projection makes y and h_n alone: where neither has a gradient torch's W_hr has
        # none (None, not zeros: an optimizer skips it)
        dw_hr = None
    return dx, None, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr, None


lstm_fwd.register_autograd(_backward, setup_context=_setup_context)


register_flop_formula(torch.ops.tandem.lstm_fwd, lstm_fwd_flops)
register_flop_formula(torch.ops.tandem.lstm_bwd, lstm_bwd_flops)
