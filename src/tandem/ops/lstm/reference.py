"""LSTM in plain PyTorch: the CPU kernel of ``tandem::lstm_fwd`` / ``tandem::lstm_bwd`` and the oracle
the GPU kernels are to be tested against.

One call runs one layer, both directions at once, over a batch in the packed layout of
:mod:`tandem.ops._packed` (rows of ``PackedSequence.data``; the reverse direction starts at each
sequence's own last frame), with torch.nn.LSTM's gate math and gate order (i, f, g, o)::

    i, f, o = sigmoid(.), g = tanh(.)      of  W_ih x + b_ih + W_hh h_prev + b_hh
    c = f * c_prev + i * g
    h = o * tanh(c)                        (times W_hr^T when there is a projection, proj_size = R)

torch's tanh costs several sigmoids on the CPU, so the backward never calls it:

- the factor 2 is folded into the g rows of both weights and the bias, so that all four gates take one
  in-place sigmoid per step: the saved ``gates`` hold (i, f, sigmoid(2a_g), o), whose derivatives the
  backward takes (g = 2 sigmoid(2a_g) - 1 there); the forward computes g = tanh(a_g) itself, from 2a_g
  halved (2 sigmoid(2a) - 1 keeps only an absolute error of one unit of 0.5's last place: a small g,
  and the outputs it makes, lost most of their digits);
- the cell state is kept doubled, C = 2c: the backward's tanh(c) = 2 sigmoid(C) - 1 needs no scaling op,
  the forward's is tanh(C / 2).

Saved for the backward, step-packed and direction-major (``[D, P, ...]``): the gate activations, C, the
unprojected ``o * tanh(c)`` when there is a projection, and the output states of the reverse direction.
The backward re-derives tanh(c) from C for all steps at once (three vectorised ops) instead of keeping
another ``[D, P, H]`` buffer alive between forward and backward; nothing of the recurrence is re-run.
Per step, each direction costs one batched matmul with W_hh plus a few in-place elementwise ops; the
weight, bias and input gradients are large batched matmuls after the loop.

The work before and after the time loops (:func:`fwd_prologue`, :func:`fwd_epilogue`,
:func:`dy_by_direction`, :func:`param_grads`) is shared with the Triton kernels of
:mod:`tandem.ops.lstm.triton`, which replace only the loops: both fill the same saved buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.ops._packed import PackedSteps
from tandem.ops._recompute import packed_layer
from tandem.ops._workspace import scratch

__all__ = ["lstm_fwd_ref", "lstm_bwd_ref", "lstm_layer_autograd"]


def _gate_scale(hid: int, like: Tensor) -> Tensor:
    """``[4H, 1]``: 2 on the g rows (see the module docstring), 1 elsewhere."""
    return like.new_tensor([1.0, 1.0, 2.0, 1.0]).repeat_interleave(hid).unsqueeze(1)


def _by_direction(x: Tensor, steps: PackedSteps, directions: int, out: Tensor | None = None) -> Tensor:
    """``[D, P, I]``: the input rows in each direction's step-packed order (written to ``out`` if given)."""
    if directions == 1:
        return x.unsqueeze(0)
    xs = out if out is not None else x.new_empty(2, *x.shape)
    xs[0].copy_(x)
    torch.index_select(x, 0, steps.rev_rows, out=xs[1])
    return xs


def _last(t: Tensor, steps: PackedSteps, batch: int) -> Tensor:
    """``[D, B, ...]``: each sequence's row of its last step in a step-packed ``[D, P, ...]`` buffer."""
    return t[:, t.shape[1] - batch :].clone() if steps.uniform else t.index_select(1, steps.last_rows)


