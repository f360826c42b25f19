"""The Triton kernels of tandem::gru_fwd / gru_bwd against torch.nn.GRU (copied weights) and against the
PyTorch kernel's saved buffers.

The ``test_triton_kernel_*`` tests run where Triton kernels run: on CUDA with a GPU, and on CPU tensors
under Triton's interpreter, which ``test_triton_kernels_under_interpreter`` starts in a fresh process
(``TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1``). Shapes stay tiny: the interpreter runs every program
instance of every launch in Python.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
from dataclasses import dataclass

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tandem
from tandem import _backend
from tandem.ops.gru.reference import gru_bwd_ref, gru_fwd_ref
from triton_support import (
    TRITON_DEVICE,
    LaunchCounter,
    assert_builds_once,
    backward_launches,
    compile_sm90,
    local_memory_bytes,
    needs_triton,
    needs_triton_compiler,
    run_under_interpreter,
    sm90_signature,
)


@dataclass(frozen=True)
class Case:
    layers: int = 1
    bidirectional: bool = True
    bias: bool = True
    packed: bool = False  # unsorted lengths, including 1 and the full length
    hidden: int = 5
    steps: int = 5
    batch: int = 4

    @property
    def id(self) -> str:
        parts = [f"L{self.layers}", "bi" if self.bidirectional else "uni"]
        parts += [f"H{self.hidden}", f"T{self.steps}"]
        return "-".join(parts + ["packed"] * self.packed + ["nobias"] * (not self.bias))


CASES = [
    Case(bidirectional=False),
    Case(),
    Case(packed=True),
    Case(packed=True, bidirectional=False, hidden=20),
    Case(layers=2, hidden=20, bias=False),
    Case(steps=1, batch=3),
    Case(hidden=17, batch=18, steps=3, packed=True),  # more than one block of rows and of columns
]
INPUT = 3


def _lengths(case: Case) -> list[int]:
    base = [case.steps, 1, max(1, case.steps // 2), max(1, case.steps - 1)]
    return (base * case.batch)[: case.batch]


def _run(module: torch.nn.Module, case: Case, x: torch.Tensor, h0: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of a fixed random loss; the outputs and every gradient, on the CPU in float64
    (copies: a module run again, the reference of several comparisons, starts from no gradients)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    h0 = h0.detach().clone().requires_grad_()
    inp = pack_padded_sequence(x, _lengths(case), enforce_sorted=False) if case.packed else x
    out, h_n = module(inp, h0)
    out = out.data if case.packed else out
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)
    w_h = torch.randn(h_n.shape, generator=gen, dtype=torch.float64).to(h_n)
    ((out * w_out).sum() + (h_n * w_h).sum()).backward()
    named = {"output": out, "h_n": h_n, "grad input": x.grad, "grad h0": h0.grad}
    named |= {f"grad {n}": p.grad for n, p in module.named_parameters()}
    return {k: v.detach().cpu().double().clone() for k, v in named.items()}


def _make(case: Case, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 torch.nn.GRU, and an input and h0 for it."""
    torch.manual_seed(0)
    kwargs = dict(num_layers=case.layers, bias=case.bias, bidirectional=case.bidirectional)
    ref = torch.nn.GRU(INPUT, case.hidden, dtype=torch.float64, **kwargs)
    x = torch.randn(case.steps, case.batch, INPUT, dtype=torch.float64)
    h0 = torch.randn(case.layers * (1 + case.bidirectional), case.batch, case.hidden, dtype=torch.float64)
    return ref, x, h0


def _results(ref: torch.nn.Module, module: torch.nn.Module, case: Case, x, h0, dtype):
    """``(expected, got)``: float64 ``ref`` on the CPU, and ``module`` run in ``dtype`` on TRITON_DEVICE
    with ``ref``'s weights."""
    module = module.to(TRITON_DEVICE, dtype)
    module.load_state_dict(ref.state_dict())
    expected = _run(ref, case, x, h0)
    got = _run(module, case, x.to(TRITON_DEVICE, dtype), h0.to(TRITON_DEVICE, dtype))
    assert expected.keys() == got.keys()
    return expected, got


def _errors(ref: torch.nn.Module, module: torch.nn.Module, case: Case, x, h0, dtype) -> dict[str, float]:
    expected, got = _results(ref, module, case, x, h0, dtype)
    return {name: (got[name] - value).abs().max().item() for name, value in expected.items()}


def _compare(case: Case, dtype: torch.dtype, atol: float, rtol: float) -> None:
    ref, x, h0 = _make(case, dtype)
    ours = tandem.nn.GRU(INPUT, case.hidden, case.layers, case.bias, bidirectional=case.bidirectional)
    expected, got = _results(ref, ours, case, x, h0, dtype)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=rtol, msg=name)


