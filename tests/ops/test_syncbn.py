"""The ops tandem::syncbn_*: the stable merge, masked statistics, gradcheck, opcheck, the Triton kernels.

Everything here runs in one process (the multi-process checks are in tests/nn/test_syncbn_module.py);
an all_reduce is simulated by summing the packed per-rank tensors, which is what it computes.

The Triton tests (``test_triton_kernel_*``) run on CUDA when there is a GPU. On CPU they need Triton's
interpreter, which ``tandem._backend`` only honours when the environment says so at import time, so
``test_triton_kernels_under_interpreter`` runs them in a fresh ``pytest`` process with
``TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1``; in this process they are skipped.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tandem import _backend
from tandem.ops.syncbn import _SyncBatchNorm, sync_batch_norm
from tandem.ops.syncbn.reference import (
    merge_stats_ref,
    syncbn_bwd_reduce_ref,
    syncbn_bwd_ref,
    syncbn_fwd_ref,
    syncbn_pack_ref,
    syncbn_stats_ref,
    syncbn_unpack_ref,
)
from triton_support import (
    TRITON_DEVICE,
    compile_sm90,
    local_memory_bytes,
    needs_triton,
    run_under_interpreter,
    sm90_signature,
)

OPS = torch.ops.tandem


def _merged(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the ranks' gathered statistics merge into: (mean, biased var, count) in float64."""
    packed = torch.stack([syncbn_pack_ref(*OPS.syncbn_stats(p, None)) for p in parts])
    mean, m2, n = syncbn_unpack_ref(packed)
    return mean, m2 / n, n


@pytest.mark.parametrize(
    "sizes", [[3, 5], [0, 1, 7], [1, 1], [16, 0, 2, 30]], ids=lambda s: "-".join(map(str, s))
)
def test_merge_equals_whole_batch(sizes):
    x = torch.randn(sum(sizes), 4, 6, dtype=torch.float64) * 3 + 1
    mean, var, n = _merged(list(x.split(sizes)))
    assert n.item() == sum(sizes) * 6
    torch.testing.assert_close(mean, x.mean((0, 2)))
    torch.testing.assert_close(var, x.var((0, 2), correction=0))


@pytest.mark.parametrize("offset", [1e5, 1e7, 1.7e9])
def test_merge_is_accurate_at_large_offset_float64(offset):
    """float64 statistics at a mean of up to a timestamp's (1.7e9 s) with std 1: the ranks' statistics
    are merged from centred differences; a merge of sums (n m^2 summed, then N m^2 taken off) left
    nothing of the variance at 1.7e9 (35.8 for 0.98) and 3e-2 of error at 1e7."""
    x = offset + torch.randn(9, 8, 40, dtype=torch.float64)
    mean, var, _ = _merged(list(x.split([0, 1, 3, 5])))
    torch.testing.assert_close(mean, x.mean((0, 2)), rtol=1e-15, atol=0)
    torch.testing.assert_close(var, x.var((0, 2), correction=0), rtol=1e-6, atol=0)


@pytest.mark.parametrize("offset", [1e2, 1e4, 1e5])
def test_merge_is_accurate_at_large_offset_float32(offset):
    """|mean|/std up to 1e5 in float32 on uneven parts: mean and variance to ~1e-5 relative, where the
    plain sum / sum-of-squares merge (the founding method) is wrong by orders of magnitude at 1e4."""
    x = offset + torch.randn(9, 8, 40)
    exact = x.double()
    mean, var, _ = _merged(list(x.split([0, 1, 3, 5])))
    true_var = exact.var((0, 2), correction=0)
    assert (mean - exact.mean((0, 2))).abs().max() <= 1e-6
    assert ((var - true_var) / true_var).abs().max() < 1e-5
    if offset >= 1e4:
        n = x.numel() / 8
        naive = (x * x).sum((0, 2)) / n - (x.sum((0, 2)) / n) ** 2
        assert ((naive.double() - true_var) / true_var).abs().max() > 0.5


def _large_offset_step(device: str) -> None:
    """One masked (so: the ops, not F.batch_norm) training step at mean/std = 1e4 in float32 against
    float64: output and input gradient within 1e-5 (torch's float32 BatchNorm: ~5e-4)."""
    import tandem

    full = 1e4 + torch.randn(6, 4, 30, dtype=torch.float64)
    grad = torch.randn(full.shape, dtype=torch.float64)
    x = full.float().to(device).requires_grad_()
    bn = tandem.nn.SyncBatchNorm(4).to(device)
    y = bn(x, mask=torch.ones(6, 30, dtype=torch.bool, device=device))
    (y * grad.float().to(device)).sum().backward()
    exact = torch.nn.BatchNorm1d(4, dtype=torch.float64)
    x64 = full.float().double().requires_grad_()
    y64 = exact(x64)
    (y64 * grad).sum().backward()
    assert (y.cpu().double() - y64).abs().max() < 1e-5
    assert (x.grad.cpu().double() - x64.grad).abs().max() < 1e-5
    torch.testing.assert_close(bn.running_var.cpu().double(), exact.running_var, atol=0, rtol=1e-6)


def test_large_offset_step():
    _large_offset_step("cpu")


def test_merge_stats_ref_chan():
    x = 1e4 + torch.randn(20, 3, dtype=torch.float64)
    parts = [x[:1], x[1:1], x[1:12], x[12:]]
    count = torch.tensor([float(len(p)) for p in parts], dtype=torch.float64)
    mean = torch.stack([p.mean(0) if len(p) else torch.zeros(3, dtype=x.dtype) for p in parts])
    m2 = torch.stack(
        [((p - p.mean(0)) ** 2).sum(0) if len(p) else torch.zeros(3, dtype=x.dtype) for p in parts]
    )
    n, m, s = merge_stats_ref(count, mean, m2)
    assert n.item() == 20
    torch.testing.assert_close(m, x.mean(0))
    torch.testing.assert_close(s / 20, x.var(0, correction=0))


def _masked_input(shape=(5, 3, 7), dtype=torch.float32):
    x = torch.randn(*shape, dtype=dtype) * 2 + 1
    mask = torch.rand(shape[0], *shape[2:]) < 0.6
    mask.view(-1)[0] = True
    return x.masked_fill(~mask.unsqueeze(1), float("nan")), mask


def test_masked_stats_ignore_padding():
    x, mask = _masked_input()
    mean, m2, n = OPS.syncbn_stats(x, mask)
    rows = x.permute(0, 2, 1)[mask].double()  # [M, C] real frames
    assert n.item() == mask.sum().item()
    torch.testing.assert_close(mean, rows.mean(0))
    torch.testing.assert_close((m2 / n).double(), rows.var(0, correction=0))


def test_empty_input_stats_are_zero():
    mean, m2, n = OPS.syncbn_stats(torch.empty(0, 4, 3), None)
    assert n.item() == 0 and not mean.any() and not m2.any()


def test_no_group_no_mask_is_f_batch_norm():
    x = torch.randn(6, 4, 5)
    rm, rv = torch.zeros(4), torch.ones(4)
    rm2, rv2 = rm.clone(), rv.clone()
    w, b = torch.rand(4), torch.randn(4)
    assert torch.equal(
        sync_batch_norm(x, rm, rv, w, b, True, 0.1), F.batch_norm(x, rm2, rv2, w, b, True, 0.1)
    )
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_gradcheck_masked_training(affine):
    x, mask = _masked_input((4, 3, 5), torch.float64)
    x = x.nan_to_num(7.0).requires_grad_()  # gradcheck perturbs every element, padded ones included
    w = torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5 if affine else None
    b = torch.randn(3, dtype=torch.float64, requires_grad=True) if affine else None
    inputs = [t for t in (x, w, b) if t is not None]

    def fn(x, *wb):
        return sync_batch_norm(x, None, None, *(wb or (None, None)), training=True, mask=mask)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_masked_eval():
    x, mask = _masked_input((4, 3, 5), torch.float64)
    x = x.nan_to_num(7.0).requires_grad_()
    w = torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5

    def fn(x, w, b):
        return sync_batch_norm(x, rm, rv, w, b, training=False, mask=mask)

    assert torch.autograd.gradcheck(fn, (x, w, b))


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
def test_eager_path_equals_registered_ops(masked):
    """Eager mode calls the reference kernels directly (lending y/dx as scratch); under a dispatch mode
    (as under torch.compile) the registered ops run. Same numbers, same layout."""
    x, mask = _masked_input((4, 3, 6, 5))
    x = x.nan_to_num(3.0).contiguous(memory_format=torch.channels_last)
    mask = mask if masked else None
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    results = []
    for mode in (contextlib.nullcontext(), _PassThrough()):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        rm, rv = torch.zeros(3), torch.ones(3)
        with mode:
            y = _SyncBatchNorm.apply(xi, wi, bi, mask, rm, rv, True, 0.1, 1e-5, None)
            y.backward(torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin())
        assert y.is_contiguous(memory_format=torch.channels_last)
        results.append((y.detach(), xi.grad, wi.grad, bi.grad, rm, rv))
    for eager, dispatched in zip(*results):
        assert torch.equal(eager, dispatched)


