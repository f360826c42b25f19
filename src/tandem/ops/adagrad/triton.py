"""Triton kernel of ``tandem::adagrad_step``: one launch updates every tensor of a (device, dtype) group.

Multi-tensor layout: the host writes a small int64 table (hyper-parameters as float64 bits, then per
tensor the element offsets of ``p, g, sum`` from a base tensor, the address of its ``step`` and its
length) and a cached chunk table (tensor index and first element of every ``CHUNK``-element piece).
Offsets from a base pointer argument, rather than raw addresses, let Triton prove 16-byte alignment:
whole chunks then use 16-byte loads and stores (checked on the sm_90 PTX in the tests).

Program ``i_c`` updates chunk ``i_c``: it reads ``p, g, sum`` once, writes ``p, sum`` once (and ``g``
once when AMP's ``grad_scale`` unscales it, as torch's fused kernels do), and, for ``tol``, reduces
``|p_new - p_old|`` of its chunk to one float32 partial maximum; a one-launch ``amax`` over the partials
finishes the reduction without a host sync.

The arithmetic follows torch's rounding for rounding: FMAs where torch's CPU kernels have them
(``addcmul``'s ``sum + g*g`` and ``add``'s ``g + wd*p``, measured on an AVX-512 build), IEEE division and
square root (``div_rn``, ``sqrt_rn``) and no other contraction; ``clr`` is computed in float64 from the
device step, as torch does on the host. The remaining float32 differences from
``torch.optim.Adagrad(foreach=False)`` on CPU come from torch's CPU square root, which is not correctly
rounded (off by ~0.7 ulp on some inputs). Half-precision tensors are computed in float32 and rounded once
per stored value.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from tandem._device import on_tensors_device
from tandem.ops.adagrad.reference import bump_versions

__all__ = ["adagrad_step_triton"]

_BLOCK = 1024  # elements per vector op: 4 warps x 32 lanes x 8 elements
_CHUNK = 4 * _BLOCK  # elements per program: 10M parameters make ~2.4k programs
_NUM_WARPS = 4

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@triton.jit
def _div(a, b, IEEE_F32: tl.constexpr):
    if IEEE_F32:
        return tl.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _sqrt(a, IEEE_F32: tl.constexpr):
    if IEEE_F32:
        return tl.sqrt_rn(a)
    else:
        return tl.sqrt(a)


@triton.jit
def _load(ptr, m, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=m, other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _store(ptr, value, m, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=m)
    else:
        tl.store(ptr, value)


@triton.jit
def _adagrad_block(
    p_p, p_g, p_s, o, m, clr, weight_decay, eps, scale, acc,
    DTYPE: tl.constexpr, COMPUTE: tl.constexpr, MASKED: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, TRACK: tl.constexpr,
):  # fmt: skip
    """Update the BLOCK elements ``o`` of one tensor; returns ``acc`` raised by their ``|p_new - p_old|``."""
    IEEE_F32: tl.constexpr = tl.float32 == COMPUTE
    b_p = _load(p_p + o, m, MASKED).to(COMPUTE)
    b_g = _load(p_g + o, m, MASKED).to(COMPUTE)
    b_s = _load(p_s + o, m, MASKED).to(COMPUTE)
    if HAS_GRAD_SCALE:
        b_g = _div(b_g, scale, IEEE_F32)
        _store(p_g + o, b_g.to(DTYPE), m, MASKED)
    if MAXIMIZE:
        b_g = -b_g
    # torch's CPU and CUDA kernels both contract these two into FMAs (add with alpha, addcmul).
    if HAS_WEIGHT_DECAY:
        b_g = tl.fma(b_p, weight_decay, b_g)
    b_s = tl.fma(b_g, b_g, b_s)
    b_std = _sqrt(b_s, IEEE_F32) + eps
    b_new = (b_p - _div(clr * b_g, b_std, IEEE_F32)).to(DTYPE)
    _store(p_s + o, b_s.to(DTYPE), m, MASKED)
    _store(p_p + o, b_new, m, MASKED)
    if TRACK:
        b_d = tl.abs(b_new.to(COMPUTE) - b_p)
        # NaN counts as an infinite change: max() would drop it, and a NaN step is not converged.
        b_d = tl.where(b_d == b_d, b_d, float("inf"))
        if MASKED:
            b_d = tl.where(m, b_d, 0.0)
        acc = tl.maximum(acc, b_d.to(tl.float32))
    return acc


@triton.jit
def _adagrad_step_kernel(
    base_ptr,  # DTYPE: one of the tensors; p, g, sum are addressed as element offsets from it
    meta_ptr,  # int64 [4 + 5 * n_tensors]: lr, lr_decay, weight_decay, eps; (p, g, sum, step, numel) rows
    chunk_ptr,  # int64 [2, n_chunks]: tensor index, first element
    n_chunks,
    grad_scale_ptr,  # float32 [1] or dummy
    found_inf_ptr,  # float32 [1] or dummy
    delta_ptr,  # float32 [n_chunks]: partial max |p_new - p_old|, when TRACK
    DTYPE: tl.constexpr,  # storage dtype of p, g, sum
    COMPUTE: tl.constexpr,  # float64 for float64 tensors, float32 otherwise
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    TRACK: tl.constexpr,
    VEC: tl.constexpr,  # every p, g, sum offset is a multiple of VEC elements (16 bytes when > 1)
):
    i_c = tl.program_id(0)
    i_t = tl.load(chunk_ptr + i_c)
    o_start = tl.multiple_of(tl.load(chunk_ptr + n_chunks + i_c), CHUNK)

    lr = tl.load(meta_ptr + 0).to(tl.float64, bitcast=True)
    lr_decay = tl.load(meta_ptr + 1).to(tl.float64, bitcast=True)
    weight_decay = tl.load(meta_ptr + 2).to(tl.float64, bitcast=True).to(COMPUTE)
    eps = tl.load(meta_ptr + 3).to(tl.float64, bitcast=True).to(COMPUTE)
    p_row = meta_ptr + 4 + 5 * i_t
    # Offsets from a kernel argument (which Triton knows to be 16-byte aligned) rather than raw
    # addresses: with the VEC hint and unmasked full chunks the compiler emits 16-byte loads and stores.
    p_p = base_ptr + tl.multiple_of(tl.load(p_row + 0), VEC)
    p_g = base_ptr + tl.multiple_of(tl.load(p_row + 1), VEC)
    p_s = base_ptr + tl.multiple_of(tl.load(p_row + 2), VEC)
    p_step = tl.load(p_row + 3).to(tl.pointer_type(tl.float32))
    n = tl.load(p_row + 4)

    # clr in float64 from the float32 step, rounded once: what torch computes on the host (Python float).
    step = tl.load(p_step).to(tl.float64)
    clr = (lr / (1.0 + (step - 1.0) * lr_decay)).to(COMPUTE)
    scale = 1.0
    if HAS_GRAD_SCALE:
        scale = tl.load(grad_scale_ptr).to(COMPUTE)
    ok = True
    if HAS_FOUND_INF:  # AMP found an inf/NaN gradient: the whole step is skipped, loads included
        ok = tl.load(found_inf_ptr) == 0.0

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if ok:
        if o_start + CHUNK <= n:
            for off in range(0, CHUNK, BLOCK):
                o = o_start + off + tl.arange(0, BLOCK)
                acc = _adagrad_block(
                    p_p, p_g, p_s, o, o, clr, weight_decay, eps, scale, acc,
                    DTYPE, COMPUTE, False, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, TRACK,
                )  # fmt: skip
        else:  # the tensor's last chunk
            for off in range(0, CHUNK, BLOCK):
                o = o_start + off + tl.arange(0, BLOCK)
                acc = _adagrad_block(
                    p_p, p_g, p_s, o, o < n, clr, weight_decay, eps, scale, acc,
                    DTYPE, COMPUTE, True, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, TRACK,
                )  # fmt: skip
    if TRACK:
        tl.store(delta_ptr + i_c, tl.max(acc, axis=0))


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@functools.lru_cache(maxsize=64)
def _chunk_table(numels: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    """int64 [2, n_chunks] (tensor index, first element) for tensors of these lengths; cached per layout."""
    index, start = [], []
    for i, n in enumerate(numels):
        for s in range(0, n, chunk):
            index.append(i)
            start.append(s)
    return torch.tensor([index, start], dtype=torch.int64, device="cpu").to(device)  # not the default device


@on_tensors_device
def adagrad_step_triton(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    track: bool = False,
    block: int = _BLOCK,
    chunk: int = _CHUNK,
) -> torch.Tensor | None:
    """Launch :func:`_adagrad_step_kernel` once for contiguous tensors of one device and dtype.

    ``state_steps`` (float32 0-d, same device) are already counted. Non-contiguous tensors take the plain
    PyTorch path. Returns the largest absolute change (0-d float32, +inf if one is NaN) when ``track``.
    ``block``/``chunk`` exist for tests (small values make several chunks out of tiny tensors).

    Example::

        ps, gs = [torch.zeros(5000, device="cuda")], [torch.ones(5000, device="cuda")]
        ss, ts = [torch.zeros_like(ps[0])], [torch.ones((), device="cuda")]
        adagrad_step_triton(ps, gs, ss, ts, lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
                            maximize=False, track=True)  # tensor(0.1000, device='cuda:0')
    """
    from tandem.ops.adagrad.reference import adagrad_step_ref

    if block & (block - 1) or chunk % block:
        raise ValueError(
            f"adagrad_step_triton: expected a power-of-two block dividing chunk, got {block=}, {chunk=}"
        )
    hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize)
    device, dtype = params[0].device, params[0].dtype
    size = params[0].element_size()
    # The kernel's base pointer: any tensor of the group with storage (an empty one may have address 0).
    anchor = next((p for p in params if p.numel() > 0), params[0])
    base = anchor.data_ptr()
    table = [_f64_bits(lr), _f64_bits(lr_decay), _f64_bits(weight_decay), _f64_bits(eps)]
    numels: list[int] = []
    keep: list[int] = []
    rest: list[int] = []
    aligned = base % 16 == 0
    # One pass (this runs every step, for every tensor): the kernel sees p, g, sum as flat arrays at
    # whole-element offsets from params[0]; anything else takes the plain PyTorch path.
    for i, (p, g, s, t) in enumerate(zip(params, grads, state_sums, state_steps)):
        p_ptr, g_ptr, s_ptr = p.data_ptr(), g.data_ptr(), s.data_ptr()
        flat = p.is_contiguous() and g.is_contiguous() and s.is_contiguous()
        if not flat or (base | p_ptr | g_ptr | s_ptr) % size:
            rest.append(i)
            continue
        n = p.numel()
        if not g.numel() == s.numel() == n:  # the kernel would read past the end
            raise ValueError(f"adagrad: params[{i}], its grad and its sum differ in size")
        if n == 0:
            continue
        aligned = aligned and (p_ptr | g_ptr | s_ptr) % 16 == 0
        table += ((p_ptr - base) // size, (g_ptr - base) // size, (s_ptr - base) // size, t.data_ptr(), n)
        numels.append(n)
        keep.append(i)

    maxima = []
    if rest:
        lists = [[x[i] for i in rest] for x in (params, grads, state_sums, state_steps)]
        m = adagrad_step_ref(*lists, **hyper, grad_scale=grad_scale, found_inf=found_inf, track=track)
        if m is not None:
            maxima.append(m)
    if keep:
        meta = torch.tensor(table, dtype=torch.int64, device="cpu").to(device, non_blocking=True)
        chunks = _chunk_table(tuple(numels), chunk, device)
        n_chunks = chunks.shape[1]
        delta = torch.empty(n_chunks if track else 1, dtype=torch.float32, device=device)
        dummy = delta  # never read: the HAS_* flags below are False when the dummy is passed
        _adagrad_step_kernel[(n_chunks,)](
            anchor,
            meta,
            chunks,
            n_chunks,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            delta,
            DTYPE=_TL_DTYPES[dtype],
            COMPUTE=tl.float64 if dtype == torch.float64 else tl.float32,
            CHUNK=chunk,
            BLOCK=block,
            MAXIMIZE=maximize,
            HAS_WEIGHT_DECAY=weight_decay != 0,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None,
            TRACK=track,
            VEC=16 // size if aligned else 1,
            num_warps=_NUM_WARPS,
            enable_fp_fusion=False,  # only the explicit FMAs: the rest rounds as torch does
        )
        # The kernel wrote behind autograd's back: bump the version counters as an in-place op would.
        bumped = [params[i] for i in keep] + [state_sums[i] for i in keep]
        bump_versions(bumped + [grads[i] for i in keep] if grad_scale is not None else bumped)
        if track:
            maxima.append(delta.amax())
    if not track:
        return None
    if not maxima:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nan_to_num(torch.stack(maxima).amax(), nan=float("inf"), posinf=float("inf"))