@pytest.fixture(params=["persistent", "per-step", "per-step-split", "per-step-graphs"])
def kernel(request, monkeypatch):
    """Each test that takes this fixture runs with every kind of time loop, whatever the size: the
    persistent kernels, the per-step kernels (with the backward step fused, or split in two launches:
    BWD_SPLIT), and the per-step kernels recorded and replayed (CUDA graphs on GPUs; on the CPU the same
    static-buffer handling around a plain replay)."""
    if TRITON_DEVICE is not None:
        from tandem.ops.gru import triton as gru_triton

        monkeypatch.setattr(gru_triton, "TIME_LOOP", request.param.split("-graphs")[0].split("-split")[0])
        # the graphs run the default, which splits the backward step there
        split = {"per-step-split": True, "per-step-graphs": None}.get(request.param, False)
        monkeypatch.setattr(gru_triton, "BWD_SPLIT", split)
        monkeypatch.setattr(gru_triton, "_SPLIT_BLOCK", 16)  # several blocks of every kind in the cases
        monkeypatch.setattr(gru_triton, "CUDA_GRAPHS", request.param.endswith("-graphs"))
        monkeypatch.setattr(gru_triton, "STEP_GRAPHS", gru_triton.StepGraphs())
    return request.param


def test_triton_kernels_under_interpreter():
    # the builds-once tests count compiled kernels: nothing to count under the interpreter
    run_under_interpreter(__file__, keyword="triton_kernel_ and not builds_once")


@needs_triton
def test_triton_kernel_is_what_runs():
    """The tests below would pass on the PyTorch kernel too: make sure they reach the Triton one."""
    assert _backend.use_triton(torch.empty(0, device=TRITON_DEVICE))