class FwdBuffers(NamedTuple):
    """What :func:`fwd_prologue` hands to the time loop of either kernel (CPU or Triton)."""

    steps: PackedSteps
    scale: Tensor  # [4H, 1]: 2 on the g rows
    y: Tensor  # [P, D*R], time-packed
    gates: Tensor  # [D, P, 4H]: the (scaled) input projection with both biases; the loop overwrites it
    cells: Tensor  # [D, P, H]: C = 2c
    hr: Tensor  # [D, P, H]: o * tanh(c) with a projection; ``states`` itself without
    states: Tensor  # [D, P, R]: every step's output, step-packed; with one direction a view of ``y``


def fwd_prologue(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    need_saved: bool,
    reuse: bool = True,
) -> FwdBuffers:
    """Everything before the forward time loop: the step index arithmetic, the output and saved buffers,
    and the input projection of every step and both directions written into ``gates``.

    ``reuse`` takes the temporaries from the per-thread workspace (:mod:`tandem.ops._workspace`), which
    the CPU kernel wants; without it every buffer is a fresh allocation.
    """
    d_, batch, hid = c0.shape
    out_size = h0.shape[2]
    total = x.shape[0]
    steps = PackedSteps.build(batch_sizes, total, batch, d_, x.device, op="lstm")
    scale = _gate_scale(hid, x)

    y = x.new_empty(total, d_ * out_size)  # y: [P, D*R], time-packed
    shapes = [(d_, total, 4 * hid), (d_, total, hid)]  # gates, 2c
    shapes += [(d_, total, hid)] * (w_hr is not None) + [(d_, total, out_size)] * (d_ == 2)  # hr, states
    if reuse:
        # Scratch: the reversed input rows, and when nothing is saved for a backward, every activation.
        temps = scratch(x, *[(2, total, x.shape[1])] * (d_ == 2), *(shapes if not need_saved else ()))
        xs_buf = [temps.pop(0)] if d_ == 2 else []
        if need_saved:
            temps = [x.new_empty(shape) for shape in shapes]
    else:
        xs_buf, temps = [], [x.new_empty(shape) for shape in shapes]
    gates, cells = temps[:2]  # gates: [D, P, 4H]; 2c: [D, P, H]
    hr = temps[2] if w_hr is not None else None  # o * tanh(c): [D, P, H]
    states = temps[-1] if d_ == 2 else y.view(1, total, out_size)  # [D, P, R]
    if hr is None:
        hr = states

    # Input projection of every step and both directions in one batched matmul, both biases folded in.
    xs = _by_direction(x, steps, d_, *xs_buf)  # [D, P, I]
    w_in = (w_ih * scale).transpose(1, 2)  # [D, I, 4H]
    if b_ih is not None:
        torch.baddbmm(((b_ih + b_hh) * scale.squeeze(1)).unsqueeze(1), xs, w_in, out=gates)
    else:
        torch.bmm(xs, w_in, out=gates)
    return FwdBuffers(steps, scale, y, gates, cells, hr, states)


