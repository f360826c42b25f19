"""The Triton kernels of ``tandem::lstm_fwd`` / ``tandem::lstm_bwd`` against torch.nn.LSTM and the reference.

The Triton tests (``test_triton_kernel_*``) run on CUDA when there is a GPU. On CPU they need Triton's
interpreter, which ``tandem._backend`` only honours when the environment says so at import time, so
``test_triton_kernels_under_interpreter`` runs them in a fresh ``pytest`` process with
``TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1`` (the ops then take their Triton path on CPU tensors); in this
process they are skipped. Shapes stay tiny: the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tandem
from tandem import _backend
from tandem.ops.lstm.reference import lstm_bwd_ref, lstm_fwd_ref
from triton_support import (
    TRITON_DEVICE,
    TRITON_VERSION,
    LaunchCounter,
    assert_builds_once,
    compile_sm90,
    local_memory_bytes,
    needs_triton,
    needs_triton_compiler,
    run_under_interpreter,
    sm90_signature,
)


@dataclass(frozen=True)
class Case:
    bidirectional: bool = False
    input: str = "padded"  # padded | packed-unsorted
    steps: int = 4
    batch: int = 3
    hidden: int = 5
    proj: int = 0
    bias: bool = True
    tile: int | None = None  # shrink every tile to this size: several row, H and R tiles out of tiny shapes

    @property
    def id(self) -> str:
        parts = [
            "bi" if self.bidirectional else "uni",
            self.input,
            f"T{self.steps}-B{self.batch}-H{self.hidden}",
        ]
        parts += [f"proj{self.proj}"] * bool(self.proj) + ["nobias"] * (not self.bias)
        parts += [f"tile{self.tile}"] * bool(self.tile)
        return "-".join(parts)

    def lengths(self) -> list[int]:
        """Includes length 1 and the full length; unsorted for the packed case."""
        if self.input == "padded":
            return [self.steps] * self.batch
        t = self.steps
        return ([t, max(1, t // 2), 1, max(1, t - 1), max(1, t - 2)] * self.batch)[: self.batch]


INPUT = 4
CASES = [
    Case(),
    Case(bidirectional=True),
    Case(bidirectional=True, input="packed-unsorted", steps=6, batch=5),
    Case(input="packed-unsorted", steps=5, batch=4, hidden=20),
    Case(bidirectional=True, hidden=20, tile=16),  # two H tiles, the second one masked
    Case(bidirectional=True, steps=2, batch=20, tile=16),  # two row tiles
    Case(proj=3, bidirectional=True, input="packed-unsorted", steps=5, batch=4),
    Case(proj=17, hidden=20, tile=16),  # two R tiles too
    Case(bias=False, bidirectional=True, input="packed-unsorted", steps=3),
    Case(steps=1, bidirectional=True),
    # two row blocks of the persistent kernels (16 rows), the second one's sequences end after step 0
    Case(bidirectional=True, input="packed-unsorted", steps=4, batch=18),
]


@pytest.fixture
def tiles(monkeypatch):
    """Shrink the kernels' tiles (read from the module at each launch)."""
    from tandem.ops.lstm import triton as lstm_triton

    def shrink(size: int | None) -> None:
        if size is not None:
            for name in ("_BLOCK_B_MAX", "_BLOCK_H", "_BLOCK_R", "_SPLIT_BLOCK"):
                monkeypatch.setattr(lstm_triton, name, size)

    return shrink


@pytest.fixture(params=["persistent", "per-step", "per-step-split", "per-step-graphs"])
def kernel(request, monkeypatch):
    """Each test that takes this fixture runs with every kind of time loop, whatever the size (with a
    projection the first two are the per-step kernels): persistent, per-step (the backward step fused, or
    split in two launches: BWD_SPLIT), and per-step recorded and replayed (CUDA graphs on GPUs; on the
    CPU the same static-buffer handling around a plain replay)."""
    if TRITON_DEVICE is not None:
        from tandem.ops.lstm import triton as lstm_triton

        monkeypatch.setattr(lstm_triton, "TIME_LOOP", request.param.split("-graphs")[0].split("-split")[0])
        # the graphs run the default, which splits the backward step there
        split = {"per-step-split": True, "per-step-graphs": None}.get(request.param, False)
        monkeypatch.setattr(lstm_triton, "BWD_SPLIT", split)
        monkeypatch.setattr(lstm_triton, "CUDA_GRAPHS", request.param.endswith("-graphs"))
        monkeypatch.setattr(lstm_triton, "STEP_GRAPHS", lstm_triton.StepGraphs())
    return request.param


