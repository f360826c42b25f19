"""``tandem::adagrad_step``: registration, the CPU kernel's paths, the functional API, the Triton kernel.

The Triton tests (``test_triton_kernel_*``) run on CUDA when there is a GPU. On CPU they need Triton's
interpreter, which ``tandem._backend`` only honours when the environment says so at import time, so
``test_triton_kernels_under_interpreter`` runs them in a fresh ``pytest`` process with
``TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1``; in this process they are skipped.
"""

from __future__ import annotations

import pytest
import torch

from tandem import _backend
from tandem.ops import adagrad
from tandem.ops.adagrad import reference
from tandem.ops.adagrad.reference import adagrad_group_ref, adagrad_step_ref, adagrad_tensor_ref
from triton_support import TRITON_DEVICE, TRITON_VERSION, needs_triton, run_under_interpreter

HYPER = [
    pytest.param(dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False), id="plain"),
    pytest.param(dict(lr=0.05, lr_decay=0.3, weight_decay=0.1, eps=1e-3, maximize=True), id="all-options"),
]


def _tensors(shapes, dtype=torch.float32, step=3.0, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]
    gs = [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]
    ss = [torch.rand(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]
    ts = [torch.full((), step, device=device) for _ in shapes]
    return ps, gs, ss, ts


def _clone(xs):
    return [x.clone() for x in xs]


# ------------------------------------------------------------------------------------------------
# registration


@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("amp", [False, True], ids=["no-amp", "amp"])
def test_opcheck(track, amp, lr):
    ps, gs, ss, ts = _tensors([(), (3,), (5, 4)])
    scale = torch.tensor(2.0) if amp else None
    found_inf = torch.tensor(0.0) if amp else None
    lr, lr_tensor = (float("nan"), lr) if isinstance(lr, torch.Tensor) else (lr, None)
    args = (ps, gs, ss, ts, lr, 0.01, 0.1, 1e-10, False, scale, found_inf, track, lr_tensor)
    torch.library.opcheck(torch.ops.tandem.adagrad_step.default, args)


def test_op_counts_steps_and_returns_the_change():
    ps, gs, ss, ts = _tensors([(4,), (2, 2)], step=0.0)
    before = _clone(ps)
    out = torch.ops.tandem.adagrad_step(ps, gs, ss, ts, 0.1, 0.0, 0.0, 1e-10, False, None, None, True)
    assert [t.item() for t in ts] == [1.0, 1.0]
    assert out.shape == () and out.dtype == torch.float32
    assert out.item() == max((p - b).abs().max().item() for p, b in zip(ps, before))
    empty = torch.ops.tandem.adagrad_step(ps, gs, ss, ts, 0.1, 0.0, 0.0, 1e-10, False, None, None, False)
    assert empty.shape == (0,)


def test_op_under_torch_compile():
    hyper = HYPER[1].values[0]
    ps, gs, ss, ts = _tensors([(8,), (3, 3)])
    expected = _clone(ps), _clone(ss), _clone(ts)
    adagrad(expected[0], gs, expected[1], expected[2], **hyper)

    def step(ps, gs, ss, ts):
        return adagrad(ps, gs, ss, ts, **hyper, return_max_change=True)

    largest = torch.compile(step, backend="aot_eager", fullgraph=True)(ps, gs, ss, ts)
    torch.testing.assert_close(ps, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(ss, expected[1], rtol=0, atol=0)
    assert [t.item() for t in ts] == [4.0, 4.0] and largest.shape == ()


# ------------------------------------------------------------------------------------------------
# the CPU kernel: torch's fused kernel (float32/64, contiguous) and the plain path (the rest)


@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_fused_path_matches_plain_path(hyper, dtype):
    shapes = [(), (5,), (40,), (16,), (3, 7), (0,)]
    ps, gs, ss, ts = _tensors(shapes, dtype)
    plain = _clone(ps), _clone(ss)
    adagrad_group_ref(plain[0], gs, plain[1], ts, **hyper)
    tracked = _clone(ps), _clone(ss)
    largest = adagrad_step_ref(tracked[0], gs, tracked[1], ts, **hyper, track=True)
    untracked = _clone(ps), _clone(ss)
    adagrad_step_ref(untracked[0], gs, untracked[1], ts, **hyper)
    torch.testing.assert_close(tracked, plain)
    assert all(torch.equal(a, b) for a, b in zip(tracked[0] + tracked[1], untracked[0] + untracked[1]))
    expected = max((a - b).abs().max().item() for a, b in zip(tracked[0], ps) if a.numel())
    assert largest.dtype == torch.float32 and largest.item() == pytest.approx(expected, rel=1e-7)


def test_tracked_slices_cut_large_tensors(monkeypatch):
    """Several tensors per slice, tensors cut over slices: the same update, the exact largest change."""
    monkeypatch.setattr(reference, "_TRACK_SLICE", 16)
    shapes = [(), (5,), (40,), (16,), (3, 7), (9,)]
    ps, gs, ss, ts = _tensors(shapes)
    untracked = _clone(ps), _clone(ss)
    adagrad_step_ref(untracked[0], gs, untracked[1], ts, **HYPER[1].values[0])
    tracked = _clone(ps), _clone(ss)
    largest = adagrad_step_ref(tracked[0], gs, tracked[1], ts, **HYPER[1].values[0], track=True)
    assert all(torch.equal(a, b) for a, b in zip(tracked[0] + tracked[1], untracked[0] + untracked[1]))
    assert largest.item() == max((a - b).abs().max().item() for a, b in zip(tracked[0], ps))


def test_non_contiguous_and_half_tensors_take_the_plain_path():
    ps, gs, ss, ts = _tensors([(6, 4), (5,)])
    ps[0], gs[0], ss[0] = ps[0].t(), gs[0].t(), ss[0].t()  # transposed: the fused kernel would misread them
    expected = _clone(ps), _clone(ss)
    adagrad_group_ref(expected[0], gs, expected[1], ts, **HYPER[1].values[0])
    adagrad_step_ref(ps, gs, ss, ts, **HYPER[1].values[0])
    torch.testing.assert_close(ps, expected[0])
    torch.testing.assert_close(ss, expected[1])
    hs = _tensors([(7,)], torch.bfloat16)
    expected = _clone(hs[0]), _clone(hs[2])
    adagrad_group_ref(expected[0], hs[1], expected[1], hs[3], **HYPER[1].values[0])
    adagrad_step_ref(hs[0], hs[1], hs[2], hs[3], **HYPER[1].values[0])
    assert torch.equal(hs[0][0], expected[0][0]) and torch.equal(hs[2][0], expected[1][0])


# ------------------------------------------------------------------------------------------------
# the functional API


def test_functional_groups_dtypes_and_complex():
    """One call, four (device, dtype) groups: each tensor gets the textbook update of its own."""
    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.randn(5, generator=gen),
        torch.randn(3, generator=gen, dtype=torch.float64),
        torch.randn(4, generator=gen).bfloat16(),
        torch.randn(2, 3, generator=gen, dtype=torch.complex64),
        torch.randn((), generator=gen),
    ]
    gs = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in ps]
    ss = [torch.zeros_like(p) for p in ps]
    ts = [torch.zeros(()) for _ in ps]
    hyper = dict(lr=0.1, lr_decay=0.1, weight_decay=0.01, eps=1e-8, maximize=False)
    originals = _clone(ps)
    expected = [(p.clone(), s.clone()) for p, s in zip(ps, ss)]
    for (p, s), g in zip(expected, gs):
        adagrad_tensor_ref(p, g, s, 1.0, **hyper)
    largest = adagrad(ps, gs, ss, ts, **hyper, return_max_change=True)
    for p, s, (ep, es) in zip(ps, ss, expected):
        torch.testing.assert_close(p, ep)
        torch.testing.assert_close(s, es)
    assert [t.item() for t in ts] == [1.0] * len(ps)
    real = [torch.view_as_real(p) if p.is_complex() else p for p in ps]
    real_originals = [torch.view_as_real(p) if p.is_complex() else p for p in originals]
    expected_change = max((p - o).abs().max().float().item() for p, o in zip(real, real_originals))
    assert largest.dtype == torch.float32 and largest.item() == expected_change


