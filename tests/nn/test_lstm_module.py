"""tandem.nn.LSTM against torch.nn.LSTM (which we did not write), with copied weights."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tandem


@dataclass(frozen=True)
class Case:
    layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    bias: bool = True
    hx: bool = False  # pass (h0, c0)
    proj: int = 0
    input: str = "padded"  # padded | packed-sorted | packed-unsorted | unbatched
    steps: int = 6
    batch: int = 4

    @property
    def id(self) -> str:
        parts = [f"L{self.layers}", "bi" if self.bidirectional else "uni", self.input, f"T{self.steps}"]
        parts += [f"proj{self.proj}"] * bool(self.proj)
        parts += ["bf"] * self.batch_first + ["nobias"] * (not self.bias) + ["hx"] * self.hx
        return "-".join(parts)

    def kwargs(self) -> dict:
        return dict(
            num_layers=self.layers,
            bias=self.bias,
            batch_first=self.batch_first,
            bidirectional=self.bidirectional,
            proj_size=self.proj,
        )


CASES = [
    Case(),
    Case(bidirectional=True),
    Case(layers=2, bidirectional=True, hx=True),
    Case(layers=3, bidirectional=False, batch_first=True),
    Case(layers=3, bidirectional=True, batch_first=True, hx=True),
    Case(bias=False, bidirectional=True),
    Case(steps=1, bidirectional=True, hx=True),
    Case(input="packed-sorted", bidirectional=True, hx=True),
    Case(input="packed-sorted", layers=2),
    Case(input="packed-unsorted", bidirectional=True, hx=True),
    Case(input="packed-unsorted", layers=2, bidirectional=True, batch_first=True),
    Case(input="packed-unsorted", steps=1, bidirectional=True),
    Case(input="unbatched", bidirectional=True, hx=True),
    Case(input="unbatched", layers=2, batch_first=True),
    Case(proj=3),
    Case(proj=3, bidirectional=True, hx=True),
    Case(proj=4, layers=2, bidirectional=True, bias=False),
    Case(proj=3, input="packed-unsorted", bidirectional=True, hx=True),
    Case(proj=2, input="unbatched", layers=2, hx=True),
]

INPUT, HIDDEN = 5, 7


def _lengths(case: Case) -> list[int]:
    # includes length 1 and the full length; unsorted order for the unsorted case
    lengths = [case.steps, max(1, case.steps // 2), 1, max(1, case.steps - 1)][: case.batch]
    return lengths if case.input == "packed-unsorted" else sorted(lengths, reverse=True)


def _run(module: torch.nn.Module, case: Case, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None):
    """Forward + backward of a fixed random loss; returns outputs and every gradient."""
    x = x.detach().clone().requires_grad_()
    if hx is not None:
        hx = tuple(t.detach().clone().requires_grad_() for t in hx)
    inp = x
    if case.input.startswith("packed"):
        inp = pack_padded_sequence(
            x, _lengths(case), batch_first=case.batch_first, enforce_sorted=case.input == "packed-sorted"
        )
    out, (h_n, c_n) = module(inp, hx)
    out = out.data if case.input.startswith("packed") else out
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (out, h_n, c_n)]
    sum(((t * w).sum() for t, w in zip((out, h_n, c_n), weights))).backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    if hx is not None:
        grads["h0"], grads["c0"] = hx[0].grad, hx[1].grad
    results = {"output": out.detach(), "h_n": h_n.detach(), "c_n": c_n.detach()}
    return {**results, **{f"grad {k}": v for k, v in grads.items()}}


def _make(case: Case, dtype: torch.dtype):
    ref = torch.nn.LSTM(INPUT, HIDDEN, dtype=dtype, **case.kwargs())
    ours = tandem.nn.LSTM(INPUT, HIDDEN, dtype=dtype, **case.kwargs())
    ours.load_state_dict(ref.state_dict())
    states = case.layers * (2 if case.bidirectional else 1)
    batch = () if case.input == "unbatched" else (case.batch,)
    if case.input == "unbatched":
        x = torch.randn(case.steps, INPUT, dtype=dtype)
    else:
        shape = (case.batch, case.steps) if case.batch_first else (case.steps, case.batch)
        x = torch.randn(*shape, INPUT, dtype=dtype)
    hx = None
    if case.hx:
        hx = (
            torch.randn(states, *batch, case.proj or HIDDEN, dtype=dtype),
            torch.randn(states, *batch, HIDDEN, dtype=dtype),
        )
    return ref, ours, x, hx


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_torch_float64(case: Case):
    ref, ours, x, hx = _make(case, torch.float64)
    expected, got = _run(ref, case, x, hx), _run(ours, case, x, hx)
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_float32_error_within_twice_torch_error(case: Case):
    """flash-attention's rule: our float32 error vs a float64 reference <= 2x torch's own + atol."""
    ref64, _, x, hx = _make(case, torch.float64)
    exact = _run(ref64, case, x, hx)
    ref32 = torch.nn.LSTM(INPUT, HIDDEN, **case.kwargs())
    ref32.load_state_dict(ref64.state_dict())
    ours32 = tandem.nn.LSTM(INPUT, HIDDEN, **case.kwargs())
    ours32.load_state_dict(ref64.state_dict())
    x32 = x.float()
    hx32 = tuple(t.float() for t in hx) if hx is not None else None
    torch_err, our_err = _run(ref32, case, x32, hx32), _run(ours32, case, x32, hx32)
    for name, value in exact.items():
        err_torch = (torch_err[name].double() - value).abs().max().item()
        err_ours = (our_err[name].double() - value).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6, f"{name}: ours {err_ours:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("proj_size", [0, 3])
def test_state_dict_and_init_match_torch(proj_size: int):
    kwargs = dict(num_layers=2, bidirectional=True, proj_size=proj_size)
    torch.manual_seed(3)
    ref = torch.nn.LSTM(6, 8, **kwargs)
    torch.manual_seed(3)
    ours = tandem.nn.LSTM(6, 8, **kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert ("weight_hr_l1_reverse" in ours.state_dict()) == bool(proj_size)
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name  # same initialisation draws in the same order
    back = torch.nn.LSTM(6, 8, **kwargs)
    back.load_state_dict(ours.state_dict())
    assert str(ours) == str(ref)


@pytest.mark.parametrize("used", ["output", "h_n", "c_n"])
def test_single_output_in_the_loss_matches_torch(used: str):
    ref = torch.nn.LSTM(5, 6, bidirectional=True, dtype=torch.float64)
    ours = tandem.nn.LSTM(5, 6, bidirectional=True, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    for module in (ref, ours):
        out, (h_n, c_n) = module(x)
        dict(output=out, h_n=h_n, c_n=c_n)[used].square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_padded_and_packed_agree_on_valid_frames():
    """A packed batch's padded frames leave no trace: each sequence equals its own unpadded run."""
    lstm = tandem.nn.LSTM(3, 4, bidirectional=True, dtype=torch.float64)
    lengths = [5, 3, 1]
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    out, (h_n, c_n) = lstm(pack_padded_sequence(x, lengths))
    padded, _ = pad_packed_sequence(out)
    for b, n in enumerate(lengths):
        alone, (h_alone, c_alone) = lstm(x[:n, b : b + 1])
        torch.testing.assert_close(padded[:n, b : b + 1], alone)
        torch.testing.assert_close(h_n[:, b : b + 1], h_alone)
        torch.testing.assert_close(c_n[:, b : b + 1], c_alone)
        assert torch.all(padded[n:, b] == 0)