def fwd_epilogue(
    fwd: FwdBuffers, batch: int, need_saved: bool, has_proj: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Everything after the forward time loop: ``(y, h_n, c_n, gates, cells, hr, states)``."""
    y, steps, states, cells = fwd.y, fwd.steps, fwd.states, fwd.cells
    d_, out_size = states.shape[0], states.shape[2]
    if d_ == 2:
        y[:, :out_size].copy_(states[0])
        y[:, out_size:].copy_(states[1].index_select(0, steps.rev_rows))
    h_n, c_n = _last(states, steps, batch), _last(cells, steps, batch).mul_(0.5)
    if not need_saved:
        return (y, h_n, c_n, *(y.new_empty(0) for _ in range(4)))
    empty = y.new_empty(0)
    return (
        y,
        h_n,
        c_n,
        fwd.gates,
        cells,
        fwd.hr if has_proj else empty,
        states if d_ == 2 else empty.clone(),
    )


def dy_by_direction(dy: Tensor | None, steps: PackedSteps, out: Tensor) -> Tensor:
    """``out`` ``[D, P, R]`` <- the output gradient ``dy`` ``[P, D*R]`` in each direction's step-packed
    order (zeros when ``dy`` is None)."""
    if dy is None:
        return out.zero_()
    out_size = out.shape[2]
    out[0].copy_(dy[:, :out_size])
    if out.shape[0] == 2:
        torch.index_select(dy[:, out_size:], 0, steps.rev_rows, out=out[1])
    return out


def param_grads(
    dz: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h0: Tensor,
    states: Tensor,
    hr: Tensor,
    w_ih: Tensor,
    w_hr: Tensor | None,
    steps: PackedSteps,
    scale: Tensor,
    has_bias: bool,
    need_dx: bool,
    xs_buf: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Everything after the backward time loop, as large batched matmuls: ``(dx, dw_ih, dw_hh, db_ih,
    db_hh, dw_hr)`` from the gate gradients ``dz`` ``[D, P, 4H]`` (of the scaled pre-activations) and,
    with a projection, the full output-state gradients ``grad_h`` ``[D, P, R]``."""
    d_, total, _ = dz.shape
    batch = h0.shape[1]
    dz_t = dz.transpose(1, 2)  # [D, 4H, P]
    if steps.uniform:
        dw_hh = torch.bmm(dz_t[..., :batch], h0)
        dw_hh.baddbmm_(dz_t[..., batch:], states[:, : total - batch])
    else:
        dw_hh = torch.bmm(dz_t, torch.cat([h0, states], 1).index_select(1, steps.prev_rows))
    dw_hh.mul_(scale)
    xs = _by_direction(x, steps, d_, *([xs_buf] if xs_buf is not None else []))
    dw_ih = torch.bmm(dz_t, xs).mul_(scale)
    if need_dx:
        dxs = torch.bmm(dz, w_ih * scale)  # [D, P, I]
        dx = dxs[0] if d_ == 1 else dxs[0].index_add_(0, steps.rev_rows, dxs[1])
    else:
        dx = x.new_empty(0)
    if has_bias:
        db_ih = dz.sum(1).mul_(scale.squeeze(1))
        db_hh = db_ih.clone()
    else:
        db_ih, db_hh = x.new_empty(0), x.new_empty(0)
    dw_hr = torch.bmm(grad_h.transpose(1, 2), hr) if w_hr is not None else x.new_empty(0)
    return dx, dw_ih, dw_hh, db_ih, db_hh, dw_hr


def lstm_fwd_ref(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    need_saved: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One LSTM layer, all directions. Returns ``(y, h_n, c_n, gates, cells, hr, states)``.

    Shapes (R = proj_size, or H without projection): x [P, I], batch_sizes [T] (int64, CPU),
    h0 [D, B, R], c0 [D, B, H], w_ih [D, 4H, I], w_hh [D, 4H, R], b_ih/b_hh [D, 4H] or None,
    w_hr [D, R, H] or None; y [P, D*R] (time-packed), h_n [D, B, R], c_n [D, B, H]. Saved for the
    backward: gates [D, P, 4H] (i, f, sigmoid(2 a_g), o), cells [D, P, H] (2c), hr [D, P, H]
    (o * tanh(c), empty without projection) and states [D, P, R] (every step's output, step-packed;
    empty with one direction, where it is ``y`` itself). Without ``need_saved`` (no gradient will be
    asked for) all four are empty and their memory is scratch reused from call to call.
    """
    fwd = fwd_prologue(x, batch_sizes, h0, c0, w_ih, b_ih, b_hh, w_hr, need_saved)
    steps, scale, gates, cells, hr, states = fwd.steps, fwd.scale, fwd.gates, fwd.cells, fwd.hr, fwd.states
    hid = c0.shape[2]

    w_hh_t = (w_hh * scale).transpose(1, 2)  # [D, R, 4H]
    w_hr_t = w_hr.transpose(1, 2) if w_hr is not None else None  # [D, H, R]
    g_all = steps.split(gates)
    g_i, g_f, g_g, g_o = (steps.split(gates[..., k * hid : (k + 1) * hid]) for k in range(4))
    c_out, hr_out, h_out = steps.split(cells), steps.split(hr), steps.split(states)
    h_prev = [h0] + [h_out[s - 1][:, :n] for s, n in enumerate(steps.sizes) if s > 0]
    c_prev = [c0 * 2.0] + [c_out[s - 1][:, :n] for s, n in enumerate(steps.sizes) if s > 0]
    tanh_g = g_g[0].new_empty(c0.shape)  # a step's g = tanh(a_g)
    for s, n in enumerate(steps.sizes):
        g_all[s].baddbmm_(h_prev[s], w_hh_t)
        # g = tanh(a_g) from the doubled 2 a_g, halved exactly: 2 sigmoid(2 a_g) - 1 kept only an absolute
        # error of one unit of 0.5's last place, all of a small g's value (torch's tanh is exact there)
        g = torch.mul(g_g[s], 0.5, out=tanh_g[:, :n]).tanh_()
        g_all[s].sigmoid_()  # i, f, o, and sigmoid(2 a_g) for the backward
        # The cell state is kept doubled, C = 2c: C = f * C_prev + 2 * i * g
        torch.mul(g_f[s], c_prev[s], out=c_out[s]).addcmul_(g_i[s], g, value=2.0)
        # h = o * tanh(c), tanh(c) = tanh(C / 2) built in h's slab
        torch.mul(c_out[s], 0.5, out=hr_out[s]).tanh_().mul_(g_o[s])
        if w_hr_t is not None:
            torch.bmm(hr_out[s], w_hr_t, out=h_out[s])

    return fwd_epilogue(fwd, c0.shape[1], need_saved, w_hr is not None)


def lstm_bwd_ref(
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
    need_dx: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`lstm_fwd_ref`. Returns ``(dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr)``.

    ``dy`` [P, D*R], ``dh_n`` [D, B, R] and ``dc_n`` [D, B, H] may be None (that output was not used).
    Empty tensors come back for the bias gradients without bias, for ``dw_hr`` without projection and
    for ``dx`` unless ``need_dx`` (the first layer of a model, whose input needs no gradient).
    """
    d_, batch, hid = c0.shape
    total, inp = x.shape
    out_size = h0.shape[2]
    steps = PackedSteps.build(batch_sizes, total, batch, d_, x.device, op="lstm")
    sizes = steps.sizes
    scale = _gate_scale(hid, x)
    if d_ == 1:
        states = y.view(1, total, out_size)
    if w_hr is None:
        hr = states

    # dL/dh and u = dL/dC (C = 2c is the saved cell state, so u = dL/dc / 2), step-packed and seeded with
    # the gradients of the outputs and of h_n / c_n; the loop adds the recurrent part in place, so
    # grad_h ends up as the full dL/dh that dW_hr needs.
    # Temporaries come from the reused workspace (see tandem.ops._workspace): none of them escapes.
    grad_h, grad_c, k, k_c, tanh_c, *xs_buf = scratch(
        x,
        (d_, total, out_size),
        (d_, total, hid),
        (d_, total, 4 * hid),
        (d_, total, hid),
        (d_, total, hid),
        *[(2, total, inp)] * (d_ - 1),
    )
    dy_by_direction(dy, steps, out=grad_h)
    grad_c.zero_()
    for grad, last, alpha in ((grad_h, dh_n, 1.0), (grad_c, dc_n, 0.5)):
        if last is None:
            continue
        if steps.uniform:
            grad[:, total - batch :].add_(last, alpha=alpha)
        else:
            grad.index_add_(1, steps.last_rows, last, alpha=alpha)

    # Local derivatives, for all steps at once: the loop then only multiplies them by u and dL/dh.
    # k = (du/dz_i, du/dz_f, du/dz_g, dh/dz_o) with z the (scaled) gate pre-activations.
    torch.sigmoid(cells, out=tanh_c).mul_(2.0).sub_(1.0)  # tanh(c) = 2 sigmoid(C) - 1: [D, P, H]
    torch.addcmul(gates, gates, gates, value=-1, out=k)  # sigmoid' = a (1 - a): [D, P, 4H]
    i, sg, o = (gates[..., a * hid : (a + 1) * hid] for a in (0, 2, 3))
    k_i, k_f, k_g, k_o = (k[..., a * hid : (a + 1) * hid] for a in range(4))
    k_i.addcmul_(k_i, sg, value=-2.0).mul_(-2.0)  # 2 g sigmoid'(z_i), g = 2 sg - 1
    k_g.mul_(i).mul_(4.0)  # 2 i d(2 sigmoid(z_g) - 1)/dz_g
    if steps.uniform:
        k_f[:, :batch].mul_(c0).mul_(2.0)  # C_prev sigmoid'(z_f)
        k_f[:, batch:].mul_(cells[:, : total - batch])
    else:
        k_f.mul_(torch.cat([c0 * 2.0, cells], 1).index_select(1, steps.prev_rows))
    k_o.mul_(tanh_c)  # tanh(c) sigmoid'(z_o)
    torch.addcmul(o, hr, tanh_c, value=-1, out=k_c).mul_(0.5)  # dh_raw -> u: o (1 - tanh(c)^2) / 2

    # The loop turns k into dL/dz in place, step by step (a step's k is dead once its dz is known).
    dz = k  # dL/dz: [D, P, 4H]
    w_hh_s = w_hh * scale  # [D, 4H, R]
    dz_ifg = [t.view(d_, n, 3, hid) for t, n in zip(steps.split(k[..., : 3 * hid]), sizes)]
    k_c_s, dz_o = steps.split(k_c), steps.split(k_o)
    dz_s, g_h, g_c = steps.split(dz), steps.split(grad_h), steps.split(grad_c)
    g_f = steps.split(gates[..., hid : 2 * hid])
    work = x.new_empty(d_ * batch * hid) if w_hr is not None else None
    for s in range(len(sizes) - 1, -1, -1):
        n = sizes[s]
        if s + 1 < len(sizes):
            m = sizes[s + 1]
            g_h[s][:, :m].baddbmm_(dz_s[s + 1], w_hh_s)
            g_c[s][:, :m].addcmul_(g_c[s + 1], g_f[s + 1])
        dh = g_h[s]
        if w_hr is not None:
            dh = torch.bmm(dh, w_hr, out=work[: d_ * n * hid].view(d_, n, hid))
        g_c[s].addcmul_(dh, k_c_s[s])
        dz_ifg[s].mul_(g_c[s].unsqueeze(2))
        dz_o[s].mul_(dh)
    dh0 = torch.bmm(dz_s[0], w_hh_s)
    dc0 = torch.mul(g_c[0], g_f[0]).mul_(2.0)

    dx, dw_ih, dw_hh, db_ih, db_hh, dw_hr = param_grads(
        dz, grad_h, x, h0, states, hr, w_ih, w_hr, steps, scale, has_bias, need_dx, *xs_buf
    )
    return dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr


def lstm_layer_autograd(
    x: Tensor,
    batch_sizes: Tensor | list[int],
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h_n, c_n)`` of :func:`lstm_fwd_ref`, step by step with autograd-tracked ops and
    torch.nn.LSTM's formulas: what a backward with ``create_graph=True`` differentiates
    (:mod:`tandem.ops._recompute`)."""

    def project(d: int, rows: Tensor) -> Tensor:
        return F.linear(rows, w_ih[d], None if b_ih is None else b_ih[d])

    def cell(d: int, gi: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        h, c = states
        i, f, g, o = (gi + F.linear(h, w_hh[d], None if b_hh is None else b_hh[d])).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h if w_hr is None else F.linear(h, w_hr[d])), c

    y, (h_n, c_n) = packed_layer(x, batch_sizes, (h0, c0), project, cell)
    return y, h_n, c_n
