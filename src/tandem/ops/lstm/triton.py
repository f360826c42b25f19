"""Triton kernels of ``tandem::lstm_fwd`` / ``tandem::lstm_bwd``: fused time steps, both directions and
every active sequence of the batch in one launch per step, or in one launch for the whole time loop.

Only the two time loops of :mod:`tandem.ops.lstm.reference` are replaced; the work before and after them
(the input projection of all steps and both directions as one batched matmul, the output copies, h_n /
c_n, and dW_ih, dW_hh, the biases' and dx's gradients as large batched matmuls) is the reference's own
code (:func:`~tandem.ops.lstm.reference.fwd_prologue` and friends), and the saved buffers have the same
shapes and meaning: (i, f, sigmoid(2 a_g), o), C = 2c, o * tanh(c) and the reverse direction's states,
step-packed and direction-major, so the Triton forward's buffers compare with the reference's directly.

Forward, one launch per step s, grid ``(D, cdiv(sizes[s], BLOCK_B), cdiv(H, BLOCK_H))``: program ``(d,
b-block, j-block)`` accumulates ``h_prev @ W_hh[d]^T`` for its columns of the four gates over a loop on ``R``
(``tl.dot``, float32 accumulation; float32 products in TF32 only where torch.nn.LSTM's cuDNN kernels would
take it: :func:`tandem.ops._triton_rnn.cudnn_rnn_tf32`), adds the input projection read from the gates buffer,
applies the gate nonlinearities and the cell update, and writes the activations (in place over the
projection), C and ``o * tanh(c)``. ``h_prev`` and ``C_prev`` are read at row offsets into ``h0`` / ``2 c0``
(step 0) or the step-packed ``states`` / ``cells`` buffers (later steps): the host only passes offsets, it
never slices in the loop. Only the first ``sizes[s]`` sequences exist at step s, and the step-packed layout
already makes the reverse direction's step s of sequence b its frame ``len_b - 1 - s``, so padding costs
nothing. With a projection (proj_size), ``h = (o * tanh(c)) @ W_hr^T`` is one ``torch.bmm`` per step on the
step's rows, both directions at once: fusing it would need all H columns of a row in one program, while the
kernel splits them over j-blocks.

Backward, one launch per step in reverse, grid ``(D, cdiv(sizes[s], BLOCK_B), cdiv(R, BLOCK_R))``:
program ``(d, b-block, r-block)`` walks the H columns in blocks, recomputes the gate gradients of its rows
elementwise from the saved activations (cheap, and no ``[D, P, 4H]`` of local derivatives is built), and
accumulates ``dz @ W_hh[d][:, r-block]`` into ``dh_prev`` with ``tl.dot``; the programs of r-block 0 also
store ``dz`` (into the ``[D, P, 4H]`` buffer the post-loop matmuls read) and ``dc_prev = dc * f``. The
carries dL/dh and dL/dc live in two ping-pong ``[D, B, .]`` buffers each (float32 for half inputs), both
seeded with ``dh_n`` / ``dc_n``: a step reads one and writes the other, since programs of one launch read
rows that others write. Rows of sequences that end at step s were never written and still hold their
``dh_n``; rows below ``sizes[s+1]`` hold the carry of step s+1. After step 0 they are ``dh0`` and ``dc0``.
The output gradient ``dy`` (step-packed) is added as dh is loaded. With a projection the host adds the
carry to ``dy`` (that full dL/dh is kept for dW_hr) and maps it back with one ``torch.bmm`` per step.

float32, float64, bfloat16 and float16 inputs; float32 math (float64 for float64) and accumulation,
activations and gradients stored in the input dtype like the reference. Any B, H, I, R: tiles are masked.
Under the interpreter (CPU tensors) bfloat16 matmuls take float32 operands
(:func:`tandem.ops._triton_rnn.upcast`); the GPU build multiplies bfloat16 on the tensor cores, which
gives the same products.

Persistent kernels, without a projection and for the small hidden sizes where a direction's four recurrent
weight tiles stay in registers (``_PERSISTENT_WARPS``): one launch runs the whole time loop, grid ``(D,
cdiv(B, BLOCK_B))``. A program owns every column of its rows, so h and C (forward) or the carried dL/dh and
dL/dc (backward) never leave its registers and no program waits for another; the weights are read once.
Each step's active rows and first packed row come from a small ``[2, T]`` table, and a block whose
sequences have all ended (or, in reverse, not started) skips the step; in the backward, rows that have not
started keep their dh_n and dc_n. h and C are rounded to the buffers' dtype between steps, as the per-step
kernels read them back, and the saved buffers are the same, so either backward reads either forward.

``CUDA_GRAPHS`` records each problem's per-step loop (the projection's per-step bmm included) once and
replays it, as the GRU's (:class:`tandem.ops._triton_rnn.StepGraphs`); off by default, never captured on
a GPU yet (the tests run the same buffer handling around a plain replay on the CPU).

Not done yet: measuring and turning on ``CUDA_GRAPHS``, no persistent kernel with a projection (the
per-step bmm stays) or for larger hidden sizes (weights spread over several programs, a grid-wide barrier
per step); block sizes and pipeline stages are untuned; nothing here has been run or timed on a GPU yet.
``TIME_LOOP`` picks the loop for every size, for measuring one against the other. The kernels are tested
with Triton's interpreter on the CPU (``TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1``), and the tests compile
them ahead of time for sm_90 to check the matmul instructions, the shared memory and, for the persistent
kernels, that nothing spills to local memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem._device import on_tensors_device
from tandem.ops._packed import PackedSteps
from tandem.ops._triton_rnn import (
    TRITON_VERSION,
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
from tandem.ops.lstm.reference import _gate_scale, dy_by_direction, fwd_epilogue, fwd_prologue, param_grads

__all__ = ["lstm_fwd_triton", "lstm_bwd_triton"]

# Untuned starting points (no GPU timing yet): 4 float32 accumulators of 32 x 32 per program.
_BLOCK_B_MAX = 32  # tl.dot needs >= 16 rows on GPUs, so small batches still take a 16-row tile
_BLOCK_H = 32
_BLOCK_R = 32
# Two pipeline stages: three put the float64 backward at 208 KB of shared memory, past an A100's 163 KB
# (the same on sm_80 and sm_90 builds; the tests check the sm_90 one). FMA contraction on, and said so:
# Triton 3.10 turns its default off, and the fused form is the more accurate one.
LAUNCH_OPTIONS = dict(num_warps=4, num_stages=2, enable_fp_fusion=True)

# Which time loop runs: "auto" (the persistent kernels where _PERSISTENT_WARPS has the hidden size, the
# per-step kernels elsewhere), or "persistent" / "per-step" for every size (tests, benchmarks). With a
# projection the per-step kernels always run.
TIME_LOOP = "auto"

# Whether the per-step backward runs as two launches a step, dz and dc_prev element by element
# (_lstm_bwd_gates) and then dh_prev = dz @ W_hh as a tile product over every column block (step_product),
# instead of the fused _lstm_bwd_kernel, whose R / BLOCK_R programs of a row block each recompute the gate
# gradients of all H columns. None (the default): split where the loops are recorded as CUDA graphs
# (CUDA_GRAPHS), fused elsewhere. Timed on an H100 at T100-B32-I512-H512 (one direction, a training step;
# docs/notes/triton-rnn.md v3.3): split 2.06x (float32) and 1.41x (bfloat16) the fused with graphs, 0.91x
# and 0.95x without. The tests run both.
BWD_SPLIT: bool | None = None
_SPLIT_BLOCK = 64  # the largest block of the split step's kernels (the tests shrink it)

# Whether the per-step loops are recorded once per problem and replayed (CUDA graphs on GPUs), as the
# GRU's: off by default, as there; tests run it on the CPU.
CUDA_GRAPHS = False
STEP_GRAPHS = StepGraphs()

# The persistent kernels keep a direction's four recurrent weight tiles in registers for the whole time
# loop. They run for the hidden sizes (padded to BLOCK_H) where the sm_90 build holds them without
# spilling to local memory (bfloat16 and float16 alike for "half"), with the fewest num_warps that does
# it: 8 rather than 4 for the float32 forward at 32, whose 4-warp build sits at 254 registers (as the
# GRU's), and for the half backward at 16, whose float16 4-warp build spills one register. Found by
# compiling ahead of time (Triton 3.9, `cuobjdump -res-usage`), checked by tests/ops/test_lstm_triton.py.
# Keyed by kernel and precision (tandem.ops._triton_rnn.precision). Four tiles instead of the GRU's
# three, and a backward that holds two carries: larger sizes spill (half forward H128, backward H64,
# with 4, 8 or 16 warps) and run the per-step kernels.
_PERSISTENT_WARPS = {
    ("fwd", "half"): {16: 4, 32: 4, 64: 8},
    ("bwd", "half"): {16: 8, 32: 8},
    ("fwd", "tf32"): {16: 4, 32: 4, 64: 8},
    ("bwd", "tf32"): {16: 4},
    ("fwd", "fp32"): {16: 4, 32: 8},
    ("bwd", "fp32"): {16: 4, 32: 8},
    ("fwd", "fp64"): {16: 4, 32: 4},
    ("bwd", "fp64"): {16: 4},
}
# The largest padded size the running Triton can build at all, by kernel and precision (none: no limit):
# above it the per-step kernels run even when TIME_LOOP asks for the persistent ones.
_PERSISTENT_MAX_BUILDABLE: dict[tuple[str, str], int] = {}
if TRITON_VERSION < (3, 7):
    # Triton 3.6 (torch 2.11's, the GPU image's): its LLVM aborts the process (an assertion in the SLP
    # vectorizer) building the half backward for sm_90 at 32, 64 and 128, with any num_warps, and the
    # float64 backward spills at 16 (432 to 1912 bytes of stack with 2 to 16 warps). Triton 3.7 to 3.9
    # build both.
    del _PERSISTENT_WARPS["bwd", "half"][32]
    _PERSISTENT_MAX_BUILDABLE["bwd", "half"] = 16
    _PERSISTENT_WARPS["bwd", "fp64"] = {}


@triton.jit(do_not_specialize=["o_row", "o_prev", "s_prev_d", "n", "P"])
def _lstm_fwd_kernel(
    p_gates,  # [D, P, 4H] in: the step's input projection; out: (i, f, sigmoid(2 a_g), o)
    p_cells,  # [D, P, H] out: C = 2c
    p_h,  # [D, P, H] out: o * tanh(c) (``hr`` with a projection, ``states`` without)
    p_hprev,  # [D, B, R] h0 at step 0, else ``states`` [D, P, R]
    p_cprev,  # [D, B, H] 2 c0 at step 0, else ``cells`` [D, P, H]
    p_w,  # [D, 4H, R] W_hh with the g rows doubled
    o_row,  # first packed row of the step
    o_prev,  # row of sequence 0's previous state in p_hprev / p_cprev
    s_prev_d,  # rows per direction of p_hprev / p_cprev (B at step 0, P later)
    n,  # active sequences at this step
    P,
    H,
    R,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see dot
    TF32: tl.constexpr,  # see dot
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i_d, i_b, i_j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = i_j * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b = o_b < n
    m_j = o_j < H
    # Rows in int64 before they meet a width: D * P * 4H passes 2**31 on long batches.
    r_row = (i_d * P + o_row + o_b).to(tl.int64)
    r_prev = (i_d * s_prev_d + o_prev + o_b).to(tl.int64)
    r_w = (i_d * 4 * H + o_j).to(tl.int64)  # W_hh rows of gate i; gate k is k * H rows further

    b_zi = tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE)
    b_zf = tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE)
    b_zg = tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE)
    b_zo = tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE)
    for r0 in range(0, R, BLOCK_R):
        o_r = r0 + tl.arange(0, BLOCK_R)
        m_r = o_r < R
        m_h = m_b[:, None] & m_r[None, :]
        b_h = tl.load(p_hprev + r_prev[:, None] * R + o_r[None, :], mask=m_h, other=0.0)
        p_wt = p_w + r_w[None, :] * R + o_r[:, None]  # [BLOCK_R, BLOCK_H]: W_hh^T tile of gate i
        m_w = m_r[:, None] & m_j[None, :]
        b_zi = dot(b_h, tl.load(p_wt, mask=m_w, other=0.0), b_zi, UPCAST, TF32)
        b_zf = dot(b_h, tl.load(p_wt + H * R, mask=m_w, other=0.0), b_zf, UPCAST, TF32)
        b_zg = dot(b_h, tl.load(p_wt + 2 * H * R, mask=m_w, other=0.0), b_zg, UPCAST, TF32)
        b_zo = dot(b_h, tl.load(p_wt + 3 * H * R, mask=m_w, other=0.0), b_zo, UPCAST, TF32)

    m = m_b[:, None] & m_j[None, :]
    p_g = p_gates + r_row[:, None] * (4 * H) + o_j[None, :]
    b_i = tl.sigmoid(b_zi + tl.load(p_g, mask=m, other=0.0).to(COMPUTE))
    b_f = tl.sigmoid(b_zf + tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE))
    b_ag = b_zg + tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE)  # 2 a_g
    b_sg = tl.sigmoid(b_ag)  # saved for the backward
    b_o = tl.sigmoid(b_zo + tl.load(p_g + 3 * H, mask=m, other=0.0).to(COMPUTE))
    b_cp = tl.load(p_cprev + r_prev[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    # As the reference: C = 2c, so C = f C_prev + 2 i g, with g = tanh(a_g) and tanh(c) = tanh_half(C)
    b_c = b_f * b_cp + 2.0 * b_i * tanh_half(b_ag)
    b_hn = b_o * tanh_half(b_c)

    DTYPE = p_gates.dtype.element_ty
    tl.store(p_g, b_i.to(DTYPE), mask=m)
    tl.store(p_g + H, b_f.to(DTYPE), mask=m)
    tl.store(p_g + 2 * H, b_sg.to(DTYPE), mask=m)
    tl.store(p_g + 3 * H, b_o.to(DTYPE), mask=m)
    tl.store(p_cells + r_row[:, None] * H + o_j[None, :], b_c.to(DTYPE), mask=m)
    tl.store(p_h + r_row[:, None] * H + o_j[None, :], b_hn.to(DTYPE), mask=m)


@triton.jit
def _gate_grads(b_i, b_f, b_sg, b_o, b_c, b_cp, b_dh, b_dc):
    """The step's pre-activation gate gradients ``(dz_i, dz_f, dz_g, dz_o)`` and its full dL/dc, element
    by element, from the saved activations (i, f, sigmoid(2 a_g), o), C = 2c and C_prev, dL/dh of its
    state and the dL/dc carried from the next step."""
    b_tc = 2.0 * tl.sigmoid(b_c) - 1.0  # tanh(c) from the saved C = 2c
    b_dc += b_dh * b_o * (1.0 - b_tc * b_tc)
    b_dzi = b_dc * (2.0 * b_sg - 1.0) * b_i * (1.0 - b_i)
    b_dzf = b_dc * (0.5 * b_cp) * b_f * (1.0 - b_f)
    b_dzg = b_dc * b_i * 2.0 * b_sg * (1.0 - b_sg)  # d/dz_g of g = 2 sigmoid(z_g) - 1, z_g = 2 a_g
    b_dzo = b_dh * b_tc * b_o * (1.0 - b_o)
    return b_dzi, b_dzf, b_dzg, b_dzo, b_dc


@triton.jit
def _tile_gate_grads(
    p_gates, p_cells, p_cprev, p_dh, p_dhin, p_dcin, p_dz, p_dcout, r_row, r_prev, r_dh, r_carry, o_j, m,
    store, H, R, HAS_DH: tl.constexpr, HAS_DHIN: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """A tile (rows ``r_*``, columns ``o_j``) of the per-step backward's elementwise half (the fused and the
    split kernels): loads what :func:`_gate_grads` takes, stores dz and dc_prev = dc * f if ``store``, and
    returns dz's four gates rounded to its dtype (half inputs: what the MMA and the post-loop matmuls
    read)."""
    DTYPE = p_dz.dtype.element_ty
    p_g = p_gates + r_row[:, None] * (4 * H) + o_j[None, :]
    b_i = tl.load(p_g, mask=m, other=0.0).to(COMPUTE)
    b_f = tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE)
    b_sg = tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE)
    b_o = tl.load(p_g + 3 * H, mask=m, other=0.0).to(COMPUTE)
    b_c = tl.load(p_cells + r_row[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    b_cp = tl.load(p_cprev + r_prev[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    b_dh = tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE)
    if HAS_DH:
        b_dh += tl.load(p_dh + r_dh[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    if HAS_DHIN:
        b_dh += tl.load(p_dhin + r_carry[:, None] * R + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    b_dc = tl.load(p_dcin + r_carry[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
    b_dzi, b_dzf, b_dzg, b_dzo, b_dc = _gate_grads(b_i, b_f, b_sg, b_o, b_c, b_cp, b_dh, b_dc)
    b_dzi, b_dzf, b_dzg, b_dzo = b_dzi.to(DTYPE), b_dzf.to(DTYPE), b_dzg.to(DTYPE), b_dzo.to(DTYPE)
    if store:
        p_z = p_dz + r_row[:, None] * (4 * H) + o_j[None, :]
        tl.store(p_z, b_dzi, mask=m)
        tl.store(p_z + H, b_dzf, mask=m)
        tl.store(p_z + 2 * H, b_dzg, mask=m)
        tl.store(p_z + 3 * H, b_dzo, mask=m)
        p_dc = p_dcout + r_carry[:, None] * H + o_j[None, :]
        tl.store(p_dc, (b_dc * b_f).to(p_dcout.dtype.element_ty), mask=m)
    return b_dzi, b_dzf, b_dzg, b_dzo


@triton.jit(do_not_specialize=["o_row", "o_prev", "s_prev_d", "o_dh", "s_dh_d", "n", "P", "B"])
def _lstm_bwd_kernel(
    p_gates,  # [D, P, 4H] saved (i, f, sigmoid(2 a_g), o)
    p_cells,  # [D, P, H] saved C = 2c
    p_cprev,  # [D, B, H] 2 c0 at step 0, else ``cells``
    p_dh,  # [D, ., H] dL/dh from outside the recurrence: step-packed dy, or with a projection the
    # step's full dL/dh mapped back through W_hr ([D, n, H])
    p_dhin,  # [D, B, R] carry dL/dh from step s+1 (seeded with dh_n)
    p_dcin,  # [D, B, H] carry dL/dc from step s+1 (seeded with dc_n)
    p_dhout,  # [D, B, R] out: carry to step s-1 (dh0 after step 0)
    p_dcout,  # [D, B, H] out: carry to step s-1 (dc0 after step 0)
    p_dz,  # [D, P, 4H] out: dL/dz of the (g-doubled) pre-activations
    p_w,  # [D, 4H, R] W_hh with the g rows doubled
    o_row,  # first packed row of the step
    o_prev,  # row of sequence 0's previous cell state in p_cprev
    s_prev_d,  # rows per direction of p_cprev (B at step 0, P later)
    o_dh,  # row of sequence 0 in p_dh
    s_dh_d,  # rows per direction of p_dh
    n,  # active sequences at this step
    P,
    B,
    H,
    R,
    HAS_DH: tl.constexpr,  # p_dh holds something (dy was given, or a projection)
    HAS_DHIN: tl.constexpr,  # add the dh carry here (without projection; with one it is in p_dh)
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see dot
    TF32: tl.constexpr,  # see dot
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i_d, i_b, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_b = o_b < n
    m_r = o_r < R
    r_row = (i_d * P + o_row + o_b).to(tl.int64)
    r_prev = (i_d * s_prev_d + o_prev + o_b).to(tl.int64)
    r_dh = (i_d * s_dh_d + o_dh + o_b).to(tl.int64)
    r_carry = (i_d * B + o_b).to(tl.int64)
    b_acc = tl.zeros([BLOCK_B, BLOCK_R], dtype=COMPUTE)  # dh_prev of the r-block
    for j0 in range(0, H, BLOCK_H):
        o_j = j0 + tl.arange(0, BLOCK_H)
        m_j = o_j < H
        m = m_b[:, None] & m_j[None, :]
        # one program per row block (r-block 0) stores the elementwise outputs
        b_dzi, b_dzf, b_dzg, b_dzo = _tile_gate_grads(
            p_gates, p_cells, p_cprev, p_dh, p_dhin, p_dcin, p_dz, p_dcout, r_row, r_prev, r_dh, r_carry, o_j,
            m, i_r == 0, H, R, HAS_DH, HAS_DHIN, COMPUTE, BLOCK_B, BLOCK_H,
        )  # fmt: skip
        p_w_j = p_w + (i_d * 4 * H + o_j).to(tl.int64)[:, None] * R + o_r[None, :]  # [BLOCK_H, BLOCK_R]
        m_w = m_j[:, None] & m_r[None, :]
        b_acc = dot(b_dzi, tl.load(p_w_j, mask=m_w, other=0.0), b_acc, UPCAST, TF32)
        b_acc = dot(b_dzf, tl.load(p_w_j + H * R, mask=m_w, other=0.0), b_acc, UPCAST, TF32)
        b_acc = dot(b_dzg, tl.load(p_w_j + 2 * H * R, mask=m_w, other=0.0), b_acc, UPCAST, TF32)
        b_acc = dot(b_dzo, tl.load(p_w_j + 3 * H * R, mask=m_w, other=0.0), b_acc, UPCAST, TF32)

    p_dho = p_dhout + r_carry[:, None] * R + o_r[None, :]
    tl.store(p_dho, b_acc.to(p_dhout.dtype.element_ty), mask=m_b[:, None] & m_r[None, :])


@triton.jit(do_not_specialize=["o_row", "o_prev", "s_prev_d", "o_dh", "s_dh_d", "n", "P", "B"])
def _lstm_bwd_gates(
    p_gates,  # [D, P, 4H] saved (i, f, sigmoid(2 a_g), o)
    p_cells,  # [D, P, H] saved C = 2c
    p_cprev,  # [D, B, H] 2 c0 at step 0, else ``cells``
    p_dh,  # [D, ., H] dL/dh from outside the recurrence, as _lstm_bwd_kernel's
    p_dhin,  # [D, B, R] carry dL/dh from step s+1 (seeded with dh_n)
    p_dcin,  # [D, B, H] carry dL/dc from step s+1 (seeded with dc_n)
    p_dcout,  # [D, B, H] out: carry to step s-1 (dc0 after step 0)
    p_dz,  # [D, P, 4H] out: dL/dz of the (g-doubled) pre-activations
    o_row,  # first packed row of the step
    o_prev,  # row of sequence 0's previous cell state in p_cprev
    s_prev_d,  # rows per direction of p_cprev (B at step 0, P later)
    o_dh,  # row of sequence 0 in p_dh
    s_dh_d,  # rows per direction of p_dh
    n,  # active sequences at this step
    P,
    B,
    H,
    R,
    HAS_DH: tl.constexpr,
    HAS_DHIN: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The elementwise half of a split backward step (``BWD_SPLIT``), grid ``(D, cdiv(n, BLOCK_B),
    cdiv(H, BLOCK_H))``: each program computes dz and dc_prev = dc * f of its own tile once; then
    :func:`tandem.ops._triton_rnn.step_product` writes dh_prev = dz @ W_hh."""
    i_d = tl.program_id(0)
    o_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (o_b < n)[:, None] & (o_j < H)[None, :]
    r_row = (i_d * P + o_row + o_b).to(tl.int64)
    r_prev = (i_d * s_prev_d + o_prev + o_b).to(tl.int64)
    r_dh = (i_d * s_dh_d + o_dh + o_b).to(tl.int64)
    r_carry = (i_d * B + o_b).to(tl.int64)
    _tile_gate_grads(
        p_gates, p_cells, p_cprev, p_dh, p_dhin, p_dcin, p_dz, p_dcout, r_row, r_prev, r_dh, r_carry, o_j, m,
        True, H, R, HAS_DH, HAS_DHIN, COMPUTE, BLOCK_B, BLOCK_H,
    )  # fmt: skip


