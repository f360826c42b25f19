"""tandem.nn.GRU against torch.nn.GRU (which we did not write), with copied weights."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tandem


@dataclass(frozen=True)
class Case:
    layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    bias: bool = True
    h0: bool = False
    input: str = "padded"  # padded | packed-sorted | packed-unsorted | unbatched
    steps: int = 6
    batch: int = 4

    @property
    def id(self) -> str:
        parts = [f"L{self.layers}", "bi" if self.bidirectional else "uni", self.input, f"T{self.steps}"]
        parts += ["bf"] * self.batch_first + ["nobias"] * (not self.bias) + ["h0"] * self.h0
        return "-".join(parts)


CASES = [
    Case(),
    Case(bidirectional=True),
    Case(layers=2, bidirectional=True, h0=True),
    Case(layers=3, bidirectional=False, batch_first=True),
    Case(layers=3, bidirectional=True, batch_first=True, h0=True),
    Case(bias=False, bidirectional=True),
    Case(steps=1, bidirectional=True, h0=True),
    Case(input="packed-sorted", bidirectional=True, h0=True),
    Case(input="packed-sorted", layers=2),
    Case(input="packed-unsorted", bidirectional=True, h0=True),
    Case(input="packed-unsorted", layers=2, bidirectional=True, batch_first=True),
    Case(input="packed-unsorted", steps=1, bidirectional=True),
    Case(input="unbatched", bidirectional=True, h0=True),
    Case(input="unbatched", layers=2, batch_first=True),
]

INPUT, HIDDEN = 5, 7


def _lengths(case: Case) -> list[int]:
    # includes length 1 and the full length; unsorted order for the unsorted case
    lengths = [case.steps, max(1, case.steps // 2), 1, max(1, case.steps - 1)][: case.batch]
    return lengths if case.input == "packed-unsorted" else sorted(lengths, reverse=True)


def _run(module: torch.nn.Module, case: Case, x: torch.Tensor, h0: torch.Tensor | None):
    """Forward + backward of a fixed random loss; returns outputs and every gradient."""
    x = x.detach().clone().requires_grad_()
    h0 = h0.detach().clone().requires_grad_() if h0 is not None else None
    inp = x
    if case.input.startswith("packed"):
        inp = pack_padded_sequence(
            x, _lengths(case), batch_first=case.batch_first, enforce_sorted=case.input == "packed-sorted"
        )
    out, h_n = module(inp, h0)
    out = out.data if case.input.startswith("packed") else out
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    w_h = torch.randn(h_n.shape, generator=gen, dtype=h_n.dtype)
    ((out * w_out).sum() + (h_n * w_h).sum()).backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    if h0 is not None:
        grads["h0"] = h0.grad
    return {"output": out.detach(), "h_n": h_n.detach(), **{f"grad {k}": v for k, v in grads.items()}}


def _make(case: Case, dtype: torch.dtype):
    kwargs = dict(
        num_layers=case.layers, bias=case.bias, batch_first=case.batch_first, bidirectional=case.bidirectional
    )
    ref = torch.nn.GRU(INPUT, HIDDEN, dtype=dtype, **kwargs)
    ours = tandem.nn.GRU(INPUT, HIDDEN, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    directions = 2 if case.bidirectional else 1
    if case.input == "unbatched":
        x = torch.randn(case.steps, INPUT, dtype=dtype)
        h0 = torch.randn(case.layers * directions, HIDDEN, dtype=dtype) if case.h0 else None
    else:
        shape = (case.batch, case.steps) if case.batch_first else (case.steps, case.batch)
        x = torch.randn(*shape, INPUT, dtype=dtype)
        h0 = torch.randn(case.layers * directions, case.batch, HIDDEN, dtype=dtype) if case.h0 else None
    return ref, ours, x, h0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_torch_float64(case: Case):
    ref, ours, x, h0 = _make(case, torch.float64)
    expected, got = _run(ref, case, x, h0), _run(ours, case, x, h0)
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_float32_error_within_twice_torch_error(case: Case):
    """flash-attention's rule: our float32 error vs a float64 reference <= 2x torch's own + atol."""
    ref64, _, x, h0 = _make(case, torch.float64)
    exact = _run(ref64, case, x, h0)
    ref32, ours32, _, _ = _make(case, torch.float32)
    for module in (ref32, ours32):
        module.load_state_dict(ref64.state_dict())
    x32, h32 = x.float(), h0.float() if h0 is not None else None
    torch_err, our_err = _run(ref32, case, x32, h32), _run(ours32, case, x32, h32)
    for name, value in exact.items():
        err_torch = (torch_err[name].double() - value).abs().max().item()
        err_ours = (our_err[name].double() - value).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6, f"{name}: ours {err_ours:.3g} vs torch {err_torch:.3g}"


def test_state_dict_and_init_match_torch():
    torch.manual_seed(3)
    ref = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    torch.manual_seed(3)
    ours = tandem.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name  # same initialisation draws in the same order
    back = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    back.load_state_dict(ours.state_dict())
    assert str(ours) == str(ref)


def test_padded_and_packed_agree_on_valid_frames():
    """A packed batch's padded frames leave no trace: each sequence equals its own unpadded run."""
    gru = tandem.nn.GRU(3, 4, bidirectional=True, dtype=torch.float64)
    lengths = [5, 3, 1]
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    out, h_n = gru(pack_padded_sequence(x, lengths))
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out)
    for b, n in enumerate(lengths):
        alone, h_alone = gru(x[:n, b : b + 1])
        torch.testing.assert_close(padded[:n, b : b + 1], alone)
        torch.testing.assert_close(h_n[:, b : b + 1], h_alone)
        assert torch.all(padded[n:, b] == 0)


BAD_INPUTS = {
    "wrong-input-size": (dict(), lambda: (torch.randn(4, 2, 6), None)),
    "wrong-h0-shape": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 3, 7))),
    "4d-input": (dict(), lambda: (torch.randn(4, 2, 5, 1), None)),
    "unbatched-with-3d-h0": (dict(), lambda: (torch.randn(4, 5), torch.randn(1, 1, 7))),
    "batched-with-2d-h0": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 7))),
    "input-dtype": (dict(), lambda: (torch.randn(4, 2, 5, dtype=torch.float64), None)),
    "input-device": (dict(), lambda: (torch.randn(4, 2, 5, device="meta"), None)),
    "h0-device": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 2, 7, device="meta"))),
    "bi-h0-layers": (dict(bidirectional=True), lambda: (torch.randn(4, 2, 5), torch.randn(1, 2, 7))),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_like_torch(name: str):
    kwargs, make = BAD_INPUTS[name]
    ref, ours = torch.nn.GRU(5, 7, **kwargs), tandem.nn.GRU(5, 7, **kwargs)
    x, h0 = make()
    with pytest.raises(Exception) as expected:
        ref(x, h0)
    with pytest.raises(type(expected.value)) as got:
        ours(x, h0)
    assert str(got.value), "the error must say what was expected and what came"


def test_hidden_dtype_mismatch_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"hx of dtype torch.float32 .* got torch.float64"):
        tandem.nn.GRU(5, 7)(torch.randn(4, 2, 5), torch.randn(1, 2, 7, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(input_size=0, hidden_size=4),
        dict(input_size=3, hidden_size=0),
        dict(input_size=3, hidden_size=-2),
        dict(input_size=3, hidden_size=4, num_layers=0),
        dict(input_size=3, hidden_size=4, dropout=1.5),
        dict(input_size=3.0, hidden_size=4),
    ],
    ids=["input0", "hidden0", "hidden-neg", "layers0", "dropout", "float-size"],
)
def test_bad_constructor_arguments_raise_like_torch(kwargs):
    with pytest.raises(Exception) as expected:
        torch.nn.GRU(**kwargs)
    with pytest.raises(type(expected.value), match=str(expected.value).split(".")[0][:30]):
        tandem.nn.GRU(**kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_equals_eager(backend: str, tmp_path, monkeypatch):
    # a private compile cache: inductor's on-disk cache keys do not cover custom-op schemas
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.compiler.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = tandem.nn.GRU(5, 8, num_layers=2, bidirectional=True, batch_first=True)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            out, _ = self.gru(x)
            return self.head(out.mean(1))

    model = Model()
    x = torch.randn(4, 6, 5, requires_grad=True)
    eager = model(x)
    (eager_grad,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got_grad, eager_grad)