@pytest.fixture
def launches(monkeypatch):
    """Counts the Triton launchers' calls: the ops must reach them, not fall back to the reference."""
    from tandem.ops.lstm import triton as lstm_triton

    calls = {"fwd": 0, "bwd": 0}
    for kind in calls:
        name = f"lstm_{kind}_triton"
        launcher = getattr(lstm_triton, name)

        def counted(*args, _launcher=launcher, _kind=kind):
            calls[_kind] += 1
            return _launcher(*args)

        monkeypatch.setattr(lstm_triton, name, counted)
    return calls


def _run(module: torch.nn.Module, case: Case, x, hx, device):
    """Forward + backward of a fixed random loss on ``device``; outputs and every gradient on the CPU
    (copies: a module run again starts from no gradients)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().to(device).requires_grad_()
    hx = tuple(t.detach().to(device).requires_grad_() for t in hx)
    inp = x
    if case.input != "padded":
        inp = pack_padded_sequence(x, case.lengths(), enforce_sorted=False)
    out, (h_n, c_n) = module(inp, hx)
    out = out.data if case.input != "padded" else out
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen).to(device, t.dtype) for t in (out, h_n, c_n)]
    sum(((t * w).float().sum() for t, w in zip((out, h_n, c_n), weights))).backward()
    grads = {"input": x.grad, "h0": hx[0].grad, "c0": hx[1].grad}
    grads |= {n: p.grad for n, p in module.named_parameters()}
    results = {"output": out, "h_n": h_n, "c_n": c_n} | {f"grad {k}": v for k, v in grads.items()}
    return {k: v.detach().cpu().clone() for k, v in results.items()}


def _make(case: Case, dtype: torch.dtype = torch.float64):
    kwargs = dict(bias=case.bias, bidirectional=case.bidirectional, proj_size=case.proj)
    ref = torch.nn.LSTM(INPUT, case.hidden, dtype=dtype, **kwargs)
    ours = tandem.nn.LSTM(INPUT, case.hidden, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    states = 2 if case.bidirectional else 1
    x = torch.randn(case.steps, case.batch, INPUT, dtype=dtype)
    hx = (
        torch.randn(states, case.batch, case.proj or case.hidden, dtype=dtype),
        torch.randn(states, case.batch, case.hidden, dtype=dtype),
    )
    return ref, ours, x, hx


# ------------------------------------------------------------------------------------------------
# the interpreter run (CI has no GPU)


@pytest.mark.timeout(600)
def test_triton_kernels_under_interpreter():
    # the builds-once tests count compiled kernels: nothing to count under the interpreter
    run_under_interpreter(__file__, keyword="triton_kernel_ and not builds_once", timeout=540)


# ------------------------------------------------------------------------------------------------
# torch.nn.LSTM, which we did not write, with copied weights


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_kernel_matches_torch_float64(case: Case, tiles, launches, kernel: str):
    tiles(case.tile)
    ref, ours, x, hx = _make(case)
    expected = _run(ref, case, x, hx, "cpu")
    got = _run(ours.to(TRITON_DEVICE), case, x, hx, TRITON_DEVICE)
    assert launches == {"fwd": 1, "bwd": 1}
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10, msg=name)


@needs_triton_compiler
@pytest.mark.parametrize("time_loop", ["per-step", "per-step-split", "persistent"])
def test_triton_kernel_builds_once_for_any_lengths(time_loop: str, monkeypatch):
    """Batches of other lengths reuse the kernels built for the first (see the GRU's test of the name)."""
    from tandem.ops import _triton_rnn
    from tandem.ops.lstm import triton as lstm_triton

    monkeypatch.setattr(lstm_triton, "TIME_LOOP", time_loop.removesuffix("-split"))
    monkeypatch.setattr(lstm_triton, "BWD_SPLIT", time_loop.endswith("-split"))
    kernels = [lstm_triton._lstm_fwd_kernel, lstm_triton._lstm_bwd_kernel]
    if time_loop == "per-step-split":
        kernels = [lstm_triton._lstm_fwd_kernel, lstm_triton._lstm_bwd_gates, _triton_rnn.step_product]
    if time_loop == "persistent":
        kernels = [lstm_triton._lstm_fwd_persistent, lstm_triton._lstm_bwd_persistent]
    lstm = tandem.nn.LSTM(8, 16, bidirectional=True, device=TRITON_DEVICE, dtype=torch.float16)
    assert_builds_once(lstm, kernels, torch.float16)


FLOAT32_CASES = [CASES[2], CASES[4], CASES[6]]


@needs_triton
@pytest.mark.parametrize("case", FLOAT32_CASES, ids=[c.id for c in FLOAT32_CASES])
def test_triton_kernel_float32_error_within_twice_torch_error(case: Case, tiles, monkeypatch):
    """flash-attention's rule: our float32 error vs a float64 reference <= 2x torch's own + atol (1e-5:
    a GPU's fast exp in the sigmoids, against torch's float32 LSTM on the CPU)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # exact float32 products on GPUs
    tiles(case.tile)
    ref64, _, x, hx = _make(case)
    exact = _run(ref64, case, x, hx, "cpu")
    ref32, ours32, _, _ = _make(case, torch.float32)
    ref32.load_state_dict(ref64.state_dict())
    ours32.load_state_dict(ref64.state_dict())
    x32, hx32 = x.float(), tuple(t.float() for t in hx)
    torch_err = _run(ref32, case, x32, hx32, "cpu")
    our_err = _run(ours32.to(TRITON_DEVICE), case, x32, hx32, TRITON_DEVICE)
    for name, value in exact.items():
        err_torch = (torch_err[name].double() - value).abs().max().item()
        err_ours = (our_err[name].double() - value).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-5, f"{name}: ours {err_ours:.3g} vs torch {err_torch:.3g}"


HALF_CASES = [CASES[2], CASES[6]]


@needs_triton
@pytest.mark.parametrize("case", HALF_CASES, ids=[c.id for c in HALF_CASES])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [pytest.param(torch.bfloat16, 5e-2, id="bfloat16"), pytest.param(torch.float16, 5e-3, id="float16")],
)
def test_triton_kernel_half_close_to_float32(case: Case, dtype, tol, kernel: str):
    """Half inputs, float32 math inside: close to torch's float32 LSTM, relative to each tensor's scale."""
    ref64, _, x, hx = _make(case)
    ref32, _, _, _ = _make(case, torch.float32)
    ref32.load_state_dict(ref64.state_dict())
    ours = tandem.nn.LSTM(
        INPUT, case.hidden, bias=case.bias, bidirectional=case.bidirectional, proj_size=case.proj
    )
    # the weights rounded to the half dtype once, so both sides start from the same numbers
    ours.load_state_dict({k: v.to(dtype) for k, v in ref64.state_dict().items()})
    ref32.load_state_dict({k: v.to(dtype).float() for k, v in ref64.state_dict().items()})
    x, hx = x.to(dtype), tuple(t.to(dtype) for t in hx)
    expected = _run(ref32, case, x.float(), tuple(t.float() for t in hx), "cpu")
    got = _run(ours.to(TRITON_DEVICE, dtype), case, x, hx, TRITON_DEVICE)
    for name, value in expected.items():
        assert got[name].dtype == dtype, name
        err = (got[name].float() - value).abs().max().item()
        scale = value.abs().max().item()
        assert err <= tol * max(scale, 1.0), f"{name}: error {err:.3g} at scale {scale:.3g}"


# ------------------------------------------------------------------------------------------------
# the launchers against the reference: saved buffers, unused outputs, no dx


def _op_inputs(case: Case, dtype=torch.float64):
    lengths = sorted(case.lengths(), reverse=True)
    batch_sizes = torch.tensor([sum(n > t for n in lengths) for t in range(lengths[0])])
    total, d_, out = sum(lengths), 2 if case.bidirectional else 1, case.proj or case.hidden
    hid = case.hidden

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64).mul_(0.5).to(TRITON_DEVICE, dtype)

    bias = (rand(d_, 4 * hid), rand(d_, 4 * hid)) if case.bias else (None, None)
    return (
        rand(total, INPUT),
        batch_sizes,
        rand(d_, case.batch, out),
        rand(d_, case.batch, hid),
        rand(d_, 4 * hid, INPUT),
        rand(d_, 4 * hid, out),
        *bias,
        rand(d_, out, hid) if case.proj else None,
    )


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_kernel_forward_buffers_match_reference(case: Case, tiles, kernel: str):
    """The saved buffers mean the same in both kernels: (i, f, sigmoid(2 a_g), o), 2c, o tanh(c), states."""
    from tandem.ops.lstm.triton import lstm_fwd_triton

    tiles(case.tile)
    args = _op_inputs(case)
    names = ["y", "h_n", "c_n", "gates", "cells", "hr", "states"]
    for need_saved in (True, False):
        got = lstm_fwd_triton(*args, need_saved)
        expected = lstm_fwd_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), need_saved)
        for name, a, b in zip(names, got, expected):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12, msg=f"{name} {need_saved=}")


BWD_CASES = [CASES[2], CASES[6], CASES[7], CASES[10]]
UNUSED = {"all": (True, True, True), "dy": (True, False, False), "h_n": (False, True, False)}
UNUSED |= {"c_n": (False, False, True)}


@needs_triton
@pytest.mark.parametrize("case", BWD_CASES, ids=[c.id for c in BWD_CASES])
@pytest.mark.parametrize("used", list(UNUSED), ids=[f"grad-of-{k}" for k in UNUSED])
@pytest.mark.parametrize("need_dx", [True, False], ids=["dx", "no-dx"])
def test_triton_kernel_backward_matches_reference(case: Case, used: str, need_dx: bool, tiles, kernel: str):
    from tandem.ops.lstm.triton import lstm_bwd_triton

    tiles(case.tile)
    args = _op_inputs(case)
    y, h_n, c_n, *saved = lstm_fwd_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    grads = [torch.randn_like(t) if u else None for t, u in zip((y, h_n, c_n), UNUSED[used])]
    x, bs, h0, c0, w_ih, w_hh, _, _, w_hr = args
    rest = (x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, case.bias, need_dx)
    expected = lstm_bwd_ref(*grads, *(a.cpu() if isinstance(a, torch.Tensor) else a for a in rest))
    on_device = [
        t.to(TRITON_DEVICE) if isinstance(t, torch.Tensor) and t is not bs else t for t in (*grads, *rest)
    ]
    got = lstm_bwd_triton(*on_device)
    for name, a, b in zip(["dx", "dh0", "dc0", "dw_ih", "dw_hh", "db_ih", "db_hh", "dw_hr"], got, expected):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-10, msg=name)


@needs_triton
@pytest.mark.parametrize("proj", [0, 2], ids=["", "proj2"])
def test_triton_kernel_recorded_loops_are_reused_with_new_data(proj: int, monkeypatch):
    """A recorded per-step loop serves every later call of the same problem with that call's data, what
    earlier calls returned survives later ones, and only the ``capacity`` most recent problems are kept."""
    from tandem.ops.lstm import triton as lstm_triton

    monkeypatch.setattr(lstm_triton, "TIME_LOOP", "per-step")
    monkeypatch.setattr(lstm_triton, "CUDA_GRAPHS", True)
    graphs = lstm_triton.StepGraphs(capacity=2)
    monkeypatch.setattr(lstm_triton, "STEP_GRAPHS", graphs)
    kept = []
    problems = [(4, 0), (4, 1), (3, 2), (4, 3), (2, 4)]  # (steps, seed): same problem, new data, ...
    for steps, seed in problems:
        case = Case(bidirectional=True, input="packed-unsorted", steps=steps, batch=3, proj=proj)
        args = tuple(a + seed if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in _op_inputs(case))  # fmt: skip
        cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        got = lstm_triton.lstm_fwd_triton(*args)
        expected = lstm_fwd_ref(*cpu)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12, msg=f"T{steps} seed {seed}")
        kept.append((got, expected))
        y, h_n, c_n, *saved = got
        grads = [torch.randn_like(t) for t in (y, h_n, c_n)]
        x, bs, h0, c0, w_ih, w_hh, _, _, w_hr = args
        rest = (x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, True, True)
        got_bwd = lstm_triton.lstm_bwd_triton(*grads, *rest)
        want = lstm_bwd_ref(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in (*grads, *rest)))
        for a, b in zip(got_bwd, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-10, msg=f"T{steps} seed {seed}")
    for got, expected in kept:
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)
    assert sorted(key[0] for key in graphs._entries) == ["bwd", "fwd"]  # the last problem's two loops


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
def test_triton_kernel_infinite_initial_state_is_torchs(kernel):
    """An inf in h0: torch's layer stays finite (the gates saturate). The persistent forward kept its
    state's padding columns in the product, where inf * 0 left NaN that the next step spread to every
    output."""
    case = Case(bidirectional=True)  # H5: a block of 16 columns, 11 of them padding
    torch.manual_seed(0)
    ref, ours, x, hx = _make(case)
    hx[0][0, 1, 2] = float("inf")
    with torch.no_grad():
        out, (h_n, c_n) = ref(x, hx)
        got = ours.to(TRITON_DEVICE)(x.to(TRITON_DEVICE), tuple(t.to(TRITON_DEVICE) for t in hx))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        (got[0].cpu(), got[1][0].cpu(), got[1][1].cpu()), (out, h_n, c_n), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("op", ["lstm_fwd", "lstm_bwd"])
def test_no_cuda_kernel_registered_apart(op):
    """CUDA tensors take the ops' one implementation, the one CI runs under the interpreter, which turns
    autocast off around the kernels: the dispatcher calls a kernel registered for "cuda" without it (on
    the GPU a backward run inside a bfloat16 autocast failed: parameter products in bfloat16 beside float16
    operands)."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"tandem::{op}", "CUDA")


# ------------------------------------------------------------------------------------------------
# the GPU build, which the interpreter cannot show (compiled ahead of time: no GPU needed)

_A100_SHARED = 166912  # bytes of shared memory one block may use on an A100 (163 KB); an H100 has more


def _compile_sm90(kernel: str, dtype: torch.dtype, tf32: bool = False):
    """``kernel``: "fwd" and "bwd" (the per-step kernels), "bwd-product" (the split backward's product;
    its other half, elementwise, has no matmul to check)."""
    tl = pytest.importorskip("triton.language")
    from tandem.ops import _triton_rnn
    from tandem.ops.lstm import triton as lstm_triton

    name = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        dtype
    ]
    compute = "fp64" if dtype == torch.float64 else "fp32"
    carries = {"p_dhin", "p_dhout", "p_dcin", "p_dcout", "p_out"}  # the carries are in the compute dtype
    constexprs = dict(COMPUTE=tl.float64 if dtype == torch.float64 else tl.float32, UPCAST=False, TF32=tf32)
    # the launch of the T100-B32-H512 shape
    if kernel == "bwd-product":
        fn = _triton_rnn.step_product
        flags = dict(HAS_DH=True, HAS_DHIN=True) | constexprs
        options = lstm_triton._split_meta(dtype, 32, 512, 512, flags)[1]
        constexprs = {key: options.pop(key) for key in list(options) if key in fn.arg_names}
    else:
        fn = getattr(lstm_triton, f"_lstm_{kernel}_kernel")
        options = lstm_triton._step_meta(kernel, dtype, 32, 512, 512)
        constexprs |= {key: options.pop(key) for key in list(options) if key.startswith("BLOCK_")}
        constexprs |= dict(HAS_DH=True, HAS_DHIN=True) if kernel == "bwd" else {}
    signature = sm90_signature(fn, constexprs, name, dict.fromkeys(carries, compute))
    return compile_sm90(fn, signature, constexprs, **options)


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kernel", ["fwd", "bwd", "bwd-product"])
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.bfloat16, torch.float16],
    ids=["float32", "float64", "bf16", "fp16"],
)
def test_sm90_build_uses_the_intended_matmuls(kernel, dtype):
    """float32 stays IEEE (no TF32 rounding), half inputs take the tensor cores with float32 accumulation,
    and every build fits an A100's shared memory."""
    compiled = _compile_sm90(kernel, dtype)
    ptx = compiled.asm["ptx"]
    assert "tf32" not in ptx
    if dtype in (torch.bfloat16, torch.float16):
        t = "bf16" if dtype == torch.bfloat16 else "f16"
        assert re.search(rf"mma\S*\.f32\.{t}\.{t}\.f32", ptx), (
            "no tensor-core matmul with float32 accumulation"
        )
    assert compiled.metadata.shared <= _A100_SHARED


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kernel", ["fwd", "bwd", "bwd-product"])
def test_sm90_build_takes_tf32_when_asked(kernel):
    """With ``torch.backends.cudnn.allow_tf32`` (as torch.nn.LSTM's cuDNN kernels) float32 products round
    to TF32 on the tensor cores."""
    assert "tf32" in _compile_sm90(kernel, torch.float32, tf32=True).asm["ptx"]