@needs_triton_compiler
@pytest.mark.parametrize("time_loop", ["per-step", "per-step-split", "persistent"])
def test_triton_kernel_builds_once_for_any_lengths(time_loop: str, monkeypatch):
    """Speech batches differ in their lengths and so in every step's rows: no build per new pattern."""
    from tandem.ops import _triton_rnn
    from tandem.ops.gru import triton as gru_triton

    monkeypatch.setattr(gru_triton, "TIME_LOOP", time_loop.removesuffix("-split"))
    monkeypatch.setattr(gru_triton, "BWD_SPLIT", time_loop.endswith("-split"))
    kernels = [gru_triton._gru_fwd_step, gru_triton._gru_bwd_step]
    if time_loop == "per-step-split":
        kernels = [gru_triton._gru_fwd_step, gru_triton._gru_bwd_gates, _triton_rnn.step_product]
    if time_loop == "persistent":
        kernels = [gru_triton._gru_fwd_persistent, gru_triton._gru_bwd_persistent]
    gru = tandem.nn.GRU(8, 16, bidirectional=True, device=TRITON_DEVICE, dtype=torch.bfloat16)
    assert_builds_once(gru, kernels, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_kernel_matches_torch_float64(case: Case, kernel: str):
    _compare(case, torch.float64, atol=1e-10, rtol=1e-10)


@needs_triton
@pytest.mark.parametrize("case", CASES[:3], ids=[c.id for c in CASES[:3]])
def test_triton_kernel_matches_torch_float32(case: Case, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # exact float32 products on GPUs
    _compare(case, torch.float32, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_half_precision_error_within_twice_torch_error(dtype: torch.dtype, kernel: str):
    """Inputs, weights and outputs in half precision, math in fp32: our error against float64 is at most
    twice that of torch.nn.GRU run in the same dtype on the same device."""
    case = Case(packed=True, hidden=20)
    ref, x, h0 = _make(case, dtype)
    kwargs = dict(bidirectional=True)
    ours = _errors(ref, tandem.nn.GRU(INPUT, case.hidden, **kwargs), case, x, h0, dtype)
    theirs = _errors(ref, torch.nn.GRU(INPUT, case.hidden, **kwargs), case, x, h0, dtype)
    for name, err in ours.items():
        assert err <= 2 * theirs[name] + 1e-3, f"{name}: ours {err:.3g} vs torch {theirs[name]:.3g}"


def _layer_inputs(batch_sizes: list[int], directions: int, hidden: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(2)
    total, batch = sum(batch_sizes), batch_sizes[0]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(TRITON_DEVICE)

    return (
        randn(total, INPUT),
        torch.tensor(batch_sizes),
        randn(directions, batch, hidden),
        randn(directions, 3 * hidden, INPUT),
        randn(directions, 3 * hidden, hidden),
        randn(directions, 3 * hidden),
        randn(directions, 3 * hidden),
    )


@needs_triton
@pytest.mark.parametrize("directions", [1, 2], ids=["uni", "bi"])
def test_triton_kernel_saved_buffers_equal_the_reference(directions: int, kernel: str):
    """Same saved gates, W_hn h + b_hn and states as the PyTorch kernel: either backward reads either
    forward's buffers."""
    args = _layer_inputs([4, 4, 2, 1], directions, hidden=6)
    got = torch.ops.tandem.gru_fwd(*args)
    expected = gru_fwd_ref(*(a.cpu() for a in args))
    for name, g, e in zip(("y", "h_n", "gates", "hn", "states"), got, expected):
        torch.testing.assert_close(g.cpu(), e, atol=1e-12, rtol=1e-12, msg=name)


@needs_triton
@pytest.mark.parametrize("used", ["y", "h_n"])
@pytest.mark.parametrize("need_dx", [True, False], ids=["dx", "no-dx"])
def test_triton_kernel_backward_with_one_output_used(used: str, need_dx: bool, kernel: str):
    """An unused output's gradient arrives as None; dx is skipped when not needed."""
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _layer_inputs([3, 3, 1], 2, hidden=5)
    y, h_n, gates, hn, states = torch.ops.tandem.gru_fwd(x, bs, h0, w_ih, w_hh, b_ih, b_hh)
    grad = torch.randn_like(y) if used == "y" else torch.randn_like(h_n)
    dy, dh_n = (grad, None) if used == "y" else (None, grad)
    saved = (x, bs, h0, w_ih, w_hh, y, gates, hn, states, True, need_dx)
    got = torch.ops.tandem.gru_bwd(dy, dh_n, *saved)
    expected = gru_bwd_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in (dy, dh_n, *saved)))
    for name, g, e in zip(("dx", "dh0", "dw_ih", "dw_hh", "db_ih", "db_hh"), got, expected):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g.cpu(), e, atol=1e-12, rtol=1e-12, msg=name)


@needs_triton
@pytest.mark.parametrize(
    "order", [(1, 0, 2), (2, 1, 0), (0, 2, 1)], ids=["batch-major", "reversed", "H-before-B"]
)
def test_triton_kernel_takes_a_permuted_h0(order: tuple[int, int, int], kernel: str):
    """h0 stored in another dim order (dense, permuted strides) gives the gradients of a contiguous one:
    the persistent backward once wrote dh0 contiguously into a buffer made with h0's strides."""
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _layer_inputs([3, 3, 1], 2, hidden=5)
    inverse = sorted(range(3), key=order.__getitem__)
    permuted = h0.permute(order).contiguous().permute(inverse)
    assert not permuted.is_contiguous()
    results = []
    for start in (h0, permuted):
        h = start.detach().requires_grad_()
        y, h_n = tandem.ops.gru(x, bs, h, w_ih, w_hh, b_ih, b_hh)
        (y.sum() + h_n.square().sum()).backward()
        results.append((y, h_n, h.grad))
    for name, want, got in zip(("y", "h_n", "dh0"), *results):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=name)


@needs_triton
def test_triton_kernel_opcheck():
    """The dispatcher registrations (fake, autograd, schema) hold for the Triton kernels too."""
    args = _layer_inputs([3, 2, 2], 2, hidden=4)
    torch.library.opcheck(torch.ops.tandem.gru_fwd.default, args)
    x, bs, h0, w_ih, w_hh, _, _ = args
    y, h_n, gates, hn, states = torch.ops.tandem.gru_fwd(*args)
    bwd_args = (torch.randn_like(y), torch.randn_like(h_n), x, bs, h0, w_ih, w_hh, y, gates, hn, states)
    torch.library.opcheck(torch.ops.tandem.gru_bwd.default, (*bwd_args, True, True))


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, True),  # torch's defaults: its cuDNN RNNs use TF32
        ({"rnn": "ieee"}, False),
        ({"rnn": "ieee", "conv": "tf32"}, False),  # the legacy allow_tf32 would raise here
        ({"rnn": "tf32", "conv": "ieee"}, True),
        ({"allow_tf32": False}, False),  # the legacy switch
    ],
    ids=["defaults", "rnn-ieee", "rnn-ieee-conv-tf32", "rnn-tf32-conv-ieee", "legacy-off"],
)
def test_tf32_follows_the_setting_torchs_cudnn_rnns_follow(settings, expected):
    from tandem.ops._triton_rnn import cudnn_rnn_tf32

    cudnn = torch.backends.cudnn
    if getattr(getattr(cudnn, "rnn", None), "fp32_precision", None) is None:
        pytest.skip("this torch has no per-operator precision settings")
    saved = (cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.fp32_precision)
    try:
        if "allow_tf32" in settings:
            cudnn.allow_tf32 = settings["allow_tf32"]
        for op in ("rnn", "conv"):
            if op in settings:
                getattr(cudnn, op).fp32_precision = settings[op]
        assert cudnn_rnn_tf32() is expected
    finally:
        cudnn.allow_tf32 = True
        cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.fp32_precision = saved


