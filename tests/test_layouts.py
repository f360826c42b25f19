"""Every module, op and optimizer of tandem fed tensors in every memory layout, against torch.

torch's modules take any strides; a kernel that reads a tensor as a dense array where it is not gives
wrong numbers and no error (tandem.nn.LSTM once did, on a permuted input, through oneDNN). Each test
lays out one tensor argument (input, states, parameters, incoming gradient, mask, ...) as

- ``strided``: every element two apart (a slice ``[..., ::2]`` of a wider buffer);
- ``transposed``: its dims in reverse order in memory;
- ``permuted``: its first two dims swapped in memory (``[T, B, I]`` stored batch-major: a permuted
  convolution output; channels-last for 4-D);
- ``expanded``: stride 0 along one dim (an initial state expanded over the batch); read-only arguments;
- ``offset``: contiguous, at a storage offset > 0 (a view into a larger buffer);

and compares outputs and gradients with torch's class given the same values contiguous. The Triton
kernels take the same inputs in ``test_triton_kernel_*`` (under the interpreter in a subprocess on
CPUs, see ``triton_support``); the data-parallel wrapper and ZeroAdagrad in spawned Gloo ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import tandem
from triton_support import TRITON_DEVICE, needs_triton, run_under_interpreter

DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]


def _strided(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return wide[..., ::2].copy_(t)


def _in_memory_order(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``t``'s values stored with its dims in ``order`` (outermost first)."""
    inverse = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 2:  # a vector has one order: strided instead
        return _strided(t)
    return _in_memory_order(t, list(reversed(range(t.dim()))))


def _permuted(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.dim() < 2:  # a vector has one order: strided instead
        return _strided(t)
    return _in_memory_order(t, [1, 0, *range(2, t.dim())])


def _expanded(t: torch.Tensor) -> torch.Tensor:
    """Stride 0 along dim 1 (dim 0 for 1-D): the values of ``t``'s first slice there, repeated."""
    dim = 1 if t.dim() > 1 else 0
    return t.narrow(dim, 0, 1).expand(t.shape)


def _offset(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel() + 3, dtype=t.dtype, device=t.device)
    return flat[3:].view(t.shape).copy_(t)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "strided": _strided,
    "transposed": _transposed,
    "permuted": _permuted,
    "expanded": _expanded,
    "offset": _offset,
}
WRITABLE = [name for name in LAYOUTS if name != "expanded"]  # in-place updates need distinct elements


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values (those of its first slice for ``expanded``) in ``layout``, a leaf that keeps
    ``t``'s requires_grad; checks that the layout is what it says."""
    with torch.no_grad():
        out = LAYOUTS[layout](t.detach())
    if t.numel() > 1 and t.dim() > 0 and layout != "offset":
        assert not out.is_contiguous(), (layout, t.shape, out.stride())
    if layout == "offset":
        assert out.storage_offset() > 0
    return out.requires_grad_(t.requires_grad)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A contiguous leaf copy of ``t`` (what torch's side gets): a copy even where ``t`` is contiguous, so
    that what either side updates in place (running statistics, parameters) is its own."""
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    # tandem's kernels and torch's differ by rounding only; a kernel that misreads a layout is off by O(1)
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)


def assert_all_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerances(dtype), msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------
# GRU and LSTM modules


@dataclass(frozen=True)
class RNNCase:
    cell: str  # "GRU" or "LSTM"
    layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    packed: bool = False  # unsorted lengths
    proj_size: int = 0

    @property
    def id(self) -> str:
        parts = [self.cell, f"L{self.layers}", "bi" if self.bidirectional else "uni"]
        parts += ["batch_first"] * self.batch_first + ["packed"] * self.packed
        return "-".join(parts + [f"proj{self.proj_size}"] * bool(self.proj_size))

    def modules(self, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
        kwargs = dict(num_layers=self.layers, bidirectional=self.bidirectional, batch_first=self.batch_first)
        if self.proj_size:
            kwargs["proj_size"] = self.proj_size
        ref = getattr(torch.nn, self.cell)(INPUT, HIDDEN, dtype=dtype, **kwargs)
        ours = getattr(tandem.nn, self.cell)(INPUT, HIDDEN, dtype=dtype, **kwargs)
        ours.load_state_dict(ref.state_dict())
        return ref, ours


INPUT, HIDDEN, STEPS, BATCH = 3, 4, 5, 3
LENGTHS = [3, 5, 1]
RNN_CASES = [
    RNNCase("GRU", layers=2),
    RNNCase("GRU", bidirectional=True, batch_first=True),
    RNNCase("GRU", bidirectional=True, packed=True),
    RNNCase("LSTM", layers=2),  # float32: oneDNN's fused LSTM
    RNNCase("LSTM", bidirectional=True, batch_first=True),
    RNNCase("LSTM", bidirectional=True, packed=True),
    RNNCase("LSTM", layers=2, bidirectional=True, proj_size=2),
]


# the batch sizes and orders of the packed cases: sequences of LENGTHS, unsorted
_PACKING = pack_padded_sequence(torch.zeros(STEPS, BATCH, 1), LENGTHS, enforce_sorted=False)


def _rnn_args(case: RNNCase, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensor arguments, contiguous leaves: ``input`` (a PackedSequence's data ``[P, I]`` for a
    packed case), ``h0`` and, for an LSTM, ``c0``."""
    d = 2 if case.bidirectional else 1
    if case.packed:
        shape = (sum(LENGTHS), INPUT)
    else:
        shape = (BATCH, STEPS, INPUT) if case.batch_first else (STEPS, BATCH, INPUT)
    args = {
        "input": torch.randn(*shape, dtype=dtype, requires_grad=True),
        "h0": torch.randn(d * case.layers, BATCH, case.proj_size or HIDDEN, dtype=dtype, requires_grad=True),
    }
    if case.cell == "LSTM":
        args["c0"] = torch.randn(d * case.layers, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    return args


def _rnn_run(
    module: torch.nn.Module,
    case: RNNCase,
    args: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    grad_layout: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Forward and backward with ``args`` and ``params`` (leaves, as given); the incoming gradient of
    every output goes through ``grad_layout``. Returns the outputs and every gradient."""
    x = args["input"]
    if case.packed:
        # the indices on the data's device, as PackedSequence.to() puts them (batch_sizes stay on the CPU)
        indices = (_PACKING.sorted_indices.to(x.device), _PACKING.unsorted_indices.to(x.device))
        x = PackedSequence(x, _PACKING.batch_sizes, *indices)
    hx = (args["h0"], args["c0"]) if case.cell == "LSTM" else args["h0"]
    out, h = torch.func.functional_call(module, params, (x, hx))
    outputs = {"output": out.data if case.packed else out}
    outputs |= {"h_n": h[0], "c_n": h[1]} if case.cell == "LSTM" else {"h_n": h}
    gen = torch.Generator().manual_seed(5)
    grads = [
        grad_layout(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)) for t in outputs.values()
    ]
    torch.autograd.backward(list(outputs.values()), grads)
    leaves = {**args, **{f"param {n}": p for n, p in params.items()}}
    return {n: t.detach() for n, t in outputs.items()} | {f"grad {n}": t.grad for n, t in leaves.items()}


def _rnn_cases() -> list:
    out = []
    for case in RNN_CASES:
        for arg in ["input", "h0", "c0", "params", "grad"]:
            if arg == "c0" and case.cell != "LSTM":
                continue
            out += [pytest.param(case, arg, layout, id=f"{case.id}-{arg}-{layout}") for layout in LAYOUTS]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, arg, layout", _rnn_cases())
def test_rnn_module_takes_any_layout(case: RNNCase, arg: str, layout: str, dtype: torch.dtype):
    check_rnn_layout(case, arg, layout, dtype, device="cpu")


def _on(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` with the same strides on ``device``, a leaf there (``t`` itself if it is there)."""
    if t.device.type == device:
        return t
    # the whole storage moves, then the same view of it: an expanded layout's elements share memory,
    # which a copy into it refuses
    storage = t.detach().as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    moved = storage.to(device).as_strided(t.shape, t.stride(), t.storage_offset())
    return moved.detach().requires_grad_(t.requires_grad)


def check_rnn_layout(case: RNNCase, arg: str, layout: str, dtype: torch.dtype, device: str) -> None:
    """tandem's module on ``device`` with ``arg`` (or ``all`` of them) laid out as ``layout`` against
    torch's on the CPU with the same values, contiguous."""
    ref, ours = case.modules(dtype)
    ours = ours.to(device)
    args = _rnn_args(case, dtype)
    args = {n: laid_out(t, layout) if arg in (n, "all") else t for n, t in args.items()}
    params = {n: p.detach().clone().requires_grad_() for n, p in ref.named_parameters()}
    if arg in ("params", "all"):
        params = {n: laid_out(p, layout) for n, p in params.items()}
    # on CUDA torch's forward hands the weights to cuDNN's flattening first, which refuses some layouts, and
    # tandem's runs the same (test_cuda_parameters_in_any_layout_as_torchs_on_cuda); without cuDNN the
    # flattening is skipped and tandem's kernels take any layout
    no_cudnn = device != "cpu" and arg in ("params", "all")
    with torch.backends.cudnn.flags(enabled=False) if no_cudnn else contextlib.nullcontext():
        got = _rnn_run(
            ours,
            case,
            {n: _on(t, device) for n, t in args.items()},
            {n: _on(t, device) for n, t in params.items()},
            LAYOUTS[layout] if arg in ("grad", "all") else lambda g: g,
        )
    args, params = {n: plain(t) for n, t in args.items()}, {n: plain(t) for n, t in params.items()}
    want = _rnn_run(
        ref, case, args, params, lambda g: plain(LAYOUTS[layout](g)) if arg in ("grad", "all") else g
    )
    assert_all_close({n: t.cpu() for n, t in got.items()}, want, dtype)


# ---------------------------------------------------------------------------------------------------
# SyncBatchNorm (one process: with a mask it runs tandem's kernels; without one it is F.batch_norm)

BN_SHAPES = {"2d": (7, 3), "3d": (3, 4, 5), "4d": (2, 3, 3, 4)}


def _bn_reference(x, mask, weight, bias, running_mean, running_var, training: bool) -> torch.Tensor:
    """torch's batch norm over the real frames only (gathered to ``[M, C]``); 0 on the others."""
    frames = x.movedim(1, -1)[mask]  # [M, C]
    normed = torch.nn.functional.batch_norm(frames, running_mean, running_var, weight, bias, training, 0.1)
    out = torch.zeros(x.movedim(1, -1).shape, dtype=x.dtype)
    out[mask] = normed
    return out.movedim(-1, 1)


def _bn_cases() -> list:
    out = []
    for shape in BN_SHAPES:
        for mode in ("train", "eval"):
            for arg in ["input", "mask", "params", "grad", "buffers"]:
                # running statistics are written in training: no expanded (aliased) buffers there
                layouts = WRITABLE if (arg, mode) == ("buffers", "train") else LAYOUTS
                out += [
                    pytest.param(shape, mode, arg, lay, id=f"{shape}-{mode}-{arg}-{lay}") for lay in layouts
                ]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, mode, arg, layout", _bn_cases())
def test_syncbatchnorm_takes_any_layout(shape: str, mode: str, arg: str, layout: str, dtype: torch.dtype):
    check_bn_layout(shape, mode, arg, layout, dtype, device="cpu")


def check_bn_layout(shape: str, mode: str, arg: str, layout: str, dtype: torch.dtype, device: str) -> None:
    """tandem.nn.SyncBatchNorm with a frame mask (some frames padding) and ``arg`` in ``layout``, against
    torch's batch norm of the real frames."""
    dims = BN_SHAPES[shape]
    channels = dims[1]
    x = torch.randn(dims, dtype=dtype, requires_grad=True)
    frame_shape = (dims[0], *dims[2:])
    mask = torch.rand(frame_shape) < 0.7
    mask.view(-1)[:2] = True  # at least two real frames
    tensors = {"input": x, "mask": mask}
    tensors["weight"] = torch.randn(channels, dtype=dtype, requires_grad=True)
    tensors["bias"] = torch.randn(channels, dtype=dtype, requires_grad=True)
    tensors["running_mean"] = torch.randn(channels, dtype=dtype)
    tensors["running_var"] = torch.rand(channels, dtype=dtype) + 0.5
    grad = torch.randn(dims, dtype=dtype)
    groups = {"params": ("weight", "bias"), "buffers": ("running_mean", "running_var")}
    for name in groups.get(arg, (arg,)):
        if name != "grad":
            tensors[name] = laid_out(tensors[name], layout)
    if arg == "grad":
        grad = LAYOUTS[layout](grad)
    want_in = {n: plain(t) for n, t in tensors.items()}
    want_in["mask"] = tensors["mask"].contiguous()

    module = tandem.nn.SyncBatchNorm(channels, dtype=dtype).train(mode == "train").to(device)
    got_in = {n: _on(t, device) for n, t in tensors.items()}
    state = {n: got_in[n] for n in ("weight", "bias", "running_mean", "running_var")}
    y = torch.func.functional_call(module, state, (got_in["input"],), dict(mask=got_in["mask"]))
    y.backward(_on(grad, device))
    want = _bn_reference(*(want_in[n] for n in ("input", "mask", "weight", "bias")), *(
        want_in[n] for n in ("running_mean", "running_var")), training=mode == "train")  # fmt: skip
    want.backward(grad.contiguous())
    got = {"output": y.detach(), "running_mean": got_in["running_mean"], "running_var": got_in["running_var"]}
    got |= {f"grad {n}": got_in[n].grad for n in ("input", "weight", "bias")}
    expected = {"output": want.detach(), "running_mean": want_in["running_mean"]}
    expected |= {"running_var": want_in["running_var"]}
    expected |= {f"grad {n}": want_in[n].grad for n in ("input", "weight", "bias")}
    assert_all_close({n: t.cpu() for n, t in got.items()}, expected, dtype)


# ---------------------------------------------------------------------------------------------------
# Adagrad: the optimizer and the functional op

ADAGRAD_SHAPES = [(7,), (5, 6), (2, 3, 2, 2)]
ADAGRAD_HYPER = {
    "default": dict(lr=0.1),
    "decay-maximize-wd": dict(lr=0.1, lr_decay=0.05, weight_decay=0.02, maximize=True, eps=1e-8),
}


def _adagrad_cases() -> list:
    out = []
    for hyper in ADAGRAD_HYPER:
        for arg in ("params", "grads", "state"):
            layouts = LAYOUTS if arg == "grads" else WRITABLE  # params and sums are updated in place
            out += [pytest.param(hyper, arg, lay, id=f"{hyper}-{arg}-{lay}") for lay in layouts]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hyper, arg, layout", _adagrad_cases())
def test_adagrad_takes_any_layout(hyper: str, arg: str, layout: str, dtype: torch.dtype):
    check_adagrad_layout(hyper, arg, layout, dtype, device="cpu")


def check_adagrad_layout(hyper: str, arg: str, layout: str, dtype: torch.dtype, device: str) -> None:
    """Three steps of tandem's Adagrad (the optimizer, or for ``state`` the functional op with the sums
    laid out) with ``arg`` in ``layout``, against torch.optim.Adagrad's on contiguous copies."""
    options = ADAGRAD_HYPER[hyper]
    values = [torch.randn(shape, dtype=dtype) for shape in ADAGRAD_SHAPES]
    ours = [laid_out(v, layout) if arg == "params" else v.clone() for v in values]
    ours = [_on(p, device).requires_grad_() for p in ours]
    theirs = [plain(v).requires_grad_() for v in values]
    ref = torch.optim.Adagrad(theirs, **options, foreach=False)
    if arg == "state":
        sums = [_on(laid_out(torch.zeros_like(v), layout), device) for v in values]
        steps = [torch.zeros((), device=device) for _ in values]
        fn_options = dict(lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False) | options
    else:
        opt = tandem.optim.Adagrad(ours, **options, tol=0.0)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(v.shape, generator=gen, dtype=dtype) for v in values]
        if arg == "grads":
            grads = [LAYOUTS[layout](g) for g in grads]
        before = [p.detach().clone() for p in theirs]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = _on(g, device), g.contiguous()
        ref.step()
        if arg == "state":
            with torch.no_grad():
                tandem.ops.adagrad(ours, [p.grad for p in ours], sums, steps, **fn_options)
        else:
            opt.step()
    got = {f"param {i}": p.detach().cpu() for i, p in enumerate(ours)}
    want = {f"param {i}": p.detach() for i, p in enumerate(theirs)}
    sums = sums if arg == "state" else [opt.state[p]["sum"] for p in ours]
    got |= {f"sum {i}": s.cpu() for i, s in enumerate(sums)}
    want |= {f"sum {i}": ref.state[p]["sum"] for i, p in enumerate(theirs)}
    if arg != "state":  # the largest change is a float32 scalar
        change = max((p.detach() - b).abs().max() for p, b in zip(theirs, before))
        torch.testing.assert_close(opt.max_change.cpu(), change.float(), **tolerances(torch.float32))
    assert_all_close(got, want, dtype)


# ---------------------------------------------------------------------------------------------------
# the Triton kernels: on a GPU, or on CPU tensors under the interpreter (in a subprocess)


def test_triton_kernels_under_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(params=["persistent", "per-step"])
def time_loop(request, monkeypatch):
    """The recurrent kernels' two time loops, whatever the size."""
    from tandem.ops.gru import triton as gru_triton
    from tandem.ops.lstm import triton as lstm_triton

    for module in (gru_triton, lstm_triton):
        monkeypatch.setattr(module, "TIME_LOOP", request.param)
    return request.param


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", RNN_CASES, ids=[c.id for c in RNN_CASES])
def test_triton_kernel_rnn_takes_any_layout(case: RNNCase, layout: str, time_loop: str):
    """Every tensor argument at once in ``layout`` (float64: never oneDNN's path)."""
    check_rnn_layout(case, "all", layout, torch.float64, device=TRITON_DEVICE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's weight flattening: CUDA only")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", RNN_CASES, ids=[c.id for c in RNN_CASES])
def test_cuda_parameters_in_any_layout_as_torchs_on_cuda(case: RNNCase, layout: str):
    """With cuDNN on, torch's forward on CUDA first flattens the weights into one cuDNN buffer, which
    refuses some layouts with a RuntimeError (transposed, expanded): tandem's raises the same error, and
    where torch's computes, tandem's computes the same (torch's module on CUDA is the reference here)."""
    ref, ours = case.modules(torch.float64)
    weights = {n: p.detach() for n, p in ref.named_parameters()}
    args = _rnn_args(case, torch.float64)
    outcomes: list[dict[str, torch.Tensor] | RuntimeError] = []
    for module in (ref.cuda(), ours.cuda()):  # each with its own copies: the flattening rewrites them
        params = {n: _on(laid_out(w.clone().requires_grad_(), layout), "cuda") for n, w in weights.items()}
        try:
            outcomes.append(
                _rnn_run(module, case, {n: _on(t, "cuda") for n, t in args.items()}, params, lambda g: g)
            )
        except RuntimeError as e:
            outcomes.append(e)
    theirs, got = outcomes
    if isinstance(theirs, RuntimeError):
        assert isinstance(got, RuntimeError) and str(got) == str(theirs), (got, theirs)
    else:
        assert not isinstance(got, RuntimeError), got
        assert_all_close(
            {n: t.cpu() for n, t in got.items()}, {n: t.cpu() for n, t in theirs.items()}, torch.float64
        )


@needs_triton
@pytest.mark.parametrize("shape, mode, arg, layout", _bn_cases())
def test_triton_kernel_syncbatchnorm_takes_any_layout(shape: str, mode: str, arg: str, layout: str):
    check_bn_layout(shape, mode, arg, layout, torch.float32, device=TRITON_DEVICE)


@needs_triton
@pytest.mark.parametrize("hyper, arg, layout", _adagrad_cases())
def test_triton_kernel_adagrad_takes_any_layout(hyper: str, arg: str, layout: str):
    check_adagrad_layout(hyper, arg, layout, torch.float32, device=TRITON_DEVICE)


# ---------------------------------------------------------------------------------------------------
# the data-parallel wrapper and ZeroAdagrad, in two Gloo ranks: parameters (so their gradients) laid out

WORLD = 2
DDP_VARIANTS = {  # name: (wrapper options, layouts); ZeroAdagrad takes contiguous parameters only
    "ddp": (dict(), WRITABLE),
    "ddp-grad-as-bucket-view": (dict(gradient_as_bucket_view=True), WRITABLE),
    "ddp-one-param-buckets": (dict(bucket_cap_mb=0), WRITABLE),
    "zero": (dict(), ["offset"]),
}


class LaidOutNet(torch.nn.Module):
    """Two float64 linear layers whose parameters are stored in ``layout`` (same values whatever it is)."""

    def __init__(self, layout: str | None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        shapes = {"w1": (8, 6), "b1": (8,), "w2": (3, 8), "b2": (3,)}
        for name, shape in shapes.items():
            value = torch.randn(shape, generator=gen, dtype=torch.float64) / 3
            setattr(self, name, torch.nn.Parameter(laid_out(value, layout) if layout else value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            torch.tanh(torch.nn.functional.linear(x, self.w1, self.b1)), self.w2, self.b2
        )


def _ddp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * WORLD, 6, generator=gen, dtype=torch.float64), torch.randn(
        4 * WORLD, 3, generator=gen, dtype=torch.float64
    )


def _ddp_train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int | None) -> list[torch.Tensor]:
    """Three Adagrad steps on a rank's share of each batch (all of it for ``rank=None``)."""
    for step in range(3):
        x, y = _ddp_batch(step)
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_rank(rank: int, store: str, result_dir: str) -> None:
    """A spawned rank: every variant and layout of :data:`DDP_VARIANTS`, each result or its error."""
    import os
    import traceback

    import _ranks

    from tandem.parallel import DistributedDataParallel, ZeroAdagrad

    results = {}
    try:
        _ranks.join_group(rank, WORLD, store)
        for variant, (options, layouts) in DDP_VARIANTS.items():
            for layout in layouts:
                try:
                    net = LaidOutNet(layout)
                    ddp = DistributedDataParallel(net, timeout=15.0, **options)
                    if variant == "zero":
                        opt = ZeroAdagrad(net.parameters(), lr=0.1, lr_decay=0.01, timeout=15.0)
                    else:
                        opt = tandem.optim.Adagrad(net.parameters(), lr=0.1, lr_decay=0.01)
                    params = _ddp_train(ddp, opt, rank)
                    results[variant, layout] = dict(
                        params=params, strides=[p.stride() for p in net.parameters()]
                    )
                except Exception:
                    results[variant, layout] = {"error": traceback.format_exc()}
    except Exception:
        results = {"fatal": traceback.format_exc()}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    os._exit(0)  # no process-group teardown to wait for


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "parallel"))  # _ranks, as the spawned ranks import it
    from _ranks import spawn_ranks

    tmp = tmp_path_factory.mktemp("layouts-ddp")
    results = spawn_ranks(_ddp_rank, lambda r: (r, str(tmp / "store"), str(tmp)), WORLD, tmp, timeout_s=120)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} left no result (crashed or timed out)"
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    return results


@pytest.mark.serial  # (Gloo ranks: see conftest.py)
@pytest.mark.parametrize(
    "variant, layout",
    [pytest.param(v, lay, id=f"{v}-{lay}") for v, (_, lays) in DDP_VARIANTS.items() for lay in lays],
)
def test_data_parallel_takes_parameters_in_any_layout(ddp_results, variant: str, layout: str):
    """Both ranks end where torch.optim.Adagrad ends in one process on the whole batches, with the
    parameters in their layout."""
    net = LaidOutNet(None)
    want = _ddp_train(net, torch.optim.Adagrad(net.parameters(), lr=0.1, lr_decay=0.01), None)
    for r, res in enumerate(ddp_results):
        got = res[variant, layout]
        assert "error" not in got, f"rank {r}:\n{got['error']}"
        assert got["strides"] == [laid_out(p, layout).stride() for p in net.parameters()]
        for i, (a, b) in enumerate(zip(got["params"], want)):
            torch.testing.assert_close(
                a, b, rtol=1e-10, atol=1e-12, msg=lambda m, i=i, r=r: f"rank {r}, param {i}: {m}"
            )