def _hx(layers: int, batch: int | None, hid: int = 7, cell: int = 7, **kw):
    b = () if batch is None else (batch,)
    return torch.randn(layers, *b, hid, **kw), torch.randn(layers, *b, cell, **kw)


BAD_INPUTS = {
    "wrong-input-size": (dict(), lambda: (torch.randn(4, 2, 6), None)),
    "wrong-h0-shape": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, 3))),
    "wrong-c0-shape": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 2, 6)))),
    "wrong-c0-batch": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 3, 7)))),
    "proj-h0-hidden-size": (dict(proj_size=3), lambda: (torch.randn(4, 2, 5), _hx(1, 2))),
    "proj-c0-proj-size": (dict(proj_size=3), lambda: (torch.randn(4, 2, 5), _hx(1, 2, 3, 3))),
    "4d-input": (dict(), lambda: (torch.randn(4, 2, 5, 1), None)),
    "unbatched-with-3d-hx": (dict(), lambda: (torch.randn(4, 5), _hx(1, 1))),
    "batched-with-2d-hx": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, None))),
    "batched-with-2d-c0": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 7)))),
    "input-dtype": (dict(), lambda: (torch.randn(4, 2, 5, dtype=torch.float64), None)),
    "input-device": (dict(), lambda: (torch.randn(4, 2, 5, device="meta"), None)),
    "h0-device": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, 2, device="meta"))),
    "bi-hx-layers": (dict(bidirectional=True), lambda: (torch.randn(4, 2, 5), _hx(1, 2))),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_like_torch(name: str):
    kwargs, make = BAD_INPUTS[name]
    ref, ours = torch.nn.LSTM(5, 7, **kwargs), tandem.nn.LSTM(5, 7, **kwargs)
    x, hx = make()
    with pytest.raises(Exception) as expected:
        ref(x, hx)
    with pytest.raises(type(expected.value)) as got:
        ours(x, hx)
    assert str(got.value), "the error must say what was expected and what came"