@pytest.mark.parametrize(
    ("cudnn_on", "matmul", "expected"),
    [
        (True, "highest", True),  # torch's defaults: cuDNN's RNNs, TF32
        (False, "highest", False),  # torch's native RNN: cuBLAS matmuls, exact by default
        (False, "high", True),  # ... unless torch.set_float32_matmul_precision allows TF32
    ],
    ids=["cudnn", "no-cudnn", "no-cudnn-matmul-high"],
)
def test_tf32_without_cudnn_follows_torchs_matmul_setting(monkeypatch, cudnn_on, matmul, expected):
    """With cuDNN off (``torch.backends.cudnn.flags(enabled=False)``) torch's RNN multiplies through
    cuBLAS, exact unless the matmul precision allows TF32: tandem used TF32 there (cuDNN's setting)."""
    from tandem.ops._triton_rnn import rnn_tf32

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)  # as on a GPU machine
    matmul_settings = torch.backends.cuda.matmul
    saved = getattr(matmul_settings, "fp32_precision", None)  # ("none" by default: not what set_... leaves)
    try:
        torch.set_float32_matmul_precision(matmul)
        with torch.backends.cudnn.flags(enabled=cudnn_on):
            assert rnn_tf32() is expected
    finally:
        torch.set_float32_matmul_precision("highest")
        if saved is not None:
            matmul_settings.fp32_precision = saved


@needs_triton
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_triton_kernel_runs_in_float16_under_autocast_as_cudnn(autocast_dtype, input_dtype):
    """Under autocast the layers run in float16 whatever autocast's dtype, as cuDNN's RNNs do (torch's
    autocast wrapper of _cudnn_rnn casts the input, states and weights to half): a float32 or bfloat16
    input (a Linear's output under the same autocast) and state, float16 outputs, the gradients in the
    float32 parameters, within twice the error of torch.nn.GRU run in float16 (against float64)."""
    case = Case(packed=True, hidden=20)
    ref, x, h0 = _make(case, torch.float32)
    half = copy.deepcopy(ref).half()  # what cuDNN's autocast computes: the input (as given) cast to half
    theirs = _run(half, case, x.to(input_dtype).half(), h0.to(input_dtype).half())
    ours = tandem.nn.GRU(INPUT, case.hidden, bidirectional=True).to(TRITON_DEVICE)
    ours.load_state_dict(ref.state_dict())
    expected = _run(ref, case, x, h0)
    x_in = x.to(TRITON_DEVICE, input_dtype).requires_grad_()
    h0_in = h0.to(TRITON_DEVICE, input_dtype).requires_grad_()
    packed = pack_padded_sequence(x_in, _lengths(case), enforce_sorted=False)  # before autocast, as a loader
    with torch.autocast(TRITON_DEVICE, dtype=autocast_dtype):
        out, h_n = ours(packed, h0_in)
    assert out.data.dtype == h_n.dtype == torch.float16
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.data.shape, generator=gen, dtype=torch.float64).to(out.data)
    w_h = torch.randn(h_n.shape, generator=gen, dtype=torch.float64).to(h_n)
    ((out.data * w_out).sum() + (h_n * w_h).sum()).backward()
    got = {"output": out.data, "h_n": h_n, "grad input": x_in.grad, "grad h0": h0_in.grad}
    got = {k: v.detach().cpu().double() for k, v in got.items()}
    got |= {f"grad {n}": p.grad.cpu().double() for n, p in ours.named_parameters()}
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())
    assert x_in.grad.dtype == h0_in.grad.dtype == input_dtype
    for name, value in expected.items():
        ours_error = (got[name] - value).abs().max().item()
        torch_error = (theirs[name] - value).abs().max().item()
        rounding = 0.0  # the input's and h0's gradients come in the input's dtype: bfloat16 rounds them
        if name in ("grad input", "grad h0") and input_dtype == torch.bfloat16:
            rounding = value.abs().max().item() * 2.0**-8
        assert ours_error <= 2 * torch_error + rounding + 1e-3, (
            f"{name}: ours {ours_error:.3g} vs torch {torch_error:.3g}"
        )