@needs_triton
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_triton_kernel_runs_in_float16_under_autocast_as_cudnn(autocast_dtype, input_dtype):
    """Under autocast the layers run in float16 whatever autocast's dtype, as cuDNN's RNNs do (torch's
    autocast wrapper of _cudnn_rnn casts the input, states and weights to half), from a float32 or
    bfloat16 input and states; the gradients reach the float32 parameters in float32, within twice the
    error of torch.nn.LSTM run in float16 (against float64)."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 20, bidirectional=True, dtype=torch.float64)
    ours = tandem.nn.LSTM(3, 20, bidirectional=True).to(TRITON_DEVICE)
    ours.load_state_dict(ref.state_dict())
    half = copy.deepcopy(ref).half()  # what cuDNN's autocast computes
    x = torch.randn(5, 4, 3).to(input_dtype).double()
    states = (torch.zeros(2, 4, 20, dtype=input_dtype), torch.zeros(2, 4, 20, dtype=input_dtype))
    out_ref, _ = ref(x)
    out_ref.sum().backward()
    out_half, _ = half(x.half())
    out_half.float().sum().backward()
    with torch.autocast(TRITON_DEVICE, dtype=autocast_dtype):
        out, (h_n, c_n) = ours(x.to(TRITON_DEVICE, input_dtype), tuple(s.to(TRITON_DEVICE) for s in states))
        assert out.dtype == h_n.dtype == c_n.dtype == torch.float16
        out.float().sum().backward()

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.detach().cpu().double() - b.detach()).abs().max().item()

    assert error(out, out_ref) <= 2 * error(out_half, out_ref) + 1e-3
    for (name, p), q, h in zip(ours.named_parameters(), ref.parameters(), half.parameters()):
        assert p.grad.dtype == torch.float32, name
        ours_error, torch_error = error(p.grad, q.grad), error(h.grad, q.grad)
        assert ours_error <= 2 * torch_error + 1e-3, (
            f"{name}: ours {ours_error:.3g} vs torch {torch_error:.3g}"
        )


@needs_triton
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_under_autocast_is_the_float16_layer(autocast_dtype):
    """Under autocast, with the backward run inside it too, the layer computes exactly what it computes in
    float16 without autocast, as torch's autocast wrapper of cuDNN's RNNs casts to half and then runs with
    autocast off: nothing inside the ops runs in autocast's own dtype."""
    case = Case(bidirectional=True, input="packed-unsorted", hidden=20, batch=5)
    torch.manual_seed(0)
    _, ours, x, hx = _make(case, torch.float32)
    ours = ours.to(TRITON_DEVICE)
    half = copy.deepcopy(ours).half()
    with torch.autocast(TRITON_DEVICE, dtype=autocast_dtype):
        got = _run(ours, case, x, hx, TRITON_DEVICE)
    expected = _run(half, case, x.half(), tuple(t.half() for t in hx), TRITON_DEVICE)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------------