def _op_args():
    x, mask = _masked_input()
    mean, invstd = torch.randn(3), torch.rand(3) + 0.5
    w, b = torch.rand(3), torch.randn(3)
    dy = torch.randn_like(x)
    return x, mask, mean, invstd, w, b, dy


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
def test_opcheck(masked):
    x, mask, mean, invstd, w, b, dy = _op_args()
    x = x.nan_to_num(0.0)
    mask = mask if masked else None
    torch.library.opcheck(OPS.syncbn_stats.default, (x, mask))
    torch.library.opcheck(OPS.syncbn_fwd.default, (x, mean, invstd, w, b, mask))
    torch.library.opcheck(OPS.syncbn_bwd_reduce.default, (dy, x, mean, invstd, mask))
    torch.library.opcheck(
        OPS.syncbn_bwd.default, (dy, x, mean, invstd, w, torch.randn(3), torch.randn(3), mask)
    )


# --------------------------------------------------------------------------------------------------
# Triton kernels against the reference


@pytest.mark.timeout(300)
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__file__, timeout=280)


# name: (shape, memory format or "transposed", masked, dtype, offset)
LAYOUTS = {
    "2d": ((37, 5), None, False, torch.float32, 0.0),
    "2d-mask": ((37, 5), None, True, torch.float32, 0.0),
    "3d": ((3, 5, 70), None, False, torch.float32, 0.0),
    "3d-mask": ((3, 5, 70), None, True, torch.float32, 0.0),
    "3d-transposed-mask": ((3, 5, 70), "transposed", True, torch.float32, 0.0),
    "4d-channels_last": ((2, 9, 5, 7), torch.channels_last, False, torch.float32, 0.0),
    "4d-channels_last-mask": ((2, 9, 5, 7), torch.channels_last, True, torch.float32, 0.0),
    "5d": ((2, 3, 2, 3, 4), None, False, torch.float32, 0.0),
    "3d-float16": ((3, 5, 70), None, False, torch.float16, 0.0),
    "3d-bfloat16-mask": ((3, 5, 70), None, True, torch.bfloat16, 0.0),
    "3d-float64": ((3, 5, 70), None, True, torch.float64, 0.0),
    "3d-offset1e4": ((3, 5, 70), None, False, torch.float32, 1e4),
    "3d-empty": ((0, 5, 70), None, False, torch.float32, 0.0),
}


def _layout_input(name: str, device: str):
    shape, fmt, masked, dtype, offset = LAYOUTS[name]
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5 + offset).to(dtype)
    if fmt == "transposed":  # [N, L, C] memory seen as [N, C, L]
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif fmt is not None:
        x = x.contiguous(memory_format=fmt)
    mask = None
    if masked:
        mask = torch.rand(shape[0], *shape[2:]) < 0.7
        x = x.masked_fill(~mask.unsqueeze(1), float("nan"))
        mask = mask.to(device)
    return x.to(device), mask


def _as_ref(t):
    return None if t is None else t.cpu()