@needs_triton
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_under_autocast_is_the_float16_layer(autocast_dtype):
    """Under autocast, with the backward run inside it too, the layer computes exactly what it computes in
    float16 without autocast, as torch's autocast wrapper of cuDNN's RNNs casts to half and then runs with
    autocast off: nothing inside the ops runs in autocast's own dtype (on the GPU a kernel registered for
    "cuda" apart ran the input projection in bfloat16)."""
    case = Case(packed=True, hidden=20)
    ref, x, h0 = _make(case, torch.float32)
    ours = tandem.nn.GRU(INPUT, case.hidden, bidirectional=True).to(TRITON_DEVICE)
    ours.load_state_dict(ref.state_dict())
    half = copy.deepcopy(ours).half()
    with torch.autocast(TRITON_DEVICE, dtype=autocast_dtype):
        got = _run(ours, case, x.to(TRITON_DEVICE, torch.float32), h0.to(TRITON_DEVICE, torch.float32))
    expected = _run(half, case, x.to(TRITON_DEVICE, torch.float16), h0.to(TRITON_DEVICE, torch.float16))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@needs_triton
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
@pytest.mark.parametrize(
    ("module_dtype", "autocast_dtype"),
    [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["fp32-in-bf16", "fp16-in-bf16", "bf16-in-fp16"],
)
def test_triton_kernel_layer_stack_under_autocast_is_the_float16_stack(cell, module_dtype, autocast_dtype):
    """Two bidirectional layers, and modules in one half precision under the other's autocast: the layers'
    states were concatenated and the directions' parameters stacked under autocast, whose promotion
    refuses float16 beside bfloat16 (a RuntimeError); now the whole forward runs as the float16 copy's,
    an empty batch (the formulas' path) in float16 too. Both cells."""
    torch.manual_seed(0)
    layer = getattr(tandem.nn, cell)(INPUT, 6, num_layers=2, bidirectional=True, dtype=module_dtype)
    ours = layer.to(TRITON_DEVICE)
    half = copy.deepcopy(ours).half()
    x = torch.randn(4, 3, INPUT, device=TRITON_DEVICE, dtype=module_dtype)
    with torch.autocast(TRITON_DEVICE, dtype=autocast_dtype):
        got = ours(x)
        empty, _ = ours(x[:, :0])
    assert empty.dtype == torch.float16 and empty.shape == (4, 0, 12)
    torch.testing.assert_close(got, half(x.half()), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("time_loop", ["per-step", "persistent"])
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_triton_kernel_under_another_default_device_as_without_it(cell, time_loop, monkeypatch):
    """Under ``torch.set_default_device`` (or the ``torch.device`` context; "meta" stands in for another
    device) a batch's forward and backward compute on the tensors' device as they do without: the layers
    made a batch's step sizes on the default device. Both cells, both time loops."""
    from tandem.ops.gru import triton as gru_triton
    from tandem.ops.lstm import triton as lstm_triton

    for module in (gru_triton, lstm_triton):
        monkeypatch.setattr(module, "TIME_LOOP", time_loop)
    torch.manual_seed(0)
    layer = getattr(tandem.nn, cell)(INPUT, 6, num_layers=2, bidirectional=True).to(TRITON_DEVICE)
    data = torch.randn(5, 3, INPUT, device=TRITON_DEVICE)
    runs = []
    for default_device in (contextlib.nullcontext(), torch.device("meta")):
        layer.zero_grad()
        x = data.clone().requires_grad_()
        with default_device:
            out, _ = layer(x)
            out.square().sum().backward()
        runs.append((out, x.grad, [p.grad.clone() for p in layer.parameters()]))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_triton_kernel_graphs_first_recorded_under_inference_mode_replay_outside_it(cell, monkeypatch):
    """CUDA_GRAPHS: a problem first seen under torch.inference_mode() recorded inference tensors as its
    static buffers, and the next call of that shape outside it (no_grad, training) raised "Inplace update
    to inference tensor outside InferenceMode" (both cells; the switch is off by default)."""
    import importlib

    module = importlib.import_module(f"tandem.ops.{cell}.triton")
    monkeypatch.setattr(module, "TIME_LOOP", "per-step")
    monkeypatch.setattr(module, "CUDA_GRAPHS", True)
    monkeypatch.setattr(module, "STEP_GRAPHS", module.StepGraphs())
    torch.manual_seed(0)
    ref = getattr(torch.nn, cell.upper())(INPUT, 5, dtype=torch.float64)
    ours = getattr(tandem.nn, cell.upper())(INPUT, 5, dtype=torch.float64).to(TRITON_DEVICE)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 2, INPUT, dtype=torch.float64)
    expected = ref(x)[0]
    with torch.inference_mode():
        first = ours(x.to(TRITON_DEVICE))[0]
    with torch.no_grad():
        second = ours(x.to(TRITON_DEVICE))[0]
    third = ours(x.to(TRITON_DEVICE))[0]
    third.sum().backward()
    for out in (first, second, third):
        torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-12, atol=1e-12)


