"""GRU in plain PyTorch: the CPU kernel of ``tandem::gru_fwd`` / ``tandem::gru_bwd`` and the oracle
the Triton kernels are tested against.

One call runs one layer, both directions at once, over a batch in packed layout:

- ``x`` is ``[P, I]``: the rows of ``PackedSequence.data`` (time-major, step ``t`` holds the first
  ``batch_sizes[t]`` sequences, sequences sorted by decreasing length). A padded ``[T, B, I]`` batch is
  the special case ``batch_sizes = [B] * T``.
- the reverse direction walks each sequence from its own last frame: its step ``s`` reads frame
  ``len_b - 1 - s`` of sequence ``b``. Both directions therefore have the same active rows at every
  step (the first ``batch_sizes[s]`` sequences), so one batched matmul serves both and padded frames
  are never computed.

Saved activations (what the backward needs, so it recomputes nothing) live in "step-packed" buffers:
row ``offsets[s] + b`` of a direction holds step ``s`` of sequence ``b``. They are direction-major
(``[D, P, ...]``): each step's slab is D contiguous blocks, and every matmul before or after the time
loop reads or writes all directions as one batched ``[D, P, ...]`` matmul with no copy (a step-major
``[T, D, B, ...]`` layout would need a gather of every buffer around those matmuls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.ops._packed import PackedSteps
from tandem.ops._recompute import packed_layer
from tandem.ops._workspace import scratch

__all__ = ["PackedSteps", "gru_fwd_ref", "gru_bwd_ref", "gru_layer_autograd"]


def _stack_directions(x: Tensor, steps: PackedSteps, out: Tensor) -> Tensor:
    """``x`` as each direction reads it, ``[D, P, I]``: the reverse direction's rows in its step order
    (written into ``out``, a workspace); one direction is ``x`` itself."""
    if steps.rev_rows is None:
        return x.unsqueeze(0)
    out[0].copy_(x)
    torch.index_select(x, 0, steps.rev_rows, out=out[1])
    return out


def gru_fwd_prologue(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    xs: Tensor,
) -> tuple[PackedSteps, Tensor, Tensor, Tensor, Tensor]:
    """What the forward does before its time loop, on every backend: ``(steps, gates, y, states, hn)``.

    ``gates`` [D, P, 3H] holds the input projection of every step and both directions (one batched
    matmul), with b_hr and b_hz folded in and the n rows doubled, so the loop adds ``2 r (W_hn h + b_hn)``
    to them: the Triton kernels take n = tanh(a) = tanh_half(2a) (:func:`tandem.ops._triton_rnn.tanh_half`),
    the CPU loop torch's tanh of the halved (exact) sum. The loop overwrites each step's slab with (r, z,
    n) and fills ``states`` and ``hn``.
    ``xs`` is a ``[D, P, I]`` workspace for two directions (ignored for one).
    """
    d_, batch, hid = h0.shape
    total = x.shape[0]
    steps = PackedSteps.build(batch_sizes, total, batch, d_, x.device, op="gru")
    n_scale = x.new_tensor([1.0, 1.0, 2.0]).repeat_interleave(hid).unsqueeze(1)  # [3H, 1]
    xs = _stack_directions(x, steps, xs)  # [D, P, I]
    gates = x.new_empty(d_, total, 3 * hid)  # gates: [D, P, 3H]
    w_in = (w_ih * n_scale).transpose(1, 2)  # [D, I, 3H]
    if b_ih is not None:
        # b_hr and b_hz only ever add to the input side: fold them in here, once for all steps
        bias = b_ih + F.pad(b_hh[:, : 2 * hid], (0, hid))
        torch.baddbmm((bias * n_scale.squeeze(1)).unsqueeze(1), xs, w_in, out=gates)
    else:
        torch.bmm(xs, w_in, out=gates)

    y = x.new_empty(total, d_ * hid)  # y: [P, D*H], time-packed
    states = y.view(1, total, hid) if d_ == 1 else x.new_empty(d_, total, hid)  # [D, P, H]
    hn = x.new_empty(d_, total, hid)  # hn: [D, P, H]
    return steps, gates, y, states, hn


def gru_fwd_epilogue(
    steps: PackedSteps, y: Tensor, gates: Tensor, hn: Tensor, states: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the forward does after its time loop: the reverse direction's outputs into ``y``, ``h_n``;
    returns the op's outputs ``(y, h_n, gates, hn, states)``."""
    d_, total, hid = states.shape
    batch = steps.sizes[0]
    if d_ == 2:
        y[:, :hid].copy_(states[0])
        y[:, hid:].copy_(states[1].index_select(0, steps.rev_rows))
    h_n = states[:, total - batch :].clone() if steps.uniform else states.index_select(1, steps.last_rows)
    return y, h_n, gates, hn, states if d_ == 2 else y.new_empty(0)