def test_hidden_dtype_mismatch_is_a_clear_error():
    hx = (torch.randn(1, 2, 7), torch.randn(1, 2, 7, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"cx of dtype torch.float32 .* got torch.float64"):
        tandem.nn.LSTM(5, 7)(torch.randn(4, 2, 5), hx)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(input_size=0, hidden_size=4),
        dict(input_size=3, hidden_size=0),
        dict(input_size=3, hidden_size=-2),
        dict(input_size=3, hidden_size=4, num_layers=0),
        dict(input_size=3, hidden_size=4, dropout=1.5),
        dict(input_size=3.0, hidden_size=4),
        dict(input_size=3, hidden_size=4, proj_size=4),
        dict(input_size=3, hidden_size=4, proj_size=7),
        dict(input_size=3, hidden_size=4, proj_size=-1),
    ],
    ids=[
        "input0",
        "hidden0",
        "hidden-neg",
        "layers0",
        "dropout",
        "float-size",
        "proj-eq",
        "proj-gt",
        "proj-neg",
    ],
)
def test_bad_constructor_arguments_raise_like_torch(kwargs):
    with pytest.raises(Exception) as expected:
        torch.nn.LSTM(**kwargs)
    with pytest.raises(type(expected.value), match=str(expected.value).split(".")[0][:30]):
        tandem.nn.LSTM(**kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_equals_eager(backend: str, tmp_path, monkeypatch):
    # a private compile cache: inductor's on-disk cache keys do not cover custom-op schemas
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.compiler.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = tandem.nn.LSTM(5, 8, num_layers=2, bidirectional=True, batch_first=True, proj_size=3)
            self.head = torch.nn.Linear(6 + 8, 3)

        def forward(self, x):
            out, (h_n, c_n) = self.lstm(x)
            return self.head(torch.cat([out.mean(1), c_n[-1]], 1)) + h_n.sum()

    model = Model()
    x = torch.randn(4, 6, 5, requires_grad=True)
    eager = model(x)
    eager_grads = torch.autograd.grad(eager.sum(), [x, *model.parameters()])
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(x)
    got_grads = torch.autograd.grad(got.sum(), [x, *model.parameters()])
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)