def _replace(k, i, x):
    return lambda lists: lists[k].__setitem__(i, x)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(_replace(1, 0, torch.zeros(4)), r"grads\[0\] to match params\[0\]", id="shape"),
        pytest.param(_replace(2, 1, torch.zeros(3, dtype=torch.float64)), r"state_sums\[1\]", id="dtype"),
        pytest.param(_replace(3, 0, torch.zeros((), dtype=torch.float64)), "state_steps", id="step"),
        pytest.param(lambda lists: lists[1].pop(), "as many grads", id="length"),
    ],
)
def test_functional_checks_raise_before_any_change(mutate, message):
    lists = [list(x) for x in _tensors([(5,), (3,)])]
    mutate(lists)
    before = [x.clone() for x in lists[0] + lists[2] + lists[3]]
    with pytest.raises(ValueError, match=message):
        adagrad(*lists, lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(lists[0] + lists[2] + lists[3], before))


# ------------------------------------------------------------------------------------------------
# the Triton kernel (CUDA, or CPU under the interpreter)


@pytest.mark.timeout(600)
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__file__, timeout=540)


def _oracle(ps, gs, ss, ts, hyper):
    """The plain path in float64 (and torch's own rounding in the tensors' dtype, for the error rule)."""
    exact = [x.double() for x in ps], [x.double() for x in ss]
    adagrad_group_ref(exact[0], [g.double() for g in gs], exact[1], ts, **hyper)
    same = _clone(ps), _clone(ss)
    adagrad_group_ref(same[0], _clone(gs), same[1], ts, **hyper)
    return exact, same