@needs_triton
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_triton_kernel_matches_reference(name):
    """Every op's Triton kernel against the plain-PyTorch reference on the same (CPU copy of the) data,
    outputs in the input's layout; float64 statistics compared tightly, the others to float32 rounding."""
    from tandem.ops.syncbn import triton as tk

    x, mask = _layout_input(name, TRITON_DEVICE)
    xc, maskc = x.cpu(), _as_ref(mask)
    c = x.shape[1]
    exact = x.dtype == torch.float64
    tol = dict(atol=1e-12, rtol=1e-12) if exact else dict(atol=1e-5, rtol=1e-5)

    mean, m2, n = tk.syncbn_stats_triton(x, mask)
    mean_r, m2_r, n_r = syncbn_stats_ref(xc, maskc)
    assert n.item() == n_r.item()
    torch.testing.assert_close(
        mean.cpu(), mean_r, atol=tol["atol"] + abs(LAYOUTS[name][4]) * 2**-22, rtol=tol["rtol"]
    )
    torch.testing.assert_close(
        m2.cpu(), m2_r, atol=1e-3 if not exact else 1e-9, rtol=1e-4 if not exact else 1e-12
    )

    acc = m2_r.dtype
    mean_g = torch.randn(c, dtype=torch.float64) + LAYOUTS[name][4]
    invstd = torch.rand(c, dtype=acc) + 0.5
    w, b = torch.rand(c, dtype=acc) + 0.5, torch.randn(c, dtype=acc)
    dev = x.device
    for weight, bias in ((w, b), (None, None)):
        y = tk.syncbn_fwd_triton(x, mean_g.to(dev), invstd.to(dev), _to(weight, dev), _to(bias, dev), mask)
        y_r = syncbn_fwd_ref(xc, mean_g, invstd, weight, bias, maskc)
        assert y.stride() == x.stride() and y.dtype == x.dtype
        _close_lowp(y.cpu(), y_r)

    dy = torch.randn(x.shape, dtype=torch.float64).to(x.dtype).to(dev).expand_as(x)  # any layout
    sdy, sdyx = tk.syncbn_bwd_reduce_triton(dy, x, mean_g.to(dev), invstd.to(dev), mask)
    sdy_r, sdyx_r = syncbn_bwd_reduce_ref(dy.cpu(), xc, mean_g, invstd, maskc)
    torch.testing.assert_close(sdy.cpu(), sdy_r, **(tol if exact else dict(atol=1e-4, rtol=1e-4)))
    torch.testing.assert_close(sdyx.cpu(), sdyx_r, **(tol if exact else dict(atol=1e-3, rtol=1e-4)))

    mdy, mdyx = torch.randn(c, dtype=acc), torch.randn(c, dtype=acc)
    for weight in (w, None):
        dx = tk.syncbn_bwd_triton(
            dy, x, mean_g.to(dev), invstd.to(dev), _to(weight, dev), mdy.to(dev), mdyx.to(dev), mask
        )
        dx_r = syncbn_bwd_ref(dy.cpu(), xc, mean_g, invstd, weight, mdy, mdyx, maskc)
        assert dx.stride() == x.stride() and dx.dtype == x.dtype
        _close_lowp(dx.cpu(), dx_r)


@needs_triton
def test_triton_kernel_large_offset_step():
    _large_offset_step(TRITON_DEVICE)


def _to(t, device):
    return None if t is None else t.to(device)


def _close_lowp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding of the output dtype (the kernels and the reference round once each)."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.double(), want.double(), atol=8 * eps, rtol=2 * eps)


@needs_triton
def test_triton_kernel_module_step_matches_reference_path():
    """A masked training step of the whole module with the Triton ops against torch.nn.BatchNorm1d on the
    real frames (no process group: the local path through the same ops)."""
    import tandem

    x, mask = _layout_input("3d-mask", TRITON_DEVICE)
    x = x.requires_grad_()
    bn = tandem.nn.SyncBatchNorm(x.shape[1]).to(x.device)
    ref = torch.nn.BatchNorm1d(x.shape[1]).to(x.device)
    with torch.no_grad():
        for m in (bn, ref):
            m.weight.copy_(torch.linspace(0.5, 2, x.shape[1]))
            m.bias.copy_(torch.linspace(-1, 1, x.shape[1]))
    y = bn(x, mask=mask)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    rows = x.detach().permute(0, 2, 1)[mask].clone().requires_grad_()
    yr = ref(rows)
    (yr * g.permute(0, 2, 1)[mask]).sum().backward()
    torch.testing.assert_close(y.permute(0, 2, 1)[mask], yr)
    torch.testing.assert_close(x.grad.permute(0, 2, 1)[mask], rows.grad)
    assert not x.grad.permute(0, 2, 1)[~mask].any()
    torch.testing.assert_close(bn.running_var, ref.running_var)
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("case", ["inf-first-frame", "spread-overflows-float32"])
def test_triton_kernel_extreme_frames_give_torchs_statistics(case):
    """An inf in the first tile of a program: torch's running mean is inf; the statistics kernel's merge
    (mean += (mean_t - inf) * w) made it NaN when a later tile followed. A channel whose spread overflows
    float32's squares: torch's running variance is inf and the output the bias; the kernel's first merge
    (delta^2 * 0 frames) made both NaN."""
    import tandem

    torch.manual_seed(0)
    x = torch.randn(4, 3, 5)
    if case == "inf-first-frame":
        x[0, 0, 0] = float("inf")
    else:
        x[0, 0, 0], x[1, 0, 0] = 1e20, -1e20
    x = x.to(TRITON_DEVICE)
    mask = torch.ones(4, 5, dtype=torch.bool, device=TRITON_DEVICE)
    ours, ref = tandem.nn.SyncBatchNorm(3).to(TRITON_DEVICE), torch.nn.BatchNorm1d(3).to(TRITON_DEVICE)
    y, expected = ours(x, mask=mask), ref(x)
    if case == "inf-first-frame":
        torch.testing.assert_close(ours.running_mean, ref.running_mean)
    else:  # (the mean of +-1e20 and small numbers is float32's rounding on either side)
        torch.testing.assert_close(ours.running_var, ref.running_var)
        torch.testing.assert_close(y, expected)


def test_one_frame_where_the_count_stays_on_the_device_leaves_the_running_variance(monkeypatch):
    """One real frame in all is torch's ValueError, raised where the frame count is on the host (CPU
    tensors); on CUDA it is not read (a sync per layer), and the running variance became 0 / 0 = NaN. It
    now stays as it was. The CUDA branch is taken here by a statistics tensor that says it is on CUDA."""
    import tandem
    import tandem.ops.syncbn as syncbn

    class LooksCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    pack = syncbn.syncbn_pack_ref
    monkeypatch.setattr(syncbn, "syncbn_pack_ref", lambda *a: pack(*a).as_subclass(LooksCuda))
    bn = tandem.nn.SyncBatchNorm(3)
    mask = torch.tensor([[True, False, False, False], [False] * 4])
    bn(torch.randn(2, 3, 4), mask=mask)
    assert torch.equal(bn.running_var, torch.ones(3)) and torch.isfinite(bn.running_mean).all()


# ------------------------------------------------------------------------------------------------
# the GPU build


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kernel", ["stats", "fwd", "bwd_reduce", "bwd"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp64"])
def test_sm90_build_of_every_kernel(kernel, dtype, tmp_path):
    """Each kernel builds for sm_90 in each dtype, with and without a frame mask and in both tile shapes
    the launcher picks (channels innermost, frames innermost), and keeps its tiles in registers: what a
    GPU compiles at its first call, checked ahead of time with every Triton CI runs."""
    tl = pytest.importorskip("triton.language")
    from tandem.ops.syncbn import triton as syncbn_triton

    fn = getattr(syncbn_triton, f"_syncbn_{kernel}_kernel")
    acc = "fp64" if dtype == "fp64" else "fp32"
    data = {"p_x", "p_y", "p_dy", "p_dx"}  # the tensors in the input's dtype; the rest is per channel
    # (BLOCK_C, BLOCK_S, num_warps) as the launcher picks them, channels innermost and frames innermost
    for has_mask, (block_c, block_s, warps) in itertools.product([True, False], [(64, 32, 8), (8, 128, 4)]):
        constexprs = dict(ACC=getattr(tl, f"float{acc[2:]}"), HAS_MASK=has_mask, BLOCK_S=block_s)
        constexprs["BLOCK_C"] = block_c
        # no mask: a dummy pointer, the input
        pointers = dict.fromkeys(data, dtype) | {"p_mask": "u8" if has_mask else dtype}
        signature = sm90_signature(fn, constexprs, acc, pointers)
        built = compile_sm90(fn, signature, constexprs, num_warps=warps, enable_fp_fusion=True)
        stack = local_memory_bytes(built.asm["cubin"], tmp_path)
        assert stack == 0, f"mask {has_mask}, BLOCK_C {block_c}, {warps} warps: {stack} bytes of stack"