def gru_fwd_ref(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One GRU layer, all directions. Returns ``(y, h_n, gates, hn, states)``.

    Shapes: x [P, I], batch_sizes [T] (int64, CPU), h0 [D, B, H], w_ih [D, 3H, I], w_hh [D, 3H, H],
    b_ih/b_hh [D, 3H] or None; y [P, D*H] (time-packed), h_n [D, B, H]. Saved for the backward:
    gates [D, P, 3H] (r, z, n), hn [D, P, H] (W_hn h + b_hn) and states [D, P, H] (every step's output
    state, step-packed). With one direction the states are ``y`` itself and ``states`` is empty.
    """
    d_, batch, hid = h0.shape
    # temporaries from the reused workspace: the step's W_hh h, and x with the reverse direction's rows
    work, xs = scratch(x, (d_ * batch * 3 * hid,), (d_ if d_ == 2 else 0, x.shape[0], x.shape[1]))
    steps, gates, y, states, hn = gru_fwd_prologue(x, batch_sizes, h0, w_ih, b_ih, b_hh, xs)

    w_hh_t = w_hh.transpose(1, 2)  # [D, H, 3H]
    bias_hn = b_hh[:, 2 * hid :].unsqueeze(1) if b_hh is not None else None  # [D, 1, H]
    g_rz, g_r, g_z, g_n = (
        steps.split(gates[..., a:b]) for a, b in ((0, 2 * hid), (0, hid), (hid, 2 * hid), (2 * hid, 3 * hid))
    )
    # W_hh h of one step stays in cache; hn keeps its n part
    ws = {n: work[: d_ * n * 3 * hid].view(d_, n, 3 * hid) for n in set(steps.sizes)}
    ws_rz = {n: w[..., : 2 * hid] for n, w in ws.items()}
    ws_n = {n: w[..., 2 * hid :] for n, w in ws.items()}
    hn_s, h_out = steps.split(hn), steps.split(states)
    h_prev = [h0[:, : steps.sizes[0]]] + [h_out[s - 1][:, :n] for s, n in enumerate(steps.sizes) if s > 0]
    for s, n in enumerate(steps.sizes):
        torch.bmm(h_prev[s], w_hh_t, out=ws[n])
        g_rz[s].add_(ws_rz[n]).sigmoid_()
        if bias_hn is not None:
            torch.add(ws_n[n], bias_hn, out=hn_s[s])
        else:
            hn_s[s].copy_(ws_n[n])
        # n = tanh(a), from 2a halved (exactly): 2 sigmoid(2a) - 1 kept only an absolute error of one unit
        # of 0.5's last place, all of a small n's value (torch's tanh is exact there)
        g_n[s].addcmul_(g_r[s], hn_s[s], value=2.0).mul_(0.5).tanh_()
        # h = (h_prev - n) z + n, the form of torch's cell (lerp's branch for z >= 0.5, h_prev - (h_prev - n)
        # (1 - z), is NaN where torch's is inf, for an infinite h_prev)
        torch.sub(h_prev[s], g_n[s], out=h_out[s])
        torch.addcmul(g_n[s], h_out[s], g_z[s], out=h_out[s])

    return gru_fwd_epilogue(steps, y, gates, hn, states)


def gru_bwd_ref(
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
    need_dx: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`gru_fwd_ref`. Returns ``(dx, dh0, dw_ih, dw_hh, db_ih, db_hh)``.

    ``dy`` [P, D*H] and ``dh_n`` [D, B, H] may be None (that output was not used). The bias gradients
    are empty tensors when ``has_bias`` is False, and ``dx`` is empty when ``need_dx`` is False (the
    first layer of a model, whose input features need no gradient).
    """
    d_, batch, hid = h0.shape
    total = x.shape[0]
    two = d_ == 2
    # Temporaries (never outputs) from the reused workspace, all in one request.
    dgates, dn_in, grad_steps, xs, h_prev = scratch(
        x,
        (d_, total, 3 * hid),  # hidden-side gate gradients
        (d_, total, hid),  # input-side n gradient
        (d_ if two else 0, total, hid),  # dy in step order
        (d_ if two else 0, total, x.shape[1]),  # x, and x with the reverse direction's rows
        (d_, total, hid),  # previous states (packed batches only)
    )
    steps, states, grad_out, dh_n = gru_bwd_prologue(dy, dh_n, x, batch_sizes, h0, y, states, grad_steps)

    # Gate gradients per step. dgates holds the hidden-side ones (dr, dz, dn * r): one batched matmul
    # with W_hh per step and one with the previous states after the loop. The input side differs only
    # in its n block (dn), kept apart in dn_in.

    r, z, n_gate = (steps.split(gates[..., k * hid : (k + 1) * hid]) for k in range(3))
    dr, dz, dn_h = (steps.split(dgates[..., k * hid : (k + 1) * hid]) for k in range(3))
    dg, dn, hn_s = steps.split(dgates), steps.split(dn_in), steps.split(hn)
    h_new, g_out = steps.split(states), steps.split(grad_out)
    sizes = steps.sizes

    dh = dh_n[:, : sizes[-1]].clone()
    for s in range(len(sizes) - 1, -1, -1):
        n = sizes[s]
        if s < len(sizes) - 1 and n > sizes[s + 1]:
            # sequences whose last frame is step s join, carrying the gradient of their h_n
            dh = torch.cat([dh, dh_n[:, sizes[s + 1] : n]], 1)
        dh.add_(g_out[s])
        dh_z = dh * z[s]
        a = dh - dh_z  # dh * (1 - z)
        # dz_pre = dh * (h_prev - n) * z * (1 - z) = a * (h - n), since h - n = z * (h_prev - n)
        torch.sub(h_new[s], n_gate[s], out=dz[s]).mul_(a)
        # dn_pre = a * (1 - n^2)
        torch.addcmul(a, a * n_gate[s], n_gate[s], value=-1, out=dn[s])
        torch.mul(dn[s], r[s], out=dn_h[s])
        # dr_pre = dn_pre * (W_hn h + b_hn) * r * (1 - r)
        torch.mul(dn_h[s], hn_s[s], out=dr[s]).addcmul_(dr[s], r[s], value=-1)
        dh = torch.baddbmm(dh_z, dg[s], w_hh)
    dx, dw_ih, dw_hh, db_ih, db_hh = gru_bwd_epilogue(
        steps, x, h0, w_ih, states, dgates, dn_in, has_bias, need_dx, xs, h_prev
    )
    return dx, dh, dw_ih, dw_hh, db_ih, db_hh


def gru_bwd_prologue(
    dy: Tensor | None,
    dh_n: Tensor | None,
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    y: Tensor,
    states: Tensor,
    grad_steps: Tensor,
) -> tuple[PackedSteps, Tensor, Tensor, Tensor]:
    """What the backward does before its time loop, on every backend: ``(steps, states, grad_out,
    dh_n)``, with the states ``[D, P, H]`` (``y`` itself for one direction), ``grad_out`` the gradient
    arriving from ``y`` in step-packed order (written into ``grad_steps`` for two directions) and
    zeros for an unused output."""
    d_, batch, hid = h0.shape
    total = x.shape[0]
    steps = PackedSteps.build(batch_sizes, total, batch, d_, x.device, op="gru")
    if d_ == 1:
        states = y.view(1, total, hid)
    # dL/dh from the outputs, step-packed like the states: [D, P, H]
    if dy is None:
        grad_out = x.new_zeros(d_, total, hid)
    elif d_ == 1:
        grad_out = dy.view(1, total, hid)
    else:
        grad_out = grad_steps
        grad_out[0].copy_(dy[:, :hid])
        torch.index_select(dy[:, hid:], 0, steps.rev_rows, out=grad_out[1])
    if dh_n is None:
        dh_n = x.new_zeros(d_, batch, hid)
    return steps, states, grad_out, dh_n


def gru_bwd_epilogue(
    steps: PackedSteps,
    x: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    states: Tensor,
    dgates: Tensor,
    dn_in: Tensor,
    has_bias: bool,
    need_dx: bool,
    xs: Tensor,
    h_prev: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the backward does after its time loop: ``(dx, dw_ih, dw_hh, db_ih, db_hh)`` as large
    batched matmuls over all steps, from the hidden-side gate gradients ``dgates`` [D, P, 3H]
    (dr, dz, dn * r) and the input-side n gradient ``dn_in`` [D, P, H]. ``xs`` ([D, P, I], two
    directions) and ``h_prev`` ([D, P, H], packed batches) are workspaces."""
    d_, batch, hid = h0.shape
    total = x.shape[0]

    # dW_hh = sum over steps of dgates^T h_prev, where h_prev is h0 at step 0
    if steps.uniform:
        dw_hh = torch.bmm(dgates[:, :batch].transpose(1, 2), h0)
        dw_hh.baddbmm_(dgates[:, batch:].transpose(1, 2), states[:, : total - batch])
    else:
        torch.index_select(torch.cat([h0, states], 1), 1, steps.prev_rows, out=h_prev)
        dw_hh = torch.bmm(dgates.transpose(1, 2), h_prev)  # [D, 3H, H]

    xs = _stack_directions(x, steps, xs)  # [D, P, I]
    d_rz = dgates[..., : 2 * hid]
    dw_ih = torch.cat([torch.bmm(d_rz.transpose(1, 2), xs), torch.bmm(dn_in.transpose(1, 2), xs)], 1)
    if need_dx:
        dxs = torch.baddbmm(torch.bmm(d_rz, w_ih[:, : 2 * hid]), dn_in, w_ih[:, 2 * hid :])  # [D, P, I]
        dx = dxs[0] if d_ == 1 else dxs[0].index_add_(0, steps.rev_rows, dxs[1])
    else:
        dx = x.new_empty(0)

    if has_bias:
        db_hh = dgates.sum(1)
        db_ih = torch.cat([db_hh[:, : 2 * hid], dn_in.sum(1)], 1)
    else:
        db_ih, db_hh = x.new_empty(0), x.new_empty(0)
    return dx, dw_ih, dw_hh, db_ih, db_hh


def gru_layer_autograd(
    x: Tensor,
    batch_sizes: Tensor | list[int],
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(y, h_n)`` of :func:`gru_fwd_ref`, step by step with autograd-tracked ops and torch.nn.GRU's
    formulas: what a backward with ``create_graph=True`` differentiates (:mod:`tandem.ops._recompute`)."""

    def project(d: int, rows: Tensor) -> Tensor:
        return F.linear(rows, w_ih[d], None if b_ih is None else b_ih[d])

    def cell(d: int, gi: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor]:
        (h,) = states
        gh = F.linear(h, w_hh[d], None if b_hh is None else b_hh[d])
        i_r, i_z, i_n = gi.chunk(3, 1)
        h_r, h_z, h_n = gh.chunk(3, 1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return ((h - n) * z + n,)  # torch's cell: (1 - z) n + z h in the form that keeps an infinite h

    y, (h_n,) = packed_layer(x, batch_sizes, (h0,), project, cell)
    return y, h_n