def _assert_as_accurate_as_torch(ours, same, exact, atol):
    for o, t, e in zip(ours, same, exact):
        err_ours = (o.double() - e).abs().max().item() if o.numel() else 0.0
        err_torch = (t.double() - e).abs().max().item() if t.numel() else 0.0
        assert err_ours <= 2 * err_torch + atol, f"Triton error {err_ours:.3g} vs torch {err_torch:.3g}"


@needs_triton
@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [
        pytest.param(torch.float32, 1e-7, id="float32"),
        pytest.param(torch.float64, 1e-15, id="float64"),
        pytest.param(torch.bfloat16, 1e-2, id="bfloat16"),
        pytest.param(torch.float16, 1e-3, id="float16"),
    ],
)
def test_triton_kernel_matches_reference(hyper, dtype, atol):
    from tandem.ops.adagrad.triton import adagrad_step_triton

    # empty first (no address to use as base), 0-d, shorter than a block, several chunks with a partial
    # last one, whole chunks only (block 16, chunk 32)
    shapes = [(0,), (), (3,), (70,), (5, 13), (64,)]
    ps, gs, ss, ts = _tensors(shapes, dtype, device=TRITON_DEVICE)
    exact, same = _oracle(ps, gs, ss, ts, hyper)
    before = _clone(ps)
    largest = adagrad_step_triton(ps, gs, ss, ts, **hyper, track=True, block=16, chunk=32)
    _assert_as_accurate_as_torch(ps, same[0], exact[0], atol)
    _assert_as_accurate_as_torch(ss, same[1], exact[1], atol)
    expected = max((p.double() - b.double()).abs().max().item() for p, b in zip(ps, before) if p.numel())
    assert largest.dtype == torch.float32 and largest.item() == pytest.approx(expected, rel=1e-6)
    assert all(t.item() == 3.0 for t in ts)  # the kernel reads the step; the op counts it


@needs_triton
def test_triton_kernel_optimizer_under_another_default_device_as_torch():
    """Under ``torch.set_default_device`` (or the ``torch.device`` context; "meta" stands in for another
    device) tandem.optim.Adagrad's step computes on its tensors' device as torch's does: the
    kernel's chunk and group tables were made on the default device."""
    from tandem.optim import Adagrad

    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(TRITON_DEVICE) for s in [(3,), (70,)]]
    ps = [[torch.nn.Parameter(x.clone()) for x in init] for _ in range(2)]
    opts = Adagrad(ps[0], lr=0.1, tol=1e-3), torch.optim.Adagrad(ps[1], lr=0.1, foreach=False)
    for _ in range(2):
        grads = [torch.randn(x.shape, generator=gen).to(TRITON_DEVICE) for x in init]
        for group, opt in zip(ps, opts):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            with torch.device("meta"):
                opt.step()
    assert opts[0].max_change.device == init[0].device
    torch.testing.assert_close(ps[0], ps[1])