@triton.jit(do_not_specialize=["n_steps", "B", "P"])
def _lstm_fwd_persistent(
    p_gates,  # [D, P, 4H] in: the input projection; out: (i, f, sigmoid(2 a_g), o)
    p_cells,  # [D, P, H] out: C = 2c
    p_states,  # [D, P, H] out: o * tanh(c)
    p_h0,  # [D, B, H]
    p_c0,  # [D, B, H] 2 c0
    p_w,  # [D, 4H, H] W_hh with the g rows doubled, contiguous
    p_rows,  # [2, T] int32: active sequences of each step, then each step's first step-packed row
    n_steps,  # T
    B,
    P,
    H: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see dot
    TF32: tl.constexpr,  # see dot
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: a program owns every column of its rows
):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = tl.arange(0, BLOCK_H)
    m_j = o_j < H
    # W_hh^T of the four gates, [k, j] tiles read once and kept in registers for every step
    b_wi = gate_tile(p_w, i_d, 0, o_j, H, 4, True)
    b_wf = gate_tile(p_w, i_d, 1, o_j, H, 4, True)
    b_wg = gate_tile(p_w, i_d, 2, o_j, H, 4, True)
    b_wo = gate_tile(p_w, i_d, 3, o_j, H, 4, True)
    # h and C in the buffers' dtype: rounded as the per-step kernel reads them back from memory
    r_0 = (i_d * B + o_b).to(tl.int64)
    m_0 = (o_b < B)[:, None] & m_j[None, :]
    b_h = tl.load(p_h0 + r_0[:, None] * H + o_j[None, :], mask=m_0, other=0.0)
    b_cs = tl.load(p_c0 + r_0[:, None] * H + o_j[None, :], mask=m_0, other=0.0)
    DTYPE = p_gates.dtype.element_ty
    for s in range(0, n_steps):
        n = tl.load(p_rows + s)
        if i_b * BLOCK_B < n:  # sequences are sorted by length: a block's rows end together or stay ended
            o_row = tl.load(p_rows + n_steps + s)
            m = (o_b < n)[:, None] & m_j[None, :]
            r_row = (i_d * P + o_row + o_b).to(tl.int64)
            b_zi = dot(b_h, b_wi, tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE), UPCAST, TF32)
            b_zf = dot(b_h, b_wf, tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE), UPCAST, TF32)
            b_zg = dot(b_h, b_wg, tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE), UPCAST, TF32)
            b_zo = dot(b_h, b_wo, tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE), UPCAST, TF32)
            p_g = p_gates + r_row[:, None] * (4 * H) + o_j[None, :]
            b_i = tl.sigmoid(b_zi + tl.load(p_g, mask=m, other=0.0).to(COMPUTE))
            b_f = tl.sigmoid(b_zf + tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE))
            b_ag = b_zg + tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE)
            b_sg = tl.sigmoid(b_ag)
            b_o = tl.sigmoid(b_zo + tl.load(p_g + 3 * H, mask=m, other=0.0).to(COMPUTE))
            b_c = b_f * b_cs.to(COMPUTE) + 2.0 * b_i * tanh_half(b_ag)  # as _lstm_fwd_kernel
            b_hn = b_o * tanh_half(b_c)
            tl.store(p_g, b_i.to(DTYPE), mask=m)
            tl.store(p_g + H, b_f.to(DTYPE), mask=m)
            tl.store(p_g + 2 * H, b_sg.to(DTYPE), mask=m)
            tl.store(p_g + 3 * H, b_o.to(DTYPE), mask=m)
            # the padding columns stay 0: an infinite state (inf * 0 in the product) would leave NaN there,
            # which the next step's product spreads to every column (torch's layer stays finite)
            b_cs = tl.where(m_j[None, :], b_c, 0.0).to(DTYPE)
            b_h = tl.where(m_j[None, :], b_hn, 0.0).to(DTYPE)
            tl.store(p_cells + r_row[:, None] * H + o_j[None, :], b_cs, mask=m)
            tl.store(p_states + r_row[:, None] * H + o_j[None, :], b_h, mask=m)