# the persistent kernels: where they run, and their GPU build


# Triton 3.6 builds the float64 persistent backward with spills: its table leaves it out (see the module)
_FP64_BWD_PERSISTENT = TRITON_VERSION >= (3, 7)


@needs_triton
@pytest.mark.parametrize(
    ("hidden", "proj", "time_loop", "max_buildable", "expected"),
    [
        pytest.param(10, 0, "auto", None, (1, 1, 0, 0) if _FP64_BWD_PERSISTENT else (1, 0, 0, 3), id="H10"),
        pytest.param(20, 0, "auto", None, (1, 0, 0, 3), id="H20"),
        pytest.param(40, 0, "auto", None, (0, 0, 3, 3), id="H40"),
        pytest.param(20, 0, "persistent", None, (1, 1, 0, 0), id="H20-persistent"),
        pytest.param(20, 0, "persistent", 16, (1, 0, 0, 3), id="H20-persistent-unbuildable"),
        pytest.param(10, 3, "persistent", None, (0, 0, 3, 3), id="H10-proj3-persistent"),
    ],
)
def test_triton_kernel_persistent_where_the_weights_fit(
    hidden, proj, time_loop, max_buildable, expected, monkeypatch
):
    """The persistent kernels run (one launch each way) where the table says a direction's weights stay
    in registers, one launch per step elsewhere: float64 H10 (BLOCK_H 16) both ways, H20 (32) only the
    forward, H40 (64) neither; every size when asked, but never with a projection, nor above the largest
    size this Triton can build (here the float64 backward's, set to 16)."""
    from tandem.ops.lstm import triton as lstm_triton

    monkeypatch.setattr(lstm_triton, "TIME_LOOP", time_loop)
    limits = {} if max_buildable is None else {("bwd", "fp64"): max_buildable}
    monkeypatch.setattr(lstm_triton, "_PERSISTENT_MAX_BUILDABLE", limits)
    names = ("_lstm_fwd_persistent", "_lstm_bwd_persistent", "_lstm_fwd_kernel", "_lstm_bwd_kernel")
    spies = {name: LaunchCounter(getattr(lstm_triton, name)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(lstm_triton, name, spy)
    case = Case(bidirectional=True, input="packed-unsorted", steps=3, batch=3, hidden=hidden, proj=proj)
    args = _op_inputs(case)
    y, h_n, c_n, *saved = lstm_triton.lstm_fwd_triton(*args)
    x, bs, h0, c0, w_ih, w_hh, _, _, w_hr = args
    lstm_triton.lstm_bwd_triton(
        torch.ones_like(y), None, None, x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, True, True
    )
    assert tuple(spy.launches for spy in spies.values()) == expected


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_persistent_equals_per_step_in_half_precision(dtype, monkeypatch):
    """Both time loops round h and C to the buffers' dtype between steps and take the same products in the
    same order (H20: one 32-wide tile each way), so under the interpreter every output and saved buffer is
    equal bit for bit; a GPU build may contract and order its float32 math differently, by an ulp or so."""
    from tandem.ops.lstm import triton as lstm_triton

    case = Case(bidirectional=True, input="packed-unsorted", steps=6, batch=18, hidden=20)
    args = _op_inputs(case, dtype)
    x, bs, h0, c0, w_ih, w_hh, _, _, w_hr = args
    gen = torch.Generator().manual_seed(1)
    results = []
    for time_loop in ("persistent", "per-step"):
        monkeypatch.setattr(lstm_triton, "TIME_LOOP", time_loop)
        y, h_n, c_n, *saved = lstm_triton.lstm_fwd_triton(*args)
        if not results:
            grads = [torch.randn(t.shape, generator=gen).to(t) for t in (y, h_n, c_n)]
        grad = lstm_triton.lstm_bwd_triton(*grads, x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, True, True)
        results.append((y, h_n, c_n, *saved, *grad))
    names = ["y", "h_n", "c_n", "gates", "cells", "hr", "states", "dx", "dh0", "dc0", "dw_ih", "dw_hh"]
    names += ["db_ih", "db_hh", "dw_hr"]
    exact = TRITON_DEVICE == "cpu"
    for name, a, b in zip(names, *results):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)


def test_persistent_kernels_take_the_hidden_sizes_in_the_table():
    pytest.importorskip("triton")
    from tandem.ops.lstm import triton as lstm_triton

    def fits(kind, dtype, hidden, proj=False):
        return lstm_triton._persistent_meta(kind, torch.empty(0, dtype=dtype), hidden, proj) is not None

    assert fits("fwd", torch.bfloat16, 64) and fits("bwd", torch.float16, 16)
    assert not fits("fwd", torch.bfloat16, 65) and not fits("bwd", torch.bfloat16, 33)
    assert (
        fits("fwd", torch.float32, 32)
        and fits("bwd", torch.float32, 17)
        and not fits("bwd", torch.float32, 33)
    )
    assert fits("fwd", torch.float64, 32) and not fits("bwd", torch.float64, 17)
    # what Triton 3.6 cannot build clean (the module says why) runs per-step there
    assert fits("bwd", torch.float16, 32) == fits("bwd", torch.float64, 16) == (TRITON_VERSION >= (3, 7))
    assert not fits("fwd", torch.float32, 8, proj=True) and not fits("bwd", torch.float64, 8, proj=True)


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("precision", ["half", "tf32", "fp32", "fp64"])
def test_sm90_build_of_the_persistent_kernels_keeps_the_weights_in_registers(kind, precision, tmp_path):
    """Every hidden size of each entry of the persistent kernels' table compiles for sm_90 with its
    num_warps and no local memory (both half dtypes; the backward with and without dy): the four weight
    tiles stay in registers, nothing spills."""
    tl = pytest.importorskip("triton.language")
    from tandem.ops.lstm import triton as lstm_triton

    fn = getattr(lstm_triton, f"_lstm_{kind}_persistent")
    compute = "fp64" if precision == "fp64" else "fp32"
    dtypes = {"half": ["bf16", "fp16"], "fp64": ["fp64"]}.get(precision, ["fp32"])
    variants = [dict(HAS_DY=True), dict(HAS_DY=False)] if kind == "bwd" else [{}]
    for (block, warps), dtype, variant in itertools.product(
        lstm_triton._PERSISTENT_WARPS[kind, precision].items(), dtypes, variants
    ):
        constexprs = dict(H=block, COMPUTE=getattr(tl, f"float{compute[2:]}"), UPCAST=False, **variant)
        constexprs |= dict(TF32=precision == "tf32", BLOCK_B=16, BLOCK_H=block)
        # dh0 and dc0 are written in the compute dtype
        signature = sm90_signature(
            fn, constexprs, dtype, {"p_dh0": compute, "p_dc0": compute, "p_rows": "i32"}
        )
        built = compile_sm90(fn, signature, constexprs, num_warps=warps, enable_fp_fusion=True)
        stack = local_memory_bytes(built.asm["cubin"], tmp_path)
        assert stack == 0, f"{dtype} BLOCK_H {block}, {warps} warps {variant}: {stack} bytes of stack"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_triton_kernel_keeps_the_digits_of_tiny_activations(dtype: torch.dtype, kernel: str, monkeypatch):
    """Inputs and states of the size of 1e-3 to 1e-9, no bias: g = tanh(a_g) and tanh(c) were
    2 sigmoid(.) - 1, whose absolute error of one unit of 0.5's last place was 19% of a float32 output of
    1e-6 (all of one of 1e-9); now the outputs agree with float64 torch to the rounding of the dtype."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # exact float32 products on GPUs
    torch.manual_seed(0)
    ref = torch.nn.LSTM(INPUT, 6, bias=False, bidirectional=True, dtype=torch.float64)
    ours = tandem.nn.LSTM(INPUT, 6, bias=False, bidirectional=True).to(TRITON_DEVICE, dtype)
    ours.load_state_dict(ref.state_dict())
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    for scale in (1e-3, 1e-6, 1e-9):
        x = torch.randn(5, 3, INPUT, dtype=torch.float64) * scale
        hx = tuple(torch.randn(2, 3, 6, dtype=torch.float64) * scale for _ in range(2))
        # packed, lengths unequal: on the CPU dense float32 runs oneDNN's cell, as torch's does
        with torch.no_grad():
            want, (want_h, want_c) = ref(pack_padded_sequence(x, [5, 2, 4], enforce_sorted=False), hx)
            x_ours = pack_padded_sequence(x.to(TRITON_DEVICE, dtype), [5, 2, 4], enforce_sorted=False)
            got, (got_h, got_c) = ours(x_ours, tuple(t.to(TRITON_DEVICE, dtype) for t in hx))
        for a, b in ((got.data, want.data), (got_h, want_h), (got_c, want_c)):
            torch.testing.assert_close(a.cpu().double(), b, rtol=tol, atol=tol * scale)