@needs_triton
def test_triton_kernel_float32_close_to_torch_bit_for_bit():
    """float32: only torch's CPU sqrt (not correctly rounded) separates the two, by an ulp at most."""
    from tandem.ops.adagrad.triton import adagrad_step_triton

    hyper = HYPER[1].values[0]
    ps, gs, ss, ts = _tensors([(300,)], device=TRITON_DEVICE)
    _, same = _oracle(ps, gs, ss, ts, hyper)
    adagrad_step_triton(ps, gs, ss, ts, **hyper, block=64, chunk=128)
    # sum: the same FMAs as torch, except where Triton's interpreter rounds tl.fma twice (before 3.9)
    fused = TRITON_DEVICE != "cpu" or TRITON_VERSION >= (3, 9)
    torch.testing.assert_close(ss, same[1], rtol=0 if fused else 2.4e-7, atol=0)
    torch.testing.assert_close(ps, same[0], rtol=2.4e-7, atol=0)


@needs_triton
@pytest.mark.parametrize("found", [0.0, 1.0], ids=["finite", "found-inf"])
def test_triton_kernel_amp(found):
    from tandem.ops.adagrad.triton import adagrad_step_triton

    hyper = HYPER[0].values[0]
    ps, gs, ss, ts = _tensors([(), (37,)], device=TRITON_DEVICE)
    scale = torch.tensor(64.0, device=TRITON_DEVICE)
    gs = [g * 64 for g in gs]
    orig = _clone(ps), _clone(gs), _clone(ss)
    unscaled = [g / 64 for g in gs]
    _, same = _oracle(ps, unscaled, ss, ts, hyper)
    found_inf = torch.tensor(found, device=TRITON_DEVICE)
    largest = adagrad_step_triton(
        ps, gs, ss, ts, **hyper, grad_scale=scale, found_inf=found_inf, track=True, block=16, chunk=32
    )
    if found:  # nothing moves, not even the gradients
        assert all(torch.equal(a, b) for a, b in zip(ps + gs + ss, orig[0] + orig[1] + orig[2]))
        assert largest.item() == 0.0
    else:
        torch.testing.assert_close(gs, unscaled, rtol=0, atol=0)
        torch.testing.assert_close(ps, same[0])
        torch.testing.assert_close(ss, same[1])


@needs_triton
def test_triton_kernel_nan_change_is_infinite():
    from tandem.ops.adagrad.triton import adagrad_step_triton

    ps, gs, ss, ts = _tensors([(20,), (5,)], device=TRITON_DEVICE)
    gs[0][7] = float("nan")
    largest = adagrad_step_triton(ps, gs, ss, ts, **HYPER[0].values[0], track=True, block=16, chunk=32)
    assert largest.item() == float("inf") and torch.isnan(ps[0][7])


@needs_triton
def test_triton_kernel_misaligned_and_strided_tensors():
    """A view at an odd offset (no 16-byte vectors) and a transposed one (plain path) in the same call."""
    from tandem.ops.adagrad.triton import adagrad_step_triton

    hyper = HYPER[1].values[0]
    ps, gs, ss, ts = _tensors([(40,), (33,), (6, 5)], device=TRITON_DEVICE)
    buf = torch.zeros(3, 41, device=TRITON_DEVICE)
    for k, x in enumerate((ps, gs, ss)):
        buf[k, 1:] = x[0]
        x[0] = buf[k, 1:]  # offset by one float
        x[2] = x[2].t().contiguous().t()  # column-major
    _, same = _oracle(ps, gs, ss, ts, hyper)
    largest = adagrad_step_triton(ps, gs, ss, ts, **hyper, track=True, block=16, chunk=32)
    torch.testing.assert_close(ps, same[0])
    torch.testing.assert_close(ss, same[1])
    assert largest.item() > 0