@triton.jit(do_not_specialize=["n_steps", "B", "P"])
def _lstm_bwd_persistent(
    p_gates,  # [D, P, 4H] saved (i, f, sigmoid(2 a_g), o)
    p_cells,  # [D, P, H] saved C = 2c
    p_c0,  # [D, B, H] 2 c0
    p_dy,  # [D, P, H] the outputs' dL/dh, step-packed (read only if HAS_DY)
    p_dhn,  # [D, B, H] dL/dh_n
    p_dcn,  # [D, B, H] dL/dc_n
    p_dh0,  # [D, B, H] out: dL/dh0 (in the compute dtype)
    p_dc0,  # [D, B, H] out: dL/dc0 (in the compute dtype)
    p_dz,  # [D, P, 4H] out: dL/dz of the (g-doubled) pre-activations
    p_w,  # [D, 4H, H] W_hh with the g rows doubled, contiguous
    p_rows,  # [2, T] int32: active sequences of each step, then each step's first step-packed row
    n_steps,  # T
    B,
    P,
    H: tl.constexpr,
    HAS_DY: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,  # see dot
    TF32: tl.constexpr,  # see dot
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: a program owns every column of its rows
):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_j = tl.arange(0, BLOCK_H)
    m_j = o_j < H
    # W_hh of the four gates, [j, k] tiles read once and kept in registers for every step
    b_wi = gate_tile(p_w, i_d, 0, o_j, H, 4, False)
    b_wf = gate_tile(p_w, i_d, 1, o_j, H, 4, False)
    b_wg = gate_tile(p_w, i_d, 2, o_j, H, 4, False)
    b_wo = gate_tile(p_w, i_d, 3, o_j, H, 4, False)
    # the carries dL/dh and dL/dc, in the compute dtype as the per-step kernel's buffers
    r_carry = (i_d * B + o_b).to(tl.int64)
    m_carry = (o_b < B)[:, None] & m_j[None, :]
    p_carry = r_carry[:, None] * H + o_j[None, :]
    b_dhc = tl.load(p_dhn + p_carry, mask=m_carry, other=0.0).to(COMPUTE)
    b_dcc = tl.load(p_dcn + p_carry, mask=m_carry, other=0.0).to(COMPUTE)
    DTYPE = p_dz.dtype.element_ty
    for i in range(0, n_steps):
        s = n_steps - 1 - i
        n = tl.load(p_rows + s)
        if i_b * BLOCK_B < n:
            o_row = tl.load(p_rows + n_steps + s)
            m_b = o_b < n
            m = m_b[:, None] & m_j[None, :]
            r_row = (i_d * P + o_row + o_b).to(tl.int64)
            if s > 0:  # C_prev: the previous step's row of ``cells``, 2 c0 at step 0
                r_prev = (i_d * P + tl.load(p_rows + n_steps + s - 1) + o_b).to(tl.int64)
                b_cp = tl.load(p_cells + r_prev[:, None] * H + o_j[None, :], mask=m, other=0.0)
            else:
                b_cp = tl.load(p_c0 + p_carry, mask=m, other=0.0)
            b_cp = b_cp.to(COMPUTE)
            b_dh = b_dhc
            if HAS_DY:
                b_dh += tl.load(p_dy + r_row[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
            p_g = p_gates + r_row[:, None] * (4 * H) + o_j[None, :]
            b_i = tl.load(p_g, mask=m, other=0.0).to(COMPUTE)
            b_f = tl.load(p_g + H, mask=m, other=0.0).to(COMPUTE)
            b_sg = tl.load(p_g + 2 * H, mask=m, other=0.0).to(COMPUTE)
            b_o = tl.load(p_g + 3 * H, mask=m, other=0.0).to(COMPUTE)
            b_c = tl.load(p_cells + r_row[:, None] * H + o_j[None, :], mask=m, other=0.0).to(COMPUTE)
            b_dzi, b_dzf, b_dzg, b_dzo, b_dc = _gate_grads(b_i, b_f, b_sg, b_o, b_c, b_cp, b_dh, b_dcc)
            b_dzi, b_dzf, b_dzg, b_dzo = b_dzi.to(DTYPE), b_dzf.to(DTYPE), b_dzg.to(DTYPE), b_dzo.to(DTYPE)
            p_z = p_dz + r_row[:, None] * (4 * H) + o_j[None, :]
            tl.store(p_z, b_dzi, mask=m)
            tl.store(p_z + H, b_dzf, mask=m)
            tl.store(p_z + 2 * H, b_dzg, mask=m)
            tl.store(p_z + 3 * H, b_dzo, mask=m)

            b_acc = dot(b_dzi, b_wi, tl.zeros([BLOCK_B, BLOCK_H], dtype=COMPUTE), UPCAST, TF32)
            b_acc = dot(b_dzf, b_wf, b_acc, UPCAST, TF32)
            b_acc = dot(b_dzg, b_wg, b_acc, UPCAST, TF32)
            b_acc = dot(b_dzo, b_wo, b_acc, UPCAST, TF32)
            # rows that have not started yet (shorter sequences) keep their dh_n and dc_n
            b_dhc = tl.where(m_b[:, None], b_acc, b_dhc)
            b_dcc = tl.where(m_b[:, None], b_dc * b_f, b_dcc)
    tl.store(p_dh0 + p_carry, b_dhc.to(p_dh0.dtype.element_ty), mask=m_carry)
    tl.store(p_dc0 + p_carry, b_dcc.to(p_dc0.dtype.element_ty), mask=m_carry)


def _blocks(batch: int, hid: int, out_size: int) -> tuple[int, int, int]:
    """Tile sizes, read from the module's constants at each call (the tests shrink them to get several
    tiles out of tiny shapes)."""
    block_b = min(_BLOCK_B_MAX, max(16, triton.next_power_of_2(batch)))
    block_h = min(_BLOCK_H, max(16, triton.next_power_of_2(hid)))
    block_r = min(_BLOCK_R, max(16, triton.next_power_of_2(out_size)))
    return block_b, block_h, block_r


def _step_meta(kind: str, dtype: torch.dtype, batch: int, hid: int, out_size: int) -> dict:
    """Block sizes and launch options of the per-step ``kind`` ("fwd"/"bwd") kernel: both the same today
    (:func:`_blocks`, LAUNCH_OPTIONS), untuned on a GPU; one function, so that a sweep can set the
    backward's alone (benchmarks/gpu_sweep_bwd.py)."""
    block_b, block_h, block_r = _blocks(batch, hid, out_size)
    return dict(BLOCK_B=block_b, BLOCK_H=block_h, BLOCK_R=block_r, **LAUNCH_OPTIONS)


def _split_meta(dtype: torch.dtype, batch: int, hid: int, out_size: int, meta: dict) -> tuple[dict, dict]:
    """Launch options of the split backward step's two kernels (``BWD_SPLIT``): the gate gradients'
    (``_lstm_bwd_gates``) and the product's (``step_product``); ``meta`` holds the fused kernel's flags
    (HAS_DH, HAS_DHIN, COMPUTE, UPCAST, TF32). Not tuned on a GPU yet."""
    block = lambda size, hi: max(16, min(hi, _SPLIT_BLOCK, triton.next_power_of_2(size)))
    gates = {k: meta[k] for k in ("HAS_DH", "HAS_DHIN", "COMPUTE")} | dict(num_warps=4, enable_fp_fusion=True)
    gates |= dict(BLOCK_B=block(batch, 32), BLOCK_H=block(hid, 64))
    product = {k: meta[k] for k in ("COMPUTE", "UPCAST", "TF32")}
    product |= dict(K=4 * hid, N=out_size, ACCUMULATE=False)
    return gates, product | product_meta(dtype, batch, 4 * hid, out_size, _SPLIT_BLOCK)


def _persistent_meta(kind: str, x: Tensor, hid: int, has_proj: bool) -> dict | None:
    """Block sizes and launch options of the persistent ``kind`` ("fwd"/"bwd") kernel for ``x`` and
    hidden size ``hid``, or None where the per-step kernels run: always with a projection, else as
    TIME_LOOP, _PERSISTENT_WARPS and _PERSISTENT_MAX_BUILDABLE say."""
    if has_proj:
        return None
    key = kind, precision(x)
    return persistent_meta(_PERSISTENT_WARPS[key], TIME_LOOP, hid, _PERSISTENT_MAX_BUILDABLE.get(key))


@on_tensors_device
def lstm_fwd_triton(
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
    """:func:`~tandem.ops.lstm.reference.lstm_fwd_ref` with the time loop in Triton: same arguments,
    outputs and saved buffers.

    Example::

        T, B, I, H = 5, 3, 4, 8
        x, h0, c0 = torch.randn(T * B, I, device="cuda"), *torch.zeros(2, 2, B, H, device="cuda")
        w_ih, w_hh = torch.randn(2, 4 * H, I, device="cuda"), torch.randn(2, 4 * H, H, device="cuda")
        y, h_n, c_n, *saved = lstm_fwd_triton(x, torch.full((T,), B), h0, c0, w_ih, w_hh, None, None, None)
        # y: [15, 16], h_n and c_n: [2, 3, 8]
    """
    # Fresh buffers rather than the CPU kernel's per-thread workspace: CUDA's caching allocator already
    # reuses memory, and a workspace handed from call to call would ignore stream order.
    fwd = fwd_prologue(x, batch_sizes, h0, c0, w_ih, b_ih, b_hh, w_hr, need_saved, reuse=False)
    d_, batch, hid = c0.shape
    out_size, total = h0.shape[2], x.shape[0]
    steps = fwd.steps
    w_hh_s = (w_hh * fwd.scale).contiguous()  # [D, 4H, R], g rows doubled
    h0c, c0x2 = h0.contiguous(), (c0 * 2.0).contiguous()  # the cell state is kept doubled
    compute = compute_dtype(x.dtype)[1]
    persistent = _persistent_meta("fwd", x, hid, w_hr is not None)
    if persistent:
        grid = (d_, triton.cdiv(batch, persistent["BLOCK_B"]))
        _lstm_fwd_persistent[grid](
            fwd.gates, fwd.cells, fwd.states, h0c, c0x2, w_hh_s, step_rows(steps, x.device),
            len(steps.sizes), batch, total, H=hid, COMPUTE=compute, UPCAST=upcast(x), TF32=tf32(x),
            **persistent,
        )  # fmt: skip
        return fwd_epilogue(fwd, batch, need_saved, False)

    has_proj = w_hr is not None
    meta = dict(COMPUTE=compute, UPCAST=upcast(x), TF32=tf32(x)) | _step_meta(
        "fwd", x.dtype, batch, hid, out_size
    )
    block_b, block_h = meta["BLOCK_B"], meta["BLOCK_H"]

    def loop(b: dict[str, Tensor]) -> None:
        # without a projection the kernel writes the states itself (``hr`` is ``states``)
        hr = b["hr"] if has_proj else b["states"]
        if has_proj:
            projections = list(zip(steps.split(hr), steps.split(b["states"])))
        for s, n in enumerate(steps.sizes):
            grid = (d_, triton.cdiv(n, block_b), triton.cdiv(hid, block_h))
            if s == 0:
                h_prev, c_prev, o_prev, s_prev_d = b["h0c"], b["c0x2"], 0, batch
            else:
                h_prev, c_prev, o_prev, s_prev_d = b["states"], b["cells"], steps.offsets[s - 1], total
            _lstm_fwd_kernel[grid](
                b["gates"], b["cells"], hr, h_prev, c_prev, b["w_hh_s"], steps.offsets[s], o_prev, s_prev_d,
                n, total, hid, out_size, **meta,
            )  # fmt: skip
            if has_proj:
                hr_s, h_s = projections[s]
                torch.bmm(hr_s, b["w_hr_t"], out=h_s)

    reads = dict(h0c=h0c, c0x2=c0x2, w_hh_s=w_hh_s)
    if has_proj:
        reads["w_hr_t"] = w_hr.transpose(1, 2)  # [D, H, R]
    writes = dict(cells=fwd.cells, states=fwd.states) | (dict(hr=fwd.hr) if has_proj else {})
    if CUDA_GRAPHS:
        key = ("fwd", x.device, x.dtype, d_, batch, hid, out_size, total, tuple(steps.sizes), need_saved)
        key += (tuple(sorted(meta.items())),)
        out = STEP_GRAPHS.run(key, loop, reads, dict(gates=fwd.gates), writes, {})
        states = out["states"]
        y = states.view(total, out_size) if d_ == 1 else fwd.y  # one direction: the states are the output
        hr = out["hr"] if has_proj else states
        fwd = fwd._replace(y=y, gates=out["gates"], cells=out["cells"], hr=hr, states=states)
    else:
        loop(reads | dict(gates=fwd.gates) | writes)
    return fwd_epilogue(fwd, batch, need_saved, has_proj)


@on_tensors_device
def lstm_bwd_triton(
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
    """:func:`~tandem.ops.lstm.reference.lstm_bwd_ref` with the time loop in Triton: same arguments and
    outputs, ``(dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr)``.

    Example::

        y, h_n, c_n, *saved = lstm_fwd_triton(x, bs, h0, c0, w_ih, w_hh, None, None, None)
        dx, dh0, dc0, dw_ih, dw_hh, _, _, _ = lstm_bwd_triton(
            torch.ones_like(y), None, None, x, bs, h0, c0, w_ih, w_hh, None, y, *saved, False
        )
    """
    d_, batch, hid = c0.shape
    total, out_size = x.shape[0], h0.shape[2]
    steps = PackedSteps.build(batch_sizes, total, batch, d_, x.device, op="lstm")
    sizes, offsets = steps.sizes, steps.offsets
    scale = _gate_scale(hid, x)
    if d_ == 1:
        states = y.view(1, total, out_size)
    if w_hr is None:
        hr = states
    compute, tl_compute = compute_dtype(x.dtype)
    dz = x.new_empty(d_, total, 4 * hid)  # dL/dz: [D, P, 4H]
    # dL/dh from the outputs, step-packed; with a projection it becomes the full dL/dh that dW_hr needs.
    grad_h = None
    if dy is not None or w_hr is not None:
        grad_h = dy_by_direction(dy, steps, out=x.new_empty(d_, total, out_size))  # [D, P, R]
    w_hh_s = (w_hh * scale).contiguous()  # [D, 4H, R], g rows doubled
    c0x2 = (c0 * 2.0).contiguous()

    persistent = _persistent_meta("bwd", x, hid, w_hr is not None)
    if persistent:
        # dh0 and dc0 in the compute dtype, rounded here as the per-step path rounds its carries (Triton's
        # interpreter rounds float32 to bfloat16 toward zero, torch and the GPU build to nearest even)
        dh0, dc0 = (torch.empty(d_, batch, hid, dtype=compute, device=x.device) for _ in range(2))
        dh_n = dh_n.contiguous() if dh_n is not None else x.new_zeros(d_, batch, hid)
        dc_n = dc_n.contiguous() if dc_n is not None else x.new_zeros(d_, batch, hid)
        grid = (d_, triton.cdiv(batch, persistent["BLOCK_B"]))
        _lstm_bwd_persistent[grid](
            gates, cells, c0x2, grad_h if grad_h is not None else dz, dh_n, dc_n, dh0, dc0, dz, w_hh_s,
            step_rows(steps, x.device), len(sizes), batch, total, H=hid, HAS_DY=grad_h is not None,
            COMPUTE=tl_compute, UPCAST=upcast(x), TF32=tf32(x), **persistent,
        )  # fmt: skip
        dh0, dc0 = dh0.to(x.dtype), dc0.to(x.dtype)
    else:
        has_proj, has_dh = w_hr is not None, grad_h is not None
        meta = dict(HAS_DH=has_dh, HAS_DHIN=not has_proj, COMPUTE=tl_compute, UPCAST=upcast(x), TF32=tf32(x))
        meta |= _step_meta("bwd", x.dtype, batch, hid, out_size)
        block_b, block_r = meta["BLOCK_B"], meta["BLOCK_R"]
        split_now = split_backward(BWD_SPLIT, CUDA_GRAPHS)
        split = _split_meta(x.dtype, batch, hid, out_size, meta) if split_now else None

        def loop(b: dict[str, Tensor]) -> None:
            # the carries ping-pong: step s reads pair i_in and writes the other
            dh_pp, dc_pp = (b["dh_pp0"], b["dh_pp1"]), (b["dc_pp0"], b["dc_pp1"])
            # with a projection each step first turns dy + carry into dL/dh (kept in grad_h) and maps it
            # back through W_hr into ``work``
            g_h = steps.split(b["grad_h"]) if has_proj else None
            for s in range(len(sizes) - 1, -1, -1):
                n = sizes[s]
                i_in = (len(sizes) - 1 - s) % 2
                c_prev = (b["c0x2"], 0, batch) if s == 0 else (b["cells"], offsets[s - 1], total)
                if has_proj:
                    dh_src = b["work"][: d_ * n * hid].view(d_, n, hid)  # [D, n, H]
                    g_h[s].add_(dh_pp[i_in][:, :n])
                    torch.bmm(g_h[s], b["w_hr"], out=dh_src)
                    dh_args = (dh_src, 0, n)
                else:
                    dh_args = (b["grad_h"] if has_dh else b["dz"], offsets[s], total)
                if split:
                    ew, product = split
                    grid = (d_, triton.cdiv(n, ew["BLOCK_B"]), triton.cdiv(hid, ew["BLOCK_H"]))
                    dh_out, dc_out = dh_pp[1 - i_in], dc_pp[1 - i_in]
                    _lstm_bwd_gates[grid](
                        b["gates"], b["cells"], c_prev[0], dh_args[0], dh_pp[i_in], dc_pp[i_in], dc_out,
                        b["dz"], offsets[s], c_prev[1], c_prev[2], dh_args[1], dh_args[2], n, total, batch,
                        hid, out_size, **ew,
                    )  # fmt: skip
                    grid = (d_, triton.cdiv(n, product["BLOCK_B"]), triton.cdiv(out_size, product["BLOCK_N"]))
                    step_product[grid](b["dz"], b["w_hh_s"], dh_out, offsets[s], n, batch, total, **product)
                    continue
                grid = (d_, triton.cdiv(n, block_b), triton.cdiv(out_size, block_r))
                _lstm_bwd_kernel[grid](
                    b["gates"], b["cells"], c_prev[0], dh_args[0], dh_pp[i_in], dc_pp[i_in], dh_pp[1 - i_in],
                    dc_pp[1 - i_in], b["dz"], b["w_hh_s"], offsets[s], c_prev[1], c_prev[2], dh_args[1],
                    dh_args[2], n, total, batch, hid, out_size, **meta,
                )  # fmt: skip

        # The carries, two of each, both seeded with the final states' gradients.
        def seeded(last: Tensor | None, size: int) -> Tensor:
            t = torch.empty(d_, batch, size, dtype=compute, device=x.device)
            return t.zero_() if last is None else t.copy_(last)

        reads = dict(dh_pp0=seeded(dh_n, out_size), dc_pp0=seeded(dc_n, hid))
        reads |= dict(dh_pp1=reads["dh_pp0"].clone(), dc_pp1=reads["dc_pp0"].clone())
        reads |= dict(gates=gates, cells=cells, c0x2=c0x2, w_hh_s=w_hh_s)
        if has_proj:
            reads["w_hr"] = w_hr.contiguous()
        updates = dict(grad_h=grad_h) if has_dh else {}  # a projection adds the carries into grad_h
        scratch = dict(dz=dz) | (dict(work=x.new_empty(d_ * batch * hid)) if has_proj else {})
        i_out = len(sizes) % 2  # the pair step 0 wrote
        for name in (f"dh_pp{i_out}", f"dc_pp{i_out}"):
            updates[name] = reads.pop(name)
        if CUDA_GRAPHS:
            key = ("bwd", x.device, x.dtype, d_, batch, hid, out_size, total, tuple(sizes))
            key += (tuple(sorted(meta.items())), split_now)
            out = STEP_GRAPHS.run(key, loop, reads, updates, {}, scratch)
        else:
            out = reads | updates | scratch
            loop(out)
        dz, grad_h = out["dz"], out["grad_h"] if has_dh else None
        dh0, dc0 = out[f"dh_pp{i_out}"].to(x.dtype), out[f"dc_pp{i_out}"].to(x.dtype)

    dx, dw_ih, dw_hh, db_ih, db_hh, dw_hr = param_grads(
        dz, grad_h, x, h0, states, hr, w_ih, w_hr, steps, scale, has_bias, need_dx
    )
    return dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr
