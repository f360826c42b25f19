"""The grid both recurrent modules are checked on against torch (copied weights): layers, directions,
batch_first, bias, given states, padded / packed sorted / packed unsorted / unbatched input, T = 1, and
for the LSTM proj_size. One case runs forward and backward of a fixed random loss of every output and
compares the outputs and the gradients of the input, the given states and every parameter."""

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
    states: bool = False  # pass h0 (GRU) or (h0, c0) (LSTM)
    proj: int = 0  # LSTM only
    input: str = "padded"  # padded | packed-sorted | packed-unsorted | unbatched
    steps: int = 6
    batch: int = 4

    @property
    def id(self) -> str:
        parts = [f"L{self.layers}", "bi" if self.bidirectional else "uni", self.input, f"T{self.steps}"]
        parts += [f"proj{self.proj}"] * bool(self.proj)
        parts += ["bf"] * self.batch_first + ["nobias"] * (not self.bias) + ["h0"] * self.states
        return "-".join(parts)

    def kwargs(self) -> dict:
        kwargs = dict(
            num_layers=self.layers,
            bias=self.bias,
            batch_first=self.batch_first,
            bidirectional=self.bidirectional,
        )
        return kwargs | (dict(proj_size=self.proj) if self.proj else {})


CASES = [
    Case(),
    Case(bidirectional=True),
    Case(layers=2, bidirectional=True, states=True),
    Case(layers=3, bidirectional=False, batch_first=True),
    Case(layers=3, bidirectional=True, batch_first=True, states=True),
    Case(bias=False, bidirectional=True),
    Case(steps=1, bidirectional=True, states=True),
    Case(input="packed-sorted", bidirectional=True, states=True),
    Case(input="packed-sorted", layers=2),
    Case(input="packed-unsorted", bidirectional=True, states=True),
    Case(input="packed-unsorted", layers=2, bidirectional=True, batch_first=True),
    Case(input="packed-unsorted", steps=1, bidirectional=True),
    Case(input="unbatched", bidirectional=True, states=True),
    Case(input="unbatched", layers=2, batch_first=True),
]
PROJ_CASES = [
    Case(proj=3),
    Case(proj=3, bidirectional=True, states=True),
    Case(proj=4, layers=2, bidirectional=True, bias=False),
    Case(proj=3, input="packed-unsorted", bidirectional=True, states=True),
    Case(proj=2, input="unbatched", layers=2, states=True),
]
GRID = [pytest.param(torch.nn.GRU, tandem.nn.GRU, c, id=f"gru-{c.id}") for c in CASES] + [
    pytest.param(torch.nn.LSTM, tandem.nn.LSTM, c, id=f"lstm-{c.id}") for c in CASES + PROJ_CASES
]

INPUT, HIDDEN = 5, 7


def _lengths(case: Case) -> list[int]:
    # includes length 1 and the full length; unsorted order for the unsorted case
    lengths = [case.steps, max(1, case.steps // 2), 1, max(1, case.steps - 1)][: case.batch]
    return lengths if case.input == "packed-unsorted" else sorted(lengths, reverse=True)


def _run(module: torch.nn.Module, case: Case, x: torch.Tensor, hx) -> dict[str, torch.Tensor]:
    """Forward + backward of a fixed random loss; returns the outputs and every gradient."""
    lstm = module.mode == "LSTM"
    x = x.detach().clone().requires_grad_()
    if hx is not None:
        hx = (
            tuple(t.detach().clone().requires_grad_() for t in hx)
            if lstm
            else hx.detach().clone().requires_grad_()
        )
    inp = x
    if case.input.startswith("packed"):
        inp = pack_padded_sequence(
            x, _lengths(case), batch_first=case.batch_first, enforce_sorted=case.input == "packed-sorted"
        )
    out, hidden = module(inp, hx)
    out = out.data if case.input.startswith("packed") else out
    results = {"output": out, **dict(zip(("h_n", "c_n"), hidden if lstm else (hidden,)))}
    gen = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in results.values()).backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    if hx is not None:
        grads |= dict(zip(("h0", "c0"), (t.grad for t in hx))) if lstm else {"h0": hx.grad}
    return {k: v.detach() for k, v in results.items()} | {f"grad {k}": v for k, v in grads.items()}


def _make(torch_cls, tandem_cls, case: Case, dtype: torch.dtype):
    ref = torch_cls(INPUT, HIDDEN, dtype=dtype, **case.kwargs())
    ours = tandem_cls(INPUT, HIDDEN, dtype=dtype, **case.kwargs())
    ours.load_state_dict(ref.state_dict())
    states = case.layers * (2 if case.bidirectional else 1)
    batch = () if case.input == "unbatched" else (case.batch,)
    if case.input == "unbatched":
        x = torch.randn(case.steps, INPUT, dtype=dtype)
    else:
        shape = (case.batch, case.steps) if case.batch_first else (case.steps, case.batch)
        x = torch.randn(*shape, INPUT, dtype=dtype)
    hx = None
    if case.states:
        h0 = torch.randn(states, *batch, case.proj or HIDDEN, dtype=dtype)
        hx = (h0, torch.randn(states, *batch, HIDDEN, dtype=dtype)) if ref.mode == "LSTM" else h0
    return ref, ours, x, hx


@pytest.mark.parametrize("torch_cls, tandem_cls, case", GRID)
def test_matches_torch_float64(torch_cls, tandem_cls, case: Case):
    ref, ours, x, hx = _make(torch_cls, tandem_cls, case, torch.float64)
    expected, got = _run(ref, case, x, hx), _run(ours, case, x, hx)
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("torch_cls, tandem_cls, case", GRID)
def test_float32_error_within_twice_torch_error(torch_cls, tandem_cls, case: Case):
    """flash-attention's rule: our float32 error vs a float64 reference <= 2x torch's own + atol."""
    ref64, _, x, hx = _make(torch_cls, tandem_cls, case, torch.float64)
    exact = _run(ref64, case, x, hx)
    ref32, ours32, _, _ = _make(torch_cls, tandem_cls, case, torch.float32)
    for module in (ref32, ours32):
        module.load_state_dict(ref64.state_dict())
    x32 = x.float()
    hx32 = None if hx is None else tuple(t.float() for t in hx) if isinstance(hx, tuple) else hx.float()
    torch_err, our_err = _run(ref32, case, x32, hx32), _run(ours32, case, x32, hx32)
    for name, value in exact.items():
        err_torch = (torch_err[name].double() - value).abs().max().item()
        err_ours = (our_err[name].double() - value).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6, f"{name}: ours {err_ours:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("tandem_cls", [tandem.nn.GRU, tandem.nn.LSTM], ids=["gru", "lstm"])
def test_padded_and_packed_agree_on_valid_frames(tandem_cls):
    """A packed batch's padded frames leave no trace: each sequence equals its own unpadded run."""
    module = tandem_cls(3, 4, bidirectional=True, dtype=torch.float64)
    lengths = [5, 3, 1]
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    out, hidden = module(pack_padded_sequence(x, lengths))
    padded, _ = pad_packed_sequence(out)
    for b, n in enumerate(lengths):
        alone, hidden_alone = module(x[:n, b : b + 1])
        torch.testing.assert_close(padded[:n, b : b + 1], alone)
        for h, h_alone in zip(*(t if isinstance(t, tuple) else (t,) for t in (hidden, hidden_alone))):
            torch.testing.assert_close(h[:, b : b + 1], h_alone)
        assert torch.all(padded[n:, b] == 0)