@needs_triton
def test_triton_kernel_optimizer_matches_torch():
    """tandem.optim.Adagrad on the Triton path against torch.optim.Adagrad, with tol."""
    from tandem.optim import Adagrad

    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in [(), (50,), (4, 9)]]
    ours_ps = [torch.nn.Parameter(x.to(TRITON_DEVICE)) for x in init]
    torch_ps = [torch.nn.Parameter(x.clone()) for x in init]
    options = dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)
    ours = Adagrad(ours_ps, tol=1e-3, **options)
    theirs = torch.optim.Adagrad(torch_ps, foreach=False, **options)
    for _ in range(20):
        for a, b in zip(ours_ps, torch_ps):
            g = torch.randn(b.shape, generator=gen)
            a.grad, b.grad = g.to(TRITON_DEVICE), g
        before = [p.detach().clone() for p in ours_ps]
        ours.step()
        theirs.step()
        change = max((p.detach() - b).abs().max().item() for p, b in zip(ours_ps, before))
        assert ours.max_change.item() == change
        assert bool(ours.converged) == (change <= 1e-3) and ours.converged.device == ours_ps[0].device
    torch.testing.assert_close([p.detach().cpu() for p in ours_ps], [p.detach() for p in torch_ps])


@needs_triton
def test_triton_kernel_optimizer_with_a_float64_step_count_set_by_hand_matches_torch():
    """A step count put into the state in float64 (as torch's for-loop path keeps it under a float64
    default dtype): the kernel read its memory as a float32, a wrong lr_decay'd rate without a word."""
    from tandem.optim import Adagrad

    init = torch.linspace(0, 1, 6)
    ours_p, torch_p = torch.nn.Parameter(init.to(TRITON_DEVICE)), torch.nn.Parameter(init.clone())
    ours, theirs = (
        Adagrad([ours_p], lr=0.1, lr_decay=0.5),
        torch.optim.Adagrad([torch_p], lr=0.1, lr_decay=0.5),
    )
    for opt, p in ((ours, ours_p), (theirs, torch_p)):
        opt.state[p]["step"] = torch.tensor(0.0, dtype=torch.float64, device=p.device)
    for t in range(3):
        g = torch.sin(torch_p.detach() * (t + 2))
        ours_p.grad, torch_p.grad = g.to(TRITON_DEVICE), g
        ours.step()
        theirs.step()
    torch.testing.assert_close(ours_p.detach().cpu(), torch_p.detach(), rtol=1e-6, atol=0)
    assert float(ours.state[ours_p]["step"]) == 3.0


def _compile_for_sm90(dtype, vec):
    """PTX of the kernel for an H100 (sm_90), compiled ahead of time: no GPU needed, only ptxas."""
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - other Triton layouts
        pytest.skip(f"no ahead-of-time compiler API in this Triton: {e}")
    from tandem.ops.adagrad.triton import _TL_DTYPES, _adagrad_step_kernel

    tl_dtype = _TL_DTYPES[dtype]
    pointer = "*" + {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16"}[dtype]
    signature = {"base_ptr": pointer, "meta_ptr": "*i64", "chunk_ptr": "*i64", "n_chunks": "i32"}
    signature |= {"grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "delta_ptr": "*fp32"}
    constexprs = dict(
        DTYPE=tl_dtype, COMPUTE=tl.float64 if dtype == torch.float64 else tl.float32, CHUNK=4096, BLOCK=1024,
        MAXIMIZE=True, HAS_WEIGHT_DECAY=True, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, TRACK=True, VEC=vec,
    )  # fmt: skip
    signature |= {name: "constexpr" for name in constexprs}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # what a launch with aligned tensors sees
    src = ASTSource(fn=_adagrad_step_kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = dict(num_warps=4, enable_fp_fusion=False)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["float32", "float64", "bf16"]
)
def test_sm90_ptx_has_vector_ieee_accesses(dtype):
    """The GPU lowering the interpreter cannot show: 16-byte accesses, IEEE sqrt/div, the two FMAs only."""
    ptx = _compile_for_sm90(dtype, vec=16 // torch.empty((), dtype=dtype).element_size())
    wide = "v2.b64" if dtype == torch.float64 else "v4.b32"
    assert f"ld.global.{wide}" in ptx and f"st.global.{wide}" in ptx
    assert ("sqrt.rn.f64" if dtype == torch.float64 else "sqrt.rn.f32") in ptx
    assert "sqrt.approx" not in ptx and "div.approx" not in ptx and "div.full" not in ptx
