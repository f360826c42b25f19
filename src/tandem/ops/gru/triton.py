"""Triton kernels of ``tandem::gru_fwd`` / ``tandem::gru_bwd``: one fused launch per time step that
serves every active sequence and both directions.

Only the time loops run here. What comes before and after them is the same on every backend and
lives in :mod:`tandem.ops.gru.reference` (``gru_fwd_prologue`` / ``gru_fwd_epilogue``,
``gru_bwd_prologue`` / ``gru_bwd_epilogue``): the input projection of all steps and both directions
as one batched matmul, the outputs' layout, and the weight, bias and input gradients as large batched
matmuls over the per-step gate gradients. The saved buffers (gates r, z, n; ``W_hn h + b_hn``; the
states) have the reference's layout and meaning, so either backend's backward reads either forward.

Forward step ``s`` (grid ``(D, cdiv(B_s, BLOCK_B), cdiv(H, BLOCK_H))``, ``B_s`` = active sequences):
program ``(d, b, j)`` computes ``h_prev[b-block] @ W_hh[d]^T`` for the r, z and n columns of its
j-block over a K loop (``tl.dot``, fp32 accumulation), adds the step's input projection, applies the
gates, writes r, z, n in place of the projection, ``W_hn h + b_hn`` and the new state. Data is
addressed by row index: step ``s`` of direction ``d`` is row ``offsets[s] + b`` of the step-packed
``[D, P, .]`` buffers, its previous state row ``offsets[s-1] + b`` of the states (``h0`` at s = 0).

Backward step ``s``, in reverse (grid ``(D, cdiv(B_s, BLOCK_B), cdiv(H, BLOCK_K))``): program
``(d, b, k)`` recomputes, element by element, the gate gradients of its rows for every column block
``j`` (``dh`` = carried gradient + the output's gradient of this step) and accumulates
``dgates[b, j] @ W_hh[d, j, k]`` over ``j``, then adds ``dh * z`` of its own columns: the carried
gradient of the previous step. The ``k = 0`` programs store the gate gradients for the matmuls after
the loop. The carried gradient lives in two fp32 ``[D, B, H]`` buffers used in turn (a program reads
every column of its rows while others write theirs, so one buffer would race); both start as ``dh_n``,
which is right for the sequences that join at a step: those rows were never written.

Float32 tiles are multiplied in TF32 on GPUs when torch lets its cuDNN RNNs use TF32
(:func:`tandem.ops._triton_rnn.cudnn_rnn_tf32`), as torch.nn.GRU's cuDNN kernels are, and exactly
otherwise.

Persistent kernels, for the small hidden sizes where a direction's three recurrent weight tiles stay in
registers (``_PERSISTENT_WARPS``): one launch runs the whole time loop, grid ``(D, cdiv(B, BLOCK_B))``.
A program owns every column of its rows, so the state (forward) or the carried gradient (backward)
never leaves its registers and no program waits for another; the weights are read once. Each step's
active rows and first packed row come from a small ``[2, T]`` table, and a block whose sequences have
all ended (or, in reverse, not started) skips the step. Same saved buffers as the per-step kernels.

``CUDA_GRAPHS`` records each problem's per-step loop once and replays it (a CUDA graph on GPUs,
:class:`tandem.ops._triton_rnn.StepGraphs`): no host gap between the launches, at the cost of copying
the loop's buffers in and out of the recorded ones. Off by default: no GPU has measured it, and the
graph itself has never been captured (the tests run the same buffer handling around a plain replay on
the CPU).

Not yet done (no GPU was available to measure them): timing and turning on ``CUDA_GRAPHS``, a
persistent kernel for larger hidden sizes (weights spread over several programs, a grid-wide barrier
per step), and any tuning of the block sizes. ``TIME_LOOP`` picks the loop for every size, for
measuring one against the other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem._device import on_tensors_device
from tandem.ops._triton_rnn import (
    StepGraphs,
    compute_dtype,
    dot,
    gate_tile,
    persistent_meta,
    precision,
    product_meta,
    split_backward,
    step_product,
    step_rows,
    tanh_half,
    tf32,
    upcast,
)
from tandem.ops._workspace import scratch
from tandem.ops.gru.reference import (
    gru_bwd_epilogue,
    gru_bwd_prologue,
    gru_fwd_epilogue,
    gru_fwd_prologue,
)

__all__ = ["gru_fwd_triton", "gru_bwd_triton"]

# FMA contraction on, and said so: Triton 3.10 turns its default off, and the fused form is the more
# accurate one.
_FMA = dict(enable_fp_fusion=True)

# Whether the per-step loops are recorded once per problem and replayed (CUDA graphs on GPUs): no host
# gap between steps. Off by default: a graph is recorded for each new pattern of lengths (BENCHMARKS.md,
# GPU, has the times); tests run it on the CPU.
CUDA_GRAPHS = False
STEP_GRAPHS = StepGraphs()

# Whether the per-step backward runs as two launches a step, the gate gradients element by element
# (_gru_bwd_gates) and then dL/dh_prev as a tile product over every column block (step_product), instead
# of the fused _gru_bwd_step, whose programs each recompute the gate gradients of all H columns. None (the
# default): split where the loops are recorded as CUDA graphs (CUDA_GRAPHS), fused elsewhere. Timed on an
# H100 at T100-B32-I512-H512 (one direction, a training step; docs/notes/triton-rnn.md v3.3): split
# 1.61x (float32) and 1.47x (bfloat16) the fused with graphs, 0.78x and 0.52x without, where each step
# pays a second launch from the host. The tests run both.
BWD_SPLIT: bool | None = None
_SPLIT_BLOCK = 64  # the largest block of the split step's kernels (the tests shrink it)

# Which time loop runs: "auto" (the persistent kernels where _PERSISTENT_WARPS has the hidden size, the
# per-step kernels elsewhere), or "persistent" / "per-step" for every size (tests, benchmarks).
TIME_LOOP = "auto"

# The persistent kernels keep a direction's three recurrent weight tiles in registers for the whole
# time loop. They run for the hidden sizes (padded to BLOCK_H) where the sm_90 build holds them without
# spilling to local memory, with the num_warps that does it; found by compiling ahead of time (Triton
# 3.9, `cuobjdump -res-usage`), checked by tests/ops/test_gru_triton.py. Keyed by kernel and precision
# (tandem.ops._triton_rnn.precision); larger sizes spill (e.g. bf16 H128 with 8 or 16 warps) and run the
# per-step kernels.
_PERSISTENT_WARPS = {
    ("fwd", "half"): {16: 4, 32: 4, 64: 8},
    ("bwd", "half"): {16: 4, 32: 4, 64: 8},
    ("fwd", "tf32"): {16: 4, 32: 4, 64: 8},
    ("bwd", "tf32"): {16: 4, 32: 4},
    ("fwd", "fp32"): {16: 4, 32: 8},
    ("bwd", "fp32"): {16: 4, 32: 8},
    ("fwd", "fp64"): {16: 4},
    ("bwd", "fp64"): {16: 4},
}


@triton.jit(do_not_specialize=["stride_prev_d", "prev_row0", "row0", "n_rows", "total"])
def _gru_fwd_step(
    p_gates,  # [D, P, 3H]: in: the input projection (n part doubled); out: r, z, n
    p_hn,  # [D, P, H]: out: W_hn h_prev + b_hn
    p_states,  # [D, P, H]: out: the new state, row `row0 + b`
    p_hprev,  # base of the previous states: h0 [D, B, H] or `p_states`
    stride_prev_d,  # direction stride of p_hprev
    prev_row0,  # row of sequence 0's previous state in p_hprev
    p_w,  # [D, 3H, H]: W_hh, contiguous
    p_bias,  # [D, H]: b_hn (b_hh's n part), or a dummy when not HAS_BIAS
    row0,  # first step-packed row of this step
    n_rows,  # active sequences at this step
    total,  # P
    H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see tandem.ops._triton_rnn
    TF32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_d = tl.program_id(0).to(tl.int64)  # offsets in int64: D * P * 3H can pass 2**31
    o_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b = o_b < n_rows
    m_j = o_j < H
    b_acc_r = tl.zeros((BLOCK_B, BLOCK_H), COMPUTE)
    b_acc_z = tl.zeros((BLOCK_B, BLOCK_H), COMPUTE)
    b_acc_n = tl.zeros((BLOCK_B, BLOCK_H), COMPUTE)
    p_prev = p_hprev + i_d * stride_prev_d + (prev_row0 + o_b).to(tl.int64)[:, None] * H
    p_wt = p_w + i_d * 3 * H * H + o_j[None, :] * H  # W_hh^T tile: [K, j]
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_h = tl.load(p_prev + o_k[None, :], mask=m_b[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_j[None, :]
        b_acc_r = dot(b_h, tl.load(p_wt + o_k[:, None], mask=m_w, other=0.0), b_acc_r, UPCAST, TF32)
        b_acc_z = dot(b_h, tl.load(p_wt + H * H + o_k[:, None], mask=m_w, other=0.0), b_acc_z, UPCAST, TF32)
        b_acc_n = dot(
            b_h, tl.load(p_wt + 2 * H * H + o_k[:, None], mask=m_w, other=0.0), b_acc_n, UPCAST, TF32
        )

    m = m_b[:, None] & m_j[None, :]
    p_g = p_gates + i_d * total * 3 * H + (row0 + o_b).to(tl.int64)[:, None] * (3 * H) + o_j[None, :]
    b_r = tl.sigmoid(tl.load(p_g, mask=m, other=0.0).to(COMPUTE) + b_acc_r)
    b_z = tl.sigmoid(tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE) + b_acc_z)
    b_hn = b_acc_n
    if HAS_BIAS:
        b_hn += tl.load(p_bias + i_d * H + o_j, mask=m_j, other=0.0).to(COMPUTE)[None, :]
    # n = tanh(a_in + r * hn) = tanh_half(2 a_in + 2 r hn), the projection holding 2 a_in
    b_n = tanh_half(tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE) + 2.0 * b_r * b_hn)
    b_hprev = tl.load(p_prev + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    b_h = b_n + b_z * (b_hprev - b_n)  # (1 - z) n + z h_prev
    out_dtype = p_gates.dtype.element_ty
    tl.store(p_g, b_r.to(out_dtype), mask=m)
    tl.store(p_g + H, b_z.to(out_dtype), mask=m)
    tl.store(p_g + 2 * H, b_n.to(out_dtype), mask=m)
    o_row = i_d * total * H + (row0 + o_b).to(tl.int64)[:, None] * H + o_j[None, :]
    tl.store(p_hn + o_row, b_hn.to(out_dtype), mask=m)
    tl.store(p_states + o_row, b_h.to(out_dtype), mask=m)


@triton.jit
def _gate_grads(b_dh, b_r, b_z, b_n, b_h, p_hn, m, COMPUTE: tl.constexpr):
    """The step's pre-activation gate gradients ``(dr, dz, dn, dn * r)`` from dL/dh of its states and its
    saved r, z, n and state h, element by element; ``W_hn h_prev + b_hn`` is loaded (``p_hn``, mask
    ``m``) only where it is used, which keeps Triton 3.6's build of the persistent backward (tf32, H16)
    from spilling."""
    b_a = b_dh * (1.0 - b_z)
    b_dz = b_a * (b_h - b_n)  # dh (h_prev - n) z (1 - z), as h - n = z (h_prev - n)
    b_dn = b_a * (1.0 - b_n * b_n)
    b_dn_h = b_dn * b_r
    b_dr = b_dn_h * tl.load(p_hn, mask=m, other=0.0).to(COMPUTE) * (1.0 - b_r)
    return b_dr, b_dz, b_dn, b_dn_h


@triton.jit
def _tile_gate_grads(
    p_dhin, p_dy, p_gates, p_hn, p_states, p_dgates, p_dn_in, o_carry, o_row, o_row3, m, store,
    H: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """A tile of the per-step backward's elementwise half (the fused and the split kernels): loads what
    :func:`_gate_grads` takes (offsets with the tile's columns; ``o_row3`` into the [D, P, 3H] buffers),
    stores the gate gradients if ``store``, and returns ``(dr, dz, dn * r)`` rounded as stored (what the
    product reads, like the reference), dL/dh and z."""
    dt = p_gates.dtype.element_ty
    b_dh = tl.load(p_dhin + o_carry, mask=m, other=0.0).to(COMPUTE)
    b_dh += tl.load(p_dy + o_row, mask=m, other=0.0).to(COMPUTE)
    b_r = tl.load(p_gates + o_row3, mask=m, other=0.0).to(COMPUTE)
    b_z = tl.load(p_gates + o_row3 + H, mask=m, other=0.0).to(COMPUTE)
    b_n = tl.load(p_gates + o_row3 + 2 * H, mask=m, other=0.0).to(COMPUTE)
    b_h = tl.load(p_states + o_row, mask=m, other=0.0).to(COMPUTE)
    b_dr, b_dz, b_dn, b_dn_h = _gate_grads(b_dh, b_r, b_z, b_n, b_h, p_hn + o_row, m, COMPUTE)
    b_dr, b_dz, b_dn_h = b_dr.to(dt), b_dz.to(dt), b_dn_h.to(dt)
    if store:
        tl.store(p_dgates + o_row3, b_dr, mask=m)
        tl.store(p_dgates + o_row3 + H, b_dz, mask=m)
        tl.store(p_dgates + o_row3 + 2 * H, b_dn_h, mask=m)
        tl.store(p_dn_in + o_row, b_dn.to(dt), mask=m)
    return b_dr, b_dz, b_dn_h, b_dh, b_z


@triton.jit(do_not_specialize=["row0", "n_rows", "batch", "total"])
def _gru_bwd_step(
    p_dhin,  # [D, B, H] fp32: dL/dh of this step's states, except the output's part
    p_dhout,  # [D, B, H] fp32: out: dL/dh_prev
    p_dy,  # [D, P, H]: the output's gradient, step-packed
    p_gates,  # [D, P, 3H]: r, z, n
    p_hn,  # [D, P, H]: W_hn h_prev + b_hn
    p_states,  # [D, P, H]: this step's states
    p_w,  # [D, 3H, H]: W_hh, contiguous
    p_dgates,  # [D, P, 3H]: out: dr, dz, dn * r (pre-activation, hidden side)
    p_dn_in,  # [D, P, H]: out: dn (pre-activation, input side)
    row0,
    n_rows,
    batch,  # B: the carry buffers' rows
    total,  # P
    H: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see tandem.ops._triton_rnn
    TF32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_d = tl.program_id(0).to(tl.int64)  # offsets in int64: D * P * 3H can pass 2**31
    i_k = tl.program_id(2)
    o_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_b = o_b < n_rows
    m_k = o_k < H
    o_carry = i_d * batch * H + o_b[:, None] * H  # + column
    o_row = i_d * total * H + (row0 + o_b).to(tl.int64)[:, None] * H  # + column, [D, P, H] buffers
    o_row3 = i_d * total * 3 * H + (row0 + o_b).to(tl.int64)[:, None] * (3 * H)  # + column, [D, P, 3H] ones
    p_w_k = p_w + i_d * 3 * H * H + o_k[None, :]  # + j * H: a [j, k] tile of W_hh
    b_acc = tl.zeros((BLOCK_B, BLOCK_K), COMPUTE)
    for j0 in range(0, H, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        m_j = o_j < H
        m = m_b[:, None] & m_j[None, :]
        # the k = 0 programs store the gate gradients for the matmuls after the loop
        b_dr, b_dz, b_dn_h, _, _ = _tile_gate_grads(
            p_dhin, p_dy, p_gates, p_hn, p_states, p_dgates, p_dn_in, o_carry + o_j[None, :],
            o_row + o_j[None, :], o_row3 + o_j[None, :], m, i_k == 0, H, COMPUTE,
        )  # fmt: skip
        m_w = m_j[:, None] & m_k[None, :]
        b_acc = dot(b_dr, tl.load(p_w_k + o_j[:, None] * H, mask=m_w, other=0.0), b_acc, UPCAST, TF32)
        b_acc = dot(b_dz, tl.load(p_w_k + (H + o_j)[:, None] * H, mask=m_w, other=0.0), b_acc, UPCAST, TF32)
        b_acc = dot(
            b_dn_h, tl.load(p_w_k + (2 * H + o_j)[:, None] * H, mask=m_w, other=0.0), b_acc, UPCAST, TF32
        )

    m = m_b[:, None] & m_k[None, :]
    b_dh = tl.load(p_dhin + o_carry + o_k[None, :], mask=m, other=0.0).to(COMPUTE)
    b_dh += tl.load(p_dy + o_row + o_k[None, :], mask=m, other=0.0).to(COMPUTE)
    b_z = tl.load(p_gates + o_row3 + H + o_k[None, :], mask=m, other=0.0).to(COMPUTE)
    tl.store(p_dhout + o_carry + o_k[None, :], (b_acc + b_dh * b_z).to(p_dhout.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["row0", "n_rows", "batch", "total"])
def _gru_bwd_gates(
    p_dhin,  # [D, B, H] fp32: dL/dh of this step's states, except the output's part
    p_dhout,  # [D, B, H] fp32: out: dh * z, the part of dL/dh_prev that is no product
    p_dy,  # [D, P, H]: the output's gradient, step-packed
    p_gates,  # [D, P, 3H]: r, z, n
    p_hn,  # [D, P, H]: W_hn h_prev + b_hn
    p_states,  # [D, P, H]: this step's states
    p_dgates,  # [D, P, 3H]: out: dr, dz, dn * r (pre-activation, hidden side)
    p_dn_in,  # [D, P, H]: out: dn (pre-activation, input side)
    row0,
    n_rows,
    batch,  # B: the carry buffers' rows
    total,  # P
    H: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """The elementwise half of a split backward step (``BWD_SPLIT``), grid ``(D, cdiv(n_rows, BLOCK_B),
    cdiv(H, BLOCK_J))``: each program computes the gate gradients of its own tile once; then
    :func:`tandem.ops._triton_rnn.step_product` adds ``dgates @ W_hh`` to ``dh * z``."""
    i_d = tl.program_id(0).to(tl.int64)
    o_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    m = (o_b < n_rows)[:, None] & (o_j < H)[None, :]
    o_carry = i_d * batch * H + o_b[:, None] * H + o_j[None, :]
    o_row = i_d * total * H + (row0 + o_b).to(tl.int64)[:, None] * H + o_j[None, :]
    o_row3 = i_d * total * 3 * H + (row0 + o_b).to(tl.int64)[:, None] * (3 * H) + o_j[None, :]
    _, _, _, b_dh, b_z = _tile_gate_grads(
        p_dhin, p_dy, p_gates, p_hn, p_states, p_dgates, p_dn_in, o_carry, o_row, o_row3, m, True, H, COMPUTE
    )
    tl.store(p_dhout + o_carry, (b_dh * b_z).to(p_dhout.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_steps", "batch", "total"])
def _gru_fwd_persistent(
    p_gates,  # [D, P, 3H]: in: the input projection (n part doubled); out: r, z, n
    p_hn,  # [D, P, H]: out: W_hn h_prev + b_hn
    p_states,  # [D, P, H]: out: the states
    p_h0,  # [D, B, H]
    p_w,  # [D, 3H, H]: W_hh, contiguous
    p_bias,  # [D, H]: b_hn (b_hh's n part), or a dummy when not HAS_BIAS
    p_rows,  # [2, T] int32: active sequences of each step, then each step's first step-packed row
    n_steps,  # T
    batch,  # B
    total,  # P
    H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see tandem.ops._triton_rnn
    TF32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: a program owns every column of its rows
):
    i_d = tl.program_id(0).to(tl.int64)  # offsets in int64: D * P * 3H can pass 2**31
    b0 = tl.program_id(1) * BLOCK_B  # the block's first row
    o_b = b0 + tl.arange(0, BLOCK_B)
    o_j = tl.arange(0, BLOCK_H)
    m_j = o_j < H
    # W_hh^T of the three gates, [k, j] tiles read once and kept on chip for every step
    b_wr = gate_tile(p_w, i_d, 0, o_j, H, 3, True)
    b_wz = gate_tile(p_w, i_d, 1, o_j, H, 3, True)
    b_wn = gate_tile(p_w, i_d, 2, o_j, H, 3, True)
    if HAS_BIAS:
        b_bias = tl.load(p_bias + i_d * H + o_j, mask=m_j, other=0.0).to(COMPUTE)
    # the state, rounded to the buffers' dtype as the per-step kernel reads it back
    m_0 = (o_b < batch)[:, None] & m_j[None, :]
    b_h = tl.load(p_h0 + i_d * batch * H + o_b[:, None] * H + o_j[None, :], mask=m_0, other=0.0)
    out_dtype = p_gates.dtype.element_ty
    for s in range(0, n_steps):
        n_rows = tl.load(p_rows + s)
        if b0 < n_rows:  # sequences are sorted by length: a block's rows end together or stay ended
            row0 = tl.load(p_rows + n_steps + s)
            m = (o_b < n_rows)[:, None] & m_j[None, :]
            b_acc_r = dot(b_h, b_wr, tl.zeros((BLOCK_B, BLOCK_H), COMPUTE), UPCAST, TF32)
            b_acc_z = dot(b_h, b_wz, tl.zeros((BLOCK_B, BLOCK_H), COMPUTE), UPCAST, TF32)
            b_hn = dot(b_h, b_wn, tl.zeros((BLOCK_B, BLOCK_H), COMPUTE), UPCAST, TF32)
            if HAS_BIAS:
                b_hn += b_bias[None, :]
            p_g = p_gates + i_d * total * 3 * H + (row0 + o_b).to(tl.int64)[:, None] * (3 * H) + o_j[None, :]
            b_r = tl.sigmoid(tl.load(p_g, mask=m, other=0.0).to(COMPUTE) + b_acc_r)
            b_z = tl.sigmoid(tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE) + b_acc_z)
            b_n = tanh_half(tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE) + 2.0 * b_r * b_hn)
            b_hnew = b_n + b_z * (b_h.to(COMPUTE) - b_n)
            tl.store(p_g, b_r.to(out_dtype), mask=m)
            tl.store(p_g + H, b_z.to(out_dtype), mask=m)
            tl.store(p_g + 2 * H, b_n.to(out_dtype), mask=m)
            o_row = i_d * total * H + (row0 + o_b).to(tl.int64)[:, None] * H + o_j[None, :]
            tl.store(p_hn + o_row, b_hn.to(out_dtype), mask=m)
            b_h = b_hnew.to(out_dtype)
            tl.store(p_states + o_row, b_h, mask=m)


@triton.jit(do_not_specialize=["n_steps", "batch", "total"])
def _gru_bwd_persistent(
    p_dhn,  # [D, B, H]: dL/dh_n, each sequence's carried gradient from its last step on
    p_dh0,  # [D, B, H] in the compute dtype: out: dL/dh0
    p_dy,  # [D, P, H]: the output's gradient, step-packed
    p_gates,  # [D, P, 3H]: r, z, n
    p_hn,  # [D, P, H]: W_hn h_prev + b_hn
    p_states,  # [D, P, H]: the states
    p_w,  # [D, 3H, H]: W_hh, contiguous
    p_dgates,  # [D, P, 3H]: out: dr, dz, dn * r (pre-activation, hidden side)
    p_dn_in,  # [D, P, H]: out: dn (pre-activation, input side)
    p_rows,  # [2, T] int32: active sequences of each step, then each step's first step-packed row
    n_steps,  # T
    batch,  # B
    total,  # P
    H: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see tandem.ops._triton_rnn
    TF32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: a program owns every column of its rows
):
    i_d = tl.program_id(0).to(tl.int64)  # offsets in int64: D * P * 3H can pass 2**31
    b0 = tl.program_id(1) * BLOCK_B  # the block's first row
    o_b = b0 + tl.arange(0, BLOCK_B)
    o_j = tl.arange(0, BLOCK_H)
    m_j = o_j < H
    # W_hh of the three gates, [j, k] tiles read once and kept on chip for every step
    b_wr = gate_tile(p_w, i_d, 0, o_j, H, 3, False)
    b_wz = gate_tile(p_w, i_d, 1, o_j, H, 3, False)
    b_wn = gate_tile(p_w, i_d, 2, o_j, H, 3, False)
    o_carry = i_d * batch * H + o_b[:, None] * H + o_j[None, :]
    m_carry = (o_b < batch)[:, None] & m_j[None, :]
    b_carry = tl.load(p_dhn + o_carry, mask=m_carry, other=0.0).to(COMPUTE)
    dt = p_gates.dtype.element_ty
    for i in range(0, n_steps):
        s = n_steps - 1 - i
        n_rows = tl.load(p_rows + s)
        if b0 < n_rows:
            row0 = tl.load(p_rows + n_steps + s)
            m_b = o_b < n_rows
            m = m_b[:, None] & m_j[None, :]
            o_row = i_d * total * H + (row0 + o_b).to(tl.int64)[:, None] * H + o_j[None, :]
            o_row3 = i_d * total * 3 * H + (row0 + o_b).to(tl.int64)[:, None] * (3 * H) + o_j[None, :]
            b_dh = b_carry + tl.load(p_dy + o_row, mask=m, other=0.0).to(COMPUTE)
            b_r = tl.load(p_gates + o_row3, mask=m, other=0.0).to(COMPUTE)
            b_z = tl.load(p_gates + o_row3 + H, mask=m, other=0.0).to(COMPUTE)
            b_n = tl.load(p_gates + o_row3 + 2 * H, mask=m, other=0.0).to(COMPUTE)
            b_h = tl.load(p_states + o_row, mask=m, other=0.0).to(COMPUTE)
            b_dr, b_dz, b_dn, b_dn_h = _gate_grads(b_dh, b_r, b_z, b_n, b_h, p_hn + o_row, m, COMPUTE)
            b_dr, b_dz, b_dn_h = b_dr.to(dt), b_dz.to(dt), b_dn_h.to(dt)
            tl.store(p_dgates + o_row3, b_dr, mask=m)
            tl.store(p_dgates + o_row3 + H, b_dz, mask=m)
            tl.store(p_dgates + o_row3 + 2 * H, b_dn_h, mask=m)
            tl.store(p_dn_in + o_row, b_dn.to(dt), mask=m)
            b_acc = dot(b_dr, b_wr, b_dh * b_z, UPCAST, TF32)
            b_acc = dot(b_dz, b_wz, b_acc, UPCAST, TF32)
            b_acc = dot(b_dn_h, b_wn, b_acc, UPCAST, TF32)
            # rows that have not started yet (shorter sequences) keep their dh_n
            b_carry = tl.where(m_b[:, None], b_acc, b_carry)
    tl.store(p_dh0 + o_carry, b_carry, mask=m_carry)


def _temporaries(like: Tensor, *shapes: tuple[int, ...]) -> list[Tensor]:
    """Uninitialised temporaries: from the reused CPU workspace for CPU tensors (the interpreter), from
    torch's caching allocator on GPUs (which already reuses memory, without keeping it)."""
    if like.device.type == "cpu":
        return scratch(like, *shapes)
    return [like.new_empty(shape) for shape in shapes]


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _common_meta(x: Tensor, hid: int) -> dict:
    return dict(H=hid, COMPUTE=compute_dtype(x.dtype)[1], UPCAST=upcast(x), TF32=tf32(x))


def _step_meta(kind: str, dtype: torch.dtype, batch: int, hid: int) -> dict:
    """Block sizes and launch options of the per-step ``kind`` ("fwd"/"bwd") kernel, spill-free in the
    sm_90 build (checked by the tests). The backward's were swept on an H200 (2026-11-26,
    benchmarks/gpu_sweep_bwd.py, a T100-B32-I512-H512 training step with CUDA graphs): each program
    recomputes the gate gradients of all H columns for its BLOCK_K columns of dh_prev, so narrow K blocks
    (16) and 4 warps run the most programs; BLOCK_J 16 for float32 (TF32) and 32 for half precision. The
    step took 6.0 ms instead of 17.5 (float32) and 4.3 instead of 7.5 (bfloat16) with the former blocks
    (J32, K64, 8 warps). Float64 keeps rows blocks of 16."""
    meta = dict(BLOCK_B=_block(batch, 16, 16 if dtype == torch.float64 else 32), **_FMA)
    if kind == "fwd":
        return meta | dict(BLOCK_H=_block(hid, 16, 64), BLOCK_K=_block(hid, 16, 32), num_warps=4)
    block_j = 32 if dtype in (torch.bfloat16, torch.float16) else 16
    return meta | dict(BLOCK_J=_block(hid, 16, block_j), BLOCK_K=16, num_warps=4)


def _split_meta(dtype: torch.dtype, batch: int, hid: int, meta: dict) -> tuple[dict, dict]:
    """Launch options of the split backward step's two kernels (``BWD_SPLIT``): the gate gradients'
    (``_gru_bwd_gates``) and the product's (``step_product``); ``meta`` holds the common ones (H,
    COMPUTE, UPCAST, TF32). Not tuned on a GPU yet."""
    most = _SPLIT_BLOCK
    gates = dict(H=hid, COMPUTE=meta["COMPUTE"], **_FMA, num_warps=4)
    gates |= dict(BLOCK_B=_block(batch, 16, min(32, most)), BLOCK_J=_block(hid, 16, most))
    product = dict(K=3 * hid, N=hid, ACCUMULATE=True, COMPUTE=meta["COMPUTE"], UPCAST=meta["UPCAST"])
    product |= dict(TF32=meta["TF32"]) | product_meta(dtype, batch, 3 * hid, hid, most)
    return gates, product


def _persistent_meta(kind: str, x: Tensor, hid: int) -> dict | None:
    """Block sizes and launch options of the persistent ``kind`` ("fwd"/"bwd") kernel for ``x`` and
    hidden size ``hid``, or None where the per-step kernels run (see TIME_LOOP, _PERSISTENT_WARPS)."""
    return persistent_meta(_PERSISTENT_WARPS[kind, precision(x)], TIME_LOOP, hid)


@on_tensors_device
def gru_fwd_triton(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`tandem.ops.gru.reference.gru_fwd_ref` with the time loop in Triton (same outputs)."""
    d_, batch, hid = h0.shape
    (xs,) = _temporaries(x, (d_ if d_ == 2 else 0, x.shape[0], x.shape[1]))
    steps, gates, y, states, hn = gru_fwd_prologue(x, batch_sizes, h0, w_ih, b_ih, b_hh, xs)
    h0 = h0.contiguous()
    w_hh = w_hh.contiguous()
    b_hn = b_hh[:, 2 * hid :].contiguous() if b_hh is not None else w_hh
    total = x.shape[0]
    meta = _common_meta(x, hid) | dict(HAS_BIAS=b_hh is not None)
    persistent = _persistent_meta("fwd", x, hid)
    if persistent:
        grid = (d_, triton.cdiv(batch, persistent["BLOCK_B"]))
        rows = step_rows(steps, x.device)
        _gru_fwd_persistent[grid](
            gates, hn, states, h0, w_hh, b_hn, rows, len(steps.sizes), batch, total, **meta, **persistent
        )
        return gru_fwd_epilogue(steps, y, gates, hn, states)

    meta |= _step_meta("fwd", x.dtype, batch, hid)

    def loop(b: dict[str, Tensor]) -> None:
        prev, stride_prev, prev_row0 = b["h0"], batch * hid, 0
        for s, n in enumerate(steps.sizes):
            grid = (d_, triton.cdiv(n, meta["BLOCK_B"]), triton.cdiv(hid, meta["BLOCK_H"]))
            row0 = steps.offsets[s]
            _gru_fwd_step[grid](
                b["gates"], b["hn"], b["states"], prev, stride_prev, prev_row0, b["w_hh"], b["b_hn"], row0, n,
                total, **meta,
            )  # fmt: skip
            prev, stride_prev, prev_row0 = b["states"], total * hid, row0

    reads = dict(h0=h0, w_hh=w_hh, b_hn=b_hn)
    if CUDA_GRAPHS:
        key = ("fwd", x.device, x.dtype, d_, batch, hid, total, tuple(steps.sizes))
        key += (tuple(sorted(meta.items())),)
        out = STEP_GRAPHS.run(key, loop, reads, dict(gates=gates), dict(hn=hn, states=states), {})
        gates, hn, states = out["gates"], out["hn"], out["states"]
        if d_ == 1:
            y = states.view(total, hid)  # one direction: the states are the output
    else:
        loop(reads | dict(gates=gates, hn=hn, states=states))
    return gru_fwd_epilogue(steps, y, gates, hn, states)


@on_tensors_device
def gru_bwd_triton(
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
    """:func:`tandem.ops.gru.reference.gru_bwd_ref` with the time loop in Triton (same outputs)."""
    d_, batch, hid = h0.shape
    total = x.shape[0]
    two = d_ == 2
    dgates, dn_in, grad_steps, xs, h_prev = _temporaries(
        x,
        (d_, total, 3 * hid),
        (d_, total, hid),
        (d_ if two else 0, total, hid),
        (d_ if two else 0, total, x.shape[1]),
        (d_, total, hid),
    )
    steps, states, grad_out, dh_n = gru_bwd_prologue(dy, dh_n, x, batch_sizes, h0, y, states, grad_steps)
    grad_out = grad_out.contiguous()
    w_hh = w_hh.contiguous()
    meta = _common_meta(x, hid)
    persistent = _persistent_meta("bwd", x, hid)
    if persistent:
        # rounded to h0's dtype here, as the per-step loop's carry (Triton's interpreter rounds float32 to
        # bfloat16 toward zero, torch to nearest); contiguous, as the kernel writes it (empty_like kept
        # the strides of a permuted h0)
        dh0 = torch.empty(h0.shape, dtype=compute_dtype(x.dtype)[0], device=h0.device)
        grid = (d_, triton.cdiv(batch, persistent["BLOCK_B"]))
        rows = step_rows(steps, x.device)
        _gru_bwd_persistent[grid](
            dh_n.contiguous(), dh0, grad_out, gates, hn, states, w_hh, dgates, dn_in, rows, len(steps.sizes),
            batch, total, **meta, **persistent,
        )  # fmt: skip
        dh0 = dh0.to(h0.dtype)
    else:
        meta |= _step_meta("bwd", x.dtype, batch, hid)
        # the carried gradient ping-pongs between two buffers, both starting as dh_n; the last one written
        # holds dh0
        last = f"carry{len(steps.sizes) % 2}"

        split_now = split_backward(BWD_SPLIT, CUDA_GRAPHS)
        split = _split_meta(x.dtype, batch, hid, meta) if split_now else None

        def loop(b: dict[str, Tensor]) -> None:
            carry = (b["carry0"], b["carry1"])
            for i, s in enumerate(range(len(steps.sizes) - 1, -1, -1)):
                n, row0, dh_in, dh_out = steps.sizes[s], steps.offsets[s], carry[i % 2], carry[(i + 1) % 2]
                if split:
                    ew, product = split
                    grid = (d_, triton.cdiv(n, ew["BLOCK_B"]), triton.cdiv(hid, ew["BLOCK_J"]))
                    _gru_bwd_gates[grid](
                        dh_in, dh_out, b["grad_out"], b["gates"], b["hn"], b["states"], b["dgates"],
                        b["dn_in"], row0, n, batch, total, **ew,
                    )  # fmt: skip
                    grid = (d_, triton.cdiv(n, product["BLOCK_B"]), triton.cdiv(hid, product["BLOCK_N"]))
                    step_product[grid](b["dgates"], b["w_hh"], dh_out, row0, n, batch, total, **product)
                    continue
                grid = (d_, triton.cdiv(n, meta["BLOCK_B"]), triton.cdiv(hid, meta["BLOCK_K"]))
                _gru_bwd_step[grid](
                    dh_in, dh_out, b["grad_out"], b["gates"], b["hn"], b["states"], b["w_hh"], b["dgates"],
                    b["dn_in"], row0, n, batch, total, **meta,
                )  # fmt: skip

        carry0 = dh_n.to(compute_dtype(x.dtype)[0], copy=True).contiguous()
        reads = dict(carry0=carry0, carry1=carry0.clone(), grad_out=grad_out, gates=gates, hn=hn)
        reads |= dict(states=states.contiguous(), w_hh=w_hh)
        if CUDA_GRAPHS:
            key = ("bwd", x.device, x.dtype, d_, batch, hid, total, tuple(steps.sizes))
            key += (tuple(sorted(meta.items())), split_now)
            updates = {last: reads.pop(last)}
            out = STEP_GRAPHS.run(key, loop, reads, updates, {}, dict(dgates=dgates, dn_in=dn_in))
            dgates, dn_in, dh0 = out["dgates"], out["dn_in"], out[last]
        else:
            loop(reads | dict(dgates=dgates, dn_in=dn_in))
            dh0 = reads[last]
        dh0 = dh0.to(h0.dtype)
    dx, dw_ih, dw_hh, db_ih, db_hh = gru_bwd_epilogue(
        steps, x, h0, w_ih, states, dgates, dn_in, has_bias, need_dx, xs, h_prev
    )
    return dx, dh0, dw_ih, dw_hh, db_ih, db_hh