@needs_triton
@pytest.mark.parametrize(
    ("cell", "fused", "split"),
    [("gru", "_gru_bwd_step", "_gru_bwd_gates"), ("lstm", "_lstm_bwd_kernel", "_lstm_bwd_gates")],
    ids=["gru", "lstm"],
)
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graphs"])
def test_triton_kernel_splits_the_backward_step_by_default_where_graphs_replay(
    cell, fused, split, graphs, monkeypatch
):
    """BWD_SPLIT's default, None: the split step where the loops are replayed as CUDA graphs (where it was
    timed faster on an H100), the fused kernel elsewhere. Both cells."""
    import importlib

    module = importlib.import_module(f"tandem.ops.{cell}.triton")
    assert module.BWD_SPLIT is None
    layer = getattr(tandem.nn, cell.upper())(INPUT, 20, bidirectional=True).to(TRITON_DEVICE)
    launches = backward_launches(module, layer, [fused, split], graphs, monkeypatch)
    assert (launches[split] > 0) is graphs
    assert (launches[fused] > 0) is not graphs


@pytest.mark.parametrize("op", ["gru_fwd", "gru_bwd"])
def test_no_cuda_kernel_registered_apart(op):
    """CUDA tensors take the ops' one implementation, the one CI runs under the interpreter, which turns
    autocast off around the kernels: the dispatcher calls a kernel registered for "cuda" without it."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"tandem::{op}", "CUDA")


# the GPU build, which the interpreter cannot show (compiled ahead of time for sm_90: no GPU needed)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _compile_gru_sm90(kernel: str, dtype: torch.dtype, tf32: bool):
    """``kernel``: "fwd" and "bwd" (the per-step kernels), "bwd-product" (the split backward's product;
    its other half, elementwise, has no matmul to check)."""
    tl = pytest.importorskip("triton.language")
    from tandem.ops import _triton_rnn
    from tandem.ops.gru import triton as gru_triton

    compute = tl.float64 if dtype == torch.float64 else tl.float32
    carry = "fp64" if dtype == torch.float64 else "fp32"
    # the launch of the T100-B32-H512 shape
    if kernel == "bwd-product":
        fn, pointers = _triton_rnn.step_product, {"p_out": carry}
        common = dict(H=512, COMPUTE=compute, UPCAST=False, TF32=tf32)
        options = gru_triton._split_meta(dtype, 32, 512, common)[1]
        constexprs = {name: options.pop(name) for name in list(options) if name in fn.arg_names}
    else:
        fn = gru_triton._gru_fwd_step if kernel == "fwd" else gru_triton._gru_bwd_step
        pointers = {"p_dhin": carry, "p_dhout": carry}
        options = gru_triton._step_meta(kernel, dtype, 32, 512)
        blocks = {name: options.pop(name) for name in list(options) if name.startswith("BLOCK_")}
        constexprs = dict(H=512, COMPUTE=compute, UPCAST=False, TF32=tf32, **blocks)
        if kernel == "fwd":
            constexprs["HAS_BIAS"] = True
    signature = sm90_signature(fn, constexprs, _DTYPE_NAMES[dtype], pointers)
    return compile_sm90(fn, signature, constexprs, **options)


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kernel", ["fwd", "bwd", "bwd-product"])
@pytest.mark.parametrize(
    ("dtype", "tf32"),
    [
        (torch.float32, False),
        (torch.float32, True),
        (torch.float64, False),
        (torch.bfloat16, False),
        (torch.float16, False),
    ],
    ids=["float32", "float32-tf32", "float64", "bf16", "fp16"],
)
def test_sm90_build_uses_the_intended_matmuls(kernel: str, dtype: torch.dtype, tf32: bool, tmp_path):
    """Exact float32 stays off TF32 and TF32 takes it when asked; half inputs take the tensor cores with
    float32 accumulation; every build compiles for sm_90, and nothing spills to local memory."""
    built = _compile_gru_sm90(kernel, dtype, tf32)
    assert local_memory_bytes(built.asm["cubin"], tmp_path) == 0
    ptx = built.asm["ptx"]
    if dtype == torch.float32:
        assert ("tf32" in ptx) == tf32
    if dtype in (torch.bfloat16, torch.float16):
        t = "bf16" if dtype == torch.bfloat16 else "f16"
        assert re.search(rf"mma\S*\.f32\.{t}\.{t}\.f32", ptx), "no tensor-core matmul with fp32 accumulation"


@needs_triton
@pytest.mark.parametrize("hidden", [10, 20])
def test_triton_kernel_persistent_where_the_weights_fit(hidden: int, monkeypatch):
    """By default the persistent kernels run (one launch each way) where the table says a direction's
    weights stay in registers, and one launch per step elsewhere: float64 H10 (BLOCK_H 16) and H20 (32)."""
    from tandem.ops.gru import triton as gru_triton

    names = ("_gru_fwd_persistent", "_gru_bwd_persistent", "_gru_fwd_step", "_gru_bwd_step")
    spies = {name: LaunchCounter(getattr(gru_triton, name)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(gru_triton, name, spy)
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _layer_inputs([3, 2, 1], 2, hidden=hidden)
    y, h_n, *saved = torch.ops.tandem.gru_fwd(x, bs, h0, w_ih, w_hh, b_ih, b_hh)
    torch.ops.tandem.gru_bwd(torch.ones_like(y), None, x, bs, h0, w_ih, w_hh, y, *saved, True, True)
    fits = hidden == 10
    expected = [int(fits), int(fits), 0 if fits else 3, 0 if fits else 3]
    assert [spy.launches for spy in spies.values()] == expected


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_half_precision_both_time_loops_agree(dtype: torch.dtype, monkeypatch):
    """In half precision the persistent and the per-step loops round the same values the same way:
    under the interpreter (CPU) outputs, saved buffers and gradients are equal bit for bit; a GPU build
    may contract and order its float32 math differently, by an ulp or so."""
    from tandem.ops.gru import triton as gru_triton

    inputs = _layer_inputs([5, 5, 3, 1], 2, hidden=20)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in inputs)
    x, bs, h0, w_ih, w_hh, _, _ = args
    gen = torch.Generator().manual_seed(1)
    results = []
    for time_loop in ("persistent", "per-step"):
        monkeypatch.setattr(gru_triton, "TIME_LOOP", time_loop)
        y, h_n, *saved = gru_triton.gru_fwd_triton(*args)
        if not results:
            grads = [torch.randn(t.shape, generator=gen).to(t) for t in (y, h_n)]
        grad = gru_triton.gru_bwd_triton(*grads, x, bs, h0, w_ih, w_hh, y, *saved, True, True)
        results.append((y, h_n, *saved, *grad))
    names = ["y", "h_n", "gates", "hn", "states", "dx", "dh0", "dw_ih", "dw_hh", "db_ih", "db_hh"]
    for name, a, b in zip(names, *results):
        if TRITON_DEVICE == "cpu":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)


@needs_triton
def test_triton_kernel_recorded_loops_are_reused_with_new_data(monkeypatch):
    """A recorded per-step loop serves every later call of the same problem with that call's data, a new
    problem records its own, and only the ``capacity`` most recent ones are kept."""
    from tandem.ops.gru import triton as gru_triton

    monkeypatch.setattr(gru_triton, "TIME_LOOP", "per-step")
    monkeypatch.setattr(gru_triton, "CUDA_GRAPHS", True)
    graphs = gru_triton.StepGraphs(capacity=2)
    monkeypatch.setattr(gru_triton, "STEP_GRAPHS", graphs)
    kept = []
    for sizes, seed in (([3, 2, 1], 0), ([3, 2, 1], 1), ([2, 2], 2), ([3, 2, 1], 3), ([3, 3], 4)):
        args = _layer_inputs(sizes, 2, hidden=6)
        args = tuple(a + seed if a.is_floating_point() else a for a in args)  # new data, same problem
        y, h_n, *saved = torch.ops.tandem.gru_fwd(*args)
        expected = gru_fwd_ref(*(a.cpu() for a in args))
        for name, g, e in zip(("y", "h_n", "gates", "hn", "states"), (y, h_n, *saved), expected):
            torch.testing.assert_close(g.cpu(), e, atol=1e-12, rtol=1e-12, msg=f"{sizes} {name}")
        kept.append(((y, h_n, *saved), expected))
        x, bs, h0, w_ih, w_hh, _, _ = args
        grads = (torch.randn_like(y), torch.randn_like(h_n))
        got = torch.ops.tandem.gru_bwd(*grads, x, bs, h0, w_ih, w_hh, y, *saved, True, True)
        want = gru_bwd_ref(*(a.cpu() for a in (*grads, x, bs, h0, w_ih, w_hh, y, *saved)), True, True)
        for name, g, e in zip(("dx", "dh0", "dw_ih", "dw_hh", "db_ih", "db_hh"), got, want):
            torch.testing.assert_close(g.cpu(), e, atol=1e-10, rtol=1e-10, msg=f"{sizes} {name}")
    for got, expected in kept:  # later calls did not overwrite what earlier ones returned
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.cpu(), e, atol=1e-12, rtol=1e-12)
    # two problems, each recorded forward and backward: the last problem's two loops are kept
    assert sorted((key[0], key[7]) for key in graphs._entries) == [("bwd", (3, 3)), ("fwd", (3, 3))]


def test_persistent_kernels_take_the_hidden_sizes_in_the_table():
    pytest.importorskip("triton")
    from tandem.ops.gru import triton as gru_triton

    def fits(kind, dtype, hidden):
        return gru_triton._persistent_meta(kind, torch.empty(0, dtype=dtype), hidden) is not None

    assert fits("fwd", torch.bfloat16, 64) and fits("bwd", torch.bfloat16, 50)
    assert not fits("fwd", torch.bfloat16, 65) and not fits("bwd", torch.float16, 128)
    assert fits("fwd", torch.float32, 32) and not fits("bwd", torch.float32, 33)
    assert fits("bwd", torch.float64, 16) and not fits("fwd", torch.float64, 17)


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("precision", ["half", "tf32", "fp32", "fp64"])
def test_sm90_build_of_the_persistent_kernels_keeps_the_weights_in_registers(kind, precision, tmp_path):
    """Every hidden size of each entry of the persistent kernels' table compiles for sm_90 with its
    num_warps and no local memory (both half dtypes): the weights stay in registers, nothing spills."""
    tl = pytest.importorskip("triton.language")
    from tandem.ops.gru import triton as gru_triton

    fn = gru_triton._gru_fwd_persistent if kind == "fwd" else gru_triton._gru_bwd_persistent
    compute = "fp64" if precision == "fp64" else "fp32"
    dtypes = {"half": ["bf16", "fp16"], "fp64": ["fp64"]}.get(precision, ["fp32"])
    table = gru_triton._PERSISTENT_WARPS[kind, precision]
    for (block, warps), dtype in itertools.product(table.items(), dtypes):
        constexprs = dict(H=block, COMPUTE=getattr(tl, f"float{compute[2:]}"), UPCAST=False)
        constexprs |= dict(TF32=precision == "tf32", BLOCK_B=16, BLOCK_H=block)
        if kind == "fwd":
            constexprs["HAS_BIAS"] = True
        # dh0 is written in the compute dtype
        signature = sm90_signature(fn, constexprs, dtype, {"p_dh0": compute, "p_rows": "i32"})
        built = compile_sm90(fn, signature, constexprs, num_warps=warps, enable_fp_fusion=True)
        stack = local_memory_bytes(built.asm["cubin"], tmp_path)
        assert stack == 0, f"{dtype} BLOCK_H {block}, {warps} warps: {stack} bytes of stack"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_triton_kernel_keeps_the_digits_of_tiny_activations(dtype: torch.dtype, kernel: str, monkeypatch):
    """Inputs and h0 of the size of 1e-3 to 1e-9, no bias: n = tanh(a) was 2 sigmoid(2a) - 1, whose
    absolute error of one unit of 0.5's last place was 7% of a float32 output of 1e-6 (all of one of
    1e-9); now the outputs agree with float64 torch to the rounding of the dtype, relative to their size."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # exact float32 products on GPUs
    torch.manual_seed(0)
    ref = torch.nn.GRU(INPUT, 6, bias=False, bidirectional=True, dtype=torch.float64)
    ours = tandem.nn.GRU(INPUT, 6, bias=False, bidirectional=True).to(TRITON_DEVICE, dtype)
    ours.load_state_dict(ref.state_dict())
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    for scale in (1e-3, 1e-6, 1e-9):
        x = torch.randn(5, 3, INPUT, dtype=torch.float64) * scale
        h0 = torch.randn(2, 3, 6, dtype=torch.float64) * scale
        with torch.no_grad():
            want, want_h = ref(x, h0)
            got, got_h = ours(x.to(TRITON_DEVICE, dtype), h0.to(TRITON_DEVICE, dtype))
        for a, b in ((got, want), (got_h, want_h)):
            torch.testing.assert_close(a.cpu().double(), b, rtol=tol, atol=tol * scale)
