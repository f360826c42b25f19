"""What the Triton kernels of the recurrent ops (GRU, LSTM) share: how a tile product is taken, in which
precision, and how the persistent kernels are launched. Imported only by the Triton modules (Triton is
optional)."""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem._device import to_device
from tandem.ops._packed import PackedSteps

__all__ = [
    "TRITON_VERSION",
    "dot",
    "upcast",
    "tf32",
    "cuda_matmul_tf32",
    "cudnn_rnn_tf32",
    "rnn_tf32",
    "compute_dtype",
    "precision",
    "persistent_meta",
    "step_rows",
    "StepGraphs",
    "gate_tile",
    "step_product",
    "product_meta",
    "split_backward",
]


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (99, 0)  # unreadable: as the newest


# (major, minor) of the Triton that builds the kernels: a kernel table may leave out what one version
# cannot build (torch 2.11's GPU image has Triton 3.6; CI takes the newest).
TRITON_VERSION: tuple[int, int] = _major_minor(triton.__version__)


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr, TF32: tl.constexpr):
    """``acc + a @ b``. "ieee": float32 operands are not rounded to TF32 (Triton's GPU default) unless
    ``TF32`` (see :func:`tf32`); no effect on the other dtypes. ``UPCAST`` (see :func:`upcast`): float32
    operands, exact since bfloat16 products are. The product takes ``acc``'s dtype (Triton 3.6 would
    otherwise ask a float32 one of float64 operands)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=acc.dtype)
    elif TF32:
        return tl.dot(a, b, acc, input_precision="tf32", out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)


@triton.jit
def tanh_half(x):
    """``tanh(x / 2)`` to a few units of the last place, near 0 too, where ``2 sigmoid(x) - 1`` keeps only
    an absolute error of one unit of 0.5's last place (a relative one of 7% at 1e-6, all of it at 1e-9:
    torch's tanh is exact there). Far from 0 ``(1 - e^-|x|) / (1 + e^-|x|)``; near it the Taylor series
    of tanh(y) to y^9, y = |x| / 2, with integer coefficients over 2835 (exact in any dtype: a float
    literal would be float32 in a float64 kernel). No libdevice: the interpreter (CI) has none."""
    ax = tl.abs(x)
    y = 0.5 * ax
    y2 = y * y
    series = y * ((((62.0 * y2 - 153.0) * y2 + 378.0) * y2 - 945.0) * y2 + 2835.0) / 2835.0
    t = tl.exp(-ax)
    far = (1.0 - t) / (1.0 + t)
    # the series' first term left out is 1382/155925 y^11: 8e-9 of tanh at y = 1/4 (float32), 9e-16 at 1/20
    r = tl.where(ax < 0.1, series, far) if x.dtype == tl.float64 else tl.where(ax < 0.5, series, far)
    return tl.where(x < 0, -r, r)


@triton.jit
def gate_tile(p_w, i_d, gate: tl.constexpr, o_j, H: tl.constexpr, G: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Gate ``gate``'s ``[H, H]`` block of ``W[i_d]`` (``p_w``: ``[D, G*H, H]``, contiguous) as a square
    tile over the offsets ``o_j``, zero past H: ``[k, j]`` (W^T, the right operand of ``h @ W^T``) if
    ``TRANSPOSED``, else ``[j, k]``. The persistent kernels load their weights once with it."""
    m_j = o_j < H
    p_rows = p_w + (i_d * G + gate) * H * H  # the gate's first row
    if TRANSPOSED:
        return tl.load(p_rows + o_j[None, :] * H + o_j[:, None], mask=m_j[:, None] & m_j[None, :], other=0.0)
    return tl.load(p_rows + o_j[:, None] * H + o_j[None, :], mask=m_j[:, None] & m_j[None, :], other=0.0)


@triton.jit(do_not_specialize=["row0", "n_rows", "batch", "total"])
def step_product(
    p_a,  # [D, P, K]: a step-packed buffer (the step's gate gradients), contiguous
    p_w,  # [D, K, N]: W_hh, contiguous
    p_out,  # [D, B, N]: out: the carry rows; += the product if ACCUMULATE, else = it
    row0,  # the step's first step-packed row
    n_rows,  # the step's active sequences
    batch,  # B: the carry buffer's rows
    total,  # P
    K: tl.constexpr,
    N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    COMPUTE: tl.constexpr,
    UPCAST: tl.constexpr,
    TF32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The product half of a split backward step (the other half computes the gate gradients element by
    element): ``out[d, b] (+)= a[d, row0 + b] @ W[d]`` for the step's rows, grid ``(D, cdiv(n_rows,
    BLOCK_B), cdiv(N, BLOCK_N))``. A plain tile product over K: no program repeats another's work."""
    i_d = tl.program_id(0).to(tl.int64)  # offsets in int64: D * P * K can pass 2**31
    o_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_b = o_b < n_rows
    m_n = o_n < N
    p_a_rows = p_a + i_d * total * K + (row0 + o_b).to(tl.int64)[:, None] * K
    p_w_d = p_w + i_d * K * N + o_n[None, :]
    b_acc = tl.zeros((BLOCK_B, BLOCK_N), COMPUTE)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_a = tl.load(p_a_rows + o_k[None, :], mask=m_b[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w_d + o_k[:, None] * N, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = dot(b_a, b_w, b_acc, UPCAST, TF32)
    o_out = i_d * batch * N + o_b[:, None] * N + o_n[None, :]
    m = m_b[:, None] & m_n[None, :]
    if ACCUMULATE:
        b_acc += tl.load(p_out + o_out, mask=m, other=0.0).to(COMPUTE)
    tl.store(p_out + o_out, b_acc.to(p_out.dtype.element_ty), mask=m)


def product_meta(dtype: torch.dtype, batch: int, k: int, n: int, most: int = 64) -> dict:
    """Block sizes and launch options of :func:`step_product` for a ``[batch, k] x [k, n]`` step, no
    block over ``most`` (the tests shrink it to get several blocks out of tiny shapes). Swept on an H100
    at T100-B32-H512 (BLOCK_K 16-128 x BLOCK_N 16-64 x 4/8 warps, both cells, float32 and bfloat16): no
    variant beat these by more than the timings' spread (about 10%)."""
    block = lambda size, hi: max(16, min(hi, most, triton.next_power_of_2(size)))
    f64 = dtype == torch.float64
    return dict(
        BLOCK_B=block(batch, 16 if f64 else 32),
        BLOCK_K=block(k, 32 if f64 else 64),
        BLOCK_N=block(n, 32),
        num_warps=4,
        enable_fp_fusion=True,
    )


def split_backward(split: bool | None, graphs: bool) -> bool:
    """Whether a per-step backward runs split in two launches a step: a cell module's ``BWD_SPLIT``, where
    None follows its ``CUDA_GRAPHS`` (split wins only where the loop is replayed as a graph, without the
    second launch from the host each step)."""
    return graphs if split is None else bool(split)


def upcast(x: Tensor) -> bool:
    """Triton kernels see CPU tensors only under the interpreter, whose bfloat16 ``tl.dot`` multiplies the
    bit patterns as integers (triton-lang/triton#11584): there bfloat16 tiles go through float32."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def tf32(x: Tensor) -> bool:
    """Float32 products in TF32 on GPUs exactly when torch's own RNN would use it (:func:`rnn_tf32`);
    exact otherwise."""
    return x.dtype == torch.float32 and x.is_cuda and rnn_tf32()


def rnn_tf32() -> bool:
    """Whether torch.nn.GRU/LSTM on a GPU multiply float32 in TF32: its cuDNN kernels where cuDNN is
    enabled (TF32 by default, :func:`cudnn_rnn_tf32`), else its native kernels, whose products are
    cuBLAS matmuls (exact by default, :func:`cuda_matmul_tf32`): ``torch.backends.cudnn.flags(enabled=
    False)``, the usual way to a double backward through torch's RNNs, gave tandem TF32 and torch not."""
    cudnn = torch.backends.cudnn
    return cudnn_rnn_tf32() if cudnn.enabled and cudnn.is_available() else cuda_matmul_tf32()


def cuda_matmul_tf32() -> bool:
    """Whether torch's cuBLAS matmuls multiply float32 in TF32 (``torch.set_float32_matmul_precision``):
    ``torch.backends.cuda.matmul.fp32_precision``, "none" deferring to torch's generic one, where torch
    has them (reading the legacy flag there raises once the two APIs were mixed); older torch:
    ``torch.backends.cuda.matmul.allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    own = getattr(matmul, "fp32_precision", None)
    if own is None:
        return bool(matmul.allow_tf32)
    for precision in (own, getattr(torch.backends, "fp32_precision", "none")):
        if precision != "none":
            return precision == "tf32"
    return False


def cudnn_rnn_tf32() -> bool:
    """Whether torch lets its cuDNN RNNs multiply float32 in TF32. Where torch has per-operator settings
    (``torch.backends.cudnn.rnn.fp32_precision``), the RNN's own: "tf32" or "ieee", "none" deferring to
    cuDNN's setting, then torch's generic one, and none of them set (what turning the legacy
    ``allow_tf32`` off leaves) meaning exact. Reading the legacy flag there raises once the RNN's and
    the convolutions' settings differ. Older torch: ``torch.backends.cudnn.allow_tf32``."""
    cudnn = torch.backends.cudnn
    rnn = getattr(getattr(cudnn, "rnn", None), "fp32_precision", None)
    if rnn is None:
        return bool(cudnn.allow_tf32)
    for precision in (
        rnn,
        getattr(cudnn, "fp32_precision", "none"),
        getattr(torch.backends, "fp32_precision", "none"),
    ):
        if precision != "none":
            return precision == "tf32"
    return False


def compute_dtype(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype]:
    """The math and carry dtype for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def precision(x: Tensor) -> str:
    """How the tiles of ``x`` are multiplied, the key of the persistent kernels' tables: "half" (bfloat16 or
    float16), "fp64", "tf32" (float32, see :func:`tf32`) or "fp32"."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return "half"
    if x.dtype == torch.float64:
        return "fp64"
    return "tf32" if tf32(x) else "fp32"


def persistent_meta(
    warps: dict[int, int], time_loop: str, hid: int, max_buildable: int | None = None
) -> dict | None:
    """Block sizes and launch options of a persistent kernel for hidden size ``hid``, or None where the
    per-step kernels run. ``warps`` maps the padded hidden sizes (BLOCK_H) whose build holds the weights
    without spilling to their num_warps; ``time_loop`` is the module's TIME_LOOP: "auto" (the persistent
    kernel for the sizes in ``warps``), "persistent" or "per-step" (for every size). Padded sizes above
    ``max_buildable`` (None: no limit), which the running Triton cannot build, run per-step whatever
    ``time_loop`` says."""
    block = max(16, triton.next_power_of_2(hid))
    if time_loop == "per-step" or (max_buildable is not None and block > max_buildable):
        return None
    num_warps = warps.get(block)
    if num_warps is None:
        if time_loop != "persistent":
            return None
        num_warps = 8
    return dict(BLOCK_B=16, BLOCK_H=block, num_warps=num_warps, enable_fp_fusion=True)


def step_rows(steps: PackedSteps, device: torch.device) -> Tensor:
    """``[2, T]`` int32 on ``device``: the active sequences of each step, then its first step-packed row."""
    return to_device(torch.tensor([steps.sizes, steps.offsets], dtype=torch.int32, device="cpu"), device)


class StepGraphs:
    """Per-step launch loops recorded once per problem and replayed: no host gap between the steps.

    ``run(key, loop, reads, updates, writes, scratch)`` keeps, per ``key`` (everything the launches depend
    on: shapes, step sizes, dtypes, block sizes), static buffers shaped like the given ones and ``loop``
    (which takes the dict of static buffers) recorded over them. Each call copies ``reads`` and
    ``updates`` into the static buffers, replays, and returns fresh copies of ``updates`` and ``writes``
    (saved for the backward, so the next call must not overwrite them) and the static ``scratch`` buffers
    themselves (valid until the next call). On a GPU the record is
    a CUDA graph (one warm-up run first, so Triton compiles outside the capture); on the CPU (Triton's
    interpreter, the tests) replaying calls the loop again, which exercises the same buffer handling.
    The ``capacity`` most recently used problems are kept.
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._entries: dict = {}

    def run(
        self,
        key: tuple,
        loop,
        reads: dict[str, Tensor],
        updates: dict[str, Tensor],
        writes: dict[str, Tensor],
        scratch: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        entry = self._entries.pop(key, None)
        if entry is None:
            # plain tensors even when first seen under inference_mode (later calls outside it copy into
            # them); leaving inference_mode turns autograd back on, which the recording must not record into
            # (an out= product of buffers cloned from inputs that require grad fails)
            with torch.inference_mode(False), torch.no_grad():
                static = {n: t.clone() for n, t in (reads | updates).items()}
                static |= {n: torch.empty_like(t) for n, t in (writes | scratch).items()}
                entry = (static, _record(lambda: loop(static), next(iter(static.values())).device))
            while len(self._entries) >= self.capacity:
                self._entries.pop(next(iter(self._entries)))
        self._entries[key] = entry  # most recently used last
        static, replay = entry
        for name, t in (reads | updates).items():
            static[name].copy_(t)
        replay()
        out = {name: static[name].clone() for name in (*updates, *writes)}
        return out | {name: static[name] for name in scratch}

    def clear(self) -> None:
        self._entries.clear()


def _record(fn, device: torch.device):
    """``fn``'s launches as a replayable callable: a CUDA graph on GPUs, ``fn`` itself elsewhere. Both
    run ``fn`` once first, in the caller's context (on a GPU, the warm-up that compiles the kernels)."""
    if device.type != "cuda":
        fn()
        return fn
    with torch.cuda.device(device):  # the capture and Triton's launches follow the current device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()  # compiles the kernels, outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return replay
